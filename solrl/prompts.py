"""Prompt sets: plain text (one prompt a line) or JSONL with metadata, and the fixed train/evaluation split.

A JSONL line is an object with a ``prompt`` string; every other key is that prompt's metadata, handed to the
rewards with each image of the prompt (GenEval's ``tag``/``include``/``exclude``, an OCR ``text``). When a run
names no evaluation file, its prompt file is split by a hash of each prompt: the split is fixed (the same
prompts whatever the file order, the machine or the run) and roughly ``eval_fraction`` of the prompts.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class PromptFileError(ValueError):
    """A prompt file that cannot be used; the message names the field, the file and the line."""


@dataclass(frozen=True)
class PromptSet:
    """Prompts and their metadata (one dict per prompt, empty for plain-text files)."""

    prompts: list[str]
    metadata: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.metadata:
            object.__setattr__(self, "metadata", [{} for _ in self.prompts])

    def select(self, keep: list[bool]) -> PromptSet:
        return PromptSet([p for p, k in zip(self.prompts, keep) if k], [m for m, k in zip(self.metadata, keep) if k])

    def has_metadata(self) -> bool:
        return any(self.metadata)


#: Suffixes (any case) of JSON Lines prompt files; any other file is plain text.
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")


def read_prompt_set(path: Path, field: str) -> PromptSet:
    """Read ``path``: JSON Lines (``JSONL_SUFFIXES``: one JSON object with a ``prompt`` a line) or plain text (one
    prompt a line); blank lines and ``#`` comments skipped in both. Lines end at ``\n``, ``\r\n`` or ``\r`` only:
    a Unicode line or paragraph separator, a form feed inside a prompt stays in it.

    Raises:
        PromptFileError: missing, unreadable or not UTF-8; a JSONL line that is not an object with a non-empty
            ``prompt`` string; a plain-text file whose first line is such an object (JSON Lines under another
            name); no prompt at all.
    """
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors) is not the prompt's
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptFileError(
            f"{field}: cannot read prompt file {str(path)!r} ({exc.__class__.__name__}: {exc})"
        ) from exc
    lines = [
        (n, ln.strip())
        for n, ln in enumerate(re.split(r"\r\n|\r|\n", text), 1)
        if ln.strip() and not ln.lstrip().startswith("#")
    ]
    if path.suffix.lower() in JSONL_SUFFIXES:
        prompts, metadata = [], []
        for number, line in lines:
            try:
                item = json.loads(line)
            except json.JSONDecodeError:
                raise PromptFileError(
                    f"{field}: {str(path)!r} line {number} is not JSON (a {path.suffix} prompt file is JSON Lines: "
                    'one {"prompt": ...} object a line)'
                ) from None
            if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"].strip():
                raise PromptFileError(
                    f'{field}: {str(path)!r} line {number} has no "prompt" string (a {path.suffix} prompt file is '
                    'JSON Lines: one {"prompt": ...} object a line)'
                )
            prompts.append(item.pop("prompt").strip())
            metadata.append(item)
        found = PromptSet(prompts, metadata)
    else:
        if lines and lines[0][1].startswith("{"):
            try:
                first = json.loads(lines[0][1])
            except json.JSONDecodeError:
                first = None
            if isinstance(first, dict) and "prompt" in first:  # read as text, its metadata would be prompt text
                raise PromptFileError(
                    f'{field}: {str(path)!r} holds JSON Lines ({{"prompt": ...}} objects) under a name read as '
                    f"plain text; name it {path.stem}.jsonl"
                )
        found = PromptSet([line for _, line in lines])
    if not found.prompts:
        raise PromptFileError(f"{field}: prompt file {str(path)!r} holds no prompt; write one prompt per line")
    return found


def in_eval_split(prompt: str, fraction: float) -> bool:
    """Whether ``prompt`` belongs to the evaluation split: sha256 of the prompt as a number in [0, 1)."""
    return int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big") / 2**64 < fraction


def split(prompts: PromptSet, fraction: float, field: str) -> tuple[PromptSet, PromptSet]:
    """(train, evaluation) by ``in_eval_split``.

    Raises:
        PromptFileError: either side would be empty.
    """
    held_out = [in_eval_split(p, fraction) for p in prompts.prompts]
    train, evaluation = prompts.select([not h for h in held_out]), prompts.select(held_out)
    if not train.prompts or not evaluation.prompts:
        raise PromptFileError(
            f"{field}: splitting {len(prompts.prompts)} prompts with campaign.eval_fraction="
            f"{fraction} leaves an empty side; give campaign.eval_prompts_file or change the fraction"
        )
    return train, evaluation
