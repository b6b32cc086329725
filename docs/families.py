"""The registered model families as the site shows them: one page per family, with its tiny CPU twin.

A family's tiny twin (``model.source: tiny``) is the class its module marks with ``tiny_twin``
(``ModelAdapter.for_source``). tiny-digits, the shipped CPU model, has its own hand-written page
(``models/tiny-digits.md``).
"""

from __future__ import annotations

from solrl.registry import MODELS


def families() -> list[tuple[str, bool, str]]:
    """``(family, whether it has a tiny twin, adapter module)`` for every registered family, in registry (name)
    order."""
    out = []
    for name in MODELS.names():
        if name == "tiny-digits":
            continue
        cls = MODELS.get(name)
        out.append((name, "_tiny_twin" in vars(cls), cls.__module__))
    return out
