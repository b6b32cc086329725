"""The math the project exists for: seeds, the ODE sampler, selection, advantages, the NFT loss, fidelity."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from solrl.stages.losses.advantages import ADV_EPS, group_advantages, prompt_history_advantages
from solrl.stages.losses.nft import nft_loss
from solrl.stages.metrics.fidelity import pool_agreement, rank_agreement
from solrl.stages.metrics.selection import pool_ranks, select_seeds
from solrl.stages.sampling.samplers import derive_seed, initial_noise, sample_ode


def test_derive_seed_is_stable_distinct_and_int63():
    a = derive_seed(42, 3, 1, 7)
    assert a == derive_seed(42, 3, 1, 7)
    assert a != derive_seed(42, 3, 1, 8) and a != derive_seed(43, 3, 1, 7)
    assert 0 <= a < 2**63
    assert derive_seed(42, "eval", 0, 0) == 8607575124786813742  # pinned: a change would re-seed every run


def test_initial_noise_rows_depend_only_on_their_seed():
    both = initial_noise([5, 9], (1, 4, 4))
    alone = initial_noise([9], (1, 4, 4))
    torch.testing.assert_close(both[1], alone[0], rtol=0, atol=0)
    assert not torch.equal(both[0], both[1])


def test_euler_ode_is_exact_on_a_straight_flow():
    # For v = eps - x0 constant along the path, x_sigma = (1 - sigma) x0 + sigma eps: Euler lands on x0 exactly.
    x0, eps = torch.randn(3, 1, 4, 4), torch.randn(3, 1, 4, 4)
    sigmas = torch.tensor([1.0, 0.7, 0.3, 0.05, 0.0])
    out = sample_ode(lambda x, s: eps - x0, eps, sigmas)
    torch.testing.assert_close(out, x0)


def test_best_worst_keeps_the_extremes_of_each_pool():
    rewards = np.array([[0.1, 0.9, 0.5, 0.3, 0.7, 0.2], [6, 5, 4, 3, 2, 1]], dtype=float)
    index, kept_as = select_seeds(rewards, 4, "best_worst")
    assert index.tolist() == [[1, 4, 0, 5], [0, 1, 5, 4]]
    assert kept_as[0].tolist() == ["best", "best", "worst", "worst"]


def test_selection_breaks_ties_by_candidate_index():
    index, _ = select_seeds(np.zeros((1, 6)), 2, "best_worst")
    assert index.tolist() == [[0, 5]]


@pytest.mark.parametrize(
    ("k", "strategy", "match"),
    [(3, "best_worst", "even k"), (7, "best_worst", "pool size 6"), (2, "median", "unknown selection strategy")],
)
def test_selection_errors(k, strategy, match):
    with pytest.raises(ValueError, match=match):
        select_seeds(np.zeros((2, 6)), k, strategy)


def test_selection_refuses_nan_rewards():
    with pytest.raises(ValueError, match="NaN"):
        select_seeds(np.array([[0.1, np.nan, 0.2, 0.3]]), 2)


def test_random_and_top_k_selection():
    rewards = np.arange(12, dtype=float).reshape(2, 6)
    top, _ = select_seeds(rewards, 3, "top_k")
    assert top.tolist() == [[5, 4, 3], [5, 4, 3]]
    rand, labels = select_seeds(rewards, 3, "random", seed=1)
    assert rand.shape == (2, 3) and len(set(rand[0])) == 3 and set(labels.ravel()) == {"random"}


def test_pool_ranks_are_one_for_the_best():
    assert pool_ranks(np.array([[0.2, 0.9, 0.5]])).tolist() == [[3, 1, 2]]


def test_group_advantages_of_a_known_group():
    r = np.array([[1.0, 2.0, 3.0, 4.0]])
    adv = group_advantages(r, global_std=False, clip=5.0)
    expected = (r - 2.5) / (np.std(r) + ADV_EPS)
    np.testing.assert_allclose(adv.values, expected, rtol=1e-6)
    assert adv.zero_std_ratio == 0.0


def test_global_std_uses_the_batch_and_zero_spread_groups_are_counted_and_zeroed():
    r = np.array([[0.0, 1.0], [0.5, 0.5]])
    adv = group_advantages(r, global_std=True, clip=5.0)
    np.testing.assert_allclose(adv.values[0], np.array([-0.5, 0.5]) / (np.std(r) + ADV_EPS), rtol=1e-6)
    assert adv.values[1].tolist() == [0.0, 0.0] and adv.zero_std_ratio == 0.5


def test_advantages_are_clipped():
    r = np.array([[0.0] * 99 + [1.0]])
    assert group_advantages(r, global_std=False, clip=2.0).values.max() == pytest.approx(2.0)


def test_prompt_tracker_centres_on_the_prompt_buffer_once_it_holds_min_count():
    history = {"a": np.array([0.0, 0.0, 1.0, 1.0])}
    r = np.array([[0.2, 0.8], [0.4, 0.6]])
    adv, updated = prompt_history_advantages(r, ["a", "b"], history, buffer_size=5, min_count=4, global_std=False)
    # "a": buffer = last 5 of [0, 0, 1, 1, 0.2, 0.8] -> [0, 1, 1, 0.2, 0.8]; "b" has 2 < min_count: batch stats.
    buffer_a = np.array([0.0, 1.0, 1.0, 0.2, 0.8])
    np.testing.assert_allclose(updated["a"], buffer_a)
    np.testing.assert_allclose(adv.values[0], (r[0] - buffer_a.mean()) / (buffer_a.std() + ADV_EPS), rtol=1e-6)
    np.testing.assert_allclose(adv.values[1], (r[1] - r.mean()) / (r.std() + ADV_EPS), rtol=1e-6)
    assert history["a"].tolist() == [0.0, 0.0, 1.0, 1.0]  # the caller's history is not modified


def test_prompt_tracker_pools_groups_of_one_prompt_and_skips_a_flat_buffer():
    r = np.array([[0.0, 1.0], [1.0, 2.0], [0.5, 0.5]])
    adv, updated = prompt_history_advantages(
        r, ["a", "a", "c"], {"c": np.array([0.5, 0.5])}, buffer_size=8, min_count=4, global_std=True
    )
    assert updated["a"].tolist() == [0.0, 1.0, 1.0, 2.0]
    np.testing.assert_allclose(adv.values[:2], (r[:2] - 1.0) / (r.std() + ADV_EPS), rtol=1e-6)
    assert adv.values[2].tolist() == [0.0, 0.0] and adv.zero_std_ratio == pytest.approx(1 / 3)


def test_prompt_tracker_rejects_a_min_count_it_could_never_reach():
    with pytest.raises(ValueError, match="min_count"):
        prompt_history_advantages(np.zeros((1, 2)), ["a"], {}, buffer_size=4, min_count=5)


def test_nft_gradient_moves_v_theta_toward_the_positive_sample():
    # Two samples at one timestep: the positive (A>0) and negative (A<0) have different clean targets. A few
    # gradient steps on v_theta (v_old fixed) must lower the x0 error on the positive and raise it on the negative.
    torch.manual_seed(0)
    x0 = torch.randn(2, 1, 4, 4)
    t = torch.full((2,), 0.6)
    eps = torch.randn_like(x0)
    x_t = (1 - 0.6) * x0 + 0.6 * eps
    v_old = (eps - x0) + 0.5 * torch.randn_like(x0)  # imperfect rollout velocity
    v = v_old.clone().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0])

    def x0_err(vel: torch.Tensor) -> torch.Tensor:
        return ((x_t - 0.6 * vel - x0) ** 2).flatten(1).mean(1)

    before = x0_err(v.detach())
    opt = torch.optim.SGD([v], lr=0.2)
    for _ in range(50):
        loss, _ = nft_loss(v, v_old, None, x_t, x0, t, adv, beta=1.0, adv_clip_max=5.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = x0_err(v.detach())
    assert after[0] < before[0] * 0.5
    assert after[1] > before[1]


def test_nft_loss_terms_and_kl():
    x0 = torch.zeros(1, 1, 2, 2)
    v = torch.ones(1, 1, 2, 2, requires_grad=True)
    loss, terms = nft_loss(
        v, v.detach(), torch.zeros_like(v), x0, x0, torch.tensor([0.5]), torch.tensor([0.0]), kl_beta=0.1
    )
    # r = 0.5; x0_hat = -0.5 everywhere; w = 0.5; each term 0.25 / 0.5 = 0.5; policy = 5 * (0.25 + 0.25) = 2.5
    assert terms["r_mean"] == pytest.approx(0.5)
    assert terms["policy_loss"] == pytest.approx(2.5)
    assert terms["kl"] == pytest.approx(1.0)
    assert loss.item() == pytest.approx(2.6)


def test_rank_agreement_perfect_and_reversed():
    e = np.array([[1.0, 2.0, 3.0, 4.0]])
    assert rank_agreement(e, e * 2) == {"spearman": 1.0, "kendall": 1.0, "top_half_match": 1.0}
    reversed_ = rank_agreement(e, -e)
    assert reversed_["spearman"] == pytest.approx(-1.0) and reversed_["top_half_match"] == 0.0


def test_pool_agreement_references_match_the_paper_for_12_of_96():
    rng = np.random.default_rng(0)
    bf16 = rng.normal(size=(3, 96))
    perfect = pool_agreement(bf16 * 3 + 1, bf16, k=24)
    assert perfect["best_true_rank"] == perfect["best_perfect"] == 6.5
    assert perfect["worst_true_rank"] == perfect["worst_perfect"] == 90.5
    assert perfect["random_rank"] == 48.5
    assert perfect["top12_match"] == 1.0 and perfect["bottom12_false_inclusion"] == 0.0
    assert perfect["spearman"] == pytest.approx(1.0)
    noise = pool_agreement(rng.normal(size=(200, 96)), rng.normal(size=(200, 96)), k=24)
    assert noise["best_true_rank"] == pytest.approx(48.5, abs=2.0) and abs(noise["spearman"]) < 0.05
    assert noise["top12_match"] == pytest.approx(12 / 96, abs=0.03)


def test_dpm2_equals_diffusers_dpm_solver_plus_plus_2m_on_the_same_sigmas():
    from diffusers import DPMSolverMultistepScheduler

    from solrl.stages.sampling.samplers import sample_dpm2, sample_ode_with

    torch.manual_seed(0)
    weight = torch.randn(4, 4) * 0.3

    def velocity(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:  # a smooth, nonlinear field
        return torch.tanh(torch.einsum("ij,bjhw->bihw", weight, x)) + sigma[:, None, None, None] * x

    scheduler = DPMSolverMultistepScheduler(
        solver_order=2,
        algorithm_type="dpmsolver++",
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=3.0,
        lower_order_final=True,
        final_sigmas_type="zero",
    )
    scheduler.set_timesteps(6)
    noise = torch.randn(2, 4, 3, 3)
    x = noise.clone()
    for i, t in enumerate(scheduler.timesteps):
        x = scheduler.step(velocity(x, scheduler.sigmas[i].expand(2)), t, x).prev_sample
    ours = sample_dpm2(velocity, noise, scheduler.sigmas.float())
    torch.testing.assert_close(ours, x, rtol=1e-5, atol=1e-5)
    euler = sample_ode_with("euler")(velocity, noise, scheduler.sigmas.float())
    assert (euler - x).abs().max() > 1e-3  # second order differs from Euler on a nonlinear field
    with pytest.raises(ValueError, match="unknown ODE solver 'heun'"):
        sample_ode_with("heun")


def _smooth_images(n: int = 4, size: int = 32) -> np.ndarray:
    """Band-limited random grey images in [20, 220], float ``[n, size, size]`` (no energy at the Nyquist)."""
    rng = np.random.default_rng(0)
    freq = np.fft.fftfreq(size)
    lowpass = (np.abs(freq)[:, None] < 0.15) & (np.abs(freq)[None, :] < 0.15)
    images = np.real(np.fft.ifft2(np.fft.fft2(rng.normal(size=(n, size, size))) * lowpass))
    return (images - images.min()) / (images.max() - images.min()) * 200 + 20


def test_grid_energy_finds_a_checkerboard_at_the_patch_period():
    from solrl.stages.metrics.grid_artifacts import grid_energy

    smooth = _smooth_images()
    checker = (np.indices((32, 32)).sum(0) % 2) * 2 - 1  # period 2 in both directions
    as_rgb = lambda x: np.clip(x, 0, 255).round().astype(np.uint8)[..., None].repeat(3, -1)  # noqa: E731
    clean, faint, strong = (grid_energy(as_rgb(smooth + a * checker), 2) for a in (0, 5, 20))
    assert clean.dtype == np.float32 and clean.shape == (4,)
    assert clean.max() < 0.005 and faint.min() > 5 * clean.max() and strong.min() > 0.2
    assert (strong > faint).all()
    assert grid_energy(as_rgb(128 + 50 * checker[None]), 2)[0] == pytest.approx(1.0)  # a pure period-2 pattern
    stripes = np.broadcast_to((np.arange(32) % 4 < 2) * 100.0 + 50, (1, 32, 32))  # period 4 along x only
    assert grid_energy(as_rgb(stripes), 4)[0] == pytest.approx(1.0) and grid_energy(as_rgb(stripes), 3)[0] < 0.05
    with pytest.raises(ValueError, match="period must be >= 2"):
        grid_energy(as_rgb(smooth), 1)
