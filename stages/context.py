"""What every stage gets: the run's config and place, the iteration, and the policy it starts from."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from solrl.config import RunConfig, without_unhashed
from solrl.stages.models import ModelAdapter, load_model, resolve_device
from solrl.stages.models.adapter import EmbeddingCacheMiss
from solrl.stages.models.policy import ADAPTERS, Policy
from solrl.stages.sampling.samplers import derive_seed
from solrl.storage.artifacts import CheckpointArtifact
from solrl.storage.mirror import RunPlace, locate
from solrl.storage.runs import Run

#: Folder of the run store caching the prompt embeddings of a run (one safetensors file per model and prompt set).
PROMPT_EMBEDDINGS = "prompt_embeddings"
#: The loaded policy of this process, keyed by (model config, run seed, device, run folder).
_POLICIES: dict[tuple[str, int, str, str], Policy] = {}


def release_policies() -> None:
    """Drop this process's loaded policy (and its GPU memory), e.g. before other processes load theirs."""
    _POLICIES.clear()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class StageContext:
    """A stage's view of the run. ``iteration`` counts from 1; iteration i trains policy version i - 1."""

    cfg: RunConfig
    run_dir: Path
    run_id: str
    iteration: int
    #: The run's recorded config hash (``Run.config_hash``); defaults to the config's digest.
    config_hash: str = ""

    @classmethod
    def of(cls, run: Run, iteration: int) -> StageContext:
        """The context of ``run``'s stages at ``iteration``: its stored config, folder, id and config hash."""
        return cls(run.config, run.run_dir, run.run_id, iteration, run.config_hash)

    @property
    def place(self) -> RunPlace:
        """Where the run lives (``solrl.storage.mirror.RunPlace``): its store, key and this machine's folder."""
        return locate(self.run_dir)

    @property
    def config_key(self) -> str:
        """The config hash that stage cache keys and checkpoints record."""
        return self.config_hash or self.cfg.digest()

    @cached_property
    def device(self) -> torch.device:
        return resolve_device(self.cfg.model.device)

    def seed(self, *path: int | str) -> int:
        """A seed derived from the run seed, this iteration and ``path``."""
        return derive_seed(self.cfg.campaign.seed, self.iteration, *path)

    def iteration_prompts(self) -> tuple[np.ndarray, list[str]]:
        """This iteration's prompts: indices ``int64 [P]`` into the prompt file, and the prompts.

        Drawn without replacement while the file has enough prompts, seeded by (run seed, iteration).
        """
        prompts = self.cfg.train_prompts()
        count = self.cfg.campaign.prompts_per_iteration
        rng = np.random.default_rng(self.seed("prompts"))
        index = rng.choice(len(prompts), size=count, replace=count > len(prompts)).astype(np.int64)
        return index, [prompts[i] for i in index]

    def train_metadata(self, prompt_index: np.ndarray, repeat: int) -> list[dict] | None:
        """The metadata of training prompts ``prompt_index [P]``, each repeated ``repeat`` times (one dict per
        image of a ``[P, repeat]`` pool), or None when the prompt set has none (plain text)."""
        train = self.cfg.prompt_sets()[0]
        if not train.has_metadata():
            return None
        return [train.metadata[int(i)] for i in prompt_index for _ in range(repeat)]

    def load_policy(self, checkpoint: CheckpointArtifact | None, *, encode_prompts: bool = True) -> Policy:
        """The model with policy/rollout/EMA adapters as of ``checkpoint`` (None: the base model's fresh LoRA).

        The model is loaded once per process and run and kept (for a SANA-size model, loading dominates a
        stage); the run's training and evaluation prompts are encoded once (cached in the run store, under
        ``prompt_embeddings/``) and the text encoders released. Every call sets all three adapters from the
        checkpoint (or the fresh LoRA init), so no state leaks from one stage to the next; the quantized
        explore copy is synced in place to the rollout adapter when explore next samples with it.
        ``encode_prompts=False`` skips the prompt embeddings (to export a LoRA, nothing is sampled).
        """
        key = (
            self.cfg.model.model_dump_json(),
            self.cfg.campaign.seed,
            str(self.device),
            str(self.run_dir),
            encode_prompts,
        )
        policy = _POLICIES.get(key)
        if policy is None:
            _POLICIES.clear()  # one model in memory at a time
            model = self._load_model(encode_prompts)
            policy = _POLICIES[key] = Policy(
                model,
                self.cfg.model.lora_rank,
                self.cfg.model.lora_alpha,
                seed=derive_seed(self.cfg.campaign.seed, "lora-init"),
            )
        for name in ADAPTERS:
            policy.load_state_dict(name, checkpoint.sections[name] if checkpoint else policy.initial_state)
        return policy

    def prompt_embeddings(self) -> tuple[list[str], Path]:
        """(the run's training and evaluation prompts, the ``.safetensors`` file of the run store caching their
        embeddings): named by the model config (its device excluded: the embeddings do not depend on it) and the
        prompts; one tensor ``<i>/<name>`` per sorted unique prompt ``i`` and conditioning entry (``ModelAdapter
        .precompute``)."""
        prompts = self.cfg.train_prompts() + self.cfg.eval_prompts()
        config = without_unhashed("model", self.cfg.model.model_dump(mode="json", exclude={"device"}))
        digest = hashlib.sha256(json.dumps([config, sorted(set(prompts))], sort_keys=True).encode()).hexdigest()[:16]
        return prompts, self.run_dir / PROMPT_EMBEDDINGS / f"{self.cfg.model.family}-{digest}.safetensors"

    def _load_model(self, encode_prompts: bool) -> ModelAdapter:
        """The model with the run's prompts encoded (``encode_prompts``), its text encoders released.

        The prompts are encoded once per run and cached in the run store, under a name from the model config (its
        device excluded: the embeddings do not depend on it) and the prompts. When that cache exists (a resumed
        run, every stage after the first), or no prompt is needed, the text encoders are not loaded at all (for
        FLUX.1 the T5-XXL encoder alone is about 9 GB); a cache that turns out unreadable is recomputed with them.
        """
        prompts, cache = self.prompt_embeddings()
        model = load_model(self.cfg.model, self.device, text_encoders=encode_prompts and not cache.exists())
        if encode_prompts:
            try:
                model.precompute(prompts, cache)
            except EmbeddingCacheMiss:
                del model  # one model in memory at a time
                model = load_model(self.cfg.model, self.device)
                model.precompute(prompts, cache)
        return model
