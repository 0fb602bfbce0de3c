"""Integrations with training frameworks (optional dependencies, imported on use).

* :mod:`gradbalance.integrations.lightning`: :class:`BalancedManualStep` for a Lightning
  ``LightningModule`` with manual optimisation (``pip install gradbalance[lightning]``).
"""
