"""Task runners of the shard tasks (issue 11): existing engines, not a home-made scheduler.

``campaign.task_runner=local`` runs a sharded stage's shards in order in the campaign's process (one model in
memory; threads would share it). ``dask`` and ``ray`` submit them at once through ``prefect-dask`` or
``prefect-ray``: to the cluster at ``campaign.task_runner_address`` (e.g. ``dask-cuda-worker`` processes, one per
GPU, or a Ray cluster), or else to a local cluster of one worker process per shard, started once for the whole
campaign. A worker keeps the model it loaded (``StageContext.load_policy`` caches it per process), so the model
is loaded once per worker, not once per task. On Ray a shard task asks for one GPU when the model runs on CUDA.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from solrl.config import ConfigError, RunConfig
from solrl.stages.cluster import CONNECT_TIMEOUT_S, ray_session, unreachable


def shard_workers(cfg: RunConfig) -> int:
    """Shards of a sharded stage (at most one per prompt): the worker processes a local cluster starts."""
    return min(cfg.campaign.shards, cfg.campaign.prompts_per_iteration)


@contextmanager
def shard_task_runner(cfg: RunConfig) -> Iterator[Any | None]:
    """The task runner of ``cfg``'s shard tasks for the duration of a campaign: None for in-order shards in this
    process (``local``, or a single shard), else a ``prefect_dask.DaskTaskRunner`` or
    ``prefect_ray.RayTaskRunner`` on a cluster that lives as long as the context.

    Raises:
        ConfigError: the engine's Prefect integration is not installed (``pip install 'solrl[distributed]'``), or
            ``campaign.task_runner_address`` cannot be reached.
    """
    kind, address = cfg.campaign.task_runner, cfg.campaign.task_runner_address
    if kind == "local" or shard_workers(cfg) < 2:
        yield None
        return
    try:
        if kind == "dask":
            from prefect_dask import DaskTaskRunner
        else:
            from prefect_ray import RayTaskRunner
    except ImportError:
        raise ConfigError(
            f"campaign.task_runner={kind} needs prefect-{kind}: pip install 'solrl[distributed]'"
        ) from None
    workers = shard_workers(cfg)
    threads = max(1, (os.cpu_count() or 1) // workers)  # torch in each local worker: its share of the cores
    if kind == "dask":
        logging.getLogger("distributed").setLevel(logging.WARNING)  # its INFO lines would drown the campaign's
        if address:
            from dask.distributed import Client

            try:  # fail now, with the field named, rather than in the first sharded stage
                _dask_port_answers(address)  # a refused port at once, not after the client's 10 s of retries
                Client(address, timeout="10s").close()
            except (OSError, TimeoutError) as exc:
                raise ConfigError(
                    unreachable(f"campaign.task_runner_address={address}", "Dask scheduler", exc)
                ) from None
            yield DaskTaskRunner(address=address)
            return
        from dask.distributed import LocalCluster

        env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        with LocalCluster(
            n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None, env=env
        ) as cluster:
            yield DaskTaskRunner(address=cluster.scheduler_address)
        return
    # Ray: one connection for the campaign (the runner of each iteration finds it and does not own it), which a
    # Ray Train update (train.launcher=ray) then shares.
    with ray_session(cfg, workers):
        yield RayTaskRunner()


def _dask_port_answers(address: str) -> None:
    """Open and close one TCP connection to the host and port of a ``tcp://`` or ``tls://`` Dask address within
    ``CONNECT_TIMEOUT_S`` (other transports are left to the client).

    Raises:
        OSError: the connection was refused or timed out.
    """
    import socket

    from distributed.comm import parse_address, parse_host_port

    scheme, location = parse_address(address)
    if scheme not in ("tcp", "tls"):
        return
    try:
        host_port = parse_host_port(location)
    except ValueError:  # no port: the client's own error says so
        return
    socket.create_connection(host_port, timeout=CONNECT_TIMEOUT_S).close()


@contextmanager
def shard_submit_options(cfg: RunConfig) -> Iterator[None]:
    """Around the shard tasks' submission: on Ray, each task asks for one GPU when the model runs on CUDA, else
    one CPU (Ray then gives its worker one OpenMP thread); nothing for the other runners."""
    if cfg.campaign.task_runner != "ray":
        yield
        return
    from prefect_ray.context import remote_options

    with remote_options(**({"num_gpus": 1} if cfg.model.device.startswith("cuda") else {"num_cpus": 1})):
        yield
