"""The policy and its copies as peft LoRA adapters on one diffusers transformer.

Three adapters share the frozen base weights (glossary, DESIGN):

* ``policy``: trained by the optimizer;
* ``rollout``: the "old" policy that samples; after each optimizer step
  ``rollout = d * rollout + (1 - d) * policy`` (DiffusionNFT, DESIGN 1);
* ``ema``: an exponential moving average of ``policy``, for evaluation.

The reference policy is the base model (adapters disabled).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
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
    def merged_weights(self, which: Which = "rollout") -> dict[str, torch.Tensor]:
        """``base + delta(which)`` for every LoRA-wrapped layer, keyed by module name (peft ``get_delta_weight``)."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        out = {}
        for name, module in self.transformer.named_modules():
            if isinstance(module, BaseTunerLayer):
                weight = module.get_base_layer().weight
                out[name] = weight + module.get_delta_weight(which).to(weight.dtype) if which != "reference" else weight
        return out

    @torch.no_grad()
    def sync_merged_copy_(self, net: nn.Module, which: Which = "rollout") -> int:
        """Write the current merged weights of ``which`` into ``net`` (a ``merged_copy``, possibly quantized) in
        place; quantized layers must then be re-quantized (``requantize_model_``). Returns the layers written."""
        merged = self.merged_weights(which)
        for name, weight in merged.items():
            net.get_submodule(name).weight.copy_(weight)
        return len(merged)

    def merged_copy(self, which: Which = "rollout") -> nn.Module:
        """A plain transformer with adapter ``which`` merged into the base weights and LoRA removed.

        The copy the low-precision explore backend quantizes (DESIGN 2). Costs one model copy.
        """
        from peft.tuners.tuners_utils import BaseTunerLayer

        net = copy.deepcopy(self.transformer)
        for module_name, module in list(net.named_modules()):
            if not isinstance(module, BaseTunerLayer):
                continue
            if which != "reference":
                module.merge(adapter_names=[which])
            parent_name, _, child = module_name.rpartition(".")
            parent = net.get_submodule(parent_name) if parent_name else net
            setattr(parent, child, module.get_base_layer())
        net.peft_config = {}
        net._hf_peft_config_loaded = False
        return net.eval().requires_grad_(False)
