"""What the API reference renders, from griffe's view with the site's extensions
(``mkdocs.yml``: ``dataclasses`` first, then ``docs/api/griffe_sphinx.py``).

A class's "Bases:" line lists only public bases (internal classes stay off the pages), and a
dataclass keeps the signature of its fields although its undocumented field members are
dropped (docs/ARCHITECTURE.md, "Docs contributor notes").
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

griffe = pytest.importorskip("griffe")

ROOT = Path(__file__).resolve().parents[3]


def _extension_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("griffe_sphinx",
                                                  ROOT / "docs" / "api" / "griffe_sphinx.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def package() -> Any:
    config = (ROOT / "mkdocs.yml").read_text()
    handler = config.split("mkdocstrings:", 1)[1]
    listed = re.findall(r"^\s+- (\S+)", handler.split("extensions:", 1)[1], re.M)[:2]
    assert listed == ["dataclasses", "docs/api/griffe_sphinx.py:SphinxStyle"]
    extensions = griffe.load_extensions("dataclasses",
                                        str(ROOT / "docs/api/griffe_sphinx.py") + ":SphinxStyle")
    return griffe.load("gradbalance", search_paths=[str(ROOT / "src")], extensions=extensions)


@pytest.mark.parametrize(("path", "shown"), [
    ("gradbalance.balancers._base.Balancer", True),  # exported by gradbalance.balancers
    ("gradbalance.weighting._base.LossWeighting", True),
    ("gradbalance.clip._task._Stateless", False),  # a private class
    ("gradbalance._module.StateModule", False),  # a public name no namespace exports
    ("gradbalance.balancers._pref.PreferenceBalancer", False),
    ("torch.nn.modules.module.Module", True),  # another library's
    ("typing.Protocol", True),
])
def test_public_base(path: str, shown: bool) -> None:
    assert _extension_module()._public_base(path) is shown


@pytest.mark.parametrize(("cls", "bases"), [
    ("gradbalance.clip.TaskClip", []),  # was "_Stateless"
    ("gradbalance.balancers.UPGrad", []),  # was "PreferenceBalancer"
    ("gradbalance.balancers.MGDA", ["Balancer"]),
    ("gradbalance.weighting.FAMO", []),  # was "OwnOptimizerWeighting"
])
def test_bases_line_shows_public_bases_only(package: Any, cls: str, bases: list[str]) -> None:
    obj = package[cls.removeprefix("gradbalance.")]
    shown = obj.extra["gradbalance"]["bases"]
    assert [str(getattr(b, "name", b)) for b in shown] == bases


def test_inherited_init_still_gives_the_signature(package: Any) -> None:
    """UPGrad's ``__init__`` comes from its private base, which is kept for that."""
    init = package["balancers.UPGrad"].all_members["__init__"]
    assert [p.name for p in init.parameters] == ["self", "num_tasks", "pref"]


def test_dataclass_keeps_its_field_signature(package: Any) -> None:
    stats = package["StepStats"]
    init = stats.all_members["__init__"]
    names = [p.name for p in init.parameters]
    assert names[:6] == ["self", "losses", "task_norms", "cosine", "cosine_to_update",
                         "update_norm"]
    assert "losses" not in stats.members  # the undocumented field itself is not rendered
