"""The public surface and its API reference.

Every name of every public namespace's ``__all__`` is rendered by a ``:::`` directive of
``docs/api/*.md`` (mkdocstrings): the name itself (``::: gradbalance.TaskGradBuffer``), its
namespace with members (``::: gradbalance.balancers``, all of ``__all__`` unless the
directive's ``members:`` option lists some), or the same object rendered under another
namespace (``gradbalance.AGC`` is ``gradbalance.clip.AGC``). Each object is rendered once;
the other names link to it. The markdown is parsed here; ``make docs`` builds the site.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import gradbalance

ROOT = Path(__file__).resolve().parents[3]
API_DOCS = ROOT / "docs" / "api"

#: The public namespaces: each one's ``__all__`` is documented in full.
NAMESPACES = (
    "gradbalance",
    "gradbalance.balancers",
    "gradbalance.weighting",
    "gradbalance.clip",
    "gradbalance.functional",
    "gradbalance.modes",
    "gradbalance.distributed",
    "gradbalance.checkpoint",
    "gradbalance.monitor",
    "gradbalance.integrations.lightning",
    "gradbalance.integrations.transformers",
    "gradbalance.integrations.accelerate",
    "gradbalance.step",
    "gradbalance.stats",
    "gradbalance.taskgrads",
    "gradbalance.gramian",  # its names render in gradbalance.functional
)
#: Modules with an ``__all__`` and no underscore in their path that are not documented as a
#: namespace of their own.
NOT_DOCUMENTED: set[str] = set()
TOP_LEVEL_MAX = 40

_DIRECTIVE = re.compile(r"^::: (?P<path>\S+)[ \t]*$")
_INLINE_LIST = re.compile(r"^\[(?P<items>.*)\]$")
# Values that may be the same object under unrelated names (interned strings, small ints).
_PLAIN = (str, bytes, int, float, bool, type(None))


@dataclass(frozen=True)
class Directive:
    page: str
    path: str
    members: bool | tuple[str, ...] | None  # None: the option is absent


def _members_option(block: list[str], where: str) -> bool | tuple[str, ...] | None:
    """The ``members`` option of a directive's indented YAML block (the only one read)."""
    for i, line in enumerate(block):
        key, _, value = line.strip().partition(":")
        if key != "members":
            continue
        value = value.strip()
        if value in ("true", "false"):
            return value == "true"
        if match := _INLINE_LIST.match(value):
            return tuple(item.strip() for item in match["items"].split(",") if item.strip())
        assert value == "", f"{where}: cannot read members: {value!r}"
        indent = len(line) - len(line.lstrip())
        items = []
        for item in block[i + 1:]:
            if len(item) - len(item.lstrip()) <= indent or not item.strip().startswith("- "):
                break
            items.append(item.strip()[2:].strip())
        return tuple(items)
    return None


def _directives() -> list[Directive]:
    found = []
    for page in sorted(API_DOCS.glob("*.md")):
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if not (match := _DIRECTIVE.match(line)):
                continue
            block = []
            for following in lines[i + 1:]:
                if following.strip() and not following.startswith("    "):
                    break
                block.append(following)
            where = f"{page.name}:{i + 1}"
            found.append(Directive(page.name, match["path"], _members_option(block, where)))
    return found


def _resolve(path: str) -> Any:
    """The object a directive names: a module, or an attribute of one."""
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError:
        module, _, name = path.rpartition(".")
        return getattr(_resolve(module), name)


def _rendered(directive: Directive) -> Iterator[tuple[str, Any]]:
    """``(path, object)`` for the directive's object and the members it renders."""
    obj = _resolve(directive.path)
    yield directive.path, obj
    if not isinstance(obj, types.ModuleType) or directive.members is False:
        return
    names = obj.__all__ if directive.members in (None, True) else directive.members
    for name in names:
        member = getattr(obj, name)
        if not isinstance(member, types.ModuleType):  # submodules are not rendered
            yield f"{directive.path}.{name}", member


def _public_modules() -> list[str]:
    names = ["gradbalance"]
    for info in pkgutil.walk_packages(gradbalance.__path__, "gradbalance."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return names


@pytest.fixture(scope="module")
def rendered() -> list[tuple[str, str, Any]]:
    """``(page, path, object)`` for everything the API reference renders."""
    return [(d.page, path, obj) for d in _directives() for path, obj in _rendered(d)]


def test_every_public_name_is_in_the_api_reference(rendered: list[tuple[str, str, Any]]) -> None:
    paths = {path for _, path, _ in rendered}
    objects = {id(obj) for _, _, obj in rendered if not isinstance(obj, _PLAIN)}
    missing = []
    for namespace in NAMESPACES:
        module = importlib.import_module(namespace)
        for name in module.__all__:
            obj = getattr(module, name)
            if f"{namespace}.{name}" in paths:
                continue
            if not isinstance(obj, _PLAIN) and id(obj) in objects:
                continue
            missing.append(f"{namespace}.{name}")
    assert missing == [], (
        f"public names without an entry in docs/api/*.md: {missing}; add a ':::' directive "
        f"(or the name to a directive's members list; a new balancer goes in "
        f"docs/api/balancers.md's list: docs/ARCHITECTURE.md, \"How to add a balancer\")"
    )


def test_every_object_is_rendered_once(rendered: list[tuple[str, str, Any]]) -> None:
    seen: dict[int, str] = {}
    twice = []
    for page, path, obj in rendered:
        if isinstance(obj, _PLAIN):
            continue
        if id(obj) in seen:
            twice.append(f"{path} ({page}) is {seen[id(obj)]}")
        seen.setdefault(id(obj), f"{path} ({page})")
    assert twice == [], f"rendered twice (keep one, link the other): {twice}"


def test_members_lists_name_exported_members() -> None:
    wrong = []
    for directive in _directives():
        if isinstance(directive.members, tuple):
            exported = _resolve(directive.path).__all__
            wrong += [f"{directive.page}: {directive.path}.{name}"
                      for name in directive.members if name not in exported]
    assert wrong == [], f"members: options naming what the namespace does not export: {wrong}"


def test_the_api_pages_are_in_the_nav() -> None:
    config = (ROOT / "mkdocs.yml").read_text()
    assert [p.name for p in sorted(API_DOCS.glob("*.md")) if f"api/{p.name}" not in config] == []
    # One page per namespace that has a directive of its own: all of them are rendered.
    assert len(_directives()) > 0


def test_every_public_module_with_all_is_a_documented_namespace() -> None:
    with_all = {name for name in _public_modules()
                if hasattr(importlib.import_module(name), "__all__")}
    assert with_all - NOT_DOCUMENTED == set(NAMESPACES)


def test_top_level_all_is_what_the_package_offers() -> None:
    names = gradbalance.__all__
    assert len(names) == len(set(names)), "duplicates in gradbalance.__all__"
    assert len(names) <= TOP_LEVEL_MAX
    assert [n for n in names if not hasattr(gradbalance, n)] == []
    star: dict[str, Any] = {}
    exec("from gradbalance import *", star)
    assert set(star) - {"__builtins__"} == set(names)
    # Every public attribute that is not a submodule is exported; submodules are exported
    # only when they are namespaces of the API.
    public = {n for n in dir(gradbalance) if not n.startswith("_") and n != "annotations"}
    modules = {n for n in public if isinstance(getattr(gradbalance, n), types.ModuleType)}
    assert public - modules == {n for n in names if not n.startswith("_")} - modules
    assert {f"gradbalance.{n}" for n in modules & set(names)} <= set(NAMESPACES)


@pytest.mark.parametrize("namespace", NAMESPACES[1:])
def test_namespace_all_is_importable(namespace: str) -> None:
    module = importlib.import_module(namespace)
    names = module.__all__
    assert len(names) == len(set(names)), f"duplicates in {namespace}.__all__"
    missing = [n for n in names if not hasattr(module, n)]
    assert missing == [], f"{namespace}.__all__ names what it does not define: {missing}"


def test_docstring_examples_run_as_doctests() -> None:
    """``python -m pytest`` collects the examples of src/gradbalance (pyproject.toml)."""
    config = (ROOT / "pyproject.toml").read_text()  # no tomllib on Python 3.10
    options = config[config.index("[tool.pytest.ini_options]"):]
    options = options[:options.find("\n[", 1)]
    testpaths = re.search(r"^testpaths = \[(.*)\]$", options, re.M)
    addopts = re.search(r"^addopts = \"(.*)\"$", options, re.M)
    assert testpaths is not None and '"src/gradbalance"' in testpaths[1]
    assert addopts is not None and "--doctest-modules" in addopts[1].split()
