"""The ``gradbalance`` command line, the experiments, the tutorial figures, the bundled data and
the demo models (docs/ARCHITECTURE.md, "Two packages").

``gradbalance_lab.compare(build_model, make_batches, methods=[...], steps=..., seeds=...)``
compares balancers and loss weightings on your own model and data
(:func:`gradbalance_lab.compare.compare`; docs/compare.md, "Your own model").
"""

from gradbalance_lab import compare

__all__ = ["compare"]
