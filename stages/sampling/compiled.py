"""Regional compilation of the sampling copies: the explore copy and the BF16 rollout (``explore.compile``,
``regenerate.compile``).

What is compiled is each *repeated block* of the transformer (the diffusers recipe: the model class's
``_repeated_blocks`` names them, else the family adapter's ``repeated_blocks``): one graph per block class serves
every layer of that class, so compile time does not grow with depth. Embedders, the final layer and the
sampler loop stay eager.

Three choices differ from ``ModelMixin.compile_repeated_blocks``, each for a reason of this project:

* **Only while sampling.** The BF16 rollout shares its modules with the policy the update trains, and the
  update must stay eager (a compiled backward is another graph, and other numerics). So the compiled forwards
  are installed on the blocks for the duration of :func:`compiled_blocks` and removed on exit. One
  ``torch.compile`` of each block class's forward serves every block of the class, and dynamo's cache lives on
  that code object, so re-entering the context, or a new model of the same classes, costs nothing.
* **The batch dimension is dynamic from the first call.** A block's tensor arguments are made contiguous and
  those whose leading dimension is the batch are marked ``maybe_mark_dynamic(t, 0)`` before the call, so a
  ragged last batch, the explore, regenerate and evaluation batch sizes and a new iteration reuse one graph
  (no second, automatic-dynamic compile). A batch of one is specialised by dynamo (its 0/1 rule), and a kernel
  choice can guard on a size range (SANA's 1x1 convs: batch >= 16): one more graph each, in the first
  iteration, since every iteration samples the same batch sizes.
* **Layers that cannot be traced are compiled around.** Layers matching ``eager`` (the explore backend's
  ``eager_layer``: Transformer Engine's modules) run under ``torch.compiler.disable``; everything else in the
  block is compiled.

Weights change between iterations (the update, then the in-place re-quantization of the explore copy): with
dynamo's default of inlining built-in modules, parameters and buffers are graph inputs, guarded on shape, dtype
and device, not on identity or value, so none of that recompiles (``tests/test_compile.py`` counts it).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, get_args

import torch
from torch import nn

from solrl.config import ModelConfig

log = logging.getLogger("solrl.compile")

#: ``torch.compile`` modes a config may name: those of ``model.compile_mode``.
COMPILE_MODES: tuple[str, ...] = get_args(ModelConfig.model_fields["compile_mode"].annotation)

#: The compiled forward of each (block class, mode), shared by every block of that class (dynamo's cache lives on
#: the forward's code object), and the (network, block classes, mode) already compiled in this process.
_FORWARDS: dict[tuple[type, str], Callable[..., Any]] = {}
_COMPILED: set[tuple[str, tuple[str, ...], str]] = set()


@dataclass
class CompileStats:
    """What a :func:`compiled_blocks` context compiled: ``blocks`` (count), ``classes`` (block class names),
    ``first`` (this network's first compiled run in this process: its first batch includes the compile),
    ``graphs`` (dynamo graphs compiled inside the context: 0 once warm) and ``seconds`` (dynamo + backend
    compile time inside the context)."""

    blocks: int = 0
    classes: tuple[str, ...] = ()
    first: bool = False
    graphs: int = 0
    seconds: float = 0.0
    _start: tuple[int, float] = field(default=(0, 0.0), repr=False)


def dynamo_totals() -> tuple[int, float]:
    """``(graphs, seconds)`` compiled by dynamo in this process so far: its ``unique_graphs`` counter and the
    summed ``_compile.compile_inner`` timings (dynamo tracing plus the backend's compile)."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    seconds = compilation_time_metrics.get("_compile.compile_inner", ())
    return int(counters["stats"]["unique_graphs"]), float(sum(seconds))


def repeated_blocks(net: nn.Module, fallback: Sequence[str] = ()) -> list[nn.Module]:
    """The repeated blocks of ``net`` (a transformer, possibly inside a wrapper): modules whose class name is in
    the first ``_repeated_blocks`` found on ``net`` or its submodules (diffusers' convention), else in
    ``fallback`` (the family adapter's ``repeated_blocks``), in ``modules()`` order.

    Raises:
        ValueError: no block class is named, or none is found in ``net``.
    """
    names: Sequence[str] = ()
    for module in net.modules():
        names = getattr(module, "_repeated_blocks", None) or ()
        if names:
            break
    names = tuple(names) or tuple(fallback)
    if not names:
        raise ValueError(
            f"{type(net).__name__} names no repeated block to compile: its class has no _repeated_blocks and the "
            f"model adapter no repeated_blocks; set one of them (the transformer block class names)"
        )
    blocks = [m for m in net.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"no module of class {', '.join(names)} in {type(net).__name__}: nothing to compile")
    return blocks


def _as_block_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The block's tensor arguments made contiguous (the first block's input is often a transposed view, which
    would be a second graph), with dim 0 marked dynamic on those whose leading size is the batch (that of the
    first tensor argument)."""
    args = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)
    kwargs = {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dim() > 0]
    for t in tensors:
        if t.shape[0] == tensors[0].shape[0]:
            torch._dynamo.maybe_mark_dynamic(t, 0)
    return args, kwargs


def _compiled_forward(cls: type, mode: str) -> Callable[..., Any]:
    """``torch.compile(cls.forward)`` for ``mode``, built once per process."""
    if (cls, mode) not in _FORWARDS:
        _FORWARDS[cls, mode] = torch.compile(cls.forward, mode=mode, dynamic=None)
    return _FORWARDS[cls, mode]


def _call_compiled(compiled: Callable[..., Any], block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    args, kwargs = _as_block_input(args, kwargs)
    return compiled(block, *args, **kwargs)


@contextmanager
def compiled_blocks(
    net: nn.Module,
    mode: str = "default",
    *,
    fallback: Sequence[str] = (),
    eager: Callable[[nn.Module], bool] | None = None,
    what: str = "network",
) -> Iterator[CompileStats]:
    """Run ``net``'s repeated blocks compiled (``torch.compile(mode=mode)``, batch dimension dynamic) inside the
    context; they are eager again on exit. ``eager(module)`` true: that layer runs uncompiled inside the compiled
    block (compiled around). ``what`` names the network in messages and tells networks apart: the first context of
    a (``what``, block classes, ``mode``) in this process logs that it compiles on the ``solrl.compile`` logger
    (the first batch includes the compile; ``solrl.flows.progress.stage_notes`` shows it).

    Yields the context's :class:`CompileStats`, completed on exit.

    Raises:
        ValueError: unknown ``mode``, or no repeated block (see :func:`repeated_blocks`).
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"unknown compile mode {mode!r}; valid modes: {', '.join(COMPILE_MODES)}")
    blocks = repeated_blocks(net, fallback)
    classes = tuple(dict.fromkeys(type(b).__name__ for b in blocks))
    around = [m for b in blocks for m in b.modules() if eager is not None and eager(m)]
    key = (what, classes, mode)
    stats = CompileStats(blocks=len(blocks), classes=classes, first=key not in _COMPILED, _start=dynamo_totals())
    if stats.first:
        _COMPILED.add(key)
        message = f"compiling {what}: {len(blocks)} {'/'.join(classes)} blocks (mode {mode})"
        if around:
            message += f", {len(around)} {type(around[0]).__name__} layers compiled around"
        log.info("%s; the first batch includes the compile", message)
    for layer in around:
        layer.forward = torch.compiler.disable(functools.partial(type(layer).forward, layer))
    for block in blocks:
        block.forward = functools.partial(_call_compiled, _compiled_forward(type(block), mode), block)
    start = time.perf_counter()
    try:
        yield stats
    finally:
        for module in (*blocks, *around):
            module.__dict__.pop("forward", None)
        graphs, seconds = dynamo_totals()
        stats.graphs = graphs - stats._start[0]
        stats.seconds = min(seconds - stats._start[1], time.perf_counter() - start)


def compile_metrics(stage: str, stats: CompileStats | None) -> dict[str, float]:
    """A stage's compile metrics (none without compile): ``<stage>/compile_seconds`` (compile time inside the
    stage, in s: the first iteration's warm-up, then 0) and ``<stage>/compiled_graphs`` (dynamo graphs compiled
    inside it: 0 once warm)."""
    if stats is None:
        return {}
    return {f"{stage}/compile_seconds": stats.seconds, f"{stage}/compiled_graphs": float(stats.graphs)}
