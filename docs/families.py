"""The registered model families as the site shows them: one page per family, its tiny CPU twins on it.

A twin is a registered class that names the family's class among its direct bases (``TinySana(TinyFamily,
Sana)``). tiny-digits, the shipped CPU model, has its own hand-written page (``models/tiny-digits.md``).
"""

from __future__ import annotations

from solrl.registry import MODELS


def families() -> list[tuple[str, list[str], str]]:
    """``(family, [tiny twins], adapter module)`` for every registered family, in registry (name) order."""
    classes = {name: MODELS.get(name) for name in MODELS.names() if name != "tiny-digits"}
    out = []
    for name, cls in classes.items():
        if name.startswith("tiny-"):
            continue
        twins = [twin for twin, other in classes.items() if twin.startswith("tiny-") and cls in other.__bases__]
        out.append((name, twins, cls.__module__))
    return out
