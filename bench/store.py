"""What a run store on S3 costs against a local folder: one tiny-digits iteration, stage by stage (issue 17).

Runs the same iteration (iteration 0's evaluation, then one training iteration) through the stage functions
twice: on a local folder and on moto's S3 server on loopback (``moto[server]``, started here). For the S3 run it
counts every request s3fs sends (by operation), the bytes uploaded and downloaded, and the seconds per stage;
then a second machine (a fresh cache) reads every committed stage back, twice, as ``inspect`` or a later stage
would: the first pass downloads each file once, the second reads nothing but the manifests. Prints the tables
and the machine.

    .venv/bin/python bench/store.py
"""

from __future__ import annotations

import solrl  # noqa: F401  (first: solrl sets the OpenMP spin policy before torch loads)

# isort: split

import collections
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import TINY  # noqa: E402  (the tests' tiny-digits overrides: 2 prompts x pool 8)

from solrl.config import load_config  # noqa: E402
from solrl.stages.context import StageContext  # noqa: E402
from solrl.stages.pipeline import campaign_plan, run_stage  # noqa: E402
from solrl.storage.runs import create_run  # noqa: E402
from solrl.storage.stage import require  # noqa: E402


class Counter:
    """Every s3fs request: count by operation, bytes sent in bodies, bytes received (ContentLength)."""

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self.sent = 0
        self.received = 0

    def install(self) -> None:
        import s3fs

        original = s3fs.S3FileSystem._call_s3
        counter = self

        async def counted(fs, method, *args, **kwargs):
            counter.calls[method] += 1
            body = kwargs.get("Body")
            counter.sent += len(body) if isinstance(body, bytes | bytearray) else 0
            out = await original(fs, method, *args, **kwargs)
            if method == "get_object" and isinstance(out, dict):
                counter.received += int(out.get("ContentLength", 0))
            return out

        s3fs.S3FileSystem._call_s3 = counted

    def take(self) -> tuple[dict[str, int], int, int]:
        taken = (dict(self.calls), self.sent, self.received)
        self.calls.clear()
        self.sent = self.received = 0
        return taken


def start_s3() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
            return server, endpoint
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("moto server did not start")


def run_iteration(root: str, counter: Counter | None) -> tuple[list[tuple], Path]:
    """Iterations 0 and 1 of a tiny-digits run in ``root``: (iteration, stage, seconds, requests, sent, received)
    per stage, and the run folder."""
    cfg = load_config("tiny-digits", [*TINY, "campaign.iterations=1", "fidelity.audit_every=0", f"storage.root={root}"])
    if counter:
        counter.take()
    run = create_run(cfg, "bench")
    rows = [(0, "create_run", 0.0, *(counter.take() if counter else ({}, 0, 0)))]
    for iteration, stages in campaign_plan(cfg):
        ctx = StageContext(run.config, run.run_dir, run.run_id, iteration, run.config_hash)
        for stage in stages:
            start = time.perf_counter()
            run_stage(ctx, stage)
            rows.append((iteration, stage, time.perf_counter() - start, *(counter.take() if counter else ({}, 0, 0))))
    return rows, run.run_dir


def read_back(run_dir: Path, plan: list[tuple[int, str]], counter: Counter) -> tuple[float, dict[str, int], int, int]:
    counter.take()
    start = time.perf_counter()
    for iteration, stage in plan:
        require(run_dir, iteration, stage)
    return (time.perf_counter() - start, *counter.take())


def fmt_calls(calls: dict[str, int]) -> str:
    return ", ".join(f"{name.removesuffix('_object').replace('_', ' ')} {n}" for name, n in sorted(calls.items()))


def main() -> None:
    import boto3

    torch.set_num_threads(min(2, torch.get_num_threads()))
    server, endpoint = start_s3()
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench-secret",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=endpoint,
        SOLRL_CACHE=tempfile.mkdtemp(prefix="solrl-bench-store-"),
    )
    boto3.client("s3").create_bucket(Bucket="bench")
    counter = Counter()
    counter.install()
    try:
        run_iteration(tempfile.mkdtemp(prefix="solrl-bench-warmup-"), None)  # imports, model load: not timed
        local_rows, _ = run_iteration(tempfile.mkdtemp(prefix="solrl-bench-local-"), None)
        s3_rows, run_dir = run_iteration("s3://bench/runs", counter)
        plan = [(row[0], row[1]) for row in s3_rows[1:]]
        os.environ["SOLRL_CACHE"] = tempfile.mkdtemp(prefix="solrl-bench-node2-")  # a second machine
        from solrl.storage.runs import open_run

        other = open_run("s3://bench/runs", "bench").run_dir
        first = read_back(other, plan, counter)
        second = read_back(other, plan, counter)
        files = sum(len(require(run_dir, i, s)[1].files) for i, s in plan)
    finally:
        server.terminate()
    print(
        f"tiny-digits, iterations 0 and 1 (2 prompts x pool 8 -> keep 4), stage functions, no Prefect or MLflow; "
        f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; S3: moto's server on "
        f"loopback\n"
    )
    print("| iteration | stage | local s | S3 s | S3 / local | requests | KiB up | KiB down |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    total = collections.Counter()
    for (iteration, stage, local_s, *_), (_, _, s3_s, calls, sent, received) in zip(local_rows, s3_rows):
        ratio = f"{s3_s / local_s:.2f}" if local_s > 0 else ""
        print(
            f"| {iteration} | {stage} | {local_s:.2f} | {s3_s:.2f} | {ratio} | {fmt_calls(calls)} | "
            f"{sent / 1024:.1f} | {received / 1024:.1f} |"
        )
        total.update(calls)
    local_total = sum(r[2] for r in local_rows)
    s3_total = sum(r[2] for r in s3_rows)
    sent_total, received_total = sum(r[4] for r in s3_rows), sum(r[5] for r in s3_rows)
    print(
        f"| all | | {local_total:.2f} | {s3_total:.2f} | {s3_total / local_total:.2f} | {sum(total.values())} "
        f"({fmt_calls(total)}) | {sent_total / 1024:.1f} | {received_total / 1024:.1f} |"
    )
    print(f"\nA second machine reads every committed stage ({len(plan)} stages, {files} files), checksums verified:\n")
    print("| pass | seconds | requests | KiB down |")
    print("| --- | --- | --- | --- |")
    for name, (seconds, calls, _, received) in (("first (empty cache)", first), ("second", second)):
        print(f"| {name} | {seconds:.2f} | {sum(calls.values())} ({fmt_calls(calls)}) | {received / 1024:.1f} |")


if __name__ == "__main__":
    main()
