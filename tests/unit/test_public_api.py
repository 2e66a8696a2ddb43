"""The public API is one list, and every name in it says what it does.

``metamode/__init__.py`` names each public object three times: ``_EXPORTS`` (what the lazy
``__getattr__`` imports, and from where), the ``TYPE_CHECKING`` imports (what type checkers
see) and ``__all__`` (what ``import *``, documentation tools and readers see). They must agree,
module for module. Every public name, and every public method or property of a public class,
has a docstring of its own: the API reference is generated from them.
"""

from __future__ import annotations

import ast
import importlib
import inspect

import pytest

import metamode
import metamode.testing
from tests.conftest import REPO

_INIT = REPO / "metamode" / "__init__.py"


def _type_checking_imports() -> dict[str, str]:
    """name -> module, from the ``if _typing.TYPE_CHECKING:`` block of ``__init__.py``."""
    tree = ast.parse(_INIT.read_text())
    blocks = [
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "_typing.TYPE_CHECKING"
    ]
    assert len(blocks) == 1, "expected one `if _typing.TYPE_CHECKING:` block"
    names: dict[str, str] = {}
    for node in blocks[0].body:
        assert isinstance(node, ast.ImportFrom), ast.unparse(node)
        for alias in node.names:
            assert alias.asname is None, f"{alias.name} is imported under another name"
            assert alias.name not in names, f"{alias.name} is imported twice"
            names[alias.name] = node.module or ""
    return names


def test_all_lists_each_public_name_once():
    assert len(metamode.__all__) == len(set(metamode.__all__))


def test_exports_and_all_agree():
    assert set(metamode.__all__) == set(metamode._EXPORTS) | set(metamode._SUBMODULES)


def test_type_checking_imports_and_exports_agree():
    expected = {name: module for name, module in metamode._EXPORTS.items()}
    expected.update({name: "metamode" for name in metamode._SUBMODULES})
    assert _type_checking_imports() == expected


@pytest.mark.parametrize("name", sorted(metamode._EXPORTS))
def test_each_export_is_defined_where_exports_says(name):
    # By name, not identity: other tests reload integration modules.
    module = importlib.import_module(metamode._EXPORTS[name])
    obj = getattr(metamode, name)
    assert hasattr(module, name) and obj.__name__ == name
    assert obj.__module__ == metamode._EXPORTS[name], "import it from where it is defined"


def _own_doc(obj: object) -> str:
    doc = vars(obj).get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    return (doc or "").strip()


def _public_objects() -> list[tuple[str, object]]:
    objects = [(f"metamode.{name}", getattr(metamode, name)) for name in metamode.__all__]
    objects += [
        (f"metamode.testing.{n}", getattr(metamode.testing, n)) for n in metamode.testing.__all__
    ]
    members = []
    for qualname, obj in objects:
        if not inspect.isclass(obj):
            continue
        for name, member in vars(obj).items():
            if name.startswith("_") or not (callable(member) or isinstance(member, property)):
                continue
            members.append((f"{qualname}.{name}", member))
    return objects + members


@pytest.mark.parametrize(("qualname", "obj"), _public_objects(), ids=lambda value: str(value))
def test_every_public_name_has_a_docstring(qualname, obj):
    assert _own_doc(obj), f"{qualname} has no docstring of its own"
