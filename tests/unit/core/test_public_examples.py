"""Every public class and function carries a short runnable example (a ``>>>`` doctest).

The examples run as doctests (``--doctest-modules`` over ``src/gradbalance``) and render as
code in the API reference (docs/api/griffe_sphinx.py); here only their presence is checked,
on the objects named by the ``__all__`` of each public namespace.
"""

from __future__ import annotations

import doctest
import importlib
import inspect
from collections.abc import Iterator
from types import ModuleType

import pytest

from unit.core.test_api_docs import NAMESPACES as DOCUMENTED

#: The documented namespaces less four defining modules, whose everyday names the others
#: re-export (``StepStats`` in ``gradbalance``, the Gramian functions in
#: ``gradbalance.functional``) and whose other names serve the step.
NAMESPACES = tuple(n for n in DOCUMENTED if n not in {
    "gradbalance.step", "gradbalance.stats", "gradbalance.taskgrads", "gradbalance.gramian"})

#: Public classes and functions allowed without an example, by the module that defines them
#: (relative to ``gradbalance``): none today. A name listed here must still lack one.
LACKING: dict[str, tuple[str, ...]] = {}
_ALLOWED = {f"gradbalance.{module}.{name}" for module, names in LACKING.items()
            for name in names}


def _import(namespace: str) -> ModuleType:
    """The namespace; a skip (not a pass) where its optional framework is not installed."""
    if namespace.startswith("gradbalance.integrations."):
        return pytest.importorskip(namespace)
    return importlib.import_module(namespace)


def _public(module: ModuleType) -> Iterator[tuple[str, str, object]]:
    """``(name, defining path, object)`` of each class and function in ``module.__all__``."""
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            yield name, f"{obj.__module__}.{obj.__qualname__}", obj


def _has_example(obj: object) -> bool:
    """Whether the object's own docstring holds a doctest (``>>>`` lines doctest would run)."""
    return bool(doctest.DocTestParser().get_examples(getattr(obj, "__doc__", None) or ""))


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_every_public_class_and_function_has_an_example(namespace: str) -> None:
    module = _import(namespace)
    missing = sorted(f"{namespace}.{name} (defined as {path})"
                     for name, path, obj in _public(module)
                     if path not in _ALLOWED and not _has_example(obj))
    assert not missing, (
        f"add a short runnable Example: section (a >>> doctest with a checkable result) to "
        f"the docstrings of {missing}"
    )


def test_the_allowlist_names_public_objects_still_lacking_an_example() -> None:
    public: dict[str, object] = {}
    unseen: tuple[str, ...] = ()  # prefixes of defining modules not importable here
    for namespace in NAMESPACES:
        try:
            module = importlib.import_module(namespace)
        except ImportError:  # an optional framework is not installed
            unseen = ("gradbalance.integrations.",)
            continue
        public.update((path, obj) for _, path, obj in _public(module))
    unknown = sorted(path for path in _ALLOWED
                     if path not in public and not path.startswith(unseen))
    assert not unknown, f"not public classes or functions, remove from LACKING: {unknown}"
    done = sorted(path for path in _ALLOWED if path in public and _has_example(public[path]))
    assert not done, f"these have an example now, remove them from LACKING: {done}"


def test_the_check_tells_an_example_from_a_mention_of_one() -> None:
    def with_example() -> None:
        """Twice.

        Example:
            >>> 2 * 2
            4
        """

    def with_mention() -> None:
        """Prose that mentions the ``>>>`` prompt without an example."""

    assert _has_example(with_example)
    assert not _has_example(with_mention)
    assert not _has_example(lambda: None)
