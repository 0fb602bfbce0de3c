"""Bundled benchmarks that need no download (scikit-learn's digits; ``gradbalance[data]``)."""

from __future__ import annotations

from gradbalance_lab.data.multidigits import MultiDigits, load_digit_images, make_multidigits

__all__ = ["MultiDigits", "load_digit_images", "make_multidigits"]
