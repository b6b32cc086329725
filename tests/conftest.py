"""Test environment: offline, a private Prefect home, tiny run configs."""

from __future__ import annotations

import os
import tempfile

import solrl  # noqa: E402, F401  (before torch: solrl sets the OpenMP spin policy, solrl/__init__.py)

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="solrl-prefect-"))
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["DO_NOT_TRACK"] = "1"
# Two cores busy compiling (Inductor) can hold the temporary Prefect server past its 20 s default start.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
# Quiet Prefect: its temporary server logs "Stopping" at exit, after pytest closed the streams.
os.environ["PREFECT_LOGGING_LEVEL"] = "WARNING"
os.environ.pop("MLFLOW_TRACKING_URI", None)
os.environ.pop("PREFECT_API_URL", None)
# The tiny twins build their random models on first use here, not in the user's ~/.cache/solrl.
os.environ["SOLRL_CACHE"] = tempfile.mkdtemp(prefix="solrl-cache-")
#: Under pytest-xdist (`make test` runs two workers) each worker and the processes it starts get one thread, so
#: the workers never compete for the machine's two cores.
XDIST = bool(os.environ.get("PYTEST_XDIST_WORKER"))
if XDIST:
    os.environ["OMP_NUM_THREADS"] = "1"

from collections.abc import Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

import fault_injection  # noqa: E402, F401  (its commit hook, in this process and the forkserver's children)
import pytest  # noqa: E402
import torch  # noqa: E402

from solrl.config import RunConfig, list_presets, load_config  # noqa: E402

torch.set_num_threads(1 if XDIST else min(2, torch.get_num_threads()))


def pytest_configure(config: pytest.Config) -> None:
    """One Prefect API server for each process that runs tests (an xdist worker, or pytest without xdist), and
    ``PREFECT_API_URL`` set to it before Prefect is imported, so each ``solrl run`` of the tests talks to it. It
    serves the database every temporary server of the process would open (``$PREFECT_HOME/prefect.db``). With a
    temporary server per command, those servers took 226 of the suite's 2,300 CPU-seconds, and a fresh clone's
    tests 1016 s against 916 s with this (2 cores). The tests of the temporary server itself run their commands
    in ``temporary_server_env()``."""
    if config.option.collectonly or config.option.help:
        return
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        from solrl.flows.server import TemporaryServer

        os.environ["PREFECT_API_URL"] = TemporaryServer().start().wait()  # stopped at exit, or with this process


#: Test files, heaviest first, by their time on this project's 2 cores (``pytest --durations``, 2026-12-07, with an
#: empty Inductor cache as CI has: the S3 and Ray tests 248 s, the server stack 229 s, torchrun and Ray Train 199 s,
#: the compiled copies 150 s, ...). ``make test`` runs ``--dist loadfile --no-loadscope-reorder``: each xdist worker
#: takes the next file of the collection when it is almost done, so with the long files first the two workers end
#: within a short file of each other. xdist's default order (most tests first) put the long few-test files last,
#: where one worker ran them while the other had nothing left. A file not named here runs after these, in
#: collection order; a stale order costs time, never a result.
HEAVIEST_FIRST = (
    "test_object_store.py",
    "test_stack.py",
    "test_distributed.py",
    "test_compile.py",
    "test_families.py",
    "test_flow.py",
    "test_serve.py",
    "test_guards.py",
    "test_shutdown.py",
    "test_shards.py",
    "test_faults.py",
    "test_remote_reward.py",
    "test_torchao.py",
    "test_hardware.py",
    "test_published_size.py",
    "test_pool_store.py",
    "test_memory.py",
    "test_stages.py",
    "test_rewards.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files of ``HEAVIEST_FIRST`` first, in its order; each file's tests keep their order."""
    rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def temporary_server_env(**extra: str) -> dict[str, str]:
    """This process's environment without ``PREFECT_API_URL``: a ``solrl`` command given it starts its own
    temporary Prefect server, as a user's does."""
    return {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | extra


@pytest.fixture
def own_prefect_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """An in-process ``solrl`` command of the test starts its own temporary Prefect server, as a user's does
    (``PREFECT_API_URL`` unset for the test): for the tests that check it started none."""
    monkeypatch.delenv("PREFECT_API_URL", raising=False)


#: Overrides that make a tiny-digits run take seconds: 2 prompts x pool 8, keep 4, 2 iterations,
#: a full-pool fidelity audit at iteration 2, and no HTML report (about 2 s of a 12 s campaign, written by 60 of the
#: suite's campaigns that never read it). A test of the report, or of what links or uploads it, adds ``REPORT``.
TINY = [
    "explore.pool_size=8",
    "select.k=4",
    "campaign.prompts_per_iteration=2",
    "campaign.eval_seeds=2",
    "campaign.iterations=2",
    "train.optimizer_steps=2",
    "tracking.grid_prompts=2",
    "fidelity.audit_every=2",
    NO_REPORT := "tracking.report=false",
]
REPORT = "tracking.report=true"
#: The tiny run's overrides as a Prefect UI form's ``overrides`` list (iterations come as their own parameter), with
#: the report on and no retries (``tests/test_serve.py``, ``tests/test_stack.py``).
UI_OVERRIDES = [o for o in TINY if not o.startswith(("campaign.iterations", "tracking.report"))]
UI_OVERRIDES += ["campaign.stage_retries=0", REPORT]


#: What the forkserver of the tests' child processes imports once, so each child forks with it loaded: the
#: pipeline, and diffusers' SANA transformer, its scheduler and peft, which a child's first ``load_policy``
#: would otherwise import again (about 6 of its 7 s).
CHILD_PRELOAD = [
    "solrl.stages.pipeline",
    "conftest",
    "diffusers.models.transformers.sana_transformer",
    "diffusers.schedulers.scheduling_flow_match_euler_discrete",
    "peft",
]


#: Every shipped tiny twin's preset (``model.source: tiny``): a new family's is picked up by the family, export,
#: memory and published-size tests without an edit there.
TINY_TWINS = [name for name in list_presets() if load_config(name, plugins=False).model.source == "tiny"]


def tiny_config(root: Path, *extra: str) -> RunConfig:
    return load_config("tiny-digits", [*TINY, f"storage.root={root}", *extra])


@pytest.fixture(scope="session")
def tiny_campaign(tmp_path_factory: pytest.TempPathFactory):
    """One finished 2-iteration tiny-digits campaign (run ``flow``, alone in its store) through the Prefect flow,
    shared by the tests that only read it (its MLflow record, its selections)."""
    from solrl.flows.sol_rl import campaign
    from solrl.storage.runs import create_run

    store = tmp_path_factory.mktemp("tiny-campaign") / "store"
    run = create_run(tiny_config(store, REPORT), "flow")  # test_flow reads its report
    campaign(str(store), run.run_id)
    return run


@pytest.fixture
def tiny_cfg(tmp_path: Path) -> RunConfig:
    return tiny_config(tmp_path / "runs")


def trained_policy(cfg: RunConfig, rank: int, alpha: float, scale: float = 0.1):
    """A Policy of ``cfg``'s model whose ``policy`` adapter is as if trained: LoRA B drawn away from its zero init."""
    from solrl.stages.models import load_model
    from solrl.stages.models.policy import Policy

    policy = Policy(load_model(cfg.model, torch.device("cpu")), rank, alpha, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for key, p in policy.adapter_params("policy").items():
            if "lora_B" in key:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return policy


def flip_middle_byte(path: Path) -> None:
    """Corrupt a committed file in place: same size, one byte changed (only its checksum can tell)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def gemm_batch_variant() -> bool:
    """Whether this CPU's float32 GEMM (torch's linear) gives a row another rounding when the batch around it
    changes. Seen on a 2-core Xeon at 2.60 GHz (2026-12-01): rows of ``linear(x[:m], w)`` differ from
    ``linear(x, w)[:m]`` for some m, so no sample can be bit-identical across batch sizes or shard layouts there,
    whatever solrl does; the emulated explore backends are batch-invariant only on a batch-invariant GEMM."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(256, 64, generator=g), torch.randn(160, 64, generator=g)
    full = torch.nn.functional.linear(x, w)
    return any(not torch.equal(torch.nn.functional.linear(x[:m], w), full[:m]) for m in (1, 2, 3, 5, 8, 16, 64, 100))


#: Skip the bit-exact layout-invariance tests where the machine's GEMM itself is batch-variant (see above).
needs_batch_invariant_gemm = pytest.mark.skipif(
    gemm_batch_variant(), reason="this CPU's GEMM is not batch-invariant (conftest.gemm_batch_variant)"
)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc, log: Path | None = None, timeout: float = 180) -> None:
    """Poll ``url`` until it answers 200, while ``proc`` (a ``subprocess.Popen``) runs; on its exit or after
    ``timeout`` seconds, fail with the tail of ``log``."""
    import time

    import httpx

    def tail() -> str:
        return log.read_text(errors="replace")[-3000:] if log else ""

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{proc.args[:3]} exited {proc.returncode}:\n{tail()}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{url} never answered:\n{tail()}")


@contextmanager
def moto_server(env: dict[str, str] | None = None) -> Iterator[str]:
    """moto's S3 server (``moto[server]``) in its own process on a free loopback port, with ``env`` added to its
    environment (``INITIAL_NO_AUTH_ACTION_COUNT=n``: IAM checks every request after the first n). Yields its
    endpoint URL; stopped at the end."""
    import os
    import subprocess
    import sys
    import time
    import urllib.request

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
                break
            except OSError:
                if server.poll() is not None:
                    raise RuntimeError(f"moto server exited with {server.returncode}") from None
                time.sleep(0.1)
        else:
            raise RuntimeError("moto server did not answer within 30 s")
        yield endpoint
    finally:
        server.terminate()
        server.wait(10)


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 server on loopback for the session: moto's server in its own process, as an S3-compatible store
    a team would run. Yields its endpoint URL; stopped at the end."""
    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture
def s3_env(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The environment of a user of the loopback S3 server (made-up keys, ``AWS_ENDPOINT_URL``), with a fresh
    bucket; returns ``s3://<bucket>``."""
    import uuid

    import boto3

    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIASOLRLTESTKEY0000")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "solrl-test-secret-0000000000000000000000")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    bucket = f"solrl-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=bucket)
    return f"s3://{bucket}"


def _postgres_bin(program: str) -> str:
    """Debian's ``postgresql`` server program ``program`` (initdb, pg_ctl): on PATH, else the newest
    ``/usr/lib/postgresql/<major>/bin``."""
    import shutil

    if found := shutil.which(program):
        return found
    versions = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{program}"), key=lambda p: int(p.parts[-3]))
    if not versions:
        raise RuntimeError(f"PostgreSQL's {program} is not installed (Debian: apt-get install postgresql)")
    return str(versions[-1])


@contextmanager
def postgres_server(databases: tuple[str, ...], max_connections: int = 20) -> Iterator[dict[str, str]]:
    """A throwaway PostgreSQL cluster on loopback: ``initdb`` and ``pg_ctl`` of Debian's ``postgresql``, as the
    ``postgres`` user when the tests run as root (the server refuses root), password authentication
    (scram-sha-256) for role ``solrl`` with a random password, ``max_connections`` as given, and ``databases``
    created. Yields ``{"host", "port", "user", "password", "log"}``; the cluster is stopped and removed at the end."""
    import os
    import secrets
    import shutil
    import subprocess
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="solrl-pg-"))
    root.chmod(0o755)
    data, log, pwfile = root / "data", root / "server.log", root / "pw"
    password = secrets.token_hex(16)
    pwfile.write_text(password)
    as_postgres: list[str] = []
    if os.geteuid() == 0:  # initdb and postgres refuse to run as root
        as_postgres = ["runuser", "-u", "postgres", "--"]
        shutil.chown(root, "postgres")
        shutil.chown(pwfile, "postgres")
    port = free_port()
    run = {"check": True, "capture_output": True, "text": True, "timeout": 120}
    initdb = [_postgres_bin("initdb"), "-D", str(data), "-U", "solrl", "--pwfile", str(pwfile)]
    subprocess.run([*as_postgres, *initdb, "--auth=scram-sha-256", "-E", "UTF8", "--no-sync"], **run)
    pwfile.unlink()
    options = f"-c listen_addresses=127.0.0.1 -c port={port} -c max_connections={max_connections}"
    options += f" -c unix_socket_directories={root} -c fsync=off"
    pg_ctl = [*as_postgres, _postgres_bin("pg_ctl"), "-D", str(data)]
    subprocess.run([*pg_ctl, "-l", str(log), "-o", options, "-w", "-t", "60", "start"], **run)
    server = {"host": "127.0.0.1", "port": str(port), "user": "solrl", "password": password, "log": str(log)}
    try:
        env = {**os.environ, "PGPASSWORD": password}
        for name in databases:
            createdb = [_postgres_bin("createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "solrl", name]
            subprocess.run(createdb, env=env, **run)
        yield server
    finally:
        subprocess.run([*pg_ctl, "-m", "fast", "-w", "stop"], capture_output=True, timeout=60)
        shutil.rmtree(root, ignore_errors=True)
