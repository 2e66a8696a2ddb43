"""The package's layers import downwards only (docs/design.md, "Layout").

Parses every module under ``metamode/`` (no imports run) and fails on an import
of a higher layer, including function-level imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

import metamode

PACKAGE = Path(metamode.__file__).parent

# module prefix -> layer; the longest matching prefix wins
LAYERS = {
    "metamode._torch": 0,
    "metamode._core": 1,
    "metamode._contexts": 2,
    "metamode.integrations": 3,
    "metamode._diagnostics": 4,
    "metamode.testing": 5,
    "metamode._tools": 5,
    "metamode.__main__": 6,
    "metamode.lab": 7,
}
_PACKAGES = {
    "metamode",
    "metamode._core",
    "metamode._contexts",
    "metamode._diagnostics",
    "metamode.integrations",
    "metamode._tools",
    "metamode.lab",
}


def _layer(module: str) -> int | None:
    matches = [p for p in LAYERS if module == p or module.startswith(p + ".")]
    return LAYERS[max(matches, key=len)] if matches else None


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(tree: ast.AST) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("metamode"):
            if node.module in _PACKAGES:  # `from metamode._core import modes`
                found += [(f"{node.module}.{alias.name}", node.lineno) for alias in node.names]
            else:
                found.append((node.module, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.startswith("metamode")]
    return found


def test_every_module_belongs_to_a_layer():
    unplaced = [
        _module_name(path)
        for path in PACKAGE.rglob("*.py")
        if _module_name(path) != "metamode" and _layer(_module_name(path)) is None
    ]
    assert unplaced == []


def test_no_module_imports_a_higher_layer():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        mine = _layer(module)
        if mine is None:
            continue
        for imported, line in _imported(ast.parse(path.read_text())):
            theirs = _layer(imported)
            if theirs is not None and theirs > mine:
                upward.append(f"{module}:{line} (layer {mine}) imports {imported} (layer {theirs})")
    assert upward == []


def test_the_check_sees_an_upward_import():
    tree = ast.parse("def f():\n    from metamode._diagnostics import doctor\n")
    assert _imported(tree) == [("metamode._diagnostics.doctor", 2)]
    assert _layer("metamode._diagnostics.doctor") > _layer("metamode._core.hooks")
