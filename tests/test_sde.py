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
