"""What the run store costs at a published preset's pool shape and resolution (issue 36).

Runs the real explore, score_explore, select, regenerate and score_regenerate stages (``run_stage``, and
``run_shard`` shard by shard with ``--shards 2``), then reads what the update reads of the regenerated samples
(their latents, trajectories and log-probs, hashed as they are read), of one iteration whose candidate pool has
the published preset's shape: its pool size, kept seeds, resolution and latent shape (from the family's own meta
adapter). Only the model and the reward are stand-ins, and their cost is reported apart from the store's:

- the family ``store-standin`` is tiny-digits' adapter with the preset's latent shape; its velocity is
  ``-x / 10`` (no network call) and its decode spreads each latent over the preset's resolution and adds
  per-pixel noise drawn from the sample's seed, so the pixels do not compress (real images compress a little;
  a worst case for the store);
- the reward ``standin_mean`` is an image's mean intensity.

Each configuration runs in a process of its own (peak RSS is per process). Per stage it reports bytes written
(``wchar`` of ``/proc/self/io``: every byte this process wrote, temporary folders and shards included), bytes
read (``rchar``: every byte read, from the page cache or not; on S3 plus the bytes downloaded), bytes hashed
(sha256 over stored files, whether read back to hash or hashed as a reader reads them), seconds (the stand-ins'
seconds apart), the peak RSS above the process's RSS before
the stage, and what the stage leaves in the store. ``--prompts`` prompts run (4 by default); the published
iteration (48 prompts) is that times 48 / prompts, every cost here being linear in the prompts.

    .venv/bin/python bench/store_scale.py      # sana-1600m and flux1-dev, local and S3, 1 and 2 shards
    .venv/bin/python bench/store_scale.py sana-1600m --stores local --shards 1 --prompts 2
    .venv/bin/python bench/store_scale.py --prune --prompts 2   # and the pool pruned as storage.pool says
    .venv/bin/python bench/store_scale.py --resume 100          # resume / ls / inspect / verify on 100 iterations
"""

from __future__ import annotations

import solrl  # noqa: F401  (first: solrl sets the OpenMP spin policy before torch loads)

# isort: split

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from solrl.config import RunConfig, load_config
from solrl.registry import MODELS, register_model, register_reward
from solrl.stages.models.tiny_digits import TinyDigits
from solrl.stages.rewards.base import Reward

ROOT = Path(__file__).resolve().parents[1]
STAGES = ["explore", "score_explore", "select", "regenerate", "score_regenerate"]
#: The stand-ins' own seconds in this process (decode and reward), kept apart from the store's.
STANDIN_SECONDS = [0.0]


@register_model("store-standin")
class StoreStandIn(TinyDigits):
    """tiny-digits' adapter with a published preset's latent shape (``SOLRL_STANDIN`` = ``C,h,w,resolution``):
    velocity ``-x / 10``, decode to ``resolution`` pixels plus seed-drawn noise (module doc)."""

    name: ClassVar[str] = "store-standin"

    @classmethod
    def load(cls, cfg, device, *, text_encoders=True):  # type: ignore[no-untyped-def]
        adapter = super().load(cfg, device, text_encoders=text_encoders)
        *latent, resolution = (int(v) for v in os.environ["SOLRL_STANDIN"].split(","))
        adapter.latent_shape = tuple(latent)
        adapter.resolution = resolution  # type: ignore[attr-defined]
        return adapter

    @classmethod
    def validate_config(cls, cfg: RunConfig) -> None:
        pass

    def velocity(self, net, x, sigma, cond):  # type: ignore[no-untyped-def]
        return -0.1 * x

    def decode(self, latents: torch.Tensor) -> np.ndarray:
        start = time.perf_counter()
        resolution = self.resolution  # type: ignore[attr-defined]
        B, _, h, w = latents.shape
        base = ((torch.tanh(latents[:, :3].float()) + 1) * 100).to(torch.uint8).permute(0, 2, 3, 1).numpy()
        images = np.empty((B, resolution, resolution, 3), np.uint8)
        for i in range(B):
            block = np.repeat(np.repeat(base[i], resolution // h, axis=0), resolution // w, axis=1)
            rng = np.random.default_rng(int(latents[i].flatten()[:4].abs().sum() * 1e6))
            images[i] = block + rng.integers(0, 56, size=block.shape, dtype=np.uint8)
        STANDIN_SECONDS[0] += time.perf_counter() - start
        return images


@register_reward("standin_mean")
class StandInMean(Reward):
    """An image's mean intensity in [0, 1] (no model)."""

    name = "standin_mean"
    parameters = 0

    def _score(self, images, prompts, metadata):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        values = images.reshape(len(images), -1).mean(axis=1, dtype=np.float64) / 255.0
        STANDIN_SECONDS[0] += time.perf_counter() - start
        return values.astype(np.float32)


class Meter:
    """``/proc/self/io`` deltas, bytes hashed, and peak RSS (sampled every 5 ms) over a block of work."""

    def __init__(self) -> None:
        from solrl.storage import stage as stage_module

        self.hashed = 0
        original = stage_module.file_sha256

        def counted(path: Path) -> str:
            self.hashed += Path(path).stat().st_size
            return original(path)

        stage_module.file_sha256 = counted
        from solrl.storage.artifacts import CheckingStore

        read = CheckingStore.get

        async def hashed_as_read(store: CheckingStore, key: str, prototype: Any = None, byte_range: Any = None) -> Any:
            value = await read(store, key, prototype, byte_range)
            if value is not None and byte_range is None and key in store.sha256:
                self.hashed += len(value)
            return value

        CheckingStore.get = hashed_as_read  # what a reader hashes as Zarr reads it (images excepted)
        self.peak = 0
        self._stop = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.rss())

    @staticmethod
    def io() -> dict[str, int]:
        with open("/proc/self/io") as f:
            return {k: int(v) for k, v in (line.split(": ") for line in f)}

    def measure(self, work: Any, received: Any = lambda: 0) -> dict[str, float]:
        io, hashed, standin, got = self.io(), self.hashed, STANDIN_SECONDS[0], received()
        base = self.peak = self.rss()
        start = time.perf_counter()
        work()
        seconds = time.perf_counter() - start
        after = self.io()
        standin = STANDIN_SECONDS[0] - standin
        return {
            "written": after["wchar"] - io["wchar"],
            "read": after["rchar"] - io["rchar"] + received() - got,
            "hashed": self.hashed - hashed,
            "seconds": seconds - standin,
            "standin_seconds": standin,
            "peak_rss": max(self.peak, self.rss()) - base,
        }


def _load_store_bench() -> Any:
    spec = importlib.util.spec_from_file_location("bench_store", Path(__file__).with_name("store.py"))
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def standin_config(preset: str, root: str, prompts: int, shards: int, extra: list[str]) -> tuple[RunConfig, str]:
    """The run config (tiny-digits with the preset's pool, kept seeds and batch sizes) and ``SOLRL_STANDIN``."""
    published = load_config(preset)
    meta = MODELS.get(published.model.family).meta_adapter(published.model, torch.bfloat16, blocks=1)[0]
    latent = meta.latent_shape
    resolution = published.model.resolution or getattr(meta, "resolution", 0)
    cfg = load_config(
        "tiny-digits",
        [
            "model.family=store-standin",
            f"explore.pool_size={published.explore.pool_size}",
            f"explore.batch_size={published.explore.batch_size}",
            "explore.steps=1",
            f"select.k={published.select.k}",
            f"regenerate.batch_size={published.regenerate.batch_size}",
            "regenerate.steps=1",
            f"campaign.prompts_per_iteration={prompts}",
            f"campaign.shards={shards}",
            "campaign.iterations=1",
            "fidelity.audit_every=0",
            "reward.weights={standin_mean: 1.0}",
            "reward.evaluate=[standin_mean]",
            f"storage.root={root}",
            *extra,
        ],
    )
    return cfg, f"{','.join(str(v) for v in latent)},{resolution}"


def store_bytes(run_dir: Path) -> int:
    """What the run leaves in its store: the local folder, or the objects under the run's key."""
    from solrl.storage.mirror import locate

    if (place := locate(run_dir)).mirrored:
        return int(place.store.fs.du(place.store.path(place.key)))
    return sum(p.stat().st_size for p in Path(run_dir).rglob("*") if p.is_file())


def one(args: argparse.Namespace) -> dict[str, Any]:
    """One configuration (``--one``): the measured stages as JSON rows."""
    from solrl.stages.context import StageContext
    from solrl.stages.pipeline import STAGES as TABLE
    from solrl.stages.pipeline import run_shard, run_stage, stage_shards
    from solrl.storage.runs import create_run

    torch.set_num_threads(min(2, torch.get_num_threads()))
    received = lambda: 0  # noqa: E731
    server = None
    if args.store == "s3":
        import boto3

        bench_store = _load_store_bench()
        server, endpoint = bench_store.start_s3()
        os.environ.update(
            AWS_ACCESS_KEY_ID="bench",
            AWS_SECRET_ACCESS_KEY="bench-secret",
            AWS_DEFAULT_REGION="us-east-1",
            AWS_ENDPOINT_URL=endpoint,
            SOLRL_CACHE=tempfile.mkdtemp(prefix="solrl-bench-scale-cache-", dir=args.tmp),
        )
        boto3.client("s3").create_bucket(Bucket="bench")
        counter = bench_store.Counter()
        counter.install()
        received = lambda: counter.received  # noqa: E731
        root = "s3://bench/runs"
    else:
        root = tempfile.mkdtemp(prefix="solrl-bench-scale-", dir=args.tmp)
    try:
        cfg, standin = standin_config(args.preset, root, args.prompts, args.shards, args.set)
        os.environ["SOLRL_STANDIN"] = standin
        meter = Meter()
        run = create_run(cfg, "scale")
        ctx = StageContext.of(run, 1)
        ctx.load_policy(None)  # the model and the prompt embeddings: not the store's
        rows = []
        grown = store_bytes(run.run_dir)
        for name in STAGES:
            shards = stage_shards(ctx, TABLE[name])
            if len(shards) > 1:
                for shard in shards:
                    row = meter.measure(lambda shard=shard, name=name: run_shard(ctx, name, shard), received)
                    rows.append({"stage": f"{name} {shard.name}", **row, "grown": None})
            row = meter.measure(lambda name=name: run_stage(ctx, name), received)
            size = store_bytes(run.run_dir)
            rows.append({"stage": name if len(shards) == 1 else f"{name} reduce", **row, "grown": size - grown})
            grown = size

        def update_reads() -> None:  # what the update stage reads of the regenerated samples, hashed as read
            from solrl.storage.artifacts import Samples

            samples = Samples.load(run.run_dir, 1)
            for array in (samples.latents, samples.trajectory, samples.log_probs, samples.seeds):
                if array is not None:
                    np.asarray(array)

        rows.append({"stage": "update's reads", **meter.measure(update_reads, received), "grown": 0})
        if args.prune:  # what the campaign does once the iteration's checkpoint is committed (storage.pool)
            from solrl.storage.artifacts import CandidatePool

            why = {"images": f"storage.pool={cfg.storage.pool}"}
            row = meter.measure(lambda: CandidatePool.prune_arrays(run.run_dir, 1, why), received)
            size = store_bytes(run.run_dir)
            rows.append({"stage": f"pool pruned ({cfg.storage.pool})", **row, "grown": size - grown})
            grown = size
        return {"rows": rows, "total_store": grown, "standin": standin}
    finally:
        if server is not None:
            server.terminate()


RESUME_RUN = [
    "campaign.prompts_per_iteration=1",
    "explore.pool_size=4",
    "select.k=2",
    "explore.steps=1",
    "regenerate.steps=2",
    "train.optimizer_steps=1",
    "campaign.eval_every=1000",
    "campaign.eval_seeds=1",
    "fidelity.audit_every=0",
    "tracking.report_every=0",
    "tracking.grid_prompts=1",
]


def _committed_run(iterations: int, tmp: str | None) -> tuple[Any, Path, float]:
    """A tiny-digits run of ``iterations`` committed iterations whose campaign has one more, built through the
    Prefect flow (as ``solrl run`` builds it): (run, store, seconds to build)."""
    from solrl.flows.sol_rl import campaign
    from solrl.storage.runs import create_run
    from solrl.storage.stage import commit_hooks

    store = Path(tempfile.mkdtemp(prefix="solrl-bench-resume-", dir=tmp)) / "store"
    cfg = load_config("tiny-digits", [*RESUME_RUN, f"campaign.iterations={iterations + 1}", f"storage.root={store}"])
    run = create_run(cfg, "resumed")

    def stop(iteration: int, stage: str, point: str) -> None:  # where the next iteration begins
        if (iteration, stage, point) == (iterations + 1, "explore", "write"):
            raise _Stop

    commit_hooks.append(stop)
    start = time.perf_counter()
    try:
        campaign(str(store), run.run_id)
    except _Stop:
        pass
    finally:
        commit_hooks.remove(stop)
    return run, store, time.perf_counter() - start


class _Stop(Exception):
    """Raised by ``_committed_run``'s commit hook: the run has its committed iterations."""


def resume_bench(iterations: int, tmp: str | None) -> str:
    """Runs of 3 and ``iterations`` committed iterations (``_committed_run``): the seconds of ``first_pending``
    (what a resume reads before its next stage), of ``solrl resume`` until that next stage writes (its process
    killed there; the 3-iteration run's is the fixed cost: start-up, Prefect, the model), ``solrl ls``, ``solrl
    inspect`` and ``solrl verify`` (which hashes every committed file, as ``first_pending`` did before issue
    36)."""
    from solrl.stages.context import StageContext
    from solrl.stages.pipeline import first_pending

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from fault_injection import fault_env  # the tests' commit hook: `solrl resume` killed where it first writes

    cli = [sys.executable, "-m", "solrl.cli"]
    rows: dict[str, dict[int, float]] = {}
    sizes = {}
    for count in (3, iterations):
        run, store, built = _committed_run(count, tmp)
        sizes[count] = (sum(p.stat().st_size for p in store.rglob("*") if p.is_file()), built)
        start = time.perf_counter()
        pending = first_pending(StageContext.of(run, 0))
        rows.setdefault("first_pending (in process)", {})[count] = time.perf_counter() - start
        assert pending == (count + 1, "explore"), pending
        env = {**os.environ, "OMP_NUM_THREADS": "2", **fault_env(f"{count + 1}:explore:write")}
        for name, command, environment in (
            ("solrl resume, until its next stage writes", [*cli, "resume", "resumed", "--store", str(store)], env),
            ("solrl ls", [*cli, "ls", "--store", str(store)], None),
            ("solrl inspect (last iteration)", [*cli, "inspect", "resumed", "--store", str(store)], None),
            (
                "solrl verify (every file hashed, as first_pending did before)",
                [*cli, "verify", "resumed", "--store", str(store)],
                None,
            ),
        ):
            start = time.perf_counter()
            subprocess.run(command, capture_output=True, env=environment)
            rows.setdefault(name, {})[count] = time.perf_counter() - start
    lines = [
        f"### Runs of 3 and {iterations} committed iterations (tiny-digits; "
        + ", ".join(
            f"{n}: {size / 2**20:.0f} MiB in the store, built in {built:.0f} s" for n, (size, built) in sizes.items()
        )
        + ")",
        "",
        f"| what | 3 iterations, s | {iterations} iterations, s | difference, s |",
        "| --- | --- | --- | --- |",
        *(f"| {name} | {v[3]:.2f} | {v[iterations]:.2f} | {v[iterations] - v[3]:+.2f} |" for name, v in rows.items()),
    ]
    return "\n".join(lines)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def table(preset: str, prompts: int, results: dict[tuple[str, int], dict[str, Any]]) -> str:
    scale = 48 / prompts
    lines = [
        f"### {preset}: one iteration at the published pool shape ({prompts} prompts measured, x{scale:g} "
        f"for the published 48; GiB and seconds per published iteration)",
        "",
        "| store | shards | stage | written | read | hashed | store s | stand-in s | peak RSS above start (MiB, "
        "measured) | store grows |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (store, shards), result in results.items():
        totals = dict.fromkeys(("written", "read", "hashed", "seconds", "standin_seconds"), 0.0)
        for row in result["rows"]:
            for key in totals:
                totals[key] += row[key]
            grown = "" if row["grown"] is None else gib(row["grown"] * scale)
            lines.append(
                f"| {store} | {shards} | {row['stage']} | {gib(row['written'] * scale)} | {gib(row['read'] * scale)} | "
                f"{gib(row['hashed'] * scale)} | {row['seconds'] * scale:.1f} | {row['standin_seconds'] * scale:.1f} | "
                f"{row['peak_rss'] / 2**20:.0f} | {grown} |"
            )
        lines.append(
            f"| {store} | {shards} | **iteration** | **{gib(totals['written'] * scale)}** | "
            f"**{gib(totals['read'] * scale)}** | **{gib(totals['hashed'] * scale)}** | "
            f"**{totals['seconds'] * scale:.1f}** | {totals['standin_seconds'] * scale:.1f} | | "
            f"**{gib(result['total_store'] * scale)}** |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("presets", nargs="*", default=["sana-1600m", "flux1-dev"])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--stores", nargs="+", default=["local", "s3"], choices=["local", "s3"])
    parser.add_argument("--shards", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--set", nargs="*", default=[], help="config overrides for every run (e.g. storage.pool=full)")
    parser.add_argument("--tmp", default=None, help="where the runs are written (default: the system's temp)")
    parser.add_argument("--prune", action="store_true", help="also prune the pool as storage.pool says, once")
    parser.add_argument("--resume", type=int, metavar="N", help="time resume, ls, inspect, verify on N iterations")
    parser.add_argument("--one", nargs=3, metavar=("PRESET", "STORE", "SHARDS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.resume:
        print(resume_bench(args.resume, args.tmp))
        return
    if args.one:
        args.preset, args.store, args.shards = args.one[0], args.one[1], int(args.one[2])
        print(json.dumps(one(args)))
        return
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d')}; S3: moto's server on loopback\n"
    )
    for preset in args.presets:
        results = {}
        for store in args.stores:
            for shards in args.shards:
                command = [
                    sys.executable,
                    __file__,
                    "--one",
                    preset,
                    store,
                    str(shards),
                    "--prompts",
                    str(args.prompts),
                ]
                if args.set:
                    command += ["--set", *args.set]
                if args.prune:
                    command.append("--prune")
                if args.tmp:
                    command += ["--tmp", args.tmp]
                done = subprocess.run(
                    command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"}
                )
                if done.returncode:
                    sys.exit(f"{preset} {store} {shards}: failed\n{done.stderr[-4000:]}")
                results[(store, shards)] = json.loads(done.stdout.strip().splitlines()[-1])
        print(table(preset, args.prompts, results), "\n", flush=True)


if __name__ == "__main__":
    main()
