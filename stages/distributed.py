"""The update stage under torchrun (issue 11): ``train.nproc_per_node`` processes, one share of the rows each.

``launch_update`` (in the stage's process, inside its atomic commit) runs
``torchrun --standalone --nproc-per-node N -m solrl.stages.distributed STORE RUN_ID ITERATION OUT``. Each process
opens the run from its store, reads the stage's inputs (checksums verified), joins the process group (NCCL with
one GPU per process, gloo on CPU) and runs ``train_policy`` on its rows with the gradients all-reduced before
every step; the first process writes the outputs into the stage's temporary folder ``OUT`` and its metrics into
``OUT/.update-output.json``, which the launcher reads and removes before the commit. A process that dies makes
torchrun stop the others and exit non-zero: the launcher raises, nothing is committed, and a resume redoes the
update from the same committed inputs.

The gradient all-reduce is done by hand rather than by wrapping the model in ``DistributedDataParallel``: one
optimizer step calls the same transformer with three LoRA adapters (policy, rollout, reference) before a single
backward, which DDP's per-forward reducer hooks do not expect; the all-reduce it would do is one flat SUM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from solrl.processes import die_with_parent
from solrl.stages.context import StageContext, release_policies
from solrl.storage.stage import StageOutput

#: The first process's metrics and info, read and removed by the launcher (never committed).
OUTPUT_FILE = ".update-output.json"
#: Test-only fault (as ``solrl.storage.stage.FAULT_ENV``): ``<iteration>:update:rank<r>`` SIGKILLs process r after
#: it joined the process group and before it trains.
FAULT_ENV = "SOLRL_FAULT"


def launch_update(ctx: StageContext, out: Path) -> StageOutput:
    """Run the update of ``ctx`` under torchrun with ``train.nproc_per_node`` processes, writing into ``out``.

    Raises:
        RuntimeError: torchrun exited non-zero (a process failed or was killed); its output's tail is included.
    """
    nproc = ctx.cfg.train.nproc_per_node
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "solrl.stages.distributed",
        str(ctx.run_dir.parent),
        ctx.run_id,
        str(ctx.iteration),
        str(out),
    ]
    release_policies()  # the stage's own process holds no model while the torchrun processes load theirs
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


def main(argv: list[str]) -> None:
    """One torchrun process: ``STORE RUN_ID ITERATION OUT`` (the environment carries RANK, WORLD_SIZE, ...)."""
    import torch
    import torch.distributed as dist

    from solrl.stages.pipeline import STAGES
    from solrl.stages.update import train_policy
    from solrl.storage.runs import open_run

    store, run_id, iteration, out = argv[0], argv[1], int(argv[2]), Path(argv[3])
    rank, world, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    run = open_run(store, run_id)
    ctx = StageContext(run.config, run.run_dir, run.run_id, iteration, run.config_hash)
    if ctx.device.type == "cuda":
        torch.cuda.set_device(local_rank)  # "cuda" is now this process's GPU
    dist.init_process_group("nccl" if ctx.device.type == "cuda" else "gloo")
    try:
        if os.environ.get(FAULT_ENV) == f"{iteration}:update:rank{rank}":
            os.kill(os.getpid(), signal.SIGKILL)
        inputs = [artifact.load(ctx.run_dir, iteration) for artifact in STAGES["update"].reads]
        output = train_policy(ctx, out if rank == 0 else None, *inputs, rank=rank, world=world)
        if rank == 0:
            (out / OUTPUT_FILE).write_text(json.dumps({"metrics": output.metrics, "info": output.info}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
