"""The policy and its copies as peft LoRA adapters on one diffusers transformer.

Three adapters share the frozen base weights (DESIGN glossary):

* ``policy``: trained by the optimizer;
* ``rollout``: the "old" policy that samples; after each optimizer step
  ``rollout = d * rollout + (1 - d) * policy`` (DiffusionNFT, DESIGN 1);
* ``ema``: an exponential moving average of ``policy``, for evaluation.

The reference policy is the base model (adapters disabled).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal

import torch
from torch import nn

from solrl.stages.models.adapter import Conditioning, ModelAdapter

ADAPTERS = ("policy", "rollout", "ema")
Which = Literal["policy", "rollout", "ema", "reference"]
#: Placeholder for the adapter name in saved tensor keys.
_SLOT = "{adapter}"


class Policy:
    """LoRA policy, rollout and EMA adapters on ``model.transformer``.

    Args:
        model: the loaded model adapter; its transformer gets three LoRA adapters, identically initialised.
        rank, alpha: LoRA rank and alpha (peft ``LoraConfig``).
        seed: seeds the LoRA initialisation, so a fresh run is reproducible.
    """

    def __init__(self, model: ModelAdapter, rank: int, alpha: float, seed: int = 0) -> None:
        from peft import LoraConfig  # imported here: peft costs about a second, and `solrl ls` never needs it

        self.model = model
        self.transformer = model.transformer
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            targets = model.lora_targets if isinstance(model.lora_targets, str) else list(model.lora_targets)
            for name in ADAPTERS:
                lora = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights="gaussian")
                with warnings.catch_warnings():  # several adapters on one model is the point here
                    warnings.filterwarnings("ignore", message="Already found a `peft_config`")
                    self.transformer.add_adapter(lora, adapter_name=name)
        for name in ("rollout", "ema"):
            self.copy_adapter_(name, "policy")
        self._activate("policy")
        self.initial_state = self.state_dict("policy")  # the fresh LoRA init, to reset to the base policy
        #: Quantized explore copies by (precision, min_dim, activation scale), synced in place
        #: (``solrl.stages.quant.backends.explore_copy``).
        self.explore_copies: dict[tuple[str, int, str], nn.Module] = {}
        self.explore_sync_seconds = 0.0

    # -- adapter bookkeeping ---------------------------------------------------
    def adapter_params(self, name: str) -> dict[str, nn.Parameter]:
        """Parameters of adapter ``name``, keyed with the adapter name replaced by ``{adapter}``."""

        tag = f".{name}."
        return {
            n.replace(tag, f".{_SLOT}."): p
            for n, p in self.transformer.named_parameters()
            if tag in n and ("lora_A" in n or "lora_B" in n)
        }

    def trainable_parameters(self) -> list[nn.Parameter]:
        return list(self.adapter_params("policy").values())

    @torch.no_grad()
    def copy_adapter_(self, dst: str, src: str) -> None:
        source = self.adapter_params(src)
        for key, p in self.adapter_params(dst).items():
            p.copy_(source[key])

    @torch.no_grad()
    def blend_(self, dst: str, src: str, decay: float) -> None:
        """``dst = decay * dst + (1 - decay) * src``, elementwise over all LoRA tensors."""
        source = self.adapter_params(src)
        for key, p in self.adapter_params(dst).items():
            p.mul_(decay).add_(source[key], alpha=1.0 - decay)

    def state_dict(self, name: str) -> dict[str, torch.Tensor]:
        """Adapter ``name``'s tensors, on the CPU. Sharded parameters (FSDP2's DTensors, ``shard_policy``) are
        gathered whole: every process of the group must then call this together."""
        return {
            k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
            for k, p in self.adapter_params(name).items()
        }

    @torch.no_grad()
    def load_state_dict(self, name: str, state: dict[str, torch.Tensor]) -> None:
        """Load adapter ``name`` from ``state_dict`` output. Raises KeyError on missing or extra keys."""
        params = self.adapter_params(name)
        if set(params) != set(state):
            missing, extra = sorted(set(params) - set(state)), sorted(set(state) - set(params))
            raise KeyError(
                f"adapter {name!r}: checkpoint does not match the model (missing {missing[:3]}, unexpected {extra[:3]})"
            )
        for key, p in params.items():
            p.copy_(state[key].to(p.device, p.dtype))

    def _activate(self, which: Which) -> None:
        if which == "reference":
            self.transformer.disable_adapters()
            return
        self.transformer.enable_adapters()
        self.transformer.set_adapter(which)
        # peft's set_adapter marks the active adapter trainable; only ``policy`` ever is.
        for name in ADAPTERS:
            for p in self.adapter_params(name).values():
                p.requires_grad_(name == "policy")

    @contextmanager
    def using(self, which: Which) -> Iterator[nn.Module]:
        """Run the transformer as ``which``; ``policy`` is active again on exit."""
        self._activate(which)
        try:
            yield self.transformer
        finally:
            self._activate("policy")

    def velocity(self, which: Which, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """Velocity of ``which`` at ``x [B, C, h, w]``, ``sigma [B]``; no grad unless ``which == 'policy'``."""
        with self.using(which) as net, torch.set_grad_enabled(which == "policy" and torch.is_grad_enabled()):
            return self.model.velocity(net, x, sigma, cond)

    @torch.no_grad()
    def sync_merged_copy_(
        self,
        net: nn.Module,
        which: Which = "rollout",
        write: Callable[[str, nn.Module, torch.Tensor], object] | None = None,
    ) -> int:
        """Write the current merged weights of ``which`` into ``net`` (a ``merged_copy``, possibly quantized) in
        place, one layer at a time: ``write(name, layer, merged_weight)`` when given, else a layer with
        ``requantize_`` (a packed ``FakeQuantLinear``, a Transformer Engine layer) re-encodes the weight and any
        other copies it. The working set is one layer's. Returns the layers written."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        written = 0
        for name, module in self.transformer.named_modules():
            if not isinstance(module, BaseTunerLayer):
                continue
            weight = merged_weight(module, which)
            target = net.get_submodule(name)
            if write is not None:
                write(name, target, weight)
            elif hasattr(target, "requantize_"):
                target.requantize_(weight)
            else:
                target.weight.copy_(weight)
            written += 1
        return written

    def merged_copy(self, which: Which = "rollout", convert: Convert | None = None) -> nn.Module:
        """A plain transformer with adapter ``which`` merged into the base weights and LoRA removed
        (:func:`merged_copy_of` of this policy's transformer): the network a low-precision explore backend
        samples with (DESIGN 2). Frozen tensors are shared with the policy, not copied."""
        return merged_copy_of(self.transformer, which, convert)

    def owned_bytes(self, net: nn.Module) -> int:
        """Bytes of ``net``'s parameters and buffers that are not the policy's own (what a copy adds)."""
        return owned_bytes(net, self.transformer)


#: ``convert(name, base_layer, merged_weight) -> module | None``: what a LoRA-wrapped layer becomes in a merged
#: copy (None: a plain layer holding the merged weight).
Convert = Callable[[str, nn.Module, torch.Tensor], "nn.Module | None"]


def merged_weight(module: nn.Module, which: Which) -> torch.Tensor:
    """``base + delta(which)`` of one peft LoRA layer (the base weight itself for the reference policy)."""
    weight = module.get_base_layer().weight
    if which == "reference":
        return weight
    return weight + module.get_delta_weight(which).to(weight.dtype)


def copy_layers(transformer: nn.Module) -> Iterator[tuple[str, nn.Module, bool]]:
    """``(name, layer, lora)`` of the leaf layers a merged copy of the peft ``transformer`` has: a LoRA-wrapped
    layer's base layer (``lora`` True; its adapters are not walked), and every other module."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    inside: tuple[str, ...] = ()
    for name, module in transformer.named_modules():
        if inside and name.startswith(inside):
            continue
        if isinstance(module, BaseTunerLayer):
            inside = (*inside, name + ".")
            yield name, module.get_base_layer(), True
        elif name:
            yield name, module, False


def counted_copy_bytes(transformer: nn.Module, quantized_bytes: Callable[[str, nn.Module], int | None]) -> int:
    """Bytes a merged copy of the peft ``transformer`` holds beyond it, counted from shapes for a backend whose
    tensors cannot be built here: ``quantized_bytes(name, layer)`` for each layer it quantizes (None: not
    quantized), plus the merged weight of each LoRA layer left in high precision; all else is shared."""
    total = 0
    for name, layer, lora in copy_layers(transformer):
        quantized = quantized_bytes(name, layer)
        if quantized is not None:
            total += quantized
        elif lora:
            total += layer.weight.nbytes
    return total


def _tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def stored_bytes(t: torch.Tensor) -> int:
    """Bytes ``t`` holds: ``nbytes`` for a plain tensor (meta tensors included); for a tensor subclass that packs
    its data (torchao's ``NVFP4Tensor`` / ``Float8Tensor``, whose ``nbytes`` is that of their bf16 view), the sum
    over its inner tensors (``__tensor_flatten__``; Transformer Engine's quantized tensors: their tensor
    attributes)."""
    if type(t) in (torch.Tensor, nn.Parameter):
        return t.nbytes
    flatten = getattr(t, "__tensor_flatten__", None)
    inner = [getattr(t, name) for name in flatten()[0]] if flatten is not None else list(vars(t).values())
    tensors = [x for x in inner if isinstance(x, torch.Tensor)]
    return sum(stored_bytes(x) for x in tensors) if tensors else t.nbytes


def owned_bytes(net: nn.Module, source: nn.Module) -> int:
    """Bytes of ``net``'s parameters and buffers that ``source`` does not hold too (``stored_bytes``; the plan
    builds copies on the meta device). Plain tensor attributes that are neither (a rotary table) are not counted."""
    shared = {id(t) for t in _tensors(source)}
    return sum(stored_bytes(t) for t in {id(t): t for t in _tensors(net)}.values() if id(t) not in shared)


@torch.no_grad()
def merged_copy_of(transformer: nn.Module, which: Which = "rollout", convert: Convert | None = None) -> nn.Module:
    """A copy of the peft ``transformer`` with adapter ``which`` merged and LoRA removed, in eval mode, no grad.

    Every tensor outside the LoRA-wrapped layers (norms, embeddings, layers LoRA does not target) is the
    transformer's own, shared, not copied: it is frozen, and the copy never writes it. Each LoRA-wrapped layer
    becomes ``convert(name, base_layer, merged_weight)`` (e.g. a packed quantized layer), or a plain layer
    holding the merged weight; layers are built one at a time, so the peak beyond the copy is one merged weight,
    never a second full model (the working set is one layer's: its merged weight and its encoding's
    temporaries). Works on the meta device (the memory plan builds copies there). Because tensors are shared, do
    not call ``.to()`` or ``requires_grad_()`` on the copy: they would change the policy too
    (``solrl.stages.quant.backends.move_owned_`` moves a copy's own tensors only). A LoRA-wrapped layer's own
    tensors are rebuilt, even where another module ties to them.

    Args:
        transformer: a diffusers transformer with peft LoRA adapters (``Policy.transformer``).
        which: the adapter merged, or ``reference`` (the base weights).
        convert: see :data:`Convert`; None: plain layers.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    memo: dict[int, object] = {}
    lora_layers = [(n, m) for n, m in transformer.named_modules() if isinstance(m, BaseTunerLayer)]
    in_lora = {id(t) for _, m in lora_layers for t in _tensors(m)}
    for t in _tensors(transformer):
        if id(t) not in in_lora:
            memo[id(t)] = t
    for name, module in lora_layers:
        base = module.get_base_layer()
        weight = merged_weight(module, which)
        layer = convert(name, base, weight) if convert is not None else None
        if layer is None:
            merged = weight if which != "reference" else weight.clone()
            layer = copy.deepcopy(
                base, {id(base.weight): nn.Parameter(merged, requires_grad=False), id(base.bias): base.bias}
            )
        memo[id(module)] = layer
    net = copy.deepcopy(transformer, memo)
    net.peft_config = {}
    net._hf_peft_config_loaded = False
    return net.eval().requires_grad_(False)
