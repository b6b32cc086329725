"""Rewards behind HTTP: a real `solrl reward-server` started here, scores equal to local scoring, failures are
errors (never scores), and a campaign whose reward server dies mid-run fails cleanly and resumes."""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import TINY

from solrl.stages.rewards import RewardError, build_reward

SOLRL = [sys.executable, "-m", "solrl.cli"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(
    name: str, port: int = 0, token: str | None = None, options: str = "{}"
) -> tuple[subprocess.Popen, str]:
    """``solrl reward-server NAME --options OPTIONS`` on loopback (requiring bearer ``token`` when given, from its
    environment); returns the process and its URL once ``/health`` answers (at most 60 s). ``port`` 0: the
    system's choice, read from the server's announcement."""
    env = {k: v for k, v in os.environ.items() if k != "SOLRL_REWARD_TOKEN"} | (
        {"SOLRL_REWARD_TOKEN": token} if token else {}
    )
    proc = subprocess.Popen(
        [*SOLRL, "reward-server", name, "--port", str(port), "--device", "cpu", "--options", options],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
        env=env,
        bufsize=0,  # unbuffered, so that select sees every line not read yet
    )
    assert proc.stderr is not None
    said, deadline = "", time.time() + 60
    while "serving reward" not in said:  # the announcement comes once the reward is built
        if not select.select([proc.stderr], [], [], max(deadline - time.time(), 0))[0]:
            break
        line = proc.stderr.readline().decode()
        if not line:  # the server exited
            break
        said += line
    found = re.search(r" on (http://127\.0\.0\.1:(\d+)) ", said)
    if found is None or proc.poll() is not None:
        stop(proc)
        raise AssertionError(f"the reward server did not announce its address: {said[-2000:]}")
    url = found[1]
    assert port == 0 or int(found[2]) == port, said
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    deadline = time.time() + 60
    while time.time() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        try:
            if httpx.get(f"{url}/health", headers=headers, timeout=1).json()["reward"] == name:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    stop(proc)
    raise AssertionError("the reward server did not come up in 60 s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.fixture(scope="module")
def jpeg_server() -> Iterator[str]:
    """A reward server on the port the system chose (``--port 0``: it announced ``:0`` before)."""
    proc, url = start_server("jpeg_compressibility")
    assert not url.endswith(":0")
    yield url
    stop(proc)


def test_remote_scores_equal_local_scores_batch_by_batch(jpeg_server: str):
    images = np.random.default_rng(0).integers(0, 256, (7, 24, 20, 3), dtype=np.uint8)
    prompts = [f"prompt {i}" for i in range(7)]
    local = build_reward("jpeg_compressibility")(images, prompts)
    remote = build_reward("jpeg_compressibility", options={"url": jpeg_server, "batch_size": 3})
    np.testing.assert_array_equal(remote(images, prompts), local)
    remote.check_server()


def test_bad_input_is_refused_by_the_server_without_retries(jpeg_server: str):
    remote = build_reward("jpeg_compressibility", options={"url": jpeg_server, "retries": 5})
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"after 1 attempt\(s\) \(HTTP 422"):
        remote._post({"prompts": ["a"], "metadata": None, "shape": [1, 2, 2, 3], "images": "AAAA"})
    assert time.monotonic() - start < 5  # a 4xx is the caller's fault: not retried


def test_a_server_that_does_not_answer_is_an_error_never_a_score():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    remote = build_reward("jpeg_compressibility", options={"url": url, "retries": 1, "timeout": 2})
    images = np.zeros((2, 8, 8, 3), np.uint8)
    with pytest.raises(RewardError, match=rf"the reward server at {url} could not score a batch after 2 attempt"):
        remote(images, ["a", "b"])
    with pytest.raises(RewardError, match=f"no reward server answers at {url}"):
        remote.check_server()


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b'{"scores": ["abc", 1.0]}', r"returned scores that are not numbers"),
        (b"<html>a proxy's page</html>", r"answered HTTP 200 that is not JSON .*reward-server"),
        (b'{"score": [1.0, 2.0]}', r"answered .*'score'.*, not \{\"scores\""),
        (b"[1.0, 2.0]", r"answered '\[1.0, 2.0\]', not"),
        (b'{"scores": [1.0, 2.0], "columns": [1, 2]}', r"answered .*'columns': \[1, 2\].*, not"),
    ],
)
def test_an_answer_that_is_not_scores_is_an_error_naming_the_server(body: bytes, match: str):
    """Not a `solrl reward-server` (a proxy's page, another service, a broken one): a RewardError naming the URL,
    never a bare ValueError, KeyError or TypeError from deep in the client."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Garbage(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Garbage)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        remote = build_reward("jpeg_compressibility", options={"url": url, "retries": 0})
        with pytest.raises(RewardError, match=rf"reward jpeg_compressibility: the server at {url} {match}"):
            remote(np.zeros((2, 8, 8, 3), np.uint8), ["a", "b"])
    finally:
        server.shutdown()
        server.server_close()


def test_a_server_with_a_token_refuses_requests_without_it_and_scores_for_a_client_that_has_it(monkeypatch):
    """``SOLRL_REWARD_TOKEN`` in the server's environment: no token, or another one, is HTTP 401 on every
    endpoint; a client whose environment holds the token scores as a local reward does."""
    token = "solrl-reward-token-" + os.urandom(8).hex()
    proc, url = start_server("jpeg_compressibility", token=token)
    try:
        images = np.random.default_rng(1).integers(0, 256, (3, 16, 16, 3), dtype=np.uint8)
        body = {"prompts": ["a", "b", "c"], "metadata": None, "shape": list(images.shape)}
        body["images"] = __import__("base64").b64encode(images.tobytes()).decode()
        for headers in ({}, {"Authorization": "Bearer not-the-token"}, {"Authorization": token}):
            assert httpx.get(f"{url}/health", headers=headers).status_code == 401, headers
            refused = httpx.post(f"{url}/score", json=body, headers=headers)
            assert refused.status_code == 401 and token not in refused.text, headers
        monkeypatch.delenv("SOLRL_REWARD_TOKEN", raising=False)
        without = build_reward("jpeg_compressibility", options={"url": url, "retries": 2})
        with pytest.raises(RewardError, match="HTTP 401.*set SOLRL_REWARD_TOKEN"):
            without(images, body["prompts"])
        with pytest.raises(RewardError, match="refused this client"):
            without.check_server()
        monkeypatch.setenv("SOLRL_REWARD_TOKEN", token)
        remote = build_reward("jpeg_compressibility", options={"url": url})
        remote.check_server()
        np.testing.assert_array_equal(
            remote(images, body["prompts"]), build_reward("jpeg_compressibility")(images, body["prompts"])
        )
    finally:
        stop(proc)


@pytest.mark.slow
def test_a_campaign_whose_reward_server_dies_fails_cleanly_and_resumes_when_it_is_back(tmp_path: Path):
    from solrl.stages.context import StageContext
    from solrl.stages.pipeline import first_pending
    from solrl.storage.runs import open_run
    from solrl.storage.stage import read_manifest

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    store = tmp_path / "store"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    reward = f"reward.models={{digit_alignment: {{url: '{url}', retries: 1}}}}"
    overrides = [*TINY, "campaign.iterations=1", f"storage.root={store}", reward]  # it dies before evaluate[1]
    server, _ = start_server("digit_alignment", port)
    run = subprocess.Popen(
        [*SOLRL, "run", *[a for o in overrides for a in ("--set", o)], "--run-id", "remote"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 300
        while read_manifest(store / "remote", 1, "score_regenerate") is None:
            assert run.poll() is None, run.stderr.read()[-3000:] if run.stderr else "solrl run ended early"
            assert time.time() < deadline, "iteration 1 never scored its regenerations"
            time.sleep(0.1)
        stop(server)  # the server dies mid-campaign
        _, stderr = run.communicate(timeout=300)
    finally:
        stop(server)
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 1, stderr[-3000:]
    assert f"the reward server at {url} could not score a batch" in stderr
    assert "continue with `solrl resume remote" in stderr
    opened = open_run(store, "remote")
    pending = first_pending(StageContext(opened.config, opened.run_dir, "remote", 0, opened.config_hash))
    assert pending is not None and pending[1] in ("evaluate", "score_explore", "audit", "score_regenerate")

    server, _ = start_server("digit_alignment", port)
    try:
        resumed = subprocess.run(
            [*SOLRL, "resume", "remote", "--store", str(store)], env=env, capture_output=True, text=True, timeout=600
        )
    finally:
        stop(server)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert first_pending(StageContext(opened.config, opened.run_dir, "remote", 0, opened.config_hash)) is None
