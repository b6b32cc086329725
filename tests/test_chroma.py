"""What Chroma does that FLUX.1 does not: its T5 token mask reaches the transformer (the common family checks,
export included, run on tiny-chroma in test_families.py and test_memory.py without naming it)."""

from __future__ import annotations

from pathlib import Path

import torch

from solrl.config import load_config
from solrl.stages.models import load_model


def test_the_text_mask_keeps_the_first_padding_token_and_hides_the_rest_from_the_transformer(tmp_path: Path):
    cfg = load_config("tiny-chroma", [f"storage.root={tmp_path}"])
    model = load_model(cfg.model, torch.device("cpu"))
    cond = model.encode(["a cat", "a red dog"])
    lengths = [len(model.pipe.tokenizer(p).input_ids) for p in ("a cat", "a red dog")]  # with </s>
    assert cond["mask"].dtype == torch.int64 and cond["mask"].sum(1).tolist() == [n + 1 for n in lengths]
    x, sigma = torch.randn(2, *model.latent_shape), torch.tensor([0.8, 0.3])
    hidden = {**cond, "emb": cond["emb"].clone()}
    hidden["emb"][cond["mask"] == 0] = 7.0  # what the mask hides does not move the velocity
    shown = {**cond, "emb": cond["emb"].clone()}
    shown["emb"][0, lengths[0]] += 1.0  # the first padding token is seen
    with torch.no_grad():
        v = model.velocity(model.transformer, x, sigma, cond)
        torch.testing.assert_close(model.velocity(model.transformer, x, sigma, hidden), v)
        assert not torch.allclose(model.velocity(model.transformer, x, sigma, shown)[0], v[0])
    assert "pooled" not in cond and not model.transformer.config.get("guidance_embeds", False)
