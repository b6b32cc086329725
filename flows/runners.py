"""Task runners of the shard tasks (issue 11): existing engines, not a home-made scheduler.

``campaign.task_runner=local`` runs a sharded stage's shards in order in the campaign's process (one model in
memory; threads would share it). ``dask`` submits them at once to a Dask cluster through ``prefect-dask``: the
cluster at ``campaign.dask_address`` (e.g. one started with ``dask-cuda-worker`` on a GPU node, one worker per
GPU), or else a local cluster of one single-threaded worker process per shard, started once for the whole
campaign. A worker keeps the model it loaded (``StageContext.load_policy`` caches it per process), so the model
is loaded once per worker, not once per task.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from solrl.config import ConfigError, RunConfig


@contextmanager
def shard_task_runner(cfg: RunConfig) -> Iterator[Any | None]:
    """The task runner of ``cfg``'s shard tasks for the duration of a campaign: None for in-order shards in this
    process (``local``, or a single shard), else a ``prefect_dask.DaskTaskRunner``.

    Raises:
        ConfigError: ``dask`` without ``prefect-dask`` installed (``pip install 'solrl[distributed]'``).
    """
    if cfg.campaign.task_runner == "local" or min(cfg.campaign.shards, cfg.campaign.prompts_per_iteration) < 2:
        yield None
        return
    try:
        from prefect_dask import DaskTaskRunner
    except ImportError:
        raise ConfigError("campaign.task_runner=dask needs prefect-dask: pip install 'solrl[distributed]'") from None
    if cfg.campaign.dask_address:
        yield DaskTaskRunner(address=cfg.campaign.dask_address)
        return
    from dask.distributed import LocalCluster

    workers = min(cfg.campaign.shards, cfg.campaign.prompts_per_iteration)
    threads = max(1, (os.cpu_count() or 1) // workers)  # torch in each worker: its share of the cores
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    with LocalCluster(
        n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None, env=env
    ) as cluster:
        yield DaskTaskRunner(address=cluster.scheduler_address)
