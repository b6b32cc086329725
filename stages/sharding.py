"""Prompt shards: a stage's prompts split into contiguous blocks, each computed by its own task (issue 11).

Every seed derives from (run seed, iteration, prompt position, candidate) and every backend is batch-invariant,
so a shard computes exactly what the whole stage computes for its prompts: the reduce step concatenates the
shards' outputs, and the result does not depend on how many shards computed it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def prompts_per_part(items_per_prompt: int, batch_sizes: Sequence[int]) -> int:
    """How many prompts a stage streams at a time (explore sampling and writing its pool, score reading and
    scoring it): the fewest whose items (``items_per_prompt`` each: candidates, or the frames scored) fill whole
    batches of every size in ``batch_sizes``, the least common multiple of ``size / gcd(items_per_prompt, size)``.
    Every batch is then exactly one of a single call over all prompts (the same numbers to the last digit on a
    CPU whose GEMM is not batch-invariant) while memory holds those prompts only, not the iteration's."""
    step = 1
    for size in batch_sizes:
        step = math.lcm(step, size // math.gcd(items_per_prompt, size))
    return step


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count``: the prompt positions ``[index * P // count, (index + 1) * P // count)``."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard index {self.index} outside 0..{self.count - 1}")

    def positions(self, prompts: int) -> range:
        """This shard's prompt positions among ``prompts`` (``count <= prompts`` keeps every shard non-empty)."""
        return range(self.index * prompts // self.count, (self.index + 1) * prompts // self.count)

    @property
    def name(self) -> str:
        """Folder name of the shard's committed output, e.g. ``001-of-004``."""
        return f"{self.index:03d}-of-{self.count:03d}"


#: The whole stage as one shard.
WHOLE = Shard()
