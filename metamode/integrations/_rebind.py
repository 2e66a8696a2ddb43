"""Atomic, reversible rebinding of a library's module-level names: the one place metamode
changes another library's namespace. The rules: docs/design.md, "Shims".
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

__all__ = ["IncompatibleLibraryError", "Rebinding"]

_LOCK = threading.RLock()
# (home_module, name) -> the library's original object, while a shim is on.
_ORIGINALS: dict[tuple[str, str], Any] = {}
# Small shared flags of the integration modules, kept here so a reload keeps them.
SHARED: dict[str, Any] = {}
_TAG = "_metamode_replaces"


def _tag_of(value: Any) -> tuple[str, str] | None:
    try:
        tag = getattr(value, _TAG, None)
    except Exception:  # an object whose __getattr__ raises something else
        return None
    return tag if isinstance(tag, tuple) else None


class IncompatibleLibraryError(RuntimeError):
    """The installed library does not have the internals a shim expects."""


@dataclass
class Rebinding:
    """Replace ``home_module``'s ``names`` (and every alias of them) in ``package``.

    ``enable`` rebinds, under ``_LOCK`` and all or nothing, the home module and every module
    of ``package`` and of the packages in ``scan`` (``from accelerate import
    init_empty_weights`` in diffusers) whose namespace holds an original, found by identity;
    it raises ``IncompatibleLibraryError`` naming the version and the missing names, with
    nothing changed, when the home module lacks one. ``before_rebinding``, if given, is called
    with ``{name: original}`` after those checks and before the first name is rebound, so a
    replacement can reach the original from the moment any code can find the replacement.
    ``disable`` restores every binding that still holds a replacement, including those of
    modules imported later and of replacements made before an ``importlib.reload`` of the
    integration. The home module is rebound first and restored last, so while another
    thread watches a toggle half done, a module holding a replacement implies that the home
    module, where the library's own functions look the names up at call time, holds it too.
    """

    package: str
    extra: str  # the pip extra that installs the package
    home_module: str
    replacements: Mapping[str, Callable[..., Any]]
    scan: tuple[str, ...] = ()
    before_rebinding: Callable[[Mapping[str, Any]], None] | None = None

    def __post_init__(self) -> None:
        for name, replacement in self.replacements.items():
            # A builtin can't be tagged: it is then not recognised after a reload.
            with contextlib.suppress(AttributeError, TypeError):
                setattr(replacement, _TAG, (self.home_module, name))

    @property
    def _keys(self) -> list[tuple[str, str]]:
        return [(self.home_module, name) for name in self.replacements]

    @property
    def _originals(self) -> dict[str, Any]:
        """``{name: the library's original}`` while enabled (read by the doctor)."""
        keys = {name: (self.home_module, name) for name in self.replacements}
        return {name: _ORIGINALS[key] for name, key in keys.items() if key in _ORIGINALS}

    @property
    def enabled(self) -> bool:
        return any(key in _ORIGINALS for key in self._keys)

    def enable(self) -> tuple[str, ...]:
        """Rebind; returns the ``module.name`` bindings now pointing at metamode."""
        with _LOCK:
            if self.enabled:
                self._refresh()
                return self._describe()
            home = self._import_home()
            missing = [name for name in self.replacements if name not in vars(home)]
            if missing:
                raise IncompatibleLibraryError(
                    f"{self.package} {self._version()} has no {', '.join(missing)} in "
                    f"{self.home_module}; metamode's shim cannot route it safely, so "
                    f"nothing was changed. Please report this with the version."
                )
            originals = {name: vars(home)[name] for name in self.replacements}
            if any(_tag_of(obj) is not None for obj in originals.values()):
                raise IncompatibleLibraryError(
                    f"{self.home_module} already holds metamode's replacements "
                    f"(another copy of metamode enabled this shim?)"
                )
            if self.before_rebinding is not None:
                self.before_rebinding(originals)
            by_original = {id(originals[n]): self.replacements[n] for n in originals}
            targets = [
                (module, attr, value, by_original[id(value)])
                for module in self._library_modules()
                for attr, value in list(vars(module).items())
                if id(value) in by_original
            ]
            applied: list[tuple[ModuleType, str, Any]] = []
            try:
                for module, attr, original, replacement in targets:
                    setattr(module, attr, replacement)
                    applied.append((module, attr, original))
            except BaseException:
                for module, attr, original in reversed(applied):
                    setattr(module, attr, original)
                raise
            for name, original in originals.items():
                _ORIGINALS[(self.home_module, name)] = original
            return self._describe()

    def disable(self) -> tuple[str, ...]:
        """Restore every original binding; returns those restored."""
        with _LOCK:
            if not self.enabled:
                return ()
            keys = set(self._keys)
            restored = []
            for module, attr, tag in reversed(self._ours()):  # the home module last
                if tag in keys and tag in _ORIGINALS:
                    setattr(module, attr, _ORIGINALS[tag])
                    restored.append(f"{module.__name__}.{attr}")
            for key in keys:
                _ORIGINALS.pop(key, None)
            return tuple(sorted(restored))

    def _ours(self) -> list[tuple[ModuleType, str, tuple[str, str]]]:
        """Every binding holding a replacement tagged with this shim's home module
        (this copy's or, after a reload, an older one's)."""
        found = []
        for module in self._library_modules():
            for attr, value in list(vars(module).items()):
                if callable(value):
                    tag = _tag_of(value)
                    if tag is not None and tag[0] == self.home_module:
                        found.append((module, attr, tag))
        return found

    def _refresh(self) -> None:
        """After a reload, point bindings of older replacements at the current ones."""
        for module, attr, tag in self._ours():
            replacement = self.replacements.get(tag[1])
            if replacement is not None and vars(module)[attr] is not replacement:
                setattr(module, attr, replacement)

    def _describe(self) -> tuple[str, ...]:
        # Only this shim's names: two shims may share a home module.
        names = set(self.replacements)
        return tuple(sorted(f"{m.__name__}.{a}" for m, a, tag in self._ours() if tag[1] in names))

    def _import_home(self) -> ModuleType:
        try:
            return importlib.import_module(self.home_module)
        except ModuleNotFoundError as error:
            if error.name == self.home_module and self._version() != "(unknown version)":
                # Installed, but a release without the module the shim targets.
                raise IncompatibleLibraryError(
                    f"{self.package} {self._version()} has no module {self.home_module}; "
                    f"metamode's shim targets releases that do, so nothing was changed."
                ) from error
            raise self._missing(error) from error
        except ImportError as error:
            raise self._missing(error) from error

    def _missing(self, error: ImportError) -> ImportError:
        return ImportError(
            f"metamode's {self.package} integration needs {self.package}: "
            f"pip install 'metamode[{self.extra}]' ({error})"
        )

    def _library_modules(self) -> list[ModuleType]:
        """The library's modules, the home module first."""
        packages = (self.package, *self.scan)
        prefixes = tuple(package + "." for package in packages)
        return sorted(
            (
                module
                for name, module in list(sys.modules.items())
                if isinstance(module, ModuleType)
                and (name in packages or name.startswith(prefixes))
            ),
            key=lambda module: module.__name__ != self.home_module,
        )

    def _version(self) -> str:
        try:
            return importlib.metadata.version(self.package)
        except importlib.metadata.PackageNotFoundError:
            return "(unknown version)"


@dataclass
class ClassAttributeRebinding:
    """Replace attributes defined on one class of a library, for libraries that keep a
    process-wide change in a method or classmethod with no module-level name to rebind.

    ``make_replacements(originals)`` gets ``{name: the attribute as vars(cls) holds it}``
    and returns ``{name: replacement}`` (raising ``IncompatibleLibraryError`` if the
    originals are not what it knows how to route). ``enable`` sets every replacement on the
    class, under ``_LOCK`` and all or nothing; ``disable`` puts back every original the
    class still holds a replacement for. Subclasses that override a name are left alone.
    """

    package: str
    extra: str
    home_module: str
    class_name: str
    names: tuple[str, ...]
    make_replacements: Callable[[Mapping[str, Any]], Mapping[str, Any]]

    def _key(self, name: str) -> tuple[str, str]:
        return (self.home_module, f"{self.class_name}.{name}")

    @property
    def enabled(self) -> bool:
        return any(self._key(name) in _ORIGINALS for name in self.names)

    @property
    def _originals(self) -> dict[str, Any]:
        """``{name: the library's original}`` while enabled (read by the doctor)."""
        return {n: _ORIGINALS[self._key(n)] for n in self.names if self._key(n) in _ORIGINALS}

    def _class(self) -> type:
        home = _home_module(self.package, self.extra, self.home_module)
        owner = vars(home).get(self.class_name)
        if not isinstance(owner, type):
            raise IncompatibleLibraryError(
                f"{self.package} {_version(self.package)} has no class {self.class_name} in "
                f"{self.home_module}; nothing was changed. Please report this with the version."
            )
        return owner

    def enable(self) -> tuple[str, ...]:
        """Set the replacements; returns the ``module.Class.name`` attributes now metamode's."""
        with _LOCK:
            owner = self._class()
            if not self.enabled:
                missing = [name for name in self.names if name not in vars(owner)]
                if missing:
                    raise IncompatibleLibraryError(
                        f"{self.package} {_version(self.package)} has no "
                        f"{', '.join(missing)} on {self.home_module}.{self.class_name}; "
                        f"nothing was changed. Please report this with the version."
                    )
                originals = {name: vars(owner)[name] for name in self.names}
                if any(_tag_of(_function_of(v)) is not None for v in originals.values()):
                    raise IncompatibleLibraryError(
                        f"{self.home_module}.{self.class_name} already holds metamode's "
                        f"replacements (another copy of metamode enabled this shim?)"
                    )
                replacements = self.make_replacements(originals)
                for name, replacement in replacements.items():
                    setattr(_function_of(replacement), _TAG, self._key(name))
                for name in self.names:
                    setattr(owner, name, replacements[name])
                for name, original in originals.items():
                    _ORIGINALS[self._key(name)] = original
            return self._describe()

    def disable(self) -> tuple[str, ...]:
        """Put every original back; returns the attributes restored."""
        with _LOCK:
            if not self.enabled:
                return ()
            owner = self._class()
            restored = []
            for name in self.names:
                original = _ORIGINALS.pop(self._key(name), None)
                if original is not None and _tag_of(_function_of(vars(owner).get(name))):
                    setattr(owner, name, original)
                    restored.append(f"{self.home_module}.{self.class_name}.{name}")
            return tuple(restored)

    def _describe(self) -> tuple[str, ...]:
        return tuple(f"{self.home_module}.{self.class_name}.{name}" for name in self.names)


def _function_of(attribute: Any) -> Any:
    """The function a ``classmethod`` or ``staticmethod`` holds; else the attribute."""
    return getattr(attribute, "__func__", attribute)


def _home_module(package: str, extra: str, home_module: str) -> ModuleType:
    return Rebinding(package, extra, home_module, {})._import_home()


def _version(package: str) -> str:
    return Rebinding(package, "", "", {})._version()
