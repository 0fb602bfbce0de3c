"""The import graph of a package, read from its sources with ``ast`` (docs/ARCHITECTURE.md,
"Layers"): every import counts, function-local and ``TYPE_CHECKING`` ones included, and
relative imports are resolved against the importing module."""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Source:
    """A module's text; ``package``: it is a package's ``__init__.py``."""

    text: str
    package: bool = False


@dataclass(frozen=True)
class Import:
    """``importer`` (line ``line``) imports ``module``, or ``name`` from it (None: the module)."""

    importer: str
    module: str
    name: str | None
    line: int

    def __str__(self) -> str:
        what = self.module if self.name is None else f"{self.module}.{self.name}"
        return f"{self.importer}:{self.line} imports {what}"


def read_package(root: Path) -> dict[str, Source]:
    """Every module under the package directory ``root``, by dotted name."""
    sources = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        package = parts[-1] == "__init__"
        sources[".".join(parts[:-1] if package else parts)] = Source(path.read_text(), package)
    return sources


def package_of(module: str, sources: Mapping[str, Source]) -> str:
    """The package ``module`` lies in (a package lies in itself)."""
    return module if sources[module].package else module.rpartition(".")[0]


def imports_of(sources: Mapping[str, Source]) -> list[Import]:
    """Every import, in any scope, of a module of ``sources`` by a module of ``sources``."""
    found = []
    for importer, source in sources.items():
        for node in ast.walk(ast.parse(source.text, filename=importer)):
            found += _resolve(importer, node, sources)
    return found


def _resolve(importer: str, node: ast.AST, sources: Mapping[str, Source]) -> Iterator[Import]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            module = _nearest(alias.name, sources)
            if module is not None:
                yield Import(importer, module, None, node.lineno)
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parts = package_of(importer, sources).split(".")
            parts = parts[: len(parts) - node.level + 1]
            base = ".".join([*parts, *([node.module] if node.module else [])])
        for alias in node.names:
            if f"{base}.{alias.name}" in sources:  # a submodule
                yield Import(importer, f"{base}.{alias.name}", None, node.lineno)
                continue
            module = _nearest(base, sources)
            if module is not None:
                yield Import(importer, module, alias.name, node.lineno)


def _nearest(dotted: str, sources: Mapping[str, Source]) -> str | None:
    """The longest prefix of ``dotted`` that is a module of ``sources`` (None: outside)."""
    while dotted and dotted not in sources:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def import_graph(sources: Mapping[str, Source]) -> dict[str, dict[str, Import]]:
    """``graph[a][b]``: an import that makes loading ``a`` load ``b`` first.

    Importing ``p.sub.m`` runs ``p/sub/__init__.py`` first, so an import reaching into a
    package from outside it is an edge to that package too (not to the importer's own
    packages, which are already loading).
    """
    graph: dict[str, dict[str, Import]] = {module: {} for module in sources}
    for imp in imports_of(sources):
        parts = imp.module.split(".")
        for depth in range(1, len(parts) + 1):
            target = ".".join(parts[:depth])
            inside = imp.importer == target or imp.importer.startswith(target + ".")
            if target in sources and not inside:
                graph[imp.importer].setdefault(target, imp)
    return graph


def find_cycle(graph: Mapping[str, Mapping[str, Import]]) -> list[Import] | None:
    """The imports of one cycle of ``graph``, in order (None: the graph is acyclic)."""
    done: set[str] = set()
    trail: list[str] = []  # the modules being visited; edges[i] leads trail[i] to trail[i + 1]
    edges: list[Import] = []

    def visit(module: str) -> list[Import] | None:
        trail.append(module)
        for target, imp in sorted(graph[module].items(), key=lambda item: item[0]):
            if target in trail:
                return [*edges[trail.index(target):], imp]
            if target not in done:
                edges.append(imp)
                cycle = visit(target)
                if cycle is not None:
                    return cycle
                edges.pop()
        trail.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        if module not in done:
            cycle = visit(module)
            if cycle is not None:
                return cycle
    return None


def upward_imports(graph: Mapping[str, Mapping[str, Import]],
                   layer: Callable[[str], int]) -> list[str]:
    """Each edge of ``graph`` from a module to one of a higher ``layer``."""
    return [f"{imp} (layer {layer(module)} -> {target}, layer {layer(target)})"
            for module, targets in sorted(graph.items())
            for target, imp in sorted(targets.items(), key=lambda item: item[0])
            if layer(target) > layer(module)]


def private_across_packages(sources: Mapping[str, Source]) -> list[Import]:
    """Each import of a private name (``_x``, not ``__x__``) from another package."""
    return [imp for imp in imports_of(sources)
            if imp.name is not None and imp.name.startswith("_")
            and not imp.name.startswith("__")
            and package_of(imp.importer, sources) != package_of(imp.module, sources)]


def local_imports(sources: Mapping[str, Source]) -> list[Import]:
    """Each import of a module of ``sources`` made inside a function."""
    found = []
    for importer, source in sources.items():
        for node in ast.walk(ast.parse(source.text, filename=importer)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    found += _resolve(importer, inner, sources)
    return sorted(set(found), key=str)
