"""MLflow tracking: one MLflow run per solrl run, resumed with it.

By default the tracking store is a sqlite file in the run store
(``<storage.root>/mlflow.db``; MLflow 3 refuses its old file store) and
artifacts go to ``<storage.root>/mlartifacts``. A ``tracking.mlflow_uri`` in
the config, or ``MLFLOW_TRACKING_URI`` in the environment, is honoured.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from solrl import __version__
from solrl.config import RunConfig
from solrl.storage.runs import Run
from solrl.storage.stage import replaced_atomically, write_json_atomic

TRACKING_FILE = "tracking.json"

#: MLflow 3's mark of a model-training experiment (the other kind is GenAI: traces, "Evaluation runs"). The
#: 3.17 UI picks its view from a toggle it keeps in the browser, not from this tag: ``experiment_url`` opens
#: the model-training view.
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}

#: The query that opens the MLflow UI (3.x) in its model-training view whatever view it last showed.
UI_VIEW = "workflowType=machine_learning"


def experiment_url(server: str, experiment_id: str) -> str:
    """The MLflow UI page of an experiment's runs, in the model-training view; ``server`` e.g.
    ``http://127.0.0.1:5000``."""
    return f"{server.rstrip('/')}/#/experiments/{experiment_id}/runs?{UI_VIEW}"


def tracking_uri(cfg: RunConfig, store: Path) -> str:
    """The MLflow tracking URI: the config's, then ``MLFLOW_TRACKING_URI``, then a sqlite file in ``store`` (the
    folder the run actually lives in, so a moved store or a resume from elsewhere keeps one MLflow history)."""
    if cfg.tracking.mlflow_uri:
        return cfg.tracking.mlflow_uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{Path(store).resolve() / 'mlflow.db'}"


@contextmanager
def _store_lock(root: Path) -> Iterator[None]:
    """Exclusive flock on ``<store>/.mlflow.lock`` (blocking; released by the OS if the process dies)."""
    fd = os.open(root / ".mlflow.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _create_sqlite_store(uri: str) -> None:
    """Create a new sqlite tracking database atomically: the empty schema is copied (or, without a usable
    ``schema_template``, built by MLflow) into a temporary file, which is renamed into place once complete, so a
    process killed while the tables are created leaves no half-migrated database that every later run would trip
    over. An existing database (or another backend) is left alone. The caller holds the store lock."""
    if not uri.startswith("sqlite:///"):
        return
    path = Path(uri.removeprefix("sqlite:///"))
    if path.exists():
        return
    template = schema_template()
    if template is not None and _copied_and_opens(template, path):
        return
    if template is not None:  # damaged in a way its version row did not show: built again next time
        template.unlink(missing_ok=True)
    _build_schema(path)


# Each temporary file MLflow opens below has a name of its own (``replaced_atomically``'s): MLflow keeps each
# database URI's engine, and its open connection, for the life of the process, so a name used twice would reach the
# first file through it.


def _build_schema(path: Path) -> None:
    """MLflow's tables built in a new sqlite file that then replaces ``path``: every Alembic migration of this
    MLflow version, about 1 to 2 s (50-odd migrations)."""
    import mlflow

    with replaced_atomically(path) as tmp:
        mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp}").search_experiments()  # creates and migrates the schema


def _copied_and_opens(template: Path, path: Path) -> bool:
    """Copy ``template`` to ``path`` (through a temporary file) once MLflow opens the copy (its schema at this
    version's head); False, with ``path`` left as it was, when either fails."""
    import shutil

    import mlflow

    try:
        with replaced_atomically(path) as tmp:
            shutil.copyfile(template, tmp)
            mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp}").search_experiments()
        return True
    except Exception:  # noqa: BLE001 - a damaged template of the cache: the caller builds the schema instead
        return False


def schema_template() -> Path | None:
    """An empty sqlite tracking database of the installed MLflow version, built once per machine in the solrl
    cache (``$SOLRL_CACHE/mlflow/schema-<version>.db``): a new run store's ``mlflow.db`` is a copy of it, which
    took milliseconds where building the schema took 1 to 2 s (measured on the tests' 2 cores: 35 new stores,
    62 s). A template that does not open is built again.

    Returns:
        the template's path, or None where the cache folder cannot hold it (the caller builds the schema in the
        store).
    """
    import mlflow

    from solrl.storage.mirror import cache_root

    template = cache_root() / "mlflow" / f"schema-{mlflow.__version__}.db"
    if template.is_file() and _opens(template):
        return template
    try:
        template.parent.mkdir(parents=True, exist_ok=True)
        _build_schema(template)
    except Exception:  # noqa: BLE001 - a cache folder that cannot hold it (OSError, or SQLite's own error)
        return None
    return template


def _opens(database: Path) -> bool:
    """Whether ``database`` is a sqlite file whose ``alembic_version`` names a revision (read-only: the
    template itself is never opened by MLflow, which would write to it)."""
    import sqlite3

    try:
        with contextlib.closing(sqlite3.connect(f"{database.as_uri()}?mode=ro", uri=True)) as connection:
            return bool(connection.execute("SELECT version_num FROM alembic_version").fetchone())
    except sqlite3.Error:
        return False


def _git_commit() -> str | None:
    """The commit of the solrl checkout this code runs from, when it is one (provenance); else None."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def _log_params(client: Any, mlflow_run_id: str, params: Mapping[str, Any]) -> None:
    """Log ``params`` (values cut to MLflow's 6,000 characters) with one ``log_batch``, which MLflow sends 100 a
    request: one request per parameter cost a campaign about 20 s at its start against a tracking server with
    basic auth, which checks the password of every request."""
    from mlflow.entities import Param
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    client.log_batch(mlflow_run_id, params=[Param(k, str(v)[:MAX_PARAM_VAL_LENGTH]) for k, v in params.items()])


class Tracker:
    """Logs a run's params, per-iteration metrics and artifacts to MLflow.

    The MLflow run id is kept in ``<run_dir>/tracking.json`` so ``solrl resume`` continues the same MLflow run.
    """

    def __init__(self, run: Run) -> None:
        import mlflow

        cfg, run_dir, run_id = run.config, run.run_dir, run.run_id
        self.run_dir = run_dir
        self._mlflow = mlflow
        root = run_dir.parent.resolve()
        self.uri = tracking_uri(cfg, root)
        # One process at a time creates the sqlite schema and the experiment (two runs starting together in
        # a new store otherwise race on MLflow's table creation and migrations).
        with _store_lock(root):
            _create_sqlite_store(self.uri)
            # A client bound to this URI, never mlflow.set_tracking_uri: that sets MLFLOW_TRACKING_URI for the
            # whole process, and every later run in it (another store) would then log into this store's database.
            client = mlflow.MlflowClient(tracking_uri=self.uri)
            experiment = client.get_experiment_by_name(cfg.tracking.experiment)
            if experiment is None:
                artifacts = (root / "mlartifacts").as_uri() if self.uri.startswith("sqlite:") else None
                experiment_id = client.create_experiment(
                    cfg.tracking.experiment, artifact_location=artifacts, tags=EXPERIMENT_TAGS
                )
            else:
                experiment_id = experiment.experiment_id
                for key, value in EXPERIMENT_TAGS.items():  # an experiment made before solrl set them
                    if experiment.tags.get(key) != value:
                        client.set_experiment_tag(experiment_id, key, value)
        state_file = run_dir / TRACKING_FILE
        try:
            stored = json.loads(state_file.read_text()) if state_file.exists() else {}
        except (OSError, ValueError) as exc:  # written atomically: only damage from outside gets here
            stored = {}
            logging.getLogger(__name__).warning(
                "%s is unreadable (%s); this run logs to a new MLflow run (its earlier metrics are logged again)",
                state_file,
                exc.__class__.__name__,
            )
        stored = stored if isinstance(stored, dict) else {}  # valid JSON of another shape: as unreadable
        if stored.get("mlflow_run_id") and stored.get("tracking_uri") == self.uri:
            self.mlflow_run_id = stored["mlflow_run_id"]
            # A resumed run is running again (it was KILLED, FAILED, or left RUNNING by a SIGKILL).
            client.update_run(self.mlflow_run_id, status="RUNNING")
        else:
            created = client.create_run(
                experiment_id,
                run_name=run_id,
                tags={
                    "solrl.run_id": run_id,
                    "solrl.run_dir": str(run_dir),
                    "solrl.version": __version__,
                    **({"mlflow.source.git.commit": commit} if (commit := _git_commit()) else {}),
                },
            )
            self.mlflow_run_id = created.info.run_id
            write_json_atomic(
                state_file,
                {"mlflow_run_id": self.mlflow_run_id, "tracking_uri": self.uri, "experiment_id": experiment_id},
            )
            params = _flatten(cfg.model_dump(mode="json", exclude={"base_dir"})) | {"config_hash": run.config_hash}
            _log_params(client, self.mlflow_run_id, params)
        self.client = client
        self.experiment_id = experiment_id
        self._steps: dict[str, set[int]] = {}  # metric key -> steps logged (filled lazily by has_metric)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Log scalar metrics at ``step`` (the iteration)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(key=k, value=float(v), timestamp=now, step=step) for k, v in metrics.items()]
        for i in range(0, len(batch), 900):
            self.client.log_batch(self.mlflow_run_id, metrics=batch[i : i + 900])
        for key in metrics:
            if key in self._steps:
                self._steps[key].add(step)

    def has_metric(self, key: str, step: int) -> bool:
        """Whether metric ``key`` was logged at ``step`` (a stage's ``seconds/<stage>``, logged last, marks its
        metrics as logged). Each key's history is read from MLflow once, then kept up to date by
        ``log_metrics``, so a resume that skips every stage of a long run does not re-read it per stage."""
        if key not in self._steps:
            self._steps[key] = {m.step for m in self.client.get_metric_history(self.mlflow_run_id, key)}
        return step in self._steps[key]

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        """Log a file, or every file of a folder, under ``artifact_path``."""
        if path.is_dir():
            self.client.log_artifacts(self.mlflow_run_id, str(path), artifact_path)
        else:
            self.client.log_artifact(self.mlflow_run_id, str(path), artifact_path)

    def log_image(self, path: Path, key: str, step: int) -> None:
        """Log a PNG under MLflow's image view (``key``, one image per ``step``, with a step slider)."""
        from PIL import Image

        with Image.open(path) as image:
            self.client.log_image(self.mlflow_run_id, image.convert("RGB"), key=key, step=step)

    def set_tag(self, key: str, value: str) -> None:
        """Set a tag of the MLflow run (MLflow keeps at most 8000 characters of a tag value)."""
        self.client.set_tag(self.mlflow_run_id, key, value[:8000])

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.mlflow_run_id, status=status)
