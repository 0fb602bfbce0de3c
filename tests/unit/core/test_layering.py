"""The core's layers (docs/ARCHITECTURE.md, "Layers" and "Two packages").

Every import of every core module, read with ``ast`` (function-local ones included, relative
ones resolved), forms no cycle, goes down the layer table, and takes no private name from
another package outside the page's list. The core never imports the lab: importing every
core module leaves ``gradbalance_lab`` (and the lab's optional packages) out of
``sys.modules``, and no core source names it.
"""

from __future__ import annotations

import ast
import itertools
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import gradbalance
from support.imports import (
    Source,
    find_cycle,
    import_graph,
    imports_of,
    local_imports,
    private_across_packages,
    read_package,
    upward_imports,
)

CORE = Path(gradbalance.__file__).parent
PAGE = Path(__file__).resolve().parents[3] / "docs" / "ARCHITECTURE.md"
SOURCES = read_package(CORE)
GRAPH = import_graph(SOURCES)

#: The layer table of docs/ARCHITECTURE.md, bottom first: files, or whole subpackages ("x/").
LAYERS: tuple[tuple[str, ...], ...] = (
    ("_types.py", "_version.py", "_optional.py", "_pickling.py", "_registry.py",
     "_statedict.py", "_checks.py", "_state_spec.py", "_module.py", "_threads.py",
     "_sparse.py", "_rng_state.py", "_recompute.py", "_caller.py", "_batching.py"),
    ("gramian.py", "_shard.py", "stats.py", "_roots.py", "_graph.py", "_coverage.py",
     "_sinks.py", "taskgrads.py", "_per_sample_eager.py", "_per_sample_mixing.py",
     "_step_state.py", "_step_inputs.py"),
    ("balancers/",),
    ("weighting/",),
    ("_sharding.py", "distributed.py", "_amp.py"),
    ("clip/",),
    ("modes/", "_per_sample_gramian.py", "_per_sample_forms.py", "_per_sample_fallback.py",
     "_per_sample_update.py"),
    ("step.py", "_per_sample_buffer.py", "_per_sample_step.py"),
    ("functional.py", "monitor.py", "checkpoint.py", "integrations/"),
    ("__init__.py", "__main__.py"),
)
#: The entry point ``python -m gradbalance`` runs the lab's command line by design.
ENTRY_POINTS = {"__main__.py"}


def _core_modules() -> list[str]:
    return sorted(
        info.name for info in pkgutil.walk_packages([str(CORE)], prefix="gradbalance.")
        if not info.name.endswith("__main__")
    )


def test_no_core_source_imports_the_lab() -> None:
    offenders = []
    for path in sorted(CORE.rglob("*.py")):
        if path.name in ENTRY_POINTS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            offenders += [f"{path.relative_to(CORE)}: {n}" for n in names
                          if n.split(".")[0] == "gradbalance_lab"]
    assert offenders == []


def test_importing_every_core_module_leaves_the_lab_out() -> None:
    modules = _core_modules()
    assert len(modules) > 40  # every subpackage was walked
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError as error:\n"
        "        if error.name not in ('lightning', 'pytorch_lightning'):\n"
        "            raise\n"
        "lab = sorted(m for m in sys.modules if m.split('.')[0] == 'gradbalance_lab')\n"
        "plots = sorted(m for m in ('matplotlib', 'sklearn') if m in sys.modules)\n"
        "print(lab, plots)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[] []", out.stdout + out.stderr


# -- the rules, on the core --------------------------------------------------------------


def _path(module: str) -> str:
    """``gradbalance.clip._task`` -> ``clip/_task.py``; a package -> its ``__init__.py``."""
    parts = module.split(".")[1:]
    return "/".join([*parts, "__init__.py"]) if SOURCES[module].package else \
        "/".join(parts) + ".py"


def _matches(path: str, pattern: str) -> bool:
    """``pattern`` is ``path``, or a subpackage (``x/``) holding it."""
    return path == pattern or (pattern.endswith("/") and path.startswith(pattern))


def _layers_of(module: str) -> list[int]:
    return [index + 1 for index, patterns in enumerate(LAYERS) for pattern in patterns
            if _matches(_path(module), pattern)]


def _layer(module: str) -> int:
    (layer,) = _layers_of(module)
    return layer


def _table(after: str) -> list[list[str]]:
    """The body rows of the first table after the text ``after`` on the page: each cell's
    code spans, joined by spaces (a cell without any: its text)."""
    lines = PAGE.read_text().split(after, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = list(itertools.takewhile(lambda line: line.startswith("|"), lines[start:]))
    return [[" ".join(re.findall(r"`([^`]+)`", cell)) or cell.strip()
             for cell in row.strip("|").split("|")] for row in table[2:]]


def test_no_import_cycle() -> None:
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle:\n" + "\n".join(map(str, cycle or []))


def test_every_module_has_one_layer_and_every_row_a_module() -> None:
    assert {m: _layers_of(m) for m in SOURCES if len(_layers_of(m)) != 1} == {}
    paths = [_path(m) for m in SOURCES]
    unused = [pattern for row in LAYERS for pattern in row
              if not any(_matches(path, pattern) for path in paths)]
    assert unused == []


def test_imports_go_down_the_layers() -> None:
    assert upward_imports(GRAPH, _layer) == []


def test_the_layer_table_is_the_pages() -> None:
    rows = _table("## Layers\n")
    assert [int(row[0]) for row in rows] == list(range(1, len(LAYERS) + 1))
    assert [tuple(row[1].split()) for row in rows] == list(LAYERS)


def _allowlist() -> set[tuple[str, str]]:
    """The page's private names across packages: ``(importer, module.name)``, dotted."""
    rows = _table("A name starting with `_` is private")
    return {("gradbalance." + row[0].removesuffix(".py").replace("/", "."), f"gradbalance.{name}")
            for row in rows for name in row[1].split()}


def test_private_names_stay_in_their_package() -> None:
    found = {(imp.importer, f"{imp.module}.{imp.name}"): imp
             for imp in private_across_packages(SOURCES)}
    allowed = _allowlist()
    assert 0 < len(allowed) <= 8  # a short list
    assert sorted(map(str, (imp for key, imp in found.items() if key not in allowed))) == []
    assert sorted(allowed - set(found)) == []  # no stale entry


def test_no_core_module_is_imported_inside_a_function() -> None:
    assert [str(imp) for imp in local_imports(SOURCES)] == []


# -- the checker, on made-up packages --------------------------------------------------------


def _fake(**modules: str) -> dict[str, Source]:
    """A made-up package ``pkg``: ``sub__init`` is ``pkg/sub/__init__.py``, ``sub__m`` is
    ``pkg/sub/m.py``."""
    sources = {"pkg": Source("", package=True)}
    for key, text in modules.items():
        package = key.endswith("__init")
        dotted = "pkg." + key.removesuffix("__init").replace("__", ".")
        sources[dotted.rstrip(".")] = Source(text, package)
    return sources


def test_a_cycle_closed_inside_a_function_is_found() -> None:
    sources = _fake(a="from .b import x\n",
                    b="def f():\n    from . import a\n    return a\n", c="from . import a\n")
    cycle = find_cycle(import_graph(sources))
    assert cycle is not None
    assert [(imp.importer, imp.line) for imp in cycle] == [("pkg.a", 1), ("pkg.b", 2)]


def test_entering_a_subpackage_runs_its_init() -> None:
    # low imports sub.x only, but sub/__init__ imports sub.y, which imports low
    sources = _fake(low="import pkg.sub.x\n", sub__init="from . import y\n", sub__x="",
                    sub__y="from ..low import thing\n")
    graph = import_graph(sources)
    assert set(graph["pkg.low"]) == {"pkg.sub", "pkg.sub.x"}
    cycle = find_cycle(graph)
    assert cycle is not None
    assert {imp.importer for imp in cycle} == {"pkg.low", "pkg.sub", "pkg.sub.y"}


def test_relative_imports_resolve_and_outside_ones_are_left_out() -> None:
    sources = _fake(sub__init="", sub__m="import torch\nfrom ..c import d, e\nfrom . import n\n",
                    sub__n="", c__init="", c__d="")
    found = {(imp.module, imp.name) for imp in imports_of(sources)}
    assert found == {("pkg.c.d", None), ("pkg.c", "e"), ("pkg.sub.n", None)}


def test_an_acyclic_package_has_no_cycle() -> None:
    sources = _fake(a="from . import b, c\n", b="from . import c\n", c="")
    assert find_cycle(import_graph(sources)) is None


def test_an_upward_import_is_reported() -> None:
    sources = _fake(low="def f():\n    from .high import g\n", high="from .low import f\n")
    layers = {"pkg": 3, "pkg.low": 1, "pkg.high": 2}
    (message,) = upward_imports(import_graph(sources), layers.__getitem__)
    assert message.startswith("pkg.low:2 imports pkg.high.g")


def test_a_private_name_from_another_package_is_reported() -> None:
    sources = _fake(sub__init="", sub__m="from ._n import _ok\nfrom ..c import _hidden, shown\n",
                    sub___n="", c="_hidden = shown = 1\n")
    assert [(imp.importer, imp.name) for imp in private_across_packages(sources)] == \
        [("pkg.sub.m", "_hidden")]


def test_a_function_local_import_is_reported() -> None:
    sources = _fake(a="import os\nfrom . import b\ndef f():\n    import os\n    from .b import x\n",
                    b="")
    assert [str(imp) for imp in local_imports(sources)] == ["pkg.a:5 imports pkg.b.x"]
