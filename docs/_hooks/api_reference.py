"""An mkdocs hook: the API reference documents exactly the public API, every name with a
docstring of its own, as the site shows it (griffe reads the source the way mkdocstrings
does). Each gap is a warning, so ``mkdocs build --strict`` fails on it.

Public: every name in ``metamode.__all__``; for a public class, its public methods and
properties; for the public module ``metamode.testing``, every name in its ``__all__``.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import griffe

log = logging.getLogger("mkdocs.plugins.metamode.api_reference")

REFERENCE = "reference/api.md"
_REPO = Path(__file__).resolve().parents[2]
_DIRECTIVE = re.compile(r"^::: ([\w.]+)\s*$", re.M)


def _undocumented(obj: griffe.Object | griffe.Alias, path: str) -> list[str]:
    missing = [] if obj.docstring and obj.docstring.value.strip() else [path]
    if obj.is_class:
        for name, member in obj.members.items():
            if name.startswith("_") or not (member.is_function or "property" in member.labels):
                continue
            if not (member.docstring and member.docstring.value.strip()):
                missing.append(f"{path}.{name}")
    return missing


def _public_api() -> tuple[list[str], list[str]]:
    """The public names' paths, and those of them (or of their members) without a docstring."""
    package = griffe.load("metamode", search_paths=[str(_REPO)], resolve_aliases=True)
    names = [f"metamode.{name}" for name in package.exports or ()]
    missing: list[str] = []
    for path in names:
        obj = package[path.removeprefix("metamode.")]
        missing += _undocumented(obj, path)
        if obj.is_module:
            for name in obj.exports or ():
                missing += _undocumented(obj[name], f"{path}.{name}")
    return names, missing


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if page.file.src_uri != REFERENCE:
        return markdown
    names, missing = _public_api()
    documented = _DIRECTIVE.findall(markdown)
    for path in names:
        if path not in documented:
            log.warning("%s: the public name %s is not in the API reference", REFERENCE, path)
    for path in documented:
        if path not in names:
            log.warning("%s: %s is not a public name (metamode.__all__)", REFERENCE, path)
    for path in missing:
        log.warning("%s has no docstring: the API reference would show nothing for it", path)
    return markdown
