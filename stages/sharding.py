"""Prompt shards: a stage's prompts split into contiguous blocks, each computed by its own task (issue 11).

Every seed derives from (run seed, iteration, prompt position, candidate) and every explore backend quantizes each
sample alone, so a shard computes what the whole stage computes for its prompts: the reduce step concatenates the
shards' outputs. To the last bit where the shards hold whole batches (``Shard.block``): a matrix product's rounding
may depend on the batch around a row (many CPUs; cuBLAS picks kernels by shape), so a batch split by a shard
boundary can differ in its last bits, and the low-precision explore of a later iteration can amplify that into
other kept seeds (``solrl.stages.pipeline.shard_warnings`` says when a shard count splits batches).
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
    """Shard ``index`` of ``count`` of a stage's prompts, in contiguous runs. ``block`` is the stage's batching
    block (``prompts_per_part`` of its sampling, decoding and scoring batches): where there are at least ``count``
    blocks, shard boundaries fall between blocks, so every batch is whole in one shard and is exactly one of the
    unsharded stage's (the same numbers to the last bit on hardware whose matrix products round by batch size);
    else the prompts split evenly, ``[index * P // count, (index + 1) * P // count)``, and a batch may be split."""

    index: int = 0
    count: int = 1
    block: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard index {self.index} outside 0..{self.count - 1}")
        if self.block < 1:
            raise ValueError(f"shard block {self.block}: give at least 1 prompt")

    def positions(self, prompts: int) -> range:
        """This shard's prompt positions among ``prompts`` (``count <= prompts`` keeps every shard non-empty)."""
        if self.splits_batches(prompts):
            return range(self.index * prompts // self.count, (self.index + 1) * prompts // self.count)
        blocks = -(-prompts // self.block)
        first, last = self.index * blocks // self.count, (self.index + 1) * blocks // self.count
        return range(min(prompts, first * self.block), min(prompts, last * self.block))

    def splits_batches(self, prompts: int) -> bool:
        """Whether ``count`` shards of ``prompts`` must split a batching block (fewer blocks than shards)."""
        return self.count > -(-prompts // self.block)

    @property
    def name(self) -> str:
        """Folder name of the shard's committed output, e.g. ``001-of-004``."""
        return f"{self.index:03d}-of-{self.count:03d}"


#: The whole stage as one shard.
WHOLE = Shard()
