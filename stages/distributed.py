"""The update stage in several processes: under torchrun on one node (issue 11), or as the workers of Ray Train's
``TorchTrainer`` on the nodes of a Ray cluster (issue 17). Each process computes one share of the rows.

torchrun (``train.launcher=torchrun``, ``train.nproc_per_node`` processes): ``launch_update`` (in the stage's
process, inside its atomic commit) runs ``torchrun --standalone --nproc-per-node N -m solrl.stages.distributed
STORE RUN_ID ITERATION OUT LAYOUT``. Each process opens the run from its store, reads the stage's inputs (checksums
verified), joins the process group (NCCL with one GPU per process, gloo on CPU) and runs ``train_policy`` on its
rows with the gradients all-reduced before every step; the first process writes the outputs into the stage's
temporary folder ``OUT`` and its metrics into ``OUT/.update-output.json``, which the launcher reads and removes
before the commit. A process that dies makes torchrun stop the others and exit non-zero: the launcher raises,
nothing is committed, and a resume redoes the update from the same committed inputs.

Ray Train (``train.launcher=ray``, ``train.workers`` workers): the workers share no disk with the stage's
process. Each opens the run from the store (an object store's run through its own node's mirror, fetching and
verifying the inputs there), joins the process group Ray Train set up (gloo on CPU, NCCL with one GPU per worker)
and runs the same ``train_policy``. The first worker writes the outputs into a folder of its own and returns them,
as bytes, with the metrics and every worker's node; Ray hands rank 0's return value to the launcher
(``Result.return_value``), which writes the files into ``OUT``. A worker that fails fails the fit (no retry:
``FailureConfig(max_failures=0)``), and nothing is committed.

The gradient all-reduce is done by hand rather than by wrapping the model in ``DistributedDataParallel``: one
optimizer step calls the same transformer with three LoRA adapters (policy, rollout, reference) before a single
backward, which DDP's per-forward reducer hooks do not expect; the all-reduce it would do is one flat SUM.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from solrl.processes import die_with_parent
from solrl.stages.context import StageContext, release_policies
from solrl.stages.models.policy import Policy
from solrl.storage.stage import StageOutput, commit_point

#: The first process's metrics and info, read and removed by the launcher (never committed).
OUTPUT_FILE = ".update-output.json"


def launch_update(ctx: StageContext, out: Path) -> StageOutput:
    """Run the update of ``ctx`` in several processes (``train.launcher``), its outputs written into ``out``.

    Raises:
        RuntimeError: a process failed or was killed (torchrun's exit status or Ray Train's error, with the tail
            of its output). ConfigError: ``train.launcher=ray`` and the Ray cluster cannot be reached.
    """
    release_policies()  # the stage's own process holds no model while the update's processes load theirs
    if ctx.cfg.train.launcher == "ray":
        return _launch_ray(ctx, out)
    return _launch_torchrun(ctx, out)


def _launch_torchrun(ctx: StageContext, out: Path) -> StageOutput:
    nproc = ctx.cfg.train.nproc_per_node
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "solrl.stages.distributed",
        ctx.place.store.address,  # the store itself: a mirrored run's folder is only this machine's copy
        ctx.run_id,
        str(ctx.iteration),
        str(out),
        json.dumps(train_layout(ctx)),
    ]
    # A session of its own, so a stop (Ctrl-C, SIGTERM, a failed task) takes torchrun *and* its workers down; and
    # SIGTERM to torchrun when this process dies, SIGKILL included (torchrun then stops its workers).
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=die_with_parent,
    )
    try:
        output, _ = proc.communicate()
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    if proc.returncode != 0:
        tail = "\n".join(output.strip().splitlines()[-15:])
        raise RuntimeError(f"iteration {ctx.iteration} update under torchrun ({nproc} processes) failed:\n{tail}")
    path = out / OUTPUT_FILE
    result = json.loads(path.read_text(encoding="utf-8"))
    path.unlink()
    return StageOutput(metrics=result["metrics"], info=result["info"])


def _launch_ray(ctx: StageContext, out: Path) -> StageOutput:
    """The update as ``train.workers`` Ray Train workers; rank 0's files come back as its return value."""
    import tempfile

    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from solrl.stages.cluster import ray_session

    workers, cuda = ctx.cfg.train.workers, ctx.device.type == "cuda"
    store = ctx.place.store.address  # what every worker's open_run takes
    with ray_session(ctx.cfg, workers), tempfile.TemporaryDirectory(prefix="solrl-ray-train-") as storage:
        trainer = TorchTrainer(
            _ray_worker,
            train_loop_config={
                "store": store,
                "run_id": ctx.run_id,
                "iteration": ctx.iteration,
                "layout": train_layout(ctx),
            },
            torch_config=TorchConfig(backend="nccl" if cuda else "gloo"),
            scaling_config=ScalingConfig(
                num_workers=workers, use_gpu=cuda, resources_per_worker={"GPU": 1} if cuda else {"CPU": 1}
            ),
            # Nothing is checkpointed through Ray: its run folder (the controller's own state) stays on this machine.
            run_config=RunConfig(
                name=f"{ctx.run_id}-iter{ctx.iteration}-update",
                storage_path=storage,
                failure_config=FailureConfig(max_failures=0),
            ),
        )
        try:
            result = trainer.fit()
        except Exception as exc:  # ray.train.TrainingFailedError: a worker raised or died
            tail = "\n".join(str(exc).strip().splitlines()[-15:])
            raise RuntimeError(
                f"iteration {ctx.iteration} update on Ray Train ({workers} workers) failed:\n{tail}"
            ) from None
    returned = result.return_value
    for relative, data in returned["files"].items():
        path = out / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return StageOutput(metrics=returned["metrics"], info={**returned["info"], "nodes": returned["nodes"]})


def _ray_worker(config: dict) -> dict | None:
    """One Ray Train worker (``TorchTrainer``'s ``train_loop_per_worker``): the run from ``config["store"]``, its
    rows of the update in the process group Ray Train initialised; rank 0 returns the outputs (file bytes by
    relative path, metrics, info) and the node of every rank, the others None."""
    import tempfile

    import ray
    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed as dist

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    ctx = open_context(config["store"], config["run_id"], int(config["iteration"]), config["layout"])
    if ctx.device.type == "cuda":
        torch.cuda.set_device(ray.train.torch.get_device())
    nodes: list[str | None] = [None] * world
    dist.all_gather_object(nodes, f"ray:{ray.get_runtime_context().get_node_id()}")
    with tempfile.TemporaryDirectory(prefix="solrl-update-") as tmp:
        out = Path(tmp)
        output = train_rank(ctx, out if rank == 0 else None, rank, world)
        dist.barrier()
        if rank != 0:
            return None
        files = {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    return {"files": files, "metrics": output.metrics, "info": output.info, "nodes": nodes}


def shard_policy(policy: Policy) -> None:
    """FSDP2 over the update's process group (``train.parallel=fsdp``), in place: each repeated block of the
    policy's transformer (``repeated_blocks``, with its LoRA adapters) is one unit, the root (embedders, norms,
    final layer) another (``torch.distributed.fsdp.fully_shard`` on a 1-D device mesh of every process). The
    frozen base and the three adapters are sharded along their first dimension; a unit is gathered while it
    computes, forward and backward, and freed after. Gradients are reduce-scattered as plain sums (divide factor
    1, sum-only collectives: gloo has no PREMUL_SUM), since each process's loss is already weighted by its share
    of the rows, as the hand all-reduce of ``train.parallel=ddp`` sums them.

    The loaded model is changed for good: the caller drops it from the process's cache afterwards
    (``release_policies``). Raises RuntimeError: no initialised process group.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from solrl.stages.models.adapter import repeated_blocks

    if not dist.is_initialized():
        raise RuntimeError("train.parallel=fsdp shards over a process group, and none is initialised")
    net = policy.transformer
    mesh = init_device_mesh(policy.model.device.type, (dist.get_world_size(),))
    for block in repeated_blocks(net):
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    for module in net.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def train_layout(ctx: StageContext) -> dict:
    """The launching stage's ``train`` layout fields (``solrl.config.LAYOUT_FIELDS``: ``parallel``,
    ``gradient_checkpointing``, ...), which its processes apply over the run's stored config: a layout may
    change between the run's start and this update (a resume with other settings)."""
    from solrl.config import LAYOUT_FIELDS

    return {key: getattr(ctx.cfg.train, key) for section, key in LAYOUT_FIELDS if section == "train"}


def open_context(store: str, run_id: str, iteration: int, layout: dict | None = None) -> StageContext:
    """The update's context in a process of its own: the run opened from ``store`` (a path or an object store's
    URL, whose run this machine then works on through its mirror), with the launcher's ``train`` ``layout``
    (``train_layout``) over its stored config."""
    from solrl.storage.runs import open_run

    ctx = StageContext.of(open_run(store, run_id), iteration)
    if layout:
        ctx = dataclasses.replace(
            ctx, cfg=ctx.cfg.model_copy(update={"train": ctx.cfg.train.model_copy(update=layout)})
        )
    return ctx


def train_rank(ctx: StageContext, out: Path | None, rank: int, world: int) -> StageOutput:
    """Process ``rank`` of ``world`` of the update, in an initialised process group: its inputs read from the run
    (checksums verified), then its rows of ``train_policy``; ``out`` (rank 0 only) receives the outputs."""
    from solrl.stages.pipeline import STAGES
    from solrl.stages.update import train_policy

    commit_point(f"rank{rank}", (ctx.iteration, "update"))  # joined the group, not yet training
    inputs = [artifact.load(ctx.run_dir, ctx.iteration) for artifact in STAGES["update"].reads]
    return train_policy(ctx, out, *inputs, rank=rank, world=world)


def main(argv: list[str]) -> None:
    """One torchrun process: ``STORE RUN_ID ITERATION OUT LAYOUT`` (``LAYOUT``: ``train_layout``'s JSON; the
    environment carries RANK, WORLD_SIZE, ...)."""
    import torch
    import torch.distributed as dist

    store, run_id, iteration, out = argv[0], argv[1], int(argv[2]), Path(argv[3])
    rank, world, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    ctx = open_context(store, run_id, iteration, json.loads(argv[4]))
    if ctx.device.type == "cuda":
        torch.cuda.set_device(local_rank)  # "cuda" is now this process's GPU
    dist.init_process_group("nccl" if ctx.device.type == "cuda" else "gloo")
    try:
        output = train_rank(ctx, out if rank == 0 else None, rank, world)
        if rank == 0:
            (out / OUTPUT_FILE).write_text(json.dumps({"metrics": output.metrics, "info": output.info}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
