"""Optional dependencies fail with the extra to install, never with a bare ModuleNotFoundError."""

from __future__ import annotations

import sys

import pytest

from gradbalance._optional import pyplot, require


def test_missing_module_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ImportError, match=r"TensorBoard logging needs tensorboard, which is not "
                                          r"installed: pip install gradbalance\[tensorboard\] "
                                          r"\(or use CSVLogger\)"):
        require("tensorboard", "tensorboard", "TensorBoard logging", "use CSVLogger")


def test_summary_writer_without_tensorboard(monkeypatch: pytest.MonkeyPatch) -> None:
    import gradbalance

    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ImportError, match=r"gradbalance\[tensorboard\]"):
        gradbalance.summary_writer("unused")


def test_multidigits_without_sklearn(monkeypatch: pytest.MonkeyPatch) -> None:
    from gradbalance_lab.data import multidigits

    multidigits.load_digit_images.cache_clear()
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(ImportError, match=r"gradbalance\[data\]"):
        multidigits.load_digit_images()
    multidigits.load_digit_images.cache_clear()


def test_present_module_is_returned() -> None:
    assert require("math", "none", "a test").sqrt(4.0) == 2.0
    plt = pyplot("a test")
    assert plt.get_backend().lower() == "agg"
