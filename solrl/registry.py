"""Plug-in registries: model families, rewards, explore backends and policy losses (DESIGN 3).

As torchtitan's ``register_train_spec`` / ``get_train_spec``: a plug-in registers under a name, and
everything else looks it up by that name; nothing switches on a name. A new model family, reward, explore
backend or loss is one module that calls ``register_*`` and its test.

Built-in plug-ins live in the ``solrl.stages`` sub-packages, found by reading those modules' sources for their
``register_*`` decorators (``scan``): a registry lists and validates names, and reads a plug-in's literal
declarations (a family's published weights), without importing any plug-in, or torch; a plug-in's module is
imported when its name is first looked up. Third-party plug-ins register from their own package, found
through the ``solrl.plugins`` entry-point group: each entry point is a module imported before the first
lookup, e.g. in a ``pyproject.toml``::

    [project.entry-points."solrl.plugins"]
    my_reward = "my_package.my_reward"

A module that is not installed with an entry point (one under development, or the tests' fault injection) is
named in ``SOLRL_PLUGINS`` (comma-separated dotted names, importable on the process's path), which every process
of a run inherits.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Generic, TypeVar

T = TypeVar("T")

#: Entry-point group of third-party plug-in modules (imported once, before the first lookup).
PLUGIN_GROUP = "solrl.plugins"
#: More plug-in modules, comma-separated dotted names, imported after the entry points.
PLUGINS_ENV = "SOLRL_PLUGINS"
_plugins_loaded = False


def load_plugins() -> None:
    """Import the third-party plug-in modules once per process: the ``solrl.plugins`` entry points, then the
    modules ``SOLRL_PLUGINS`` names. The registries call it before their first lookup, and a stage's commit before
    its first ``commit_hooks`` call.

    Raises:
        solrl.config.ConfigError: a plug-in module failed to import (the message names it, its error and the fix;
            the commands print it as one line, exit code 2).
    """
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    named = [
        (
            entry.load,
            f"entry point {entry.name} = {entry.value} ({PLUGIN_GROUP})",
            "fix it, or uninstall the package that declares it",
        )
        for entry in entry_points(group=PLUGIN_GROUP)
    ]
    for module in filter(None, (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(","))):
        named.append(
            (
                lambda module=module: importlib.import_module(module),
                f"module {module} ({PLUGINS_ENV})",
                f"fix it, or remove it from {PLUGINS_ENV}",
            )
        )
    for load, what, fix in named:
        try:
            load()
        except Exception as exc:  # a broken third-party plug-in: name it instead of a traceback
            from solrl.config import ConfigError

            raise ConfigError(f"plug-in {what} failed to import: {exc.__class__.__name__}: {exc}; {fix}") from exc


@dataclass(frozen=True)
class Declared:
    """A built-in plug-in as its source declares it, read without importing it.

    Attributes:
        module: the dotted module that registers it, e.g. ``solrl.stages.models.flux``.
        qualname: the decorated class or function, e.g. ``Flux``.
        attributes: the literal values (``ast.literal_eval``) assigned in the class's own body, e.g. ``hub_id``.
    """

    module: str
    qualname: str
    attributes: dict[str, Any]


def _literal_attributes(node: ast.ClassDef) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
            target, value = stmt.target.id, stmt.value
        elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            target, value = stmt.targets[0].id, stmt.value
        else:
            continue
        try:
            values[target] = ast.literal_eval(value)
        except ValueError:  # not a literal (a call, a name): only an import can tell
            continue
    return values


#: Held while a registry scans its sources (``Registry.index``): each registry scans once, whichever thread asks
#: first, and solrl's own ``ast.parse`` calls never overlap. CPython 3.11 keeps the AST constructor's recursion depth
#: per interpreter, not per thread, so two threads parsing at once can fail with a spurious ``SystemError: AST
#: constructor recursion depth mismatch`` (python/cpython#106905; seen in a served campaign's flow run).
_SCAN_LOCK = threading.Lock()


def _parse(path: Path, attempts: int = 3) -> ast.Module:
    """``path`` parsed by ``ast``; the spurious ``SystemError`` above, raised when another thread (a library's)
    parsed at the same moment, is retried: parsing is pure.

    Raises:
        SystemError: the same error ``attempts`` times in a row.
    """
    source, attempt = path.read_text(encoding="utf-8"), 1
    while True:
        try:
            return ast.parse(source, str(path))
        except SystemError as exc:
            if "recursion depth mismatch" not in str(exc) or attempt >= attempts:
                raise
            attempt += 1


def scan(package: str, decorator: str) -> dict[str, Declared]:
    """Name -> ``Declared`` of every ``@decorator("name")`` in the modules of ``package``, read with ``ast``.

    Only the package's parent packages are imported (to find its folder), so a registry lists and checks its
    built-in names without importing them, or torch. A name registered twice in the sources is an error.

    Raises:
        ValueError: two modules register the same name.
    """
    spec = importlib.util.find_spec(package)
    found: dict[str, Declared] = {}
    for folder in (spec.submodule_search_locations or []) if spec else []:
        for path in sorted(Path(folder).glob("*.py")):
            module = package if path.stem == "__init__" else f"{package}.{path.stem}"
            for node in _parse(path).body:
                if not isinstance(node, ast.ClassDef | ast.FunctionDef):
                    continue
                for call in node.decorator_list:
                    func = getattr(call, "func", None)
                    called = getattr(func, "id", None) or getattr(func, "attr", None)
                    args = getattr(call, "args", [])
                    if called != decorator or not args or not isinstance(args[0], ast.Constant):
                        continue
                    name = args[0].value
                    if name in found:
                        raise ValueError(f"{name!r} is registered by {found[name].module} and {module}")
                    attributes = _literal_attributes(node) if isinstance(node, ast.ClassDef) else {}
                    found[name] = Declared(module, node.name, attributes)
    return found


class Registry(Generic[T]):
    """Name -> plug-in (a class or factory) for one plug-in point.

    The built-in plug-ins are found by reading the modules of ``builtins`` for ``@decorator("name")`` (``scan``):
    a new module there is registered by being there, with no list to edit, and is imported only when its name is
    looked up (``get``). Listing names and reading a plug-in's literal declarations (``declared``) import nothing.
    Third-party plug-ins register from their entry points (imported before the first lookup), and tests may
    register with the decorator directly.

    Args:
        kind: what is registered, for messages ("reward", "model family", ...).
        builtins: the package whose modules hold the built-in plug-ins.
        decorator: the name the built-in modules register with, e.g. ``register_reward``.
    """

    def __init__(self, kind: str, builtins: str, decorator: str) -> None:
        self.kind = kind
        self._builtins = builtins
        self._decorator = decorator
        self._entries: dict[str, T] = {}
        self._index: dict[str, Declared] | None = None

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: register ``entry`` under ``name``.

        Raises:
            ValueError: ``name`` is already registered (to a different entry, or to another module's built-in).
        """

        def decorator(entry: T) -> T:
            if self._entries.get(name, entry) is not entry:
                raise ValueError(f"{self.kind} {name!r} is already registered to {self._entries[name]!r}")
            builtin = self.index().get(name)
            if builtin is not None and builtin.module != getattr(entry, "__module__", builtin.module):
                raise ValueError(f"{self.kind} {name!r} is solrl's own ({builtin.module}); register another name")
            self._entries[name] = entry
            return entry

        return decorator

    def index(self) -> dict[str, Declared]:
        """The built-in plug-ins as their sources declare them (``scan``, once per process, whichever thread asks
        first)."""
        if self._index is None:
            with _SCAN_LOCK:
                if self._index is None:
                    self._index = scan(self._builtins, self._decorator)
        return self._index

    def names(self) -> list[str]:
        """Every registered name, sorted (built-in ones without importing them)."""
        load_plugins()
        return sorted({*self.index(), *self._entries})

    def get(self, name: str) -> T:
        """The plug-in registered as ``name``, its module imported on first use.

        Raises:
            ValueError: no plug-in of that name; the message lists the registered names.
        """
        if name not in self._entries and name in self.index():
            importlib.import_module(self.index()[name].module)
        load_plugins()
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())}") from None

    def declared(self, name: str, attribute: str, default: Any = None) -> Any:
        """A plug-in's own class attribute without importing it when it is built-in (its literal value in its
        class body; ``default`` where that body assigns none: an inherited value is not read), else the registered
        entry's attribute (inherited values included).

        Raises:
            ValueError: no plug-in of that name.
        """
        if name in self.index():
            return self.index()[name].attributes.get(attribute, default)
        return getattr(self.get(name), attribute, default)

    def __contains__(self, name: object) -> bool:
        load_plugins()
        return name in self.index() or name in self._entries


MODELS: Registry = Registry("model family", "solrl.stages.models", "register_model")
REWARDS: Registry = Registry("reward", "solrl.stages.rewards", "register_reward")
EXPLORE_BACKENDS: Registry = Registry("explore precision", "solrl.stages.quant", "register_explore_backend")
LOSSES: Registry = Registry("loss", "solrl.stages.losses", "register_loss")

register_model = MODELS.register
register_reward = REWARDS.register
register_explore_backend = EXPLORE_BACKENDS.register
register_loss = LOSSES.register
