"""The trained LoRA in diffusers' format, so a stock pipeline's ``load_lora_weights`` loads it.

solrl keeps three adapters (policy, rollout, EMA) on one transformer; its checkpoint sections key them by
peft parameter name with the adapter replaced by ``{adapter}``, which diffusers cannot read. This module
writes one adapter as diffusers does: ``pytorch_lora_weights.safetensors``, keys
``transformer.<module>.lora_A.weight`` / ``lora_B.weight`` (peft's ``get_peft_model_state_dict``, no
``base_model.model.`` prefix, no adapter name) and the peft ``LoraConfig`` (rank, alpha, targets) as the
file's ``lora_adapter_metadata``, written by the family's pipeline class (``save_lora_weights``).

Loading: ``pipe.load_lora_weights(folder)``, or ``transformer.load_lora_adapter(folder,
weight_name="pytorch_lora_weights.safetensors", prefix="transformer")``. Passing the *file* path to
``load_lora_adapter`` makes diffusers skip the metadata and assume alpha = rank (diffusers 0.42).
"""

from __future__ import annotations

import json
from pathlib import Path

from solrl.stages.models.policy import Policy
from solrl.storage.stage import plain_modes

#: The file name diffusers' ``save_lora_weights`` writes and ``load_lora_weights`` looks for.
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"


def save_diffusers_lora(policy: Policy, adapter: str, pipeline_class: str, out: Path) -> Path:
    """Write adapter ``adapter`` of ``policy`` to ``out/pytorch_lora_weights.safetensors`` in diffusers' format.

    Args:
        adapter: ``policy``, ``rollout`` or ``ema``.
        pipeline_class: the diffusers pipeline of the family (e.g. ``SanaPipeline``), whose LoRA loader mixin
            writes the file.

    Returns:
        the file written.

    Raises:
        KeyError: unknown adapter.
    """
    import diffusers
    from peft import get_peft_model_state_dict

    if adapter not in policy.transformer.peft_config:
        raise KeyError(f"no adapter {adapter!r}; the policy has {sorted(policy.transformer.peft_config)}")
    state = get_peft_model_state_dict(policy.transformer, adapter_name=adapter)
    # Sets (target_modules) in a canonical order, so the same adapter always writes the same bytes (a redone
    # checkpoint keeps its digest, and nothing downstream is recomputed).
    metadata = {
        k: sorted(v) if isinstance(v, set) else v for k, v in policy.transformer.peft_config[adapter].to_dict().items()
    }
    out.mkdir(parents=True, exist_ok=True)
    getattr(diffusers, pipeline_class).save_lora_weights(
        out, transformer_lora_layers=state, transformer_lora_adapter_metadata=metadata
    )
    canonical_header(out / LORA_WEIGHTS)
    plain_modes(out / LORA_WEIGHTS)  # safetensors writes 0600: readable by whoever the umask lets read
    return out / LORA_WEIGHTS


def canonical_header(path: Path) -> None:
    """Rewrite a safetensors file's JSON header with sorted keys, in place, so the same tensors and metadata
    always give the same bytes: safetensors writes ``__metadata__`` from a hash map whose order changes from
    process to process. The header keeps its length (same JSON, other order), so the data is untouched.
    Format: 8-byte little-endian header length, the JSON header (space-padded), the tensor bytes."""
    with open(path, "r+b") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
        canonical = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
        if len(canonical) > length:  # cannot happen for the same JSON; never corrupt the file
            raise ValueError(f"{path}: canonical safetensors header longer than the original")
        f.seek(8)
        f.write(canonical.ljust(length, b" "))
