"""Runnable experiments behind the ``gradbalance`` command line."""
