"""The Ray cluster a campaign's shard tasks and its Ray Train update run on (issue 17).

One address for both, so one cluster spans the nodes: ``campaign.task_runner_address`` when
``campaign.task_runner=ray``, else Ray's own ``RAY_ADDRESS``, else a local instance started for the work at hand.
An address that does not answer is refused where work starts (``check_ray_address``, from
``solrl.stages.runnable.check_runnable``), in one line naming the field, before anything is written.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

from solrl.config import ConfigError, RunConfig

#: Object store of a local Ray instance: shard tasks return a flag and the update its few output files.
RAY_OBJECT_STORE_BYTES = 128 * 2**20
#: Seconds a TCP connection to a Ray or Dask address may take before the address counts as not answering.
CONNECT_TIMEOUT_S = 3.0


def ray_address(cfg: RunConfig) -> tuple[str | None, str]:
    """The address ``cfg``'s Ray work joins and the setting it comes from: (``campaign.task_runner_address``,
    "campaign.task_runner_address") with ``campaign.task_runner=ray``, else (``$RAY_ADDRESS``, "RAY_ADDRESS"),
    else (None, "") for a local instance."""
    if cfg.campaign.task_runner == "ray" and cfg.campaign.task_runner_address:
        return cfg.campaign.task_runner_address, "campaign.task_runner_address"
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
    return None, ""


def uses_ray(cfg: RunConfig) -> bool:
    """Whether ``cfg`` runs anything on Ray: sharded stages (``campaign.task_runner=ray``) or the update
    (``train.launcher=ray``)."""
    return cfg.campaign.task_runner == "ray" or cfg.train.launcher == "ray"


def check_ray_address(cfg: RunConfig) -> None:
    """Refuse, before any work, a Ray address of ``cfg`` (``ray_address``) that does not answer: a TCP connection
    to its host and port (the GCS of ``host:port``, the Ray Client server of ``ray://host:port``) within
    ``CONNECT_TIMEOUT_S``. ``auto`` and ``local`` are left to ``ray.init``.

    Raises:
        ConfigError: one line naming the address, the setting it came from and what to do.
    """
    if not uses_ray(cfg):
        return
    address, field = ray_address(cfg)
    if address is None or address in ("auto", "local"):
        return
    parts = urlsplit(address if "://" in address else f"ray://{address}")
    if parts.scheme != "ray":
        raise ConfigError(
            f"{field}={address}: not a Ray address ({parts.scheme}:// is not how a driver joins a cluster; the "
            f"dashboard's http:// address takes Ray jobs, not drivers); give host:port of the head node (its GCS, "
            f"e.g. 10.0.0.5:6379) or ray://host:port (its Ray Client server)"
        )
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None:
        raise ConfigError(
            f"{field}={address}: not a Ray address; give host:port of the head node (its GCS, e.g. "
            f"10.0.0.5:6379) or ray://host:port (its Ray Client server)"
        )
    try:
        socket.create_connection((parts.hostname, port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise ConfigError(unreachable(f"{field}={address}", "Ray cluster", exc)) from None


def unreachable(setting: str, what: str, exc: BaseException) -> str:
    """The one-line message of a cluster that does not answer at ``setting`` (``field=address``)."""
    return (
        f"{setting}: cannot reach the {what} ({exc.__class__.__name__}: {exc}); start it, or unset it for a local one"
    )


def _token_hint() -> str:
    """What to check when a Ray cluster that answers on its port refuses this process: its token. Ray 2.59 and
    later start a head node (``ray start --head``) with token authentication, which a driver uses only where
    ``RAY_AUTH_MODE=token`` is set (Ray's own log says ``InvalidAuthToken`` then, and the connection times out)."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
        return "; if it uses token authentication, check that RAY_AUTH_TOKEN (or ~/.ray/auth_token) is the head's"
    return (
        "; if the address answers and Ray's log says InvalidAuthToken, the cluster uses token authentication (the "
        "default of `ray start --head` since Ray 2.59): set RAY_AUTH_MODE=token, with the head's token in "
        "RAY_AUTH_TOKEN or ~/.ray/auth_token (`ray get-auth-token` on the head prints it)"
    )


@contextmanager
def ray_session(cfg: RunConfig, num_cpus: int) -> Iterator[None]:
    """This process connected to ``cfg``'s Ray cluster for the duration of the context: the connection it has
    (the campaign's shard task runner's), else one to ``ray_address(cfg)``, else a local instance of
    ``num_cpus`` CPUs, shut down at the end (a connection this context did not make stays open).

    Raises:
        ConfigError: the address does not answer.
    """
    import ray

    if cfg.train.launcher == "ray":  # a local instance runs the update's workers too
        num_cpus = max(num_cpus, cfg.train.workers)
    if ray.is_initialized():
        yield
        return
    address, field = ray_address(cfg)
    try:
        if address is not None:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(
                address="local",  # a new instance: never a cluster that another process started on this machine
                num_cpus=num_cpus,
                include_dashboard=False,
                object_store_memory=RAY_OBJECT_STORE_BYTES,
                log_to_driver=False,
            )
    except (ConnectionError, OSError, TimeoutError) as exc:
        raise ConfigError(unreachable(f"{field}={address}", "Ray cluster", exc) + _token_hint()) from None
    try:
        yield
    finally:
        ray.shutdown()
