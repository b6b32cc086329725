"""The run store's backend on a local folder and on a real S3 server on loopback (moto's), and the lease lock."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from solrl.storage.lease import Lease, LeaseHeld, LeaseLost, hold
from solrl.storage.store import Store, StoreError


@pytest.fixture(params=["local", "s3"])
def store_uri(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URI of an empty store root on each backend."""
    if request.param == "local":
        return str(tmp_path / "runs")
    return request.getfixturevalue("s3_env") + "/runs"


def test_open_spells_the_root_without_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = Store.open(tmp_path / "a" / ".." / "runs")
    assert local.local and local.root == str(tmp_path / "runs") and local.uri == (tmp_path / "runs").as_uri()
    assert Store.open(f"file://{tmp_path}/runs").root == local.root
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    s3 = Store.open("s3://bucket/team/runs/")
    assert (
        not s3.local and s3.root == "bucket/team/runs" and s3.url("r1/run.json") == "s3://bucket/team/runs/r1/run.json"
    )
    assert s3.describe() == "s3://bucket/team/runs (endpoint http://127.0.0.1:9)"
    with pytest.raises(StoreError, match="carries credentials") as err:
        Store.open("s3://AKIAXXXX:very-secret@bucket/runs")
    assert "very-secret" not in str(err.value) and "AKIAXXXX" not in str(err.value)
    with pytest.raises(StoreError, match="names no bucket"):
        Store.open("s3:///runs")


def test_reads_writes_and_conditional_writes(store_uri: str) -> None:
    store = Store.open(store_uri)
    assert not store.exists("r/a.json") and store.tag("r/a.json") is None and store.ls("r") == []
    first = store.create("r/a.json", b"one")
    assert first and store.read_bytes("r/a.json") == b"one"
    assert store.create("r/a.json", b"two") is None  # create-only: the first write stands
    assert store.read_bytes("r/a.json") == b"one" and store.tag("r/a.json") == first
    second = store.replace_if("r/a.json", b"two", first)
    assert second and second != first and store.read_bytes("r/a.json") == b"two"
    assert store.replace_if("r/a.json", b"three", first) is None  # a stale tag loses
    assert store.read_bytes("r/a.json") == b"two"
    assert store.replace_if("r/none.json", b"x", first) is None
    store.write_bytes("r/b/c.bin", b"\x00" * 10)
    assert store.ls("r") == ["a.json", "b"] and store.ls("r/b") == ["c.bin"]
    store.delete("r/b")
    assert store.ls("r") == ["a.json"] and not store.exists("r/b/c.bin")
    with pytest.raises(FileNotFoundError):
        store.read_bytes("r/b/c.bin")


def test_a_full_disk_leaves_no_temporary_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A local write that fails part-way (ENOSPC at the fsync) removes its temporary file: a lease renewed on a
    full disk left one ``._LEASE.json.tmp-*`` per try."""
    import errno

    store = Store.open(str(tmp_path))
    tag = store.create("r/_LEASE.json", b"one")

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    for write in (
        lambda: store.write_bytes("r/a.json", b"x"),
        lambda: store.create("r/b.json", b"x"),
        lambda: store.replace_if("r/_LEASE.json", b"two", tag),
    ):
        with pytest.raises(OSError, match="No space"):
            write()
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["_LEASE.json"]
    assert store.read_bytes("r/_LEASE.json") == b"one"


def test_another_clients_write_is_seen_at_once(store_uri: str) -> None:
    """Listings are never cached: a file written by another client after this one listed is found (s3fs #657)."""
    reader, writer = Store.open(store_uri), Store.open(store_uri)
    writer.write_bytes("r/first", b"1")
    assert reader.ls("r") == ["first"] and reader.exists("r/first")
    writer.write_bytes("r/second", b"2")
    assert reader.ls("r") == ["first", "second"] and reader.exists("r/second")
    assert reader.read_bytes("r/second") == b"2"


def test_put_folder_uploads_every_file(store_uri: str, tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    (staging / "pool.zarr" / "c").mkdir(parents=True)
    (staging / "pool.zarr" / "zarr.json").write_text("{}")
    (staging / "pool.zarr" / "c" / "0").write_bytes(b"\x01\x02")
    (staging / "scores.parquet").write_bytes(b"PAR1")
    store = Store.open(store_uri)
    store.put_folder(staging, "r/iter/explore/attempt-1")
    assert store.ls("r/iter/explore/attempt-1") == ["pool.zarr", "scores.parquet"]
    assert store.read_bytes("r/iter/explore/attempt-1/pool.zarr/c/0") == b"\x01\x02"


def test_racing_creates_have_one_winner(store_uri: str) -> None:
    """Twelve writers, each with its own client, create one name at once: one gets a tag, eleven get None, and
    the object is the winner's. (On AWS S3 the server decides this race; on moto's server the check and the
    write are one request under its lock, see the note of issue 17.)"""
    payloads = [f"writer {i}".encode() for i in range(12)]
    stores = [Store.open(store_uri) for _ in payloads]
    results: list[str | None] = [None] * len(payloads)
    start = threading.Barrier(len(payloads))

    def write(i: int) -> None:
        start.wait()
        results[i] = stores[i].create("race/_MANIFEST.json", payloads[i])

    threads = [threading.Thread(target=write, args=(i,)) for i in range(len(payloads))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, tag in enumerate(results) if tag]
    assert len(winners) == 1, f"{len(winners)} writers won the create-only write"
    assert stores[0].read_bytes("race/_MANIFEST.json") == payloads[winners[0]]


def test_lease_is_exclusive_renewed_and_released(store_uri: str) -> None:
    store = Store.open(store_uri)
    with hold(store, "r/_LEASE.json", ttl=30) as lease:
        record = json.loads(store.read_bytes("r/_LEASE.json"))
        assert record["holder"]["pid"] == os.getpid() and record["expires"] > time.time() + 20
        with pytest.raises(LeaseHeld, match=f"pid {os.getpid()}"):
            Lease(store, "r/_LEASE.json").acquire()
        before = record["expires"]
        time.sleep(0.01)
        lease.renew()
        assert json.loads(store.read_bytes("r/_LEASE.json"))["expires"] > before
    assert json.loads(store.read_bytes("r/_LEASE.json"))["expires"] == 0.0  # released
    with hold(store, "r/_LEASE.json", ttl=30):  # and free again, for this process too
        pass


def test_an_expired_lease_is_taken_over_and_its_stalled_holder_stops(
    store_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import solrl.storage.lease

    store = Store.open(store_uri)
    stalled = Lease(store, "r/_LEASE.json", ttl=30)
    stalled.acquire()
    stalled._stop.set()  # the holder stalls: no more renewals
    stalled._thread.join()
    with pytest.raises(LeaseHeld):
        Lease(store, "r/_LEASE.json", ttl=30).acquire()
    # Its term runs out: the lease's clock moved past it, not a sleep through it (a 3 s term slept through
    # was outlasted by the requests to moto's server on busy cores: the lease expired before it was checked).
    monkeypatch.setattr(solrl.storage.lease, "time", SimpleNamespace(time=lambda: time.time() + 31))
    successor = Lease(store, "r/_LEASE.json", ttl=30)
    successor.acquire()
    try:
        with pytest.raises(LeaseLost, match="was taken by"):
            stalled.renew()
        with pytest.raises(LeaseLost):
            stalled.check()  # what a commit asks before it writes its manifest
        stalled.release()  # releases nothing: the lease is the successor's
        assert json.loads(store.read_bytes("r/_LEASE.json"))["holder"]["token"] == successor.token
    finally:
        successor.release()


def test_a_killed_holders_lease_on_this_host_is_free_at_once(store_uri: str) -> None:
    """A holder SIGKILLed on this host is seen dead (pid and start time), so a resume need not wait out its
    term; the object store's environment reaches the child through the inherited variables."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys, time
                from solrl.storage.lease import Lease
                from solrl.storage.store import Store
                Lease(Store.open({store_uri!r}), "r/_LEASE.json", ttl=3600).acquire()
                print("held", flush=True)
                time.sleep(600)
                """
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(LeaseHeld, match=f"pid {child.pid}"):
            Lease(Store.open(store_uri), "r/_LEASE.json").acquire()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    with hold(Store.open(store_uri), "r/_LEASE.json") as lease:
        assert json.loads(Store.open(store_uri).read_bytes("r/_LEASE.json"))["holder"]["token"] == lease.token


def test_bad_object_store_input_is_one_line_before_any_write(s3_env: str, monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = s3_env.removeprefix("s3://")
    Store.open(f"{s3_env}/runs").check(write=True)  # the good store passes, and keeps no probe
    assert Store.open(s3_env).ls() == []
    with pytest.raises(StoreError, match=r"bucket 'solrl-missing-bucket' of s3://solrl-missing-bucket/runs does not"):
        Store.open("s3://solrl-missing-bucket/runs").check(write=True)
    with monkeypatch.context() as env:
        env.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
        started = time.perf_counter()
        with pytest.raises(StoreError, match=r"cannot reach the object store for s3://.* at http://127.0.0.1:9; check"):
            Store.open(f"{s3_env}/runs").check(write=True)
        assert time.perf_counter() - started < 10  # one try, a short connect timeout
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(StoreError, match=f"no credentials for s3://{bucket}/runs: set AWS_ACCESS_KEY_ID"):
        Store.open(f"{s3_env}/runs").check(write=True)
