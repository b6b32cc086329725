"""Rewards served over HTTP: a server for any registered reward, and the client the scoring stages use.

The peers keep GenEval and VLM judges in their own processes because their dependencies conflict with the
trainer's. ``solrl reward-server NAME`` serves reward ``NAME`` (``create_app``: FastAPI, ``POST /score``,
``GET /health``); a reward whose ``reward.models.<name>.url`` is set is scored through that server by
``RemoteReward``: the same batches, each request retried with exponential back-off, a clear error when the
server stays down or times out, and never a made-up score for a failed request.

Wire format (JSON): ``{"prompts": [...], "metadata": [...] | null, "shape": [B, H, W, 3], "images": base64 of
the raw uint8 bytes}`` -> ``{"scores": [B floats]}``; errors are HTTP 4xx/5xx with ``{"detail": "..."}``.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from pydantic import BaseModel

from solrl.stages.rewards.base import Metadata, Reward, RewardError, RewardOptions

#: Seconds before the first retry; doubled after each failed attempt.
BACKOFF_SECONDS = 0.5


class ScoreRequest(BaseModel):
    """The body of ``POST /score``."""

    prompts: list[str]
    metadata: list[dict[str, Any]] | None = None
    shape: list[int]
    images: str  # base64 of the uint8 [B, H, W, 3] bytes


def encode_images(images: np.ndarray) -> dict[str, Any]:
    return {"shape": list(images.shape), "images": base64.b64encode(np.ascontiguousarray(images).tobytes()).decode()}


def decode_images(shape: Sequence[int], data: str) -> np.ndarray:
    """uint8 ``[B, H, W, 3]`` from the wire. Raises ValueError on a size or shape mismatch."""
    raw = base64.b64decode(data, validate=True)
    if len(shape) != 4 or shape[-1] != 3 or int(np.prod(shape)) != len(raw):
        raise ValueError(f"images: {len(raw)} bytes do not make uint8 [B, H, W, 3] of shape {list(shape)}")
    return np.frombuffer(raw, dtype=np.uint8).reshape(shape)


def create_app(reward: Reward):  # -> fastapi.FastAPI
    """A FastAPI app serving ``reward``: ``POST /score`` and ``GET /health``."""
    from fastapi import FastAPI, HTTPException

    app = FastAPI(title=f"solrl reward server: {reward.name}")

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"reward": reward.name, "options": reward.options.model_dump(mode="json")}

    @app.post("/score")
    def score(request: ScoreRequest) -> dict[str, list[float]]:
        try:
            images = decode_images(request.shape, request.images)
            values = reward(images, request.prompts, request.metadata)
        except ValueError as exc:
            raise HTTPException(status_code=422, detail=str(exc)) from exc
        return {"scores": [float(v) for v in values]}

    return app


class RemoteReward(Reward):
    """Client of a reward server: scores batches of ``options.batch_size`` images by ``POST {url}/score``.

    Each request is tried ``options.retries + 1`` times with back-off (0.5 s, 1 s, 2 s, ...) on connection
    errors, timeouts and 5xx answers; a 4xx answer (bad input) is not retried.

    Raises (call):
        RewardError: the server could not score a batch; the message names the reward, URL and cause.
    """

    def __init__(self, name: str, options: RewardOptions) -> None:
        import httpx

        super().__init__(options, "cpu")
        self.name = name  # type: ignore[misc]  # the served reward's name, not a class constant here
        self.url = str(options.url).rstrip("/")
        self.client = httpx.Client(timeout=options.timeout)

    def _post(self, payload: dict[str, Any]) -> list[float]:
        import httpx

        attempts = self.options.retries + 1
        for attempt in range(attempts):
            try:
                response = self.client.post(f"{self.url}/score", json=payload)
            except httpx.HTTPError as exc:
                cause = f"{exc.__class__.__name__}: {exc}"
            else:
                if response.status_code < 400:
                    return response.json()["scores"]
                cause = f"HTTP {response.status_code}: {response.text[:300]}"
                if response.status_code < 500:
                    break
            if attempt < attempts - 1:
                time.sleep(BACKOFF_SECONDS * 2**attempt)
        raise RewardError(
            f"reward {self.name}: the reward server at {self.url} could not score a batch after "
            f"{attempt + 1} attempt(s) ({cause}); start it with `solrl reward-server {self.name}` or "
            f"fix reward.models.{self.name}.url, then resume"
        )

    def _score(self, images: np.ndarray, prompts: Sequence[str], metadata: Metadata) -> np.ndarray:
        scores = self._post(
            {
                "prompts": list(prompts),
                "metadata": None if metadata is None else list(metadata),
                **encode_images(images),
            }
        )
        if len(scores) != len(prompts):
            raise RewardError(
                f"reward {self.name}: the server at {self.url} returned {len(scores)} scores for {len(prompts)} images"
            )
        return np.asarray(scores, np.float32)

    def check_server(self) -> None:
        """Raises RewardError unless ``GET {url}/health`` answers for this reward."""
        import httpx

        try:
            served = self.client.get(f"{self.url}/health").json().get("reward")
        except (httpx.HTTPError, ValueError) as exc:
            raise RewardError(
                f"reward {self.name}: no reward server answers at {self.url} ({exc.__class__.__name__}); "
                f"start it with `solrl reward-server {self.name}`"
            ) from None
        if served != self.name:
            raise RewardError(f"reward {self.name}: the server at {self.url} serves {served!r}, not {self.name!r}")
