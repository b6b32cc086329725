"""The memory plan: what each stage holds on one device, measured, against the device's size (issue 20).

Nothing here guesses from parameter counts alone. The family's transformer and VAE are built from their configs
on PyTorch's ``meta`` device (shapes and dtypes, no storage: FLUX.1-dev's 12B parameters build in a second), and
the plan runs the product's own code on them: the adapter's ``velocity`` (packing, position ids, conditioning) in
a training forward and backward with the policy LoRA, a no-grad sampling forward, and ``vae_decode``. Two
counters measure them exactly:

* ``saved_bytes``: the activations autograd saves for backward, counted with
  ``torch.autograd.graph.saved_tensors_hooks`` (one count per storage, parameters excluded);
* ``peak_bytes``: the peak of the bytes live in tensors created by the computation, from a ``TorchDispatchMode``
  that sees every operator's outputs and a finalizer that sees each storage freed: the working set.

Attention is counted as the fused kernels the GPU runs (flash / memory-efficient SDPA: saves q, k, v, the output
and the log-sum-exp, never the ``L x L`` scores), not as the CPU's math fallback. Every count is linear in the
batch (measured at 1 and 2 samples), so the plan also gives the largest batch that fits.

A stage's peak is what stays resident (the transformer with its three LoRA adapters, the explore copy once
built, the VAE, the rewards that ``keep_loaded``) plus its own working set; the update adds the trainable LoRA's
gradients and AdamW moments (in the LoRA's dtype, as ``torch.optim.AdamW`` keeps them) and the micro-batch's activations
(``train.micro_batch`` rows split over the update's processes). FSDP (``train.parallel=fsdp``) shards the frozen
base and the LoRA over the processes and holds one block unsharded at a time (two, with the prefetch);
gradient checkpointing keeps each block's input and recomputes the block in backward.
"""

from __future__ import annotations

import json
import math
import numbers
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from solrl.config import ConfigError, without_unhashed
from solrl.stages.models.adapter import repeated_blocks

GIB = 1 << 30
#: The GPUs the plan is printed for: name -> the device memory CUDA reports, in GiB (nvidia-smi's total in MiB / 1024:
#: 81559 MiB on an H100 80GB HBM3 and 143771 MiB on an H200, both read on this project's lent machines; 183359 MiB on
#: a B200, as NVIDIA/TensorRT-LLM#10278 shows). A card's name in GB is not its size in GiB: a B200 has 179 GiB.
GPU_SIZES: dict[str, float] = {
    "H100 80 GB": 81559 / 1024,
    "H200 141 GB": 143771 / 1024,
    "B200 192 GB": 183359 / 1024,
}


def a_or_an(word: str) -> str:
    """The indefinite article of ``word`` (a number of GiB, a GPU's name) as read aloud: "an" before an eight, an
    eleven, an eighteen or a letter read with a vowel sound (``H100``), else "a"."""
    return "an" if word and (word[0] in "8AEFHILMNORSX" or word.split(".")[0] in ("11", "18")) else "a"


#: Device memory the plan leaves free: the CUDA context, cuBLAS / NCCL workspaces and allocator fragmentation.
RESERVE_FRACTION = 0.07


# -- the two counters -------------------------------------------------------------------------------------------
def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _PeakCounter(TorchDispatchMode):
    """Bytes live in the storages of tensors created under the mode (outputs of every operator), and their peak.

    A storage counts once however many tensors view it, and stops counting when the last of them is freed.
    Storages that existed before (``exclude``: parameters, buffers, inputs) never count.
    """

    def __init__(self, exclude: set[int]) -> None:
        super().__init__()
        self.exclude, self.live, self.peak = exclude, 0, 0
        self.views: dict[int, int] = {}
        self.sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        key = _key(t)
        if key in self.exclude:
            return
        if key not in self.views:
            self.views[key], self.sizes[key] = 0, t.untyped_storage().nbytes()
            self.live += self.sizes[key]
            self.peak = max(self.peak, self.live)
        self.views[key] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        self.views[key] -= 1
        if not self.views[key]:
            self.live -= self.sizes.pop(key)
            del self.views[key]


class _FusedAttention(torch.autograd.Function):
    """SDPA with the memory of the fused GPU kernels (flash / memory-efficient attention): saves q, k, v, the mask,
    the output and the log-sum-exp (``[..., L_q]`` float32), never the ``L_q x L_k`` scores, and recomputes them in
    backward. On meta tensors it gives the shapes only; on real ones the values of ``original``."""

    @staticmethod
    def forward(ctx, original, q, k, v, mask, kwargs):  # noqa: ANN001, ANN205 - autograd.Function protocol
        if q.device.type == "meta":
            out = q.new_empty(*q.shape[:-1], v.shape[-1])
        else:
            out = original(q, k, v, mask, **kwargs)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse, *([mask] if mask is not None else []))
        ctx.original, ctx.kwargs, ctx.has_mask = original, kwargs, mask is not None
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        saved = ctx.saved_tensors  # read once: checkpointing unpacks each saved tensor once
        q, k, v = saved[:3]
        if q.device.type == "meta":
            return None, torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None, None
        mask = saved[5] if ctx.has_mask else None
        with torch.enable_grad():
            q2, k2, v2 = (t.detach().requires_grad_(t.requires_grad) for t in (q, k, v))
            out = ctx.original(q2, k2, v2, mask, **ctx.kwargs)
            inputs = [t for t in (q2, k2, v2) if t.requires_grad]
            grads = iter(torch.autograd.grad(out, inputs, grad) if inputs else ())
        return None, *(next(grads) if t.requires_grad else None for t in (q2, k2, v2)), None, None


@contextmanager
def fused_attention() -> Iterator[None]:
    """``torch.nn.functional.scaled_dot_product_attention`` with the fused kernels' memory for the duration (saved
    tensors as flash attention saves them), so that a count on CPU or on the meta device is the GPU's count."""
    original = torch.nn.functional.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):  # noqa: ANN001, ANN202
        kwargs = {"dropout_p": dropout_p, "is_causal": is_causal, "scale": scale, "enable_gqa": enable_gqa}
        return _FusedAttention.apply(original, query, key, value, attn_mask, kwargs)

    torch.nn.functional.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def module_bytes(module: nn.Module | None) -> int:
    """Bytes of ``module``'s parameters and buffers (each storage once)."""
    if module is None:
        return 0
    seen: dict[int, int] = {}
    for t in [*module.parameters(), *module.buffers()]:
        seen[_key(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


def size(n: float) -> str:
    """Bytes for people: ``1.5 GiB``, ``12.0 MiB``, ``3.0 KiB``."""
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale or unit == "KiB":
            return f"{n / scale:.1f} {unit}" if unit != "GiB" else f"{n / scale:.2f} {unit}"
    return f"{n} B"


# -- measuring one family ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Linear:
    """``fixed + per_sample * batch`` bytes."""

    fixed: int
    per_sample: int

    def at(self, batch: int) -> int:
        return self.fixed + self.per_sample * batch

    def largest(self, room: int) -> int:
        """The largest batch whose bytes fit in ``room`` (0: not one sample)."""
        if self.per_sample <= 0:
            return 0 if room < self.fixed else 1 << 20
        return max(0, (room - self.fixed) // self.per_sample)


def _linear(measure: Any) -> Linear:
    one, two = measure(1), measure(2)
    return Linear(fixed=max(0, 2 * one - two), per_sample=max(0, two - one))


@dataclass(frozen=True)
class Footprint:
    """What one family's pipeline needs on the device, in bytes, measured at one resolution (``measure``).

    Attributes:
        transformer: the frozen base transformer's parameters and buffers, in the weights' dtype.
        lora: one LoRA adapter (the policy holds three: policy, rollout, EMA).
        quantizable: bytes of the base's layers the explore copy quantizes (the Sol-RL skip rule applied).
        explore_copy: bytes each registered explore backend's copy holds beyond the policy, by
            ``explore.precision`` (``ExploreBackend.copy_bytes``: the emulated copies built on the meta device and
            their own tensors summed; Transformer Engine's counted from its storage layout).
        largest_block: the largest repeated block's parameters (the unit FSDP gathers).
        blocks: repeated transformer blocks.
        vae, text_encoders: the other components' parameters (text encoders: loaded only to encode the prompts
            once per run; then released).
        train: peak activation bytes of one training forward + backward of the policy, per batch.
        train_checkpointed: the same with gradient checkpointing.
        saved: the part of ``train`` autograd saves for backward (``saved_tensors_hooks``).
        sample: peak bytes of one no-grad sampling forward (explore, regenerate), per batch.
        decode: peak bytes of one VAE decode, per batch of images (0 for a pixel-space family).
        source: where the configs came from (the weights folder, or the published configs shipped with solrl).
        weights_dtype: the dtype the transformer was measured in (``bfloat16``, or ``float32`` for a family
            that keeps its weights in float32 whatever is asked).
    """

    family: str
    resolution: int
    transformer: int
    lora: int
    quantizable: int
    explore_copy: dict[str, int]
    largest_block: int
    blocks: int
    vae: int
    text_encoders: int
    train: Linear
    train_checkpointed: Linear
    saved: Linear
    sample: Linear
    decode: Linear
    source: str = ""
    notes: list[str] = field(default_factory=list)
    weights_dtype: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _excluded(*modules: nn.Module | None) -> set[int]:
    return {_key(t) for m in modules if m is not None for t in [*m.parameters(), *m.buffers()]}


def train_bytes(adapter: Any, batch: int, checkpointed: bool = False) -> tuple[int, int]:
    """(peak, saved) activation bytes of one training forward + backward of ``batch`` samples of ``adapter``'s
    transformer (its active LoRA trainable, the base frozen; conditioning ``conditioning_like``), on its device:
    the meta device for the plan, or real tensors (``bench/memory_plan.py`` checks the two agree)."""
    net = adapter.transformer
    if checkpointed:
        net.enable_gradient_checkpointing()
    saved: dict[int, int] = {}
    exclude = _excluded(net)

    def pack(t: torch.Tensor) -> torch.Tensor:
        if _key(t) not in exclude:
            saved[_key(t)] = t.untyped_storage().nbytes()
        return t

    try:
        with fused_attention(), _PeakCounter(exclude) as counter:
            x = torch.zeros(batch, *adapter.latent_shape, device=adapter.device)
            sigma = torch.full((batch,), 0.5, device=adapter.device)
            cond = adapter.conditioning_like(batch)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                v = adapter.velocity(net, x, sigma, cond)
                loss = (v.float() - x).pow(2).mean()
            loss.backward()
            del v, loss, x, cond
    finally:
        if checkpointed:
            net.disable_gradient_checkpointing()
        for p in net.parameters():
            p.grad = None
    return counter.peak, sum(saved.values())


def _sample_bytes(adapter: Any, batch: int) -> int:
    net = adapter.transformer
    with fused_attention(), torch.no_grad(), _PeakCounter(_excluded(net)) as counter:
        x = torch.zeros(batch, *adapter.latent_shape, device=adapter.device)
        cond = adapter.conditioning_like(batch)
        v = adapter.velocity(net, x, torch.full((batch,), 0.5, device=adapter.device), cond)
        del v
    return counter.peak


def _decode_bytes(adapter: Any, batch: int) -> int:
    vae = getattr(getattr(adapter, "pipe", None), "vae", None)
    if vae is None:
        return 0
    with torch.no_grad(), _PeakCounter(_excluded(vae)) as counter:
        z = torch.zeros(batch, *adapter.latent_shape, device=adapter.device, dtype=vae.dtype)
        image = adapter.vae_decode(z)
        del image
    return counter.peak


def measure(
    cfg: Any, *, weights_dtype: torch.dtype = torch.bfloat16, blocks: int | dict[str, int] | None = None
) -> Footprint:
    """Measure the footprint of ``cfg``'s family at its resolution, on the meta device (seconds, no weights read).

    Args:
        cfg: the run's ``RunConfig`` (model family, path, resolution, LoRA rank, ``explore.min_dim``).
        weights_dtype: dtype of the weights on the device (bfloat16 on CUDA, as the product loads them).
        blocks: keep only this many repeated blocks of each kind, or of the named depth config keys (the
            benchmarks' depth checks); None = all.

    Raises:
        ConfigError: the family's configs are neither in ``model.path`` nor shipped with solrl; or the backend of
            ``explore.precision`` cannot count its copy (``copy_bytes`` raised, or returned no int >= 0). Another
            backend that cannot is left out of ``explore_copy``.
        NotImplementedError: the family implements no memory plan, or its velocity or decode does not run on the
            meta device (the message names the family and says so).
    """
    from peft import LoraConfig

    from solrl.registry import EXPLORE_BACKENDS
    from solrl.stages.models import model_family
    from solrl.stages.quant import eligible_layers

    family = model_family(cfg.model)
    adapter, source, text_encoders = family.meta_adapter(cfg.model, weights_dtype, blocks=blocks)
    net = adapter.transformer
    base = module_bytes(net)
    quantizable = sum(
        module_bytes(m) for _, m in eligible_layers(net, skip=adapter.explore_skip, min_dim=cfg.explore.min_dim)
    )
    repeated = repeated_blocks(net)
    largest = max((module_bytes(b) for b in repeated), default=0)
    targets = adapter.lora_targets if isinstance(adapter.lora_targets, str) else list(adapter.lora_targets)
    net.add_adapter(
        LoraConfig(r=cfg.model.lora_rank, lora_alpha=cfg.model.lora_alpha, target_modules=targets), "policy"
    )
    net.set_adapter("policy")
    lora = module_bytes(net) - base
    explore_copy = {}
    for name in EXPLORE_BACKENDS.names():
        backend = EXPLORE_BACKENDS.get(name)
        try:
            counted = backend.copy_bytes(net, adapter.explore_skip, cfg.explore.min_dim)
            if isinstance(counted, bool) or not isinstance(counted, numbers.Integral) or counted < 0:
                raise TypeError(f"returned {counted!r}, not a number of bytes (an int >= 0)")
        except Exception as exc:
            if name != cfg.explore.precision:  # another precision's plug-in: not this plan's business
                continue
            where = f"{backend.__module__}.{getattr(backend, '__qualname__', name)}"
            raise ConfigError(
                f"explore.precision={name}: its backend ({where}) cannot count its copy's bytes for the memory "
                f"plan: copy_bytes {exc.__class__.__name__}: {exc}"
            ) from exc
        explore_copy[name] = int(counted)
    try:
        train = [train_bytes(adapter, b, False) for b in (1, 2)]
        checkpointed = _linear(lambda b: train_bytes(adapter, b, True)[0])
        sample, decode = _linear(lambda b: _sample_bytes(adapter, b)), _linear(lambda b: _decode_bytes(adapter, b))
    except (NotImplementedError, RuntimeError, TypeError) as exc:  # "Cannot copy out of meta tensor; no data!"
        if "meta" not in str(exc):
            raise
        raise NotImplementedError(
            f"model family {cfg.model.family} does not run on the meta device, where the memory plan runs its "
            f"velocity and decode with no data ({exc}): something there reads a tensor's values; keep them to "
            "tensor operations (the extending guide's family page)"
        ) from exc
    return Footprint(
        family=cfg.model.family,
        resolution=getattr(adapter, "resolution", 0) or adapter.latent_shape[-1],
        transformer=base,
        lora=lora,
        quantizable=quantizable,
        explore_copy=explore_copy,
        largest_block=largest,
        blocks=len(repeated),
        vae=module_bytes(getattr(getattr(adapter, "pipe", None), "vae", None)),
        text_encoders=text_encoders,
        train=Linear(max(0, 2 * train[0][0] - train[1][0]), max(0, train[1][0] - train[0][0])),
        train_checkpointed=checkpointed,
        saved=Linear(max(0, 2 * train[0][1] - train[1][1]), max(0, train[1][1] - train[0][1])),
        sample=sample,
        decode=decode,
        source=source,
        weights_dtype=str(next(net.parameters()).dtype).removeprefix("torch."),
    )


# -- the plan ------------------------------------------------------------------------------------------------------
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class StageNeed:
    """One stage's peak on one device: its parts in bytes, by name."""

    stage: str
    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())


@dataclass(frozen=True)
class Plan:
    """Per stage, what one device holds at its peak, for one layout; ``fits`` against ``device_bytes``."""

    footprint: Footprint
    parallel: str
    processes: int
    checkpointing: bool
    device_bytes: int | None
    stages: list[StageNeed]
    largest_explore_batch: int
    largest_micro_batch: int

    @property
    def usable(self) -> int | None:
        return None if self.device_bytes is None else int(self.device_bytes * (1 - RESERVE_FRACTION))

    def over(self) -> list[StageNeed]:
        """The stages that do not fit (none without a device size)."""
        usable = self.usable
        return [] if usable is None else [s for s in self.stages if s.total > usable]


def rewards_bytes(cfg: Any, *, report_only: bool = False) -> tuple[int, int]:
    """(bytes kept loaded between stages, bytes loaded only while scoring) of the config's rewards on the
    device: each reward's declared parameter count (``Reward.parameters``, its published size: no weights file is
    read) times its dtype; remote rewards and rewards on the CPU count 0. ``report_only`` (a plan checked against
    no device: a CPU run) counts a reward that declares no parameter count as 0 instead of refusing it.

    Raises:
        ConfigError: a reward on the device declares no parameter count, and not ``report_only``.
    """
    from solrl.config import ConfigError
    from solrl.stages.rewards.base import reward_class, reward_options

    kept = scored = 0
    for name in sorted({*cfg.reward.weights, *cfg.reward.evaluate}):
        reward = reward_class(name, cfg.reward.models)
        options = reward_options(name, cfg.reward.models)
        if options.url or options.device == "cpu":
            continue
        if reward.parameters is None:
            if report_only:
                continue
            raise ConfigError(
                f"reward {name!r} declares no parameter count ({reward.__module__}.{reward.__qualname__}.parameters:"
                f" its model's parameters, 0 without a model), so the memory plan cannot count it; declare it, or "
                f"run it with reward.models.{name}.device=cpu or behind a url"
            )
        size = reward.parameters * _DTYPE_BYTES[options.dtype]
        if options.keep_loaded:
            kept += size
        else:
            scored += size
    return kept, scored


def sampling_batches(cfg: Any) -> tuple[int, int]:
    """``(explore, bf16)``: the largest sampling batch each precision runs in one forward, in samples. Each is its
    ``batch_size`` capped at the samples one stage draws: explore ``prompts_per_iteration * pool_size``; BF16 the
    most of regenerate's ``prompts_per_iteration * select.k``, an audit's ``audit_prompts * pool_size`` and
    evaluation's ``eval prompts * eval_seeds`` (its configured batch where the prompt files cannot be read)."""
    P, N = cfg.campaign.prompts_per_iteration, cfg.explore.pool_size
    explore = min(cfg.explore.batch_size, P * N)
    try:
        drawn = [len(cfg.eval_prompts()) * cfg.campaign.eval_seeds]
    except ConfigError:
        return explore, cfg.regenerate.batch_size
    if cfg.regenerate.enabled:
        drawn.append(P * cfg.select.k)
    if cfg.fidelity.audit_every:
        drawn.append(min(cfg.fidelity.audit_prompts, P) * N)
    return explore, min(cfg.regenerate.batch_size, max(drawn))


def make_plan(
    cfg: Any,
    footprint: Footprint,
    device_bytes: int | None,
    *,
    parallel: str | None = None,
    processes: int | None = None,
    checkpointing: bool | None = None,
) -> Plan:
    """The per-stage peaks of ``cfg`` on one device of ``device_bytes`` (None: report only).

    Args:
        parallel, processes, checkpointing: the update's layout; None = the config's (``train.parallel``,
            ``train.nproc_per_node`` or ``train.workers``, ``train.gradient_checkpointing``).
    """
    tc = cfg.train
    parallel = parallel or getattr(tc, "parallel", "ddp")
    processes = processes or (tc.workers if tc.launcher == "ray" else tc.nproc_per_node)
    checkpointing = getattr(tc, "gradient_checkpointing", False) if checkpointing is None else checkpointing
    f = footprint
    kept, scored = rewards_bytes(cfg, report_only=device_bytes is None)
    policy = {"transformer": f.transformer, "LoRA x3": 3 * f.lora}
    copy = f.explore_copy.get(cfg.explore.precision, 0)
    resident = {**policy, "VAE": f.vae, **({"rewards kept loaded": kept} if kept else {})}
    explore_copy = {"explore copy": copy} if copy else {}
    # Outside explore the copy is resident only with explore.keep_copy=device (host / none: moved out or freed).
    kept_copy = explore_copy if cfg.explore.keep_copy == "device" else {}
    from solrl.stages.models.diffusers_family import DECODE_BATCH

    explore_batch, bf16_batch = sampling_batches(cfg)
    decode_batch = min(DECODE_BATCH, explore_batch)
    stages = [
        StageNeed(
            "explore",
            {**resident, **explore_copy, "sampling": max(f.sample.at(explore_batch), f.decode.at(decode_batch))},
        ),
        StageNeed("score", {**resident, **kept_copy, "rewards while scoring": scored}),
    ]
    if cfg.regenerate.enabled:  # else the kept explore samples are copied: nothing is sampled
        regenerate = {"sampling": max(f.sample.at(bf16_batch), f.decode.at(min(DECODE_BATCH, bf16_batch)))}
        stages.append(StageNeed("regenerate", {**resident, **kept_copy, **regenerate}))
    rows = math.ceil(tc.micro_batch / processes)
    activations = (f.train_checkpointed if checkpointing else f.train).at(rows)
    trainable = 3 * f.lora  # the policy LoRA's gradients and AdamW's two moments, in the LoRA's own dtype
    if processes > 1:  # the update's own processes load the policy alone (no explore copy, no rewards)
        update = {"transformer": f.transformer, "LoRA x3": 3 * f.lora, "VAE": f.vae}
    else:
        update = {**resident, **kept_copy}
    loading = None
    if parallel == "fsdp" and processes > 1:
        # Each process loads the whole pipeline before fully_shard cuts it (solrl.stages.distributed.shard_policy).
        loading = StageNeed("update load", dict(update))
        update["transformer"] = math.ceil(f.transformer / processes) + 2 * f.largest_block  # own shard + 2 gathered
        update["LoRA x3"] = math.ceil(3 * f.lora / processes)
        trainable = math.ceil(trainable / processes)
    update |= {"gradients + AdamW": trainable, "activations": activations}
    stages.append(StageNeed("update", update))
    if loading is not None:
        stages.append(loading)
    usable = None if device_bytes is None else int(device_bytes * (1 - RESERVE_FRACTION))
    explore_fixed = sum(stages[0].parts.values()) - stages[0].parts["sampling"]
    update_fixed = sum(update.values()) - activations
    train_linear = f.train_checkpointed if checkpointing else f.train
    big = 1 << 20
    largest_explore = big
    if usable is not None:
        room = usable - explore_fixed
        largest_explore = f.sample.largest(room)
        decodable = f.decode.largest(room)  # images decode in chunks of min(DECODE_BATCH, batch)
        if decodable < DECODE_BATCH:
            largest_explore = min(largest_explore, decodable)
    return Plan(
        footprint=f,
        parallel=parallel,
        processes=processes,
        checkpointing=checkpointing,
        device_bytes=device_bytes,
        stages=stages,
        largest_explore_batch=largest_explore,
        largest_micro_batch=big if usable is None else train_linear.largest(usable - update_fixed) * processes,
    )


def fixes(cfg: Any, plan: Plan) -> list[tuple[str, frozenset[str]]]:
    """What would make stages of ``plan`` fit on its device, each checked against the same measurement, with the
    stages over the device that it alone makes fit (a setting that makes none fit is not offered): gradient
    checkpointing, FSDP over the update's processes (or over 2, 4 or 8 GPUs), a smaller micro-batch or explore
    batch, the explore copy off the GPU outside explore (``explore.keep_copy=host``), rewards freed between
    stages."""
    over = {s.stage for s in plan.over()}
    found: list[tuple[str, frozenset[str]]] = []

    def trial(config: Any = None, **layout: Any) -> frozenset[str]:
        """The stages over the device that fit with ``config`` (default ``cfg``) and ``layout``; none where that
        puts another stage over it (FSDP's loading of the whole pipeline, say)."""
        layout = {"parallel": plan.parallel, "processes": plan.processes, "checkpointing": plan.checkpointing} | layout
        still = {s.stage for s in make_plan(config or cfg, plan.footprint, plan.device_bytes, **layout).over()}
        return frozenset() if still - over else frozenset(over - still)

    def offer(fix: str, fitted: frozenset[str]) -> None:
        if fitted:
            found.append((fix, fitted))

    if over & {"update", "update load"}:
        if not plan.checkpointing:
            offer("train.gradient_checkpointing=true", trial(checkpointing=True))
        if plan.parallel != "fsdp" or plan.processes == 1:
            for processes, checkpointing in (
                (p, c) for p in sorted({plan.processes, 2, 4, 8} - {1}) for c in sorted({plan.checkpointing, True})
            ):
                fitted = trial(parallel="fsdp", processes=processes, checkpointing=checkpointing)
                if not fitted & {"update", "update load"}:
                    continue
                offer(
                    f"train.parallel=fsdp over {processes} GPUs (train.nproc_per_node={processes}, or "
                    f"train.launcher=ray with train.workers={processes})"
                    + (" with train.gradient_checkpointing=true" if checkpointing and not plan.checkpointing else ""),
                    fitted,
                )
                break
        if plan.largest_micro_batch >= 1 and "update" in over:
            smaller = cfg.train.model_copy(update={"micro_batch": plan.largest_micro_batch})
            offer(f"train.micro_batch={plan.largest_micro_batch}", trial(cfg.model_copy(update={"train": smaller})))
    if cfg.explore.keep_copy == "device" and plan.footprint.explore_copy.get(cfg.explore.precision, 0):
        hosted = cfg.model_copy(update={"explore": cfg.explore.model_copy(update={"keep_copy": "host"})})
        offer("explore.keep_copy=host (the explore copy off the GPU outside explore)", trial(hosted))
    if over & {"explore", "regenerate"} and plan.largest_explore_batch >= 1:
        batch = plan.largest_explore_batch
        smaller = cfg.model_copy(
            update={
                "explore": cfg.explore.model_copy(update={"batch_size": min(batch, cfg.explore.batch_size)}),
                "regenerate": cfg.regenerate.model_copy(update={"batch_size": min(batch, cfg.regenerate.batch_size)}),
            }
        )
        offer(f"explore.batch_size and regenerate.batch_size at most {batch}", trial(smaller))
    if rewards_bytes(cfg)[0] and over:
        models = {
            name: {**cfg.reward.models.get(name, {}), "keep_loaded": False}
            for name in {*cfg.reward.weights, *cfg.reward.evaluate}
        }
        freed = cfg.model_copy(update={"reward": cfg.reward.model_copy(update={"models": models})})
        kept = ", ".join(sorted(models))
        offer(f"keep_loaded: false under reward.models.<name> for {kept} (freed between stages)", trial(freed))
    return found


def fix_summary(cfg: Any, plan: Plan) -> str:
    """``fixes`` as one sentence, grouped by the stages each makes fit (``to fit update: A, or B; to fit explore
    and regenerate: C``), then the stages that no single setting makes fit; "" when the plan fits."""
    order = [s.stage for s in plan.over()]
    if not order:
        return ""
    groups: dict[frozenset[str], list[str]] = {}
    for fix, fitted in fixes(cfg, plan):
        groups.setdefault(fitted, []).append(fix)

    def named(stages: Iterable[str]) -> str:
        names = [s for s in order if s in set(stages)]
        return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"

    parts = [f"to fit {named(stages)}: {', or '.join(found)}" for stages, found in groups.items()]
    if unfitted := [s for s in order if not any(s in stages for stages in groups)]:
        parts.append(f"no single setting fits {named(unfitted)} (a larger device does)")
    return "; ".join(parts)


def format_plan(plan: Plan, title: str = "") -> str:
    """The plan as a Markdown table: one row per stage, its parts and total (each with its unit, GiB to KiB), and
    whether it fits."""
    f = plan.footprint
    usable = plan.usable
    layout = f"{plan.parallel} x {plan.processes}" + (", gradient checkpointing" if plan.checkpointing else "")
    head = title or f"{f.family} at {f.resolution} px"
    device = "no device size (report only)" if usable is None else f"{size(usable)} usable"
    lines = [
        f"{head}: update {layout}; {device}; configs from {f.source}",
        "",
        "| stage | peak | parts | fits |",
    ]
    lines.append("| --- | ---: | --- | --- |")
    for s in plan.stages:
        parts = ", ".join(f"{k} {size(v)}" for k, v in s.parts.items() if v)
        fits = "-" if usable is None else ("yes" if s.total <= usable else f"NO (by {size(s.total - usable)})")
        lines.append(f"| {s.stage} | {size(s.total)} | {parts} | {fits} |")
    return "\n".join(lines)


def to_json(plan: Plan) -> dict[str, Any]:
    return {
        "family": plan.footprint.family,
        "parallel": plan.parallel,
        "processes": plan.processes,
        "checkpointing": plan.checkpointing,
        "device_bytes": plan.device_bytes,
        "stages": {s.stage: {"total": s.total, "parts": s.parts} for s in plan.stages},
        "largest_explore_batch": plan.largest_explore_batch,
        "largest_micro_batch": plan.largest_micro_batch,
        "footprint": plan.footprint.to_json(),
    }


def dump(path: Path, plans: list[Plan]) -> None:
    path.write_text(json.dumps([to_json(p) for p in plans], indent=1))


# -- where work starts -----------------------------------------------------------------------------------------
#: Test and what-if override of the device's memory, in GiB: the plan is checked against it on any machine.
DEVICE_MEMORY_ENV = "SOLRL_DEVICE_MEMORY_GIB"
#: Set (to 1) by ``--force``: work starts though the plan does not fit.
FORCE_ENV = "SOLRL_FORCE_MEMORY"


class MemoryPlanError(ConfigError):
    """The config's memory plan does not fit the device: the message gives the numbers and the fixes."""


def device_memory(cfg: Any) -> tuple[int | None, str]:
    """(bytes of the device the run would use, its name): ``$SOLRL_DEVICE_MEMORY_GIB`` when set, else the
    smallest visible CUDA device for ``model.device`` cuda / auto, else (None, "cpu").

    Raises:
        ConfigError: ``$SOLRL_DEVICE_MEMORY_GIB`` is not a positive number.
    """
    import os

    from solrl.stages.models import resolve_device

    raw = os.environ.get(DEVICE_MEMORY_ENV)
    if raw:
        try:
            gib = float(raw)
        except ValueError:
            gib = -1.0
        if not gib > 0:
            raise ConfigError(f"{DEVICE_MEMORY_ENV}={raw!r}: give the device memory in GiB, e.g. 80")
        return int(gib * GIB), f"{a_or_an(f'{gib:g}')} {gib:g} GiB device ({DEVICE_MEMORY_ENV})"
    if resolve_device(cfg.model.device).type == "cuda":
        count = torch.cuda.device_count()
        sizes = [torch.cuda.get_device_properties(i).total_memory for i in range(count)]
        smallest = min(range(count), key=sizes.__getitem__)
        return sizes[smallest], torch.cuda.get_device_name(smallest)
    return None, "cpu"


def _cache_key(cfg: Any, dtype: torch.dtype) -> str:
    import hashlib

    from solrl.stages.models import model_family

    family = model_family(cfg.model)
    try:
        config = family.weights_dir(cfg.model) / "transformer" / "config.json"
        stamp = config.stat().st_mtime_ns if config.is_file() else 0
    except ConfigError:
        stamp = 0
    model = without_unhashed("model", cfg.model.model_dump(mode="json", exclude={"device"}))
    payload = [model, cfg.explore.min_dim, str(dtype), stamp, _backend_stamps(), 4]  # 4: Footprint.weights_dtype
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:20]


def _backend_stamps() -> list[list[str | int]]:
    """Each registered explore backend that is not solrl's own (a plug-in: its copy's bytes are its own code's)
    with its module and its source file's time, so a plan cached before a plug-in was loaded or changed is not
    taken for its."""
    import inspect
    import sys

    from solrl.registry import EXPLORE_BACKENDS

    stamps: list[list[str | int]] = []
    for name in EXPLORE_BACKENDS.names():
        if name in EXPLORE_BACKENDS.index():  # built in: the cache's version stamps it
            continue
        backend = EXPLORE_BACKENDS.get(name)
        module = getattr(backend, "__module__", "")
        try:
            stamp = Path(inspect.getfile(sys.modules[module])).stat().st_mtime_ns
        except (KeyError, TypeError, OSError):
            stamp = 0
        stamps.append([name, f"{module}.{getattr(backend, '__qualname__', '')}", stamp])
    return stamps


def cached_measure(cfg: Any, dtype: torch.dtype) -> Footprint:
    """``measure`` through a cache in the solrl cache folder (``plans/``), keyed by the model config, the explore
    copy's ``min_dim``, the dtype, the transformer config file's time and the plug-in explore backends: a resumed or
    repeated run plans at once."""
    import os
    import tempfile

    from solrl.stages.models.diffusers_family import solrl_cache

    folder = solrl_cache() / "plans"
    path = folder / f"{_cache_key(cfg, dtype)}.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        data = {**data, **{k: Linear(**data[k]) for k in ("train", "train_checkpointed", "saved", "sample", "decode")}}
        if cfg.explore.precision in data["explore_copy"]:  # else measured with another precision's plan
            return Footprint(**data)
    except (OSError, ValueError, TypeError, KeyError):
        pass
    footprint = measure(cfg, weights_dtype=dtype)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".plan-")
        with os.fdopen(fd, "w") as out:
            json.dump(footprint.to_json(), out)
        os.replace(tmp, path)
    except OSError:  # a read-only cache: measured again next time
        pass
    return footprint


#: In ``check_memory``'s line where a device was there to check against and no plan was made: a warning.
UNCHECKED = "not checked against the device"


def check_memory(cfg: Any, *, force: bool | None = None) -> str:
    """Compare ``cfg``'s memory plan with the device it would run on, before any work (``solrl run``, ``solrl
    resume``, the campaign flow). On CPU (no ``$SOLRL_DEVICE_MEMORY_GIB``) it only reports.

    Returns:
        one line for the log: each stage's peak against the device, or why nothing was planned (with
        ``UNCHECKED`` where there was a device to check against: the callers warn).

    Raises:
        MemoryPlanError: a stage's peak exceeds the device's usable memory and ``force`` (default
            ``$SOLRL_FORCE_MEMORY``) is not set; the message gives the numbers per stage and the fixes.
    """
    import os

    from solrl.stages.models import resolve_device
    from solrl.stages.models.adapter import weights_dtype

    device_bytes, device = device_memory(cfg)
    force = bool(os.environ.get(FORCE_ENV)) if force is None else force
    dtype = weights_dtype(resolve_device(cfg.model.device), cfg.model.dtype)
    unchecked = "" if device_bytes is None else f"; {UNCHECKED} ({device})"
    try:
        footprint = cached_measure(cfg, dtype)
    except NotImplementedError as exc:
        return f"memory plan: none ({exc}){unchecked}"
    except Exception as exc:  # a family's code that does not run on meta tensors: said, never in the run's way
        return f"memory plan: not measured ({type(exc).__name__}: {exc}); not checked{unchecked}"
    plan = make_plan(cfg, footprint, device_bytes)
    peaks = ", ".join(f"{s.stage} {size(s.total)}" for s in plan.stages)
    weights = f"{footprint.weights_dtype} weights"  # float32 on CPU: twice `solrl plan`'s bf16
    usable = plan.usable
    if usable is None:
        return f"memory plan ({weights}, peak per device, {device}: not checked): {peaks}"
    over = plan.over()
    if not over:
        return f"memory plan ({weights}, peak per device, {size(usable)} usable on {device}): {peaks}; fits"
    detail = "; ".join(
        f"{s.stage} needs {size(s.total)} ("
        + ", ".join(f"{k} {size(v)}" for k, v in sorted(s.parts.items(), key=lambda kv: -kv[1]) if v)
        + ")"
        for s in over
    )
    message = (
        f"the memory plan does not fit {device}: {size(usable)} usable of {size(device_bytes)} "
        f"({RESERVE_FRACTION:.0%} kept free); {detail}. Fix: {fix_summary(cfg, plan)}. `solrl plan` prints the "
        "table"
    )
    if force:
        return f"memory plan: forced past: {message}."
    raise MemoryPlanError(f"{message}; --force runs anyway.")
