"""tiny-digits model, the LoRA policy/rollout/EMA adapters, the explore copy, and the rewards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from solrl.config import load_config
from solrl.stages.models import load_model
from solrl.stages.models import tiny_digits as td
from solrl.stages.models.adapter import EmbeddingCacheMiss
from solrl.stages.models.policy import Policy
from solrl.stages.quant import FakeQuantLinear
from solrl.stages.quant.backends import rollout_network
from solrl.stages.rewards import RewardError, build_reward
from solrl.stages.rewards.base import checked
from solrl.stages.sampling.rollout import generate
from solrl.storage.stage import file_sha256


@pytest.fixture(scope="module")
def policy() -> Policy:
    cfg = load_config()
    return Policy(load_model(cfg.model, torch.device("cpu")), rank=4, alpha=4.0, seed=0)


def _inputs(policy: Policy, n: int = 3):
    torch.manual_seed(1)
    cond = policy.model.encode(["a handwritten digit three"] * n)
    return torch.randn(n, 1, 16, 16), torch.full((n,), 0.7), cond


def test_prompt_digit_and_tokenizer():
    assert td.prompt_digit("a handwritten digit seven") == 7
    assert td.prompt_digit("number 4") == 4
    with pytest.raises(ValueError, match="names no digit"):
        td.prompt_digit("a cat")
    ids, mask = td.tokenize(["the digit two", "zebra"])
    assert ids.shape == (2, td.MAX_TOKENS) and mask[0].tolist() == [1, 1, 1, 0, 0, 0]
    assert ids[1, 0] == td.VOCAB.index("<unk>")


def test_shipped_model_is_a_real_diffusers_sana_transformer():
    from diffusers import SanaTransformer2DModel

    model = load_model(load_config().model, torch.device("cpu"))
    assert isinstance(model.transformer, SanaTransformer2DModel)
    assert sum(p.numel() for p in model.transformer.parameters()) < 400_000


def test_fresh_adapters_are_identical_and_equal_to_the_base(policy: Policy):
    x, s, cond = _inputs(policy)
    outs = [policy.velocity(w, x, s, cond) for w in ("policy", "rollout", "ema", "reference")]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0])


def test_only_the_policy_adapter_is_trainable(policy: Policy):
    trainable = {id(p) for p in policy.trainable_parameters()}
    for name, p in policy.transformer.named_parameters():
        assert p.requires_grad == (id(p) in trainable), name
    with policy.using("rollout"):
        pass
    assert all(p.requires_grad for p in policy.trainable_parameters())


def test_blend_moves_rollout_toward_policy_and_merged_copy_matches(policy: Policy):
    x, s, cond = _inputs(policy)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.05 * torch.randn_like(p))
    policy.blend_("rollout", "policy", decay=0.0)
    torch.testing.assert_close(policy.velocity("rollout", x, s, cond), policy.velocity("policy", x, s, cond).detach())
    assert not torch.allclose(policy.velocity("rollout", x, s, cond), policy.velocity("reference", x, s, cond))
    merged = policy.merged_copy("rollout")
    torch.testing.assert_close(
        policy.model.velocity(merged, x, s, cond),
        policy.velocity("rollout", x, s, cond),
        rtol=1e-4,
        atol=1e-5,
    )
    assert not any("lora" in n for n, _ in merged.named_parameters())


def test_adapter_state_round_trip_and_mismatch_error(policy: Policy):
    state = policy.state_dict("policy")
    policy.load_state_dict("ema", state)
    torch.testing.assert_close(policy.state_dict("ema"), state)
    with pytest.raises(KeyError, match="does not match the model"):
        policy.load_state_dict("ema", {"nope": torch.zeros(1)})


def test_nvfp4_explore_copy_quantizes_attention_and_ff_but_not_embedders(policy: Policy):
    with rollout_network(policy, "nvfp4_emulated") as net:
        wrapped = {n for n, m in net.named_modules() if isinstance(m, FakeQuantLinear)}
    assert "transformer_blocks.0.attn1.to_q" in wrapped and "transformer_blocks.2.ff.conv_point" in wrapped
    assert not any(k in n for n in wrapped for k in ("patch_embed", "time_embed", "caption_projection", "proj_out"))
    with pytest.raises(
        ValueError, match="unknown explore precision 'fp3'; registered: bf16, fp8, fp8_emulated, nvfp4, nvfp4_emulated"
    ):
        with rollout_network(policy, "fp3"):
            pass


def test_same_seed_same_image_and_nvfp4_differs_slightly(policy: Policy):
    prompts, seeds = ["a handwritten digit five"] * 3, [11, 12, 11]
    with rollout_network(policy, "bf16") as net:
        a = generate(policy.model, net, prompts, seeds, 4, 8).samples
        b = generate(policy.model, net, prompts, seeds, 4, 8).samples
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(a[0], a[2], rtol=0, atol=0)
    assert not torch.equal(a[0], a[1])
    with rollout_network(policy, "nvfp4_emulated") as net:
        q = generate(policy.model, net, prompts, seeds, 4, 8).samples
    assert 0 < (q - a).abs().mean() < 0.5 * a.abs().mean()


def test_digit_rewards_recognise_real_held_out_digits():
    _, _, x_te, y_te = td.load_digits_16()
    images = td.latents_to_images(torch.from_numpy(x_te[:40]))
    prompts = [f"a handwritten digit {td.DIGIT_WORDS[y]}" for y in y_te[:40]]
    wrong = [f"a handwritten digit {td.DIGIT_WORDS[(y + 1) % 10]}" for y in y_te[:40]]
    for name in ("digit_alignment", "digit_evaluator"):
        reward = build_reward(name)
        right_p, wrong_p = checked(reward, images, prompts).values, checked(reward, images, wrong).values
        assert right_p.dtype == np.float32 and right_p.mean() > 0.9 and wrong_p.mean() < 0.1


def test_jpeg_compressibility_prefers_flat_images():
    flat = np.full((1, 16, 16, 3), 128, np.uint8)
    noisy = np.random.default_rng(0).integers(0, 255, (1, 16, 16, 3), dtype=np.uint8)
    reward = build_reward("jpeg_compressibility")
    assert reward(flat, ["x"])[0] > reward(noisy, ["x"])[0]


def test_a_nan_reward_is_an_error_naming_the_prompt():
    from solrl.stages.rewards import Reward

    class Broken(Reward):
        name = "broken"

        def _score(self, images, prompts, metadata):
            return np.array([0.5, np.nan], np.float32)

    with pytest.raises(RewardError, match="returned nan for prompt 'b'"):
        checked(Broken(), np.zeros((2, 16, 16, 3), np.uint8), ["a", "b"])


def test_fp8_explore_copy_is_closer_to_full_precision_than_nvfp4(policy: Policy):
    prompts, seeds = ["a handwritten digit eight"] * 4, [1, 2, 3, 4]
    with rollout_network(policy, "bf16") as net:
        full = generate(policy.model, net, prompts, seeds, 4, 8).samples
    errors = {}
    for precision in ("fp8_emulated", "nvfp4_emulated"):
        with rollout_network(policy, precision) as net:
            errors[precision] = (generate(policy.model, net, prompts, seeds, 4, 8).samples - full).abs().mean().item()
    assert 0 < errors["fp8_emulated"] < errors["nvfp4_emulated"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_hardware_explore_backends_refuse_a_machine_without_the_hardware(policy: Policy):
    with pytest.raises(ValueError, match="explore.precision=nvfp4 cannot run here: this machine has no CUDA"):
        with rollout_network(policy, "nvfp4"):
            pass


def test_explore_copy_syncs_in_place_and_equals_a_fresh_build(policy: Policy):
    from solrl.stages.quant.backends import explore_copy

    x, s, cond = _inputs(policy)
    first = explore_copy(policy, "nvfp4_emulated")
    with torch.no_grad():
        for p in policy.adapter_params("rollout").values():
            p.add_(0.05 * torch.randn_like(p))
    synced = explore_copy(policy, "nvfp4_emulated")
    assert synced is first  # no rebuild
    policy.explore_copies.clear()
    fresh = explore_copy(policy, "nvfp4_emulated")
    assert fresh is not first
    torch.testing.assert_close(
        policy.model.velocity(synced, x, s, cond), policy.model.velocity(fresh, x, s, cond), rtol=0, atol=0
    )


def test_keep_copy_keeps_moves_out_or_frees_the_copy_and_never_moves_the_policy(policy: Policy):
    from solrl.stages.quant.backends import move_owned_

    x, s, cond = _inputs(policy)
    policy.explore_copies.clear()
    with rollout_network(policy, "nvfp4_emulated", keep_copy="device") as net:
        expect = policy.model.velocity(net, x, s, cond)
    assert list(policy.explore_copies.values()) == [net]
    with rollout_network(policy, "nvfp4_emulated", keep_copy="none") as again:
        assert again is net  # synced in place
    assert not policy.explore_copies  # freed
    with rollout_network(policy, "nvfp4_emulated", keep_copy="host") as net:  # on a CPU policy: stays
        torch.testing.assert_close(policy.model.velocity(net, x, s, cond), expect, rtol=0, atol=0)
    with pytest.raises(ValueError, match="keep_copy must be one of"):
        with rollout_network(policy, "nvfp4_emulated", keep_copy="disk"):
            pass
    # What keep_copy=host moves is the copy's own tensors only: the packed layers, not the shared base.
    moved = move_owned_(net, policy.transformer, "meta")
    assert moved == policy.owned_bytes(net) > 0
    assert all(t.device.type == "cpu" for t in [*policy.transformer.parameters(), *policy.transformer.buffers()])
    packed = [m for m in net.modules() if isinstance(m, FakeQuantLinear)]
    assert packed and all(m.codes.device.type == "meta" for m in packed)
    policy.explore_copies.clear()


class _UnpackedReference(torch.nn.Module):
    """The explore copy's layer as it was before the packed copy: the high-precision weight kept, and
    ``F.linear`` / ``F.conv2d`` of the float32 fake-quantized operands (per-sample activation scales)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.inner = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from solrl.stages.quant.nvfp4 import fake_quantize_per_sample, nvfp4_fake_quantize

        w = self.inner.weight.detach().float()
        b = None if self.inner.bias is None else self.inner.bias.detach().float()
        if isinstance(self.inner, torch.nn.Conv2d):
            xq = fake_quantize_per_sample(x.float().movedim(1, -1).contiguous(), "nvfp4").movedim(-1, 1)
            wq = nvfp4_fake_quantize(w.reshape(w.shape[0], -1)).view_as(w)
            return torch.nn.functional.conv2d(xq, wq, b).to(x.dtype)
        wq = nvfp4_fake_quantize(w)
        return torch.nn.functional.linear(fake_quantize_per_sample(x.float(), "nvfp4"), wq, b).to(x.dtype)


@pytest.mark.parametrize("family", ["tiny-digits", "tiny-sd3", "tiny-flux"])
def test_the_packed_explore_copy_samples_as_the_unpacked_one_and_holds_under_035x_of_its_layers_in_bf16(
    tmp_path, family
):
    from solrl.stages.memory import module_bytes
    from solrl.stages.quant.backends import explore_copy
    from solrl.stages.quant.nvfp4 import eligible_layers

    cfg = load_config(
        family, [f"storage.root={tmp_path}", *([] if family == "tiny-digits" else [f"model.path={tmp_path / family}"])]
    )
    policy = Policy(load_model(cfg.model, torch.device("cpu")), rank=4, alpha=4.0, seed=0)
    with torch.no_grad():  # a rollout adapter away from its init, so the merge matters
        for p in policy.adapter_params("rollout").values():
            p.add_(0.05 * torch.randn_like(p))
    reference = policy.merged_copy("rollout")
    layers = eligible_layers(reference, skip=policy.model.explore_skip, min_dim=cfg.explore.min_dim)
    for name, module in layers:
        parent, _, child = name.rpartition(".")
        setattr(reference.get_submodule(parent) if parent else reference, child, _UnpackedReference(module))
    packed = explore_copy(policy, "nvfp4_emulated", cfg.explore.min_dim)
    torch.manual_seed(3)
    cond = policy.model.encode(["a photo of a cat", "a handwritten digit three"])
    x, sigma = torch.randn(2, *policy.model.latent_shape), torch.tensor([0.9, 0.4])
    with torch.no_grad():
        expect = policy.model.velocity(reference, x, sigma, cond)
        torch.testing.assert_close(policy.model.velocity(packed, x, sigma, cond), expect, rtol=0, atol=0)
    quantized = {name for name, _ in layers}
    held = sum(module_bytes(m) for n, m in packed.named_modules() if n in quantized)
    in_bf16 = sum(m.weight.numel() * 2 for _, m in layers)
    assert held <= 0.35 * in_bf16, (held, in_bf16)
    # Everything but the quantized layers and the merged LoRA layers left in high precision is the policy's own
    # (shared), and the memory plan's copy, built on the meta device, holds exactly the bytes of this one.
    shared = {id(t) for t in [*policy.transformer.parameters(), *policy.transformer.buffers()]}
    norms = [t for n, m in packed.named_modules() if isinstance(m, torch.nn.LayerNorm) for t in m.parameters()]
    assert all(id(t) in shared for t in norms)
    from solrl.stages.memory import measure

    planned = measure(cfg, weights_dtype=torch.float32).explore_copy["nvfp4_emulated"]
    assert policy.owned_bytes(packed) == planned > 0


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_loading_tiny_digits_prints_no_diffusers_cast_warning(dtype, capfd):
    """``.to(dtype)`` on a diffusers model printed "There are modules in SanaTransformer2DModel that should be kept
    in float32: []" on every run, resume, show and export (diffusers warns even for an empty list)."""
    adapter = load_model(load_config("tiny-digits", [f"model.dtype={dtype}"]).model, torch.device("cpu"))
    assert next(adapter.transformer.parameters()).dtype == (torch.bfloat16 if dtype == "bfloat16" else torch.float32)
    assert "should be kept in float32" not in capfd.readouterr().err


@pytest.mark.parametrize("preset", ["tiny-sd3", "tiny-flux"])
def test_a_tiny_twin_encodes_a_long_prompt_without_the_truncation_warning(preset, tmp_path, capfd):
    """A twin's tokenizer spells words letter by letter, so its 16 tokens cut every prompt and diffusers warned
    "The following part of your input was truncated" on every run of a twin."""
    cfg = load_config(preset, [f"model.path={tmp_path / preset}"])
    adapter = load_model(cfg.model, torch.device("cpu"))
    capfd.readouterr()
    cond = adapter.encode(["a photograph of a red fox sitting in the snow at the edge of a pine forest at dawn"])
    assert cond["emb"].shape[0] == 1
    assert "was truncated" not in capfd.readouterr().err


def test_a_prompt_embedding_cache_changed_in_place_is_a_miss_not_read(tmp_path):
    """A breaker's finding: every stage read the run's prompt-embedding cache, and no manifest or checksum covered
    it, so embeddings changed in place (the file still loading) trained and evaluated a run silently. Its sha256
    is kept beside it and checked first; a changed file, or one without its digest, is encoded again."""
    from conftest import flip_middle_byte

    cfg = load_config()
    cache, prompts = tmp_path / "cache.safetensors", ["a handwritten digit three", "a handwritten digit seven"]
    model = load_model(cfg.model, torch.device("cpu"))
    model.precompute(prompts, cache)
    expect = {p: {k: v.clone() for k, v in model._cache[p].items()} for p in prompts}
    assert (tmp_path / "cache.safetensors.sha256").read_text().strip() == file_sha256(cache)

    def fresh():
        again = load_model(cfg.model, torch.device("cpu"), text_encoders=False)
        return again, again._load_embeddings(cache, sorted(prompts))

    assert fresh()[1]
    flip_middle_byte(cache)
    again, loaded = fresh()
    assert not loaded
    with pytest.raises(EmbeddingCacheMiss):  # no text encoders to encode them again with
        again.precompute(prompts, cache)
    model = load_model(cfg.model, torch.device("cpu"))
    model.precompute(prompts, cache)  # encoded again and the file rewritten, with its digest
    again, loaded = fresh()
    assert loaded and all(torch.equal(again._cache[p][k], v) for p in prompts for k, v in expect[p].items())
    (tmp_path / "cache.safetensors.sha256").unlink()
    assert not fresh()[1]
