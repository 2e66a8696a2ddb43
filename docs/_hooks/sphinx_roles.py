"""A griffe extension: the docstrings' reST roles (:func:`x`, :class:`~a.b.C`) as Markdown.

A role naming a public object (a name in ``metamode.__all__`` or ``metamode.testing.__all__``)
becomes a link to its entry in the API reference; any other becomes inline code.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import griffe

_PACKAGE = Path(__file__).resolve().parents[2] / "metamode"
_ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|exc|obj):`(~?)([\w.]+)`")


def _all(path: Path) -> list[str]:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return list(ast.literal_eval(node.value))
    return []


_PUBLIC = {f"metamode.{name}" for name in _all(_PACKAGE / "__init__.py")} | {
    f"metamode.testing.{name}" for name in _all(_PACKAGE / "testing.py")
}
_BY_SHORT_NAME = {path.rsplit(".", 1)[1]: path for path in _PUBLIC}


def _markdown(match: re.Match[str]) -> str:
    short, target = match.group(1) == "~", match.group(2)
    shown = target.rsplit(".", 1)[-1] if short else target
    path = target if target in _PUBLIC else _BY_SHORT_NAME.get(target)
    return f"[`{shown}`][{path}]" if path else f"`{shown}`"


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_markdown, obj.docstring.value)
