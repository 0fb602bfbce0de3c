"""Griffe extension for the API reference: the docstrings' Sphinx habits, in Markdown.

Loaded by mkdocstrings (``extensions`` in mkdocs.yml); it changes only what is rendered.

* reST roles (``:class:`~gradbalance.AutoClip```, ``:meth:`apply_```) become code spans
  wrapped in optional autorefs links: a link where the target is rendered in the API
  reference, plain code elsewhere (private helpers, torch). A name without a dot is looked
  up in the scope of the docstring's object, then in each enclosing scope, as Sphinx does.
* reST's ``::`` before a literal block becomes ``:`` (the indented block is Markdown's code
  block).
* A doctest (lines from ``>>>`` to the next blank line) becomes a fenced ``pycon`` code block,
  so that an ``Example:`` section renders as code, not as nested quotes.
* ``#:`` comments above a module-level constant become its docstring, as Sphinx's autodoc
  reads them.
* A registry filled at import (``BALANCERS: dict[str, type[...]] = {}`` then ``register``)
  shows its contents: the module is imported at build time and its names and classes are
  listed under the docstring.
* A class's bases that are not public (a class of a private module that no public namespace
  exports, such as ``_Stateless`` or ``StateModule``) are left out of its "Bases:" line
  (``extra["gradbalance"]["bases"]``, read by ``templates/python/mkdocs/class.html.jinja``),
  so internal names stay off the public pages; bases from other libraries (``nn.Module``)
  stay. The bases themselves are kept: inherited ``__init__`` signatures come through them.
* Members of a class without a docstring (instance attributes, overrides such as
  ``__repr__``) are left out; ``__call__`` stays, its signature is the interface, and so
  does ``__init__``, merged into the class.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

from griffe import Alias, AliasResolutionError, Docstring, Extension, Object

_ROLE = re.compile(
    r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`(?P<tilde>~?)(?P<target>[^`\s]+)`"
)
_LITERAL_BLOCK = re.compile(r"::\n(?=\n)")
_KEEP_UNDOCUMENTED = {"__init__", "__call__"}  # __init__: merged into the class


def _canonical(obj: Object | Alias) -> str | None:
    try:
        return obj.final_target.path if isinstance(obj, Alias) else obj.path
    except AliasResolutionError:  # an alias to an object griffe did not load (torch)
        return None


def _descend(obj: Object | Alias, parts: list[str]) -> Object | Alias | None:
    for part in parts:
        try:
            obj = (obj.all_members if obj.is_class else obj.members)[part]
        except (KeyError, AliasResolutionError):
            return None
    return obj


def _resolve(scope: Object, target: str) -> str:
    """The path of ``target`` as seen from the docstring of ``scope``, else ``target``."""
    if target.startswith("."):  # relative to the package of the docstring's module
        module = scope.module
        package = module if module.is_package else module.parent
        return f"{package.path}{target}" if package is not None else target.lstrip(".")
    parts = target.split(".")
    holder: Object | None = scope
    while holder is not None:
        found = _descend(holder, parts)
        if found is None and holder.parent is None and parts[0] == holder.name:
            found = _descend(holder, parts[1:])  # a full path, from the package down
        if found is not None:
            return _canonical(found) or target
        holder = holder.parent
    return target


def _fence_doctests(text: str) -> str:
    """``text`` with each doctest block wrapped in a fenced ``pycon`` block at its indent."""
    out: list[str] = []
    indent: str | None = None
    for line in text.split("\n"):
        stripped = line.lstrip()
        if indent is None and stripped.startswith(">>>"):
            indent = line[: len(line) - len(stripped)]
            out.append(f"{indent}```pycon")
        elif indent is not None and not stripped:
            out.append(f"{indent}```")
            indent = None
        out.append(line)
    if indent is not None:
        out.append(f"{indent}```")
    return "\n".join(out)


def rewrite(text: str, scope: Object) -> str:
    """``text`` with its roles as optional autorefs, ``::`` as ``:``, doctests fenced."""

    def link(match: re.Match[str]) -> str:
        target = match["target"]
        shown = target.rsplit(".", 1)[-1] if match["tilde"] else target.lstrip(".")
        identifier = _resolve(scope, target)
        return f'<autoref identifier="{identifier}" optional>`{shown}`</autoref>'

    return _fence_doctests(_LITERAL_BLOCK.sub(":\n", _ROLE.sub(link, text)))


def _comment_docstring(attr: Object) -> Docstring | None:
    """The ``#:`` comment lines right above a module-level assignment, as a docstring."""
    lines = attr.module.lines
    if attr.lineno is None or not lines:
        return None
    found: list[str] = []
    index = attr.lineno - 2  # the line above, 0-based
    while index >= 0 and lines[index].startswith("#:"):
        found.insert(0, lines[index][2:].strip())
        index -= 1
    if not found:
        return None
    return Docstring("\n".join(found), lineno=index + 2, parent=attr)


def _registry_contents(attr: Object) -> str | None:
    """The names and classes of a registry filled at import, as a Markdown list, else None."""
    annotation = str(attr.annotation or "")
    if str(attr.value) != "{}" or not annotation.startswith("dict[str, type["):
        return None
    registry = getattr(importlib.import_module(attr.module.path), attr.name)
    rows = [
        f"- `{name}`: [`{cls.__name__}`][{cls.__module__.split('._')[0]}.{cls.__name__}]"
        for name, cls in sorted(registry.items())
    ]
    return "Contents:\n\n" + "\n".join(rows)


def _public_base(base: object) -> bool:
    """Whether a base class is shown: from another library, or exported by the public
    namespace above its private module (``gradbalance.balancers._base.Balancer``: yes)."""
    path = str(getattr(base, "canonical_path", base))
    if path.split(".")[0] not in ("gradbalance", "gradbalance_lab"):
        return True
    package, private, _ = path.partition("._")
    name = path.rsplit(".", 1)[-1]
    if not private:
        return not name.startswith("_")
    return name in getattr(importlib.import_module(package), "__all__", ())


class SphinxStyle(Extension):
    """Apply the rules of the module docstring to every object of the loaded package."""

    def on_package(self, *, pkg: Object, **kwargs: Any) -> None:
        objects: list[Object] = []
        stack: list[Object] = [pkg]
        while stack:
            obj = stack.pop()
            objects.append(obj)
            stack.extend(m for m in obj.members.values() if not isinstance(m, Alias))
        for obj in objects:
            if obj.is_attribute and obj.docstring is None and obj.parent is not None \
                    and obj.parent.is_module:
                obj.docstring = _comment_docstring(obj)
            contents = _registry_contents(obj) if obj.is_attribute else None
            if contents is not None and obj.docstring is not None:
                obj.docstring.value += "\n\n" + contents
                obj.value = None  # not the empty dict of the source line
            if obj.docstring is not None:
                obj.docstring.value = rewrite(obj.docstring.value, obj)
        # Last, so that the roles above could still be resolved against these members.
        for obj in objects:
            if obj.is_class:
                obj.extra["gradbalance"]["bases"] = [b for b in obj.bases if _public_base(b)]
                for name, member in list(obj.members.items()):
                    if member.docstring is None and name not in _KEEP_UNDOCUMENTED:
                        del obj.members[name]
