"""The reward interface, its options, building (once per process) and checked, weighted scoring."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from solrl.config import ConfigError, reward_option_values, reward_type
from solrl.registry import REWARDS

#: Per-sample metadata a reward may use (e.g. GenEval's object specs); one dict per image.
Metadata = Sequence[dict[str, Any]] | None

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: What a reward scores: one image, one whole video, or the whole group of one prompt's images at once.
Inputs = Literal["image", "video", "group"]


@dataclass
class Scores:
    """What a reward gives for ``B`` images or videos: ``values`` float32 ``[B]`` (higher is better) and its extra
    ``columns`` (name -> ``B`` values, e.g. a judge's rationale), which land beside ``value`` in the stage's
    rewards table."""

    values: np.ndarray
    columns: dict[str, list[Any]] = field(default_factory=dict)

    @staticmethod
    def join(parts: Sequence[Scores]) -> Scores:
        """The parts one after another (each part holding the same columns)."""
        values = np.concatenate([p.values for p in parts]) if parts else np.zeros(0, np.float32)
        names = parts[0].columns if parts else {}
        return Scores(values, {name: [v for p in parts for v in p.columns[name]] for name in names})

    def take(self, index: np.ndarray) -> Scores:
        """The rows ``index`` (int ``[M]``) of the values and of every column."""
        return Scores(self.values[index], {k: [v[i] for i in index] for k, v in self.columns.items()})


def local(path: str) -> str:
    """A weights path from the config with ``~`` expanded."""
    return str(Path(path).expanduser())


class RewardError(ValueError):
    """A reward returned something unusable (NaN, wrong shape): the stage stops, nothing is written."""


class RewardOptions(BaseModel):
    """What every reward takes under ``reward.models.<name>``; a reward with weights adds their paths."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    device: str = Field("auto", description="Device of the reward model: auto = the stage's device, or cpu, cuda:N.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Dtype of the reward model.")
    batch_size: int = Field(32, ge=1, description="Images per forward pass of the reward model.")
    keep_loaded: bool = Field(True, description="Keep the model in memory between stages (false: free it).")
    url: str | None = Field(
        None,
        description="Score through the reward server at this URL (`solrl reward-server NAME`) instead of "
        "loading the reward here; the server holds the reward's other options.",
    )
    timeout: float = Field(120.0, gt=0, description="Remote rewards: seconds a request may take.")
    retries: int = Field(3, ge=0, description="Remote rewards: retries of a failed request, with back-off.")


class Reward:
    """One signature for every reward: images uint8 ``[B, H, W, 3]`` (or videos ``[B, F, H, W, 3]``) + prompts +
    metadata -> float32 ``[B]``, higher is better, scored in batches of ``options.batch_size``.

    A reward registers under its name (``solrl.registry.register_reward``) and declares its options
    (``Options``, validated with the config), the weight files they name (``weight_files``, checked where
    work starts, with ``published`` in the error), the prompts it can score (``check_prompts``), what one call
    of ``_score`` takes (``inputs``) and the extra columns it may return (``columns``). Subclasses implement
    ``_score`` on one batch.
    """

    name: ClassVar[str]
    Options: ClassVar[type[RewardOptions]] = RewardOptions
    #: Where the weights are published (for the missing-weights error).
    published: ClassVar[str] = ""
    #: Modules the reward imports (checked where work starts) and the optional extra that installs them.
    requires: ClassVar[tuple[str, ...]] = ()
    extra: ClassVar[str] = "rewards"
    #: Parameters of the model the reward puts on the device, at its published size (the memory plan counts them
    #: in the reward's dtype; 0 for a reward without a model on the device). None: not declared, which the memory
    #: plan refuses rather than count a judge of billions of parameters as 0 bytes.
    parameters: ClassVar[int | None] = None
    #: What ``_score`` takes: ``image`` (uint8 ``[b, H, W, 3]``; a video family's samples are scored frame by
    #: frame, ``reward.video``), ``video`` (uint8 ``[b, F, H, W, 3]``; an image is a one-frame video) or
    #: ``group`` (all the images, or videos, of one prompt at once, whatever the batch size: a group-wise judge).
    inputs: ClassVar[Inputs] = "image"
    #: Extra columns ``_score`` may return (in ``Scores.columns``), when its options ask for them.
    columns: ClassVar[tuple[str, ...]] = ()

    def __init__(self, options: RewardOptions | None = None, device: torch.device | str = "cpu") -> None:
        self.options = options or self.Options()
        self.device = torch.device(device if self.options.device == "auto" else self.options.device)
        self.dtype = DTYPES[self.options.dtype]

    @classmethod
    def options_for(cls, raw: dict[str, Any]) -> RewardOptions:
        """Validate ``reward.models.<name>``: this reward's ``Options``, or only the common ones when ``url``
        names a reward server (which holds the rest). Raises pydantic's ValidationError."""
        return (RewardOptions if raw.get("url") else cls.Options).model_validate(raw)

    @classmethod
    def check_prompts(cls, prompts: Sequence[str], field: str) -> None:
        """Raises ValueError naming the first prompt this reward cannot score (default: any prompt is fine)."""

    @classmethod
    def weight_files(cls, options: RewardOptions) -> dict[str, str | None]:
        """Option name -> path of every weights file or folder the options name (none by default)."""
        return {}

    @classmethod
    def check_runnable(cls, options: RewardOptions, key: str | None = None) -> None:
        """Raises ConfigError naming a missing module or the first missing weights path (as
        ``reward.models.<key>.<option>``; ``key`` is an instance's own name, default the registered one) and where
        the weights are published; for a remote reward, unless its server answers."""
        key = key or cls.name
        if options.url:
            from solrl.stages.rewards.remote import RemoteReward

            try:
                RemoteReward(cls.name, options, key).check_server()
            except RewardError as exc:
                raise ConfigError(str(exc)) from None
            return
        for module in cls.requires:
            if importlib.util.find_spec(module) is None:
                raise ConfigError(f"reward {cls.name} needs the {module} package: pip install 'solrl[{cls.extra}]'")
        for option, path in cls.weight_files(options).items():
            if path is not None and not Path(path).expanduser().exists():
                where = f"; weights: {cls.published}" if cls.published else ""
                raise ConfigError(f"reward.models.{key}.{option}: {path} does not exist{where}")

    @classmethod
    def benchmark_options(cls, root: Path) -> dict[str, Any]:
        """Options that build this reward at its published architecture with random weights, written under
        ``root`` (nothing downloaded), for ``bench/rewards.py``: speed, not scores. Default: none (a reward without
        weights, or with weights shipped in a package).

        Raises:
            NotImplementedError: the reward cannot be built here without downloads; the message says why.
        """
        return {}

    @classmethod
    def benchmark_inputs(cls, count: int, size: int = 512) -> tuple[np.ndarray, list[str]]:
        """``count`` uint8 images ``[count, size, size, 3]`` and prompts the reward can score, for
        ``bench/rewards.py``. Default: uniform noise (seed 0) and one GenEval-style prompt."""
        images = np.random.default_rng(0).integers(0, 256, (count, size, size, 3), dtype=np.uint8)
        return images, ["a photo of a red apple"] * count

    def _score(
        self, images: np.ndarray, prompts: Sequence[str], metadata: Metadata
    ) -> np.ndarray | torch.Tensor | Scores:
        """Scores of one batch (one group for ``inputs="group"``): uint8 ``[b, H, W, 3]`` (``[b, F, H, W, 3]`` for
        ``inputs="video"``) -> ``[b]``, or ``Scores`` with extra columns."""
        raise NotImplementedError

    def batches(self, count: int, group_size: int | None = None) -> list[slice]:
        """The slices of ``count`` images that ``_score`` is called on: runs of ``options.batch_size``, or for
        ``inputs="group"`` each group of ``group_size`` (the stages lay a pool out group by group; None: all
        ``count`` are one group)."""
        size = (group_size or count) if self.inputs == "group" else self.options.batch_size
        return [slice(start, start + size) for start in range(0, count, max(size, 1))]

    def _values(self, values: Any, count: int) -> np.ndarray:
        """What ``_score`` returned for a batch of ``count`` images as float32 ``[count]``.

        Raises:
            RewardError: not numbers, not one per image, or beyond float32's range (which would read as inf).
        """
        if isinstance(values, torch.Tensor):
            values = values.detach().double().cpu().numpy()
        try:
            found = np.asarray(values, dtype=np.float64).reshape(-1)
        except (TypeError, ValueError) as exc:
            raise RewardError(
                f"reward {self.name!r} returned {str(values)[:80]!r}, not numbers ({exc}); _score returns one float "
                "per image (or Scores)"
            ) from None
        if found.shape != (count,):
            raise RewardError(f"reward {self.name!r} returned {found.size} values for a batch of {count} images")
        huge = found[np.isfinite(found) & (np.abs(found) > np.finfo(np.float32).max)]
        if huge.size:
            raise RewardError(f"reward {self.name!r} returned {huge[0]:g}, beyond float32's range (3.4e38)")
        return found.astype(np.float32)

    def score(
        self, images: np.ndarray, prompts: Sequence[str], metadata: Metadata = None, group_size: int | None = None
    ) -> Scores:
        """Score images uint8 ``[B, H, W, 3]`` (or, for a ``video`` or ``group`` reward, videos
        ``[B, F, H, W, 3]``) with ``len(prompts) == B``, batch by batch (``batches``; a ``group`` reward group by
        group, ``group_size`` consecutive images each): values float32 ``[B]`` and the extra columns the reward
        returned.

        Raises:
            ValueError: images are not uint8 ``[B, H, W, 3]`` (or ``[B, F, H, W, 3]`` where the reward takes
                videos), prompts or metadata do not match them (``check_alignment``), images are not whole groups,
                or the reward returned a column it does not declare in ``columns``.
            RewardError: the reward did not return one number per image (``_values``).
        """
        images = np.asarray(images)
        takes_video = self.inputs != "image"
        if images.dtype != np.uint8 or images.ndim not in ((4, 5) if takes_video else (4,)) or images.shape[-1] != 3:
            shape = "[B, H, W, 3] or videos [B, F, H, W, 3]" if takes_video else "[B, H, W, 3]"
            raise ValueError(f"reward {self.name}: expected uint8 images {shape}, got {images.dtype} {images.shape}")
        if self.inputs == "video" and images.ndim == 4:
            images = images[:, None]  # an image is a one-frame video
        check_alignment(self.name, len(images), prompts, metadata)
        if self.inputs == "group" and group_size and len(images) % group_size:
            raise ValueError(f"reward {self.name}: {len(images)} images are not whole groups of {group_size}")
        parts = []
        with torch.no_grad():
            for batch in self.batches(len(images), group_size):
                scored = self._score(
                    images[batch], list(prompts[batch]), None if metadata is None else list(metadata[batch])
                )
                if not isinstance(scored, Scores):
                    scored = Scores(scored)
                scored.values = self._values(scored.values, len(range(len(images))[batch]))
                undeclared = sorted(set(scored.columns) - set(self.columns))
                if undeclared:
                    raise ValueError(f"reward {self.name} returned columns {undeclared} it does not declare")
                parts.append(scored)
        if any(p.columns.keys() != parts[0].columns.keys() for p in parts):
            raise ValueError(f"reward {self.name} returned different columns for different batches")
        return Scores.join(parts)

    def __call__(self, images: np.ndarray, prompts: Sequence[str], metadata: Metadata = None) -> np.ndarray:
        """``score(...).values``: float32 ``[B]``."""
        return self.score(images, prompts, metadata).values


def check_alignment(name: str, count: int, prompts: Sequence[str], metadata: Metadata) -> None:
    """That ``count`` images come with one prompt each and, when given, one metadata dict each.

    Raises:
        ValueError: naming what does not match and the form expected: a prompt count, a metadata count, metadata
        given as one dict of lists (columns) instead of a list of dicts (one per image), or an entry not a dict.
    """
    if len(prompts) != count:
        raise ValueError(f"reward {name}: {count} images but {len(prompts)} prompts; give one prompt per image")
    if metadata is None:
        return
    expected = f"give metadata as a list of {count} dicts, one per image (e.g. [{{'text': ...}}, ...])"
    if isinstance(metadata, Mapping):
        columns = ", ".join(f"{key!r}" for key in list(metadata)[:4])
        raise ValueError(
            f"reward {name}: metadata is one dict of columns ({columns}), not one dict per image; {expected}"
        )
    if len(metadata) != count:
        raise ValueError(f"reward {name}: {count} images but {len(metadata)} metadata entries; {expected}")
    for i, entry in enumerate(metadata):
        if not isinstance(entry, Mapping):
            raise ValueError(f"reward {name}: metadata entry {i} is a {type(entry).__name__}, not a dict; {expected}")


#: Rewards built in this process: (name, registered reward, options JSON, device) -> reward.
_LOADED: dict[tuple[str, str, str, str], Reward] = {}


def reward_class(name: str, models: dict[str, dict[str, Any]]) -> type[Reward]:
    """The registered reward that ``name`` is: its ``reward.models`` entry's ``type`` (an instance of a registered
    reward, configured on its own), else ``name`` itself.

    Raises:
        ValueError: no such registered reward (the message lists them).
    """
    return REWARDS.get(reward_type(name, models))


def reward_options(name: str, models: dict[str, dict[str, Any]]) -> RewardOptions:
    """The validated options of reward ``name`` from ``reward.models`` (defaults when absent; ``type`` is not an
    option).

    Raises:
        ValueError: unknown reward, or options the reward refuses (pydantic's message).
    """
    return reward_class(name, models).options_for(reward_option_values(name, models))


def build_reward(name: str, device: torch.device | str = "cpu", options: dict[str, Any] | None = None) -> Reward:
    """The reward ``name`` with ``options`` (its ``reward.models`` entry: ``type`` names the registered reward it
    is an instance of, default ``name``), built once per process, device and options; with ``options["url"]``,
    the client of that reward server (``solrl.stages.rewards.remote``).

    Raises:
        ValueError: unknown reward (the message lists the registered rewards), or bad options.
    """
    models = {name: options or {}}
    kind, validated = reward_class(name, models), reward_options(name, models)
    registered = reward_type(name, models)
    key = (name, registered, validated.model_dump_json(), str(device))
    if key not in _LOADED:
        if validated.url:
            from solrl.stages.rewards.remote import RemoteReward

            _LOADED[key] = RemoteReward(registered, validated, name)  # the server serves the registered reward
        else:
            if not getattr(kind, "name", None):  # a plug-in that did not set it: its registered name
                kind.name = registered
            _LOADED[key] = kind(validated, device)
    return _LOADED[key]


def release_rewards(names: Sequence[str] | None = None) -> None:
    """Drop the built rewards whose options say ``keep_loaded: false`` (all, with ``names=None`` and none kept),
    freeing their memory."""
    for key in list(_LOADED):
        reward = _LOADED[key]
        if (names is None or key[0] in names) and not reward.options.keep_loaded:
            del _LOADED[key]
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def checked(
    reward: Reward,
    images: np.ndarray,
    prompts: Sequence[str],
    metadata: Metadata = None,
    group_size: int | None = None,
) -> Scores:
    """Call ``reward.score`` (``group_size``: images per group, for a group reward) and check its output: float32
    ``[B]``, all finite, each column ``B`` long.

    Raises:
        RewardError: wrong shape or column length, or a NaN/inf value (naming the first bad prompt).
    """
    scores = reward.score(images, prompts, metadata, group_size)
    values = scores.values
    if values.shape != (len(prompts),):
        raise RewardError(f"reward {reward.name!r} returned shape {values.shape}, expected ({len(prompts)},)")
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        raise RewardError(
            f"reward {reward.name!r} returned {values[bad[0]]} for prompt {prompts[bad[0]]!r} "
            f"({bad.size} non-finite of {values.size}); fix the reward or its inputs"
        )
    for column, cells in scores.columns.items():
        if len(cells) != len(prompts):
            raise RewardError(f"reward {reward.name!r} returned {len(cells)} {column!r} for {len(prompts)} images")
    return scores


def score_all(
    rewards: dict[str, tuple[Reward, float]],
    images: np.ndarray,
    prompts: Sequence[str],
    metadata: Metadata = None,
    group_size: int | None = None,
) -> dict[str, Scores]:
    """Score images with every reward (``checked``). ``rewards``: name -> (reward, weight). Returns name ->
    ``Scores`` (values float32 ``[B]``)."""
    return {name: checked(reward, images, prompts, metadata, group_size) for name, (reward, _) in rewards.items()}
