"""Integrations with training frameworks (optional dependencies, imported on use).

* :mod:`gradbalance.integrations.lightning`: :class:`BalancedManualStep` for a Lightning
  ``LightningModule`` with manual optimisation; its state travels in Lightning's checkpoints
  (``pip install gradbalance[lightning]``).
* :mod:`gradbalance.integrations.transformers`: :class:`BalancedTrainer`, a Hugging Face
  ``Trainer`` whose ``training_step`` is the balanced step (``pip install
  gradbalance[transformers]``).
* :mod:`gradbalance.integrations.accelerate`: :class:`BalancedAcceleratorStep` for a loop
  driven by an ``accelerate.Accelerator`` (``pip install gradbalance[accelerate]``).

``docs/integrations.md`` has a runnable example of each, and of ``torch.compile``.
"""
