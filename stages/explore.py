"""Stage 1, explore: sample the candidate pool with the low-precision copy of the rollout policy."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from solrl.registry import EXPLORE_BACKENDS
from solrl.stages.context import StageContext
from solrl.stages.quant.backends import quantized_layers, sampling_network
from solrl.stages.sampling.compiled import compile_metrics
from solrl.stages.sampling.rollout import generate, trajectory_arrays
from solrl.stages.sharding import WHOLE, Shard, prompts_per_part
from solrl.storage.artifacts import CandidatePool, StartingPolicy
from solrl.storage.stage import StageOutput, read_manifest


def explored_in(ctx: StageContext, iteration: int) -> str | None:
    """The precision iteration ``iteration`` explored in, from its committed explore manifest (None: not committed)."""
    manifest = read_manifest(ctx.run_dir, iteration, "explore")
    return None if manifest is None else manifest.info.get("precision")


def explore_precision(ctx: StageContext) -> tuple[str, list[str]]:
    """The precision this iteration explores in: ``explore.precision``, unless the previous iteration explored in
    it and its proxy fidelity fell below ``fidelity.min_spearman`` with ``fidelity.on_low=bf16`` (then ``bf16``,
    with a warning).

    An iteration without a fidelity measurement (``regenerate.enabled=false``: nothing is regenerated to compare
    with) keeps the configured precision. An iteration that explored in bf16 measured bf16 against bf16, which
    says nothing of the quantized copy, so the next one explores in ``explore.precision`` again and measures it.

    Reads the previous ``explore`` and ``score_regenerate`` manifests, which the previous checkpoint (this stage's
    ``StartingPolicy``) depends on, so the cache key covers them."""
    configured, bound = ctx.cfg.explore.precision, ctx.cfg.fidelity.min_spearman
    if bound is None or ctx.cfg.fidelity.on_low != "bf16" or ctx.iteration <= 1 or configured == "bf16":
        return configured, []
    if explored_in(ctx, ctx.iteration - 1) != configured:
        return configured, []
    previous = read_manifest(ctx.run_dir, ctx.iteration - 1, "score_regenerate")
    rho = previous.metrics.get("fidelity/spearman") if previous else None
    if rho is None or math.isnan(rho) or rho >= bound:
        return configured, []
    return "bf16", [
        f"iteration {ctx.iteration - 1} proxy fidelity Spearman {rho:.3f} < {bound}: exploring in bf16 "
        f"instead of {configured} this iteration (the next explores in {configured} again and measures it)"
    ]


def explore(ctx: StageContext, out: Path, start: StartingPolicy | None, *, shard: Shard = WHOLE) -> StageOutput:
    """Draw ``pool_size`` seeds per prompt and sample each with the explore copy (``explore.precision``) of the
    rollout policy ``start`` (None: the base model).

    Writes a ``CandidatePool``: images uint8 ``[P, N, H, W, 3]``, seeds int64 ``[P, N]``, prompt_index int64
    ``[P]``; with ``regenerate.enabled=false`` (the baselines that train on the explore samples) also what the
    loss needs (final latents; SDE trajectories and log-probs), and with ``storage.pool=latents`` the final
    latents float32 ``[P, N, C, h, w]`` (what the pool keeps once its checkpoint is committed,
    ``solrl.storage.retention``). Seeds derive from (run seed, iteration, prompt position, candidate index).
    With ``shard``, only that shard's prompts (``P`` of them). The pool is written as it is sampled,
    ``prompts_per_part`` prompts at a time (whole sampling batches).
    """
    cfg = ctx.cfg.explore
    precision, warnings = explore_precision(ctx)
    prompt_index, prompts = ctx.iteration_prompts()
    positions = shard.positions(len(prompts))
    prompt_index, prompts = prompt_index[list(positions)], [prompts[p] for p in positions]
    P, N = len(prompts), cfg.pool_size
    seeds = np.array([[ctx.seed("explore", p, n) for n in range(N)] for p in positions], dtype=np.int64)
    policy = ctx.load_policy(start)
    policy.explore_sync_seconds = 0.0
    noise_level = ctx.cfg.sde_noise_level()
    step = prompts_per_part(N, [cfg.batch_size])
    attrs = {"prompts": prompts, "precision": precision, "steps": cfg.steps, "policy_version": ctx.iteration - 1}
    sde_steps: list[bool] = []
    with (
        sampling_network(
            policy,
            precision,
            compile=cfg.compile,
            mode=ctx.cfg.model.compile_mode,
            min_dim=cfg.min_dim,
            activation_scale=cfg.activation_scale,
            keep_copy=cfg.keep_copy,
        ) as (net, compiled),
        CandidatePool.writer(out, P, attrs) as writer,
    ):
        writer.put(0, seeds=seeds, prompt_index=prompt_index)
        backend = EXPLORE_BACKENDS.get(precision)
        if backend.low_precision and backend.__module__.startswith("solrl.") and not quantized_layers(net):
            warnings.append(  # a breaker's finding: a huge min_dim made nvfp4_emulated a bf16 run, said nowhere
                f"explore.precision={precision} quantizes no layer of this transformer (explore.min_dim="
                f"{cfg.min_dim} and the family's skip rule leave none): the pool is sampled at the policy's precision"
            )
        for first in range(0, P, step):
            last = min(first + step, P)
            traj = generate(
                policy.model,
                net,
                [prompts[p] for p in range(first, last) for _ in range(N)],
                seeds[first:last].reshape(-1).tolist(),
                cfg.steps,
                cfg.batch_size,
                desc=f"explore {precision}",
                noise_level=noise_level,
                sde_window=ctx.cfg.regenerate.sde_window if cfg.steps == ctx.cfg.regenerate.steps else None,
            )
            images = policy.model.decode(traj.samples)  # [n*N, H, W, 3]
            groups = (last - first, N)
            if not ctx.cfg.regenerate.enabled:  # the update trains on the pool itself
                latents = trajectory_arrays(traj, groups, noise_level > 0)
            elif ctx.cfg.storage.pool == "latents":  # what the pool keeps once its images are pruned
                latents = {"latents": trajectory_arrays(traj, groups, False)["latents"]}
            else:
                latents = {}
            writer.put(first, images=images.reshape(*groups, *images.shape[1:]), **latents)
            sde_steps = traj.sde.tolist()
            del traj, images, latents
        writer.attrs["sde_steps"] = sde_steps
    # Seconds to build (first iteration in this process) or sync in place (later) the quantized copy.
    return StageOutput(
        metrics={
            "explore/sync_seconds": policy.explore_sync_seconds,
            "explore/low_precision": EXPLORE_BACKENDS.get(precision).low_precision,
            **compile_metrics("explore", compiled),
        },
        info={"precision": precision, "prompts": P, "pool_size": N, "warnings": warnings},
    )
