"""Explore throughput on 1, 2 (and 4) workers: images per second and scaling efficiency of sharded explore.

The product's path without Prefect: a run's explore stage split into as many prompt shards as workers
(``campaign.shards``), each shard's ``run_shard`` submitted to a Dask cluster of that many worker processes, as
``campaign.task_runner=dask`` does. On CPU the workers are processes sharing the machine's cores (each gets
``cores // workers`` torch threads, so 1 worker has them all); on a GPU node with ``dask-cuda`` installed, one
worker per GPU. Every worker first loads the model and explores once (not timed); then the same explore is timed
from submission to the last shard's commit. Efficiency = (images/s with w workers) / (w x images/s with 1).

    .venv/bin/python bench/scale.py                         # tiny-digits, 8 prompts x pool 32, nvfp4_emulated
    .venv/bin/python bench/scale.py --workers 1 2 --prompts 8 --pool 64 --out bench/results/scale.md
"""

from __future__ import annotations

import solrl  # noqa: F401  (first: solrl sets the OpenMP spin policy before torch loads)

# isort: split

import argparse
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch

from solrl.config import load_config
from solrl.stages.context import StageContext
from solrl.stages.pipeline import run_shard, shards_folder
from solrl.stages.sharding import Shard
from solrl.storage.runs import create_run, open_run


def explore_shard(store: str, run_id: str, index: int, count: int) -> float:
    """One shard of iteration 1's explore (in a worker); returns its seconds."""
    run = open_run(store, run_id)
    ctx = StageContext(run.config, run.run_dir, run.run_id, 1, run.config_hash)
    start = time.perf_counter()
    run_shard(ctx, "explore", Shard(index, count))
    return time.perf_counter() - start


def cluster(workers: int, gpus: int):
    """A local Dask cluster: one worker per GPU (dask-cuda) on a GPU node, else processes sharing the cores."""
    if gpus:
        from dask_cuda import LocalCUDACluster

        return LocalCUDACluster(CUDA_VISIBLE_DEVICES=list(range(workers)), dashboard_address=None)
    from dask.distributed import LocalCluster

    threads = str(max(1, (os.cpu_count() or 1) // workers))
    return LocalCluster(
        n_workers=workers,
        threads_per_worker=1,
        processes=True,
        dashboard_address=None,
        env={"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads},
    )


def measure(args: argparse.Namespace, workers: int, gpus: int, store: Path) -> float:
    """Seconds of one timed sharded explore on ``workers`` workers (after an untimed warm-up)."""
    from dask.distributed import Client

    overrides = [
        f"storage.root={store}",
        f"campaign.prompts_per_iteration={args.prompts}",
        f"explore.pool_size={args.pool}",
        f"explore.steps={args.steps}",
        f"explore.precision={args.precision}",
        f"campaign.shards={workers}",
        f"model.device={'cuda' if gpus else 'cpu'}",
    ]
    run = create_run(load_config(args.config, overrides), f"scale-{workers}")
    folder = run.run_dir / "iter_000001" / shards_folder("explore")
    with cluster(workers, gpus) as local, Client(local) as client:
        seconds = []
        for _ in range(1 + args.repeat):  # the first loads the model in every worker: not timed
            shutil.rmtree(folder, ignore_errors=True)
            start = time.perf_counter()
            futures = [
                client.submit(explore_shard, str(store), run.run_id, i, workers, pure=False) for i in range(workers)
            ]
            client.gather(futures)
            seconds.append(time.perf_counter() - start)
    return min(seconds[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny-digits")
    parser.add_argument("--workers", type=int, nargs="+", default=None, help="default: 1, 2 and 4 where there are")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--pool", type=int, default=32)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--precision", default="nvfp4_emulated")
    parser.add_argument("--repeat", type=int, default=2, help="timed explores per worker count (the best is kept)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table (markdown) here")
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    units = gpus or os.cpu_count() or 1
    workers = args.workers or [w for w in (1, 2, 4) if w <= max(units, 2)]
    store = Path(tempfile.mkdtemp(prefix="solrl-scale-"))
    images = args.prompts * args.pool
    try:
        rows = [(w, measure(args, w, gpus, store / str(w))) for w in workers]
    finally:
        shutil.rmtree(store, ignore_errors=True)
    base = images / dict(rows).get(1, rows[0][1])
    machine = f"{gpus} x {torch.cuda.get_device_name(0)}" if gpus else f"{platform.machine()}, {os.cpu_count()} cores"
    lines = [
        f"{args.config}, explore {args.precision}, {args.prompts} prompts x pool {args.pool} = {images} images, "
        f"{args.steps} steps; best of {args.repeat} after a warm-up; machine: {machine}, torch {torch.__version__}",
        "",
        "| workers | seconds | images/s | speed-up | efficiency |",
        "| --- | --- | --- | --- | --- |",
    ]
    for w, seconds in rows:
        rate = images / seconds
        lines.append(f"| {w} | {seconds:.2f} | {rate:.1f} | {rate / base:.2f}x | {rate / base / w:.0%} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
