"""Plug-in registries: model families, rewards, explore backends and policy losses (DESIGN 3).

As torchtitan's ``register_train_spec`` / ``get_train_spec``: a plug-in registers under a name, and
everything else looks it up by that name; nothing switches on a name. A new model family, reward, explore
backend or loss is one module that calls ``register_*`` and its test.

Built-in plug-ins live in the ``solrl.stages`` sub-packages; a registry imports its package by name on the
first lookup (so the config schema can validate names without a static import of the stage code, which
would point the layers the wrong way). Third-party plug-ins register from their own package, found
through the ``solrl.plugins`` entry-point group: each entry point is a module imported before the first
lookup, e.g. in a ``pyproject.toml``::

    [project.entry-points."solrl.plugins"]
    my_reward = "my_package.my_reward"
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Generic, TypeVar

T = TypeVar("T")

#: Entry-point group of third-party plug-in modules (imported once, before the first lookup).
PLUGIN_GROUP = "solrl.plugins"
_plugins_loaded = False


def _load_entry_point_plugins() -> None:
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for entry in entry_points(group=PLUGIN_GROUP):
        try:
            entry.load()
        except Exception as exc:  # a broken third-party plug-in: name it instead of a traceback
            raise ValueError(
                f"plug-in entry point {entry.name} = {entry.value} ({PLUGIN_GROUP}) failed to import: "
                f"{exc.__class__.__name__}: {exc}"
            ) from exc


class Registry(Generic[T]):
    """Name -> plug-in (a class or factory) for one plug-in point.

    Args:
        kind: what is registered, for messages ("reward", "model family", ...).
        builtins: the package whose import registers the built-in plug-ins.
    """

    def __init__(self, kind: str, builtins: str) -> None:
        self.kind = kind
        self._builtins = builtins
        self._entries: dict[str, T] = {}
        self._discovered = False

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: register ``entry`` under ``name``.

        Raises:
            ValueError: ``name`` is already registered (to a different entry).
        """

        def decorator(entry: T) -> T:
            if self._entries.get(name, entry) is not entry:
                raise ValueError(f"{self.kind} {name!r} is already registered to {self._entries[name]!r}")
            self._entries[name] = entry
            return entry

        return decorator

    def _discover(self) -> None:
        if not self._discovered:
            self._discovered = True
            importlib.import_module(self._builtins)
            _load_entry_point_plugins()

    def names(self) -> list[str]:
        """Every registered name, sorted."""
        self._discover()
        return sorted(self._entries)

    def get(self, name: str) -> T:
        """The plug-in registered as ``name``.

        Raises:
            ValueError: no plug-in of that name; the message lists the registered names.
        """
        self._discover()
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())}") from None

    def __contains__(self, name: object) -> bool:
        self._discover()
        return name in self._entries


MODELS: Registry = Registry("model family", "solrl.stages.models")
REWARDS: Registry = Registry("reward", "solrl.stages.rewards")
EXPLORE_BACKENDS: Registry = Registry("explore precision", "solrl.stages.quant")
LOSSES: Registry = Registry("loss", "solrl.stages.losses")

register_model = MODELS.register
register_reward = REWARDS.register
register_explore_backend = EXPLORE_BACKENDS.register
register_loss = LOSSES.register
