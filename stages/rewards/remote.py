"""Rewards served over HTTP: a server for any registered reward, and the client the scoring stages use.

The peers keep GenEval and VLM judges in their own processes because their dependencies conflict with the
trainer's. ``solrl reward-server NAME`` serves reward ``NAME`` (``create_app``: FastAPI, ``POST /score``,
``GET /health``); a reward whose ``reward.models.<name>.url`` is set is scored through that server by
``RemoteReward``: the same batches, each request retried with exponential back-off, a clear error when the
server stays down or times out, and never a made-up score for a failed request.

Who may score: with ``SOLRL_REWARD_TOKEN`` set in the server's environment, every request must carry it as a
bearer token (``Authorization: Bearer <token>``) or is refused with HTTP 401; the client sends the token of its
own environment. The token only ever comes from the environment, never from a config or the command line.

What is served is the reward's own: its ``inputs`` (image batches, videos ``[B, F, H, W, 3]``, or one prompt's
whole group per request) and its extra ``columns`` (e.g. a judge's rationale), which ``GET /health`` declares and
the client takes over, so a remote reward stores the same rewards table as a local one.

Wire format (JSON): ``{"prompts": [...], "metadata": [...] | null, "shape": [B, H, W, 3] or [B, F, H, W, 3],
"images": base64 of the raw uint8 bytes, "group_size": int | null}`` -> ``{"scores": [B floats], "columns":
{name: [B values]}}``; errors are HTTP 4xx/5xx with ``{"detail": "..."}``.
"""

from __future__ import annotations

import base64
import os
import secrets
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from pydantic import BaseModel

from solrl.stages.rewards.base import Metadata, Reward, RewardError, RewardOptions, Scores

#: Seconds before the first retry; doubled after each failed attempt.
BACKOFF_SECONDS = 0.5
#: The bearer token a reward server requires and its clients send (from the environment only).
TOKEN_ENV = "SOLRL_REWARD_TOKEN"


def reward_token() -> str | None:
    """The bearer token of this environment (``SOLRL_REWARD_TOKEN``), or None when unset or empty."""
    return os.environ.get(TOKEN_ENV) or None


class ScoreRequest(BaseModel):
    """The body of ``POST /score``."""

    prompts: list[str]
    metadata: list[dict[str, Any]] | None = None
    shape: list[int]
    images: str  # base64 of the uint8 [B, H, W, 3] (or [B, F, H, W, 3]) bytes
    group_size: int | None = None  # a group reward: consecutive samples per group (null: all one group)


def encode_images(images: np.ndarray) -> dict[str, Any]:
    return {"shape": list(images.shape), "images": base64.b64encode(np.ascontiguousarray(images).tobytes()).decode()}


def decode_images(shape: Sequence[int], data: str) -> np.ndarray:
    """uint8 images ``[B, H, W, 3]`` or videos ``[B, F, H, W, 3]`` from the wire (the reward checks which it takes).

    Raises:
        ValueError: the bytes do not make that shape, or the shape is neither.
    """
    raw = base64.b64decode(data, validate=True)
    if len(shape) not in (4, 5) or shape[-1] != 3 or int(np.prod(shape)) != len(raw):
        raise ValueError(
            f"images: {len(raw)} bytes do not make uint8 [B, H, W, 3] or [B, F, H, W, 3] of shape {list(shape)}"
        )
    return np.frombuffer(raw, dtype=np.uint8).reshape(shape)


def create_app(reward: Reward, token: str | None = None):  # -> fastapi.FastAPI
    """A FastAPI app serving ``reward``: ``POST /score`` and ``GET /health``; with ``token``, a request without
    ``Authorization: Bearer <token>`` is refused with HTTP 401 (compared in constant time)."""
    from fastapi import Depends, FastAPI, HTTPException
    from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

    bearer = HTTPBearer(auto_error=False)

    def authorised(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if token is None:
            return
        given = credentials.credentials if credentials is not None else ""
        if not secrets.compare_digest(given.encode(), token.encode()):
            raise HTTPException(
                status_code=401,
                detail=f"this reward server needs the bearer token of {TOKEN_ENV}",
                headers={"WWW-Authenticate": "Bearer"},
            )

    app = FastAPI(title=f"solrl reward server: {reward.name}", dependencies=[Depends(authorised)])

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {
            "reward": reward.name,
            "options": reward.options.model_dump(mode="json"),
            "inputs": reward.inputs,
            "columns": list(reward.columns),
        }

    @app.post("/score")
    def score(request: ScoreRequest) -> dict[str, Any]:
        try:
            images = decode_images(request.shape, request.images)
            scored = reward.score(images, request.prompts, request.metadata, group_size=request.group_size)
        except ValueError as exc:
            raise HTTPException(status_code=422, detail=str(exc)) from exc
        columns = {
            name: [v.item() if isinstance(v, np.generic) else v for v in vs] for name, vs in scored.columns.items()
        }
        return {"scores": [float(v) for v in scored.values], "columns": columns}

    return app


class RemoteReward(Reward):
    """Client of a reward server: scores batches of ``options.batch_size`` images (or videos, or one group per
    request, as the served reward's ``inputs`` say) by ``POST {url}/score``, with the served reward's columns.

    Each request is tried ``options.retries + 1`` times with back-off (0.5 s, 1 s, 2 s, ...) on connection
    errors, timeouts and 5xx answers; a 4xx answer (bad input) is not retried.

    Raises (call):
        RewardError: the server could not score a batch; the message names the reward, URL and cause.
    """

    def __init__(self, name: str, options: RewardOptions, key: str | None = None) -> None:
        """``name``: the registered reward the server serves; ``key``: this reward's name under ``reward.models``
        (an instance's own name; default ``name``), for the messages."""
        import httpx

        from solrl.registry import REWARDS

        super().__init__(options, "cpu")
        self.name = name  # type: ignore[misc]  # the served reward's name, not a class constant here
        served = REWARDS.get(name)
        self.inputs, self.columns = served.inputs, served.columns  # type: ignore[misc]  # the served reward's
        self.key = key or name
        self.url = str(options.url).rstrip("/")
        token = reward_token()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = httpx.Client(timeout=options.timeout, headers=headers)

    def _post(self, payload: dict[str, Any]) -> dict[str, Any]:
        import httpx

        attempts = self.options.retries + 1
        for attempt in range(attempts):
            try:
                response = self.client.post(f"{self.url}/score", json=payload)
            except httpx.HTTPError as exc:
                cause = f"{exc.__class__.__name__}: {exc}"
            else:
                if response.status_code < 400:
                    try:
                        return response.json()
                    except ValueError:  # an answer that is not JSON: a proxy's page, another service
                        raise RewardError(
                            f"reward {self.name}: the server at {self.url} answered HTTP {response.status_code} "
                            f"that is not JSON ({response.text[:200]!r}); is reward.models.{self.key}.url a "
                            "`solrl reward-server`?"
                        ) from None
                cause = f"HTTP {response.status_code}: {response.text[:300]}"
                if response.status_code == 401:
                    cause += f"; set {TOKEN_ENV} to the server's token"
                if response.status_code < 500:
                    break
            if attempt < attempts - 1:
                time.sleep(BACKOFF_SECONDS * 2**attempt)
        raise RewardError(
            f"reward {self.name}: the reward server at {self.url} could not score a batch after "
            f"{attempt + 1} attempt(s) ({cause}); start it with `solrl reward-server {self.name}` or "
            f"fix reward.models.{self.key}.url, then resume"
        )

    def _score(self, images: np.ndarray, prompts: Sequence[str], metadata: Metadata) -> Scores:
        answer = self._post(
            {
                "prompts": list(prompts),
                "metadata": None if metadata is None else list(metadata),
                "group_size": len(prompts) if self.inputs == "group" else None,
                **encode_images(images),
            }
        )
        scores = answer.get("scores") if isinstance(answer, dict) else None
        columns = (answer.get("columns") or {}) if isinstance(answer, dict) else None
        if (
            not isinstance(scores, list)
            or not isinstance(columns, dict)
            or not all(isinstance(values, list) for values in columns.values())
        ):
            raise RewardError(
                f"reward {self.name}: the server at {self.url} answered {str(answer)[:200]!r}, not "
                '{"scores": [...], "columns": {name: [...]}}'
            )
        lengths = {len(scores), *(len(values) for values in columns.values())}
        if lengths != {len(prompts)}:
            raise RewardError(
                f"reward {self.name}: the server at {self.url} returned {len(scores)} scores and columns of "
                f"{sorted(lengths)} values for {len(prompts)} samples"
            )
        try:
            values = np.asarray(scores, np.float32)
        except (TypeError, ValueError) as exc:
            raise RewardError(
                f"reward {self.name}: the server at {self.url} returned scores that are not numbers ({exc})"
            ) from None
        return Scores(values, columns)

    def check_server(self) -> None:
        """Raises RewardError unless ``GET {url}/health`` answers for this reward."""
        import httpx

        try:
            answer = self.client.get(f"{self.url}/health")
            served = None if answer.status_code == 401 else answer.json().get("reward")
        except (httpx.HTTPError, ValueError) as exc:
            raise RewardError(
                f"reward {self.name}: no reward server answers at {self.url} ({exc.__class__.__name__}); "
                f"start it with `solrl reward-server {self.name}`"
            ) from None
        if answer.status_code == 401:
            raise RewardError(
                f"reward {self.name}: the reward server at {self.url} refused this client (HTTP 401); set "
                f"{TOKEN_ENV} to the server's token"
            )
        if served != self.name:
            raise RewardError(f"reward {self.name}: the server at {self.url} serves {served!r}, not {self.name!r}")
