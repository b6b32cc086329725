"""The Flow-GRPO SDE step (issue 4 groundwork): reduces to the ODE, and its log-prob is the Gaussian density."""

from __future__ import annotations

import math

import torch

from solrl.stages.sampling.sde import gaussian_log_prob, sde_mean, sde_std, sde_step


def _state():
    torch.manual_seed(0)
    x, v, eps = torch.randn(3, 1, 4, 4), torch.randn(3, 1, 4, 4), torch.randn(3, 1, 4, 4)
    return x, v, eps, torch.full((3,), 0.6), torch.full((3,), 0.45)


def test_sde_step_with_noise_level_zero_is_the_euler_ode_step():
    x, v, eps, sigma, sigma_next = _state()
    x_next, _ = sde_step(x, v, sigma, sigma_next, eps, noise_level=0.0, sigma_max=0.9)
    torch.testing.assert_close(x_next, x + (0.45 - 0.6) * v)


def test_sde_mean_matches_the_design_formula():
    x, v, _, sigma, sigma_next = _state()
    a, dt = 0.7, 0.45 - 0.6
    s2 = a**2 * 0.6 / (1 - 0.6)
    expected = x + (v + s2 / (2 * 0.6) * (x + (1 - 0.6) * v)) * dt
    torch.testing.assert_close(sde_mean(x, v, sigma, sigma_next, a, 0.9), expected)


def test_log_prob_is_the_closed_form_gaussian_density_of_the_drawn_sample():
    x, v, eps, sigma, sigma_next = _state()
    x_next, log_prob = sde_step(x, v, sigma, sigma_next, eps, noise_level=0.7, sigma_max=0.9)
    std = 0.7 * math.sqrt(0.6 / 0.4) * math.sqrt(0.15)
    torch.testing.assert_close(sde_std(sigma, sigma_next, 0.7, 0.9), torch.full((3,), std))
    dist = torch.distributions.Normal(sde_mean(x, v, sigma, sigma_next, 0.7, 0.9).double(), std)
    expected = dist.log_prob(x_next.double()).mean(dim=(1, 2, 3)).float()
    torch.testing.assert_close(log_prob, expected)
    # ...which for the drawn sample is -eps^2/2 - log(std) - log(sqrt(2 pi)), averaged.
    manual = (-0.5 * eps**2).mean(dim=(1, 2, 3)) - math.log(std) - 0.5 * math.log(2 * math.pi)
    torch.testing.assert_close(log_prob, manual, rtol=1e-4, atol=1e-4)


def test_sigma_one_uses_sigma_max_in_the_denominator():
    std = sde_std(torch.tensor([1.0]), torch.tensor([0.9]), 0.7, sigma_max=0.9)
    assert torch.isfinite(std).all()
    torch.testing.assert_close(std, torch.tensor([0.7 * math.sqrt(1.0 / 0.1) * math.sqrt(0.1)]))


def test_gaussian_log_prob_shapes():
    assert gaussian_log_prob(torch.zeros(5, 2, 3), torch.zeros(5, 2, 3), torch.ones(5)).shape == (5,)


def test_grpo_ratio_is_one_on_policy_and_the_gradient_follows_the_advantage():
    import pytest

    from solrl.stages.losses.grpo import grpo_loss

    old = torch.tensor([-1.0, -2.0, -0.5])
    new = old.clone().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 0.5])
    loss, terms = grpo_loss(new, old, adv, clip_range=0.2)
    assert terms["ratio_mean"] == 1.0 and terms["clip_fraction"] == 0.0
    assert loss.item() == pytest.approx(-adv.mean().item())
    loss.backward()
    torch.testing.assert_close(new.grad, -adv / 3)  # descent raises log-prob where A > 0
    with pytest.raises(ValueError, match="clip_range must be > 0"):
        grpo_loss(new, old, adv, clip_range=0.0)


def test_grpo_clipping_stops_the_gradient_outside_the_trust_region():
    from solrl.stages.losses.grpo import grpo_loss

    old = torch.zeros(2)
    new = torch.tensor([0.5, -0.5], requires_grad=True)  # ratios e^0.5 and e^-0.5, far outside 1 +- 0.1
    loss, terms = grpo_loss(new, old, torch.tensor([1.0, -1.0]), clip_range=0.1)
    loss.backward()
    assert terms["clip_fraction"] == 1.0
    torch.testing.assert_close(new.grad, torch.zeros(2))


def test_grpo_kl_is_the_gaussian_kl_of_the_step_means():
    from solrl.stages.losses.grpo import grpo_loss

    mean, ref = torch.ones(1, 2, 2), torch.zeros(1, 2, 2)
    _, terms = grpo_loss(
        torch.zeros(1),
        torch.zeros(1),
        torch.zeros(1),
        clip_range=0.1,
        mean=mean,
        ref_mean=ref,
        std=torch.tensor([0.5]),
        kl_beta=1.0,
    )
    assert abs(terms["kl"] - 1.0 / (2 * 0.25)) < 1e-6


def _guard_case():
    """Two samples of 2 elements, step std 0.5, dt 0.25, drawn with eps = (1, -1) from mu_old = 0: sample 0's policy
    mean moved by Delta = (0.1, -0.1), sample 1's not at all."""
    from solrl.stages.sampling.sde import gaussian_log_prob

    std, dt = torch.tensor([0.5, 0.5]), torch.tensor([0.25, 0.25])
    eps = torch.tensor([[1.0, -1.0], [1.0, -1.0]])
    old_mean = torch.zeros(2, 2)
    x_next = old_mean + std[:, None] * eps
    mean = torch.tensor([[0.1, -0.1], [0.0, 0.0]], requires_grad=True)
    log_prob = gaussian_log_prob(x_next, mean, std)
    old_log_prob = gaussian_log_prob(x_next, old_mean, std)
    return log_prob, old_log_prob, mean, old_mean, std, dt


def test_grpo_guard_equals_its_formulas_computed_by_hand():
    """GRPO-Guard (arXiv 2510.22319) on numbers worked by hand, sample 0:
    raw log-ratio = [-(0.4^2) + 0.5^2] / (2 * 0.5^2) = 0.18; b = mean(0.1^2) / (2 * 0.25) = 0.02;
    normalised log-ratio = (0.18 + 0.02) * 0.5 = 0.1 = mean(eps * Delta); ratio = e^0.1.
    Sample 1: Delta = 0, ratio 1. A = (1, -1), weight 1/|dt| = 4:
    clip 0.2 -> loss = [4 * (-e^0.1) + 4 * 1] / 2;  clip 0.05 -> sample 0 is clipped at 1.05: [4 * -1.05 + 4] / 2."""
    import pytest

    from solrl.stages.losses.grpo import grpo_loss

    log_prob, old_log_prob, mean, old_mean, std, dt = _guard_case()
    assert (log_prob - old_log_prob)[0].item() == pytest.approx(0.18, abs=1e-6)
    adv = torch.tensor([1.0, -1.0])
    loss, terms = grpo_loss(log_prob, old_log_prob, adv, clip_range=0.2, mean=mean, std=std, old_mean=old_mean, dt=dt)
    assert loss.item() == pytest.approx((4 * -math.exp(0.1) + 4 * 1.0) / 2, abs=1e-6)
    assert terms["ratio_mean"] == pytest.approx((math.exp(0.1) + 1) / 2, abs=1e-6)
    assert terms["ratio_shift"] == pytest.approx((0.02 * 0.5 + 0.0) / 2, abs=1e-7)
    assert terms["clip_fraction"] == 0.0
    # d loss / d mu_i = (1/2) * 4 * (-A_i) * ratio_i * eps / 2 (from the closed form mean(eps * Delta)):
    # sample 0: -e^0.1 * eps; sample 1 (A = -1, ratio 1): +eps
    loss.backward()
    torch.testing.assert_close(mean.grad[0], -math.exp(0.1) * torch.tensor([1.0, -1.0]))
    torch.testing.assert_close(mean.grad[1], torch.tensor([1.0, -1.0]))

    log_prob, old_log_prob, mean, old_mean, std, dt = _guard_case()
    loss, terms = grpo_loss(log_prob, old_log_prob, adv, clip_range=0.05, mean=mean, std=std, old_mean=old_mean, dt=dt)
    assert loss.item() == pytest.approx((4 * -1.05 + 4 * 1.0) / 2, abs=1e-6)
    assert terms["clip_fraction"] == 0.5
    loss.backward()
    torch.testing.assert_close(mean.grad[0], torch.zeros(2))  # clipped: no gradient


def test_grpo_guard_without_the_guard_is_the_raw_ratio_and_needs_its_inputs():
    import pytest

    from solrl.stages.losses.grpo import grpo_loss

    log_prob, old_log_prob, mean, old_mean, std, dt = _guard_case()
    _, terms = grpo_loss(log_prob, old_log_prob, torch.tensor([1.0, -1.0]), clip_range=0.5)
    assert terms["ratio_mean"] == pytest.approx((math.exp(0.18) + 1) / 2, abs=1e-6)
    assert terms["ratio_shift"] == 0.0
    with pytest.raises(ValueError, match="GRPO-Guard needs"):
        grpo_loss(log_prob, old_log_prob, torch.ones(2), clip_range=0.1, old_mean=old_mean, std=std, dt=dt)
    with pytest.raises(ValueError, match="GRPO-Guard needs"):
        grpo_loss(log_prob, old_log_prob, torch.ones(2), clip_range=0.1, mean=mean, old_mean=old_mean, std=std, dt=-dt)


def test_the_rollout_mean_comes_back_from_the_seeds_noise_and_a_foreign_trajectory_is_refused():
    """GRPO-Guard does not store mu_old: x_{t+1} - std eps with eps redrawn from the sample's seed gives it back."""
    import pytest

    from solrl.stages.losses.base import Batch
    from solrl.stages.losses.grpo import rollout_mean
    from solrl.stages.sampling.samplers import sample_sde, seed_noise

    seeds = [11, 12, 13]
    sigmas = torch.linspace(1, 0, 5)
    noise = seed_noise(seeds, (1, 4, 4), len(sigmas))
    traj = sample_sde(lambda x, sigma: 0.3 * x - sigma.reshape(-1, 1, 1, 1), noise, sigmas, 0.7)
    batch = Batch(
        traj.samples,
        torch.zeros(3),
        {},
        sigmas,
        traj.latents,
        traj.log_probs,
        traj.sde.tolist(),
        torch.tensor(seeds),
    )
    t = 2
    sigma, sigma_next = sigmas[t].expand(3), sigmas[t + 1].expand(3)
    x_t = traj.latents[:, t]
    std = sde_std(sigma, sigma_next, 0.7, float(sigmas[1]))
    expected = sde_mean(x_t, 0.3 * x_t - sigma.reshape(-1, 1, 1, 1), sigma, sigma_next, 0.7, float(sigmas[1]))
    torch.testing.assert_close(rollout_mean(batch, slice(0, 3), t, std, traj.log_probs[:, t]), expected)
    torch.testing.assert_close(rollout_mean(batch, slice(1, 3), t, std[1:], traj.log_probs[1:, t]), expected[1:])
    batch.seeds = torch.tensor([11, 99, 13])  # another seed's noise: not the draw that made this trajectory
    with pytest.raises(RuntimeError, match="not sampled from their seeds' noise"):
        rollout_mean(batch, slice(0, 3), t, std, traj.log_probs[:, t])
