"""The fixed evaluation sets: each a task, its generator parameters and a size, identified by the
sha256 of its content (every sample's task, prompt and answer, in order).

Sample i of set S is generated from its own seed ``"eval:S:i"``, so the first n samples of a set do not
depend on its size: a gate that evaluates n samples reads the first n. The pinned ``sha256`` of every
set is checked by tests/tasks/test_evalsets.py: a change to a generator that changes an evaluation set
fails there, and the gates' references (keyed by the set's hash) stop applying, as they must.

Training never sees an evaluation prompt: ``eval_prompts(task)`` lists them and the training data
redraws a collision (only the short arithmetic problems can collide at all).
"""

from __future__ import annotations

import hashlib
import json
import random
from functools import lru_cache

from pydantic import BaseModel, ConfigDict, Field

from impl.tasks import TASKS
from impl.tasks.base import Sample


class EvalSet(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    task: str
    size: int = Field(ge=1)
    params: dict[str, int | bool] = Field(default_factory=dict)
    sha256: str
    why: str = Field(min_length=10)

    def task_params(self):
        return TASKS[self.task].params_model(**self.params)

    def max_new_tokens(self) -> int:
        return TASKS[self.task].max_new_tokens(self.task_params())


EVAL_SETS: dict[str, EvalSet] = {s.name: s for s in (
    EvalSet(name="arithmetic", task="arithmetic", size=400,
            sha256="60da061710c4991e2cdf49aa73fd837efd2f86e9b6be8ded5996e75793acee4c",
            why="GSM8K-style word problems with one to three events, worked answers, #### N"),
    EvalSet(name="mqar", task="mqar", size=400, params={"pairs": 32},
            sha256="f526e180b653b30093fb5356182afd1c48599c164b5481969c973fa47e045774",
            why="32 key-value pairs, one query: about 200 tokens, seven blocks"),
    EvalSet(name="retrieval_512", task="retrieval", size=200, params={"length": 512},
            sha256="8d1cbd16548f3e3a0427bec3153f0f3f159e472a65ac774c28fcf00a2bd8c62a",
            why="4 records in 512 tokens (16 blocks): the short retrieval a CPU gate can afford"),
    EvalSet(name="retrieval_2k", task="retrieval", size=100, params={"length": 2048},
            sha256="5c6ec877239de260661d4ac029bdb058801f3d517797aa1f114d0e76da1d7576",
            why="16 records in 2048 tokens (64 blocks)"),
    EvalSet(name="retrieval_4k", task="retrieval", size=100, params={"length": 4096},
            sha256="af66699184e6d3cb971194a059bc655b7bc8b2ef9ed8064f9c8c8f5f4ecd47aa",
            why="32 records in 4096 tokens (128 blocks)"),
    EvalSet(name="retrieval_8k", task="retrieval", size=100, params={"length": 8192},
            sha256="0a0a151707d291899641ba96ead2d4f4914e082e711eecce295018c16a40b91d",
            why="64 records in 8192 tokens (256 blocks), the longest trained length"),
    EvalSet(name="frames", task="frames", size=200, params={"frames": 4},
            sha256="90da317aad39ca8e717c38638af391e19c1507f9f01326ba435f4df8a9842049",
            why="which of 4 frames (2 tower groups, 16 frame rows) holds the bright square: 1 in 4 "
                "by chance"),
)}


def generate(spec: EvalSet, count: int | None = None) -> list[Sample]:
    """The first ``count`` samples (default: all) of a set, generated afresh."""
    task, params = TASKS[spec.task], spec.task_params()
    n = spec.size if count is None else min(count, spec.size)
    return [task.generate(random.Random(f"eval:{spec.name}:{i}"), params, i) for i in range(n)]


@lru_cache(maxsize=None)
def samples(name: str) -> tuple[Sample, ...]:
    """Every sample of the named set (cached)."""
    if name not in EVAL_SETS:
        raise KeyError(f"unknown evaluation set {name!r}; known: {sorted(EVAL_SETS)}")
    return tuple(generate(EVAL_SETS[name]))


def content_hash(items: list[Sample] | tuple[Sample, ...]) -> str:
    """sha256 over the samples' records, one canonical JSON line each."""
    h = hashlib.sha256()
    for s in items:
        h.update(json.dumps(s.record(), sort_keys=True, ensure_ascii=True).encode() + b"\n")
    return h.hexdigest()


@lru_cache(maxsize=None)
def eval_prompts(task: str) -> frozenset[str]:
    """Every evaluation prompt of ``task`` (training redraws a sample that equals one)."""
    return frozenset(s.prompt for spec in EVAL_SETS.values() if spec.task == task
                     for s in samples(spec.name))


__all__ = ["EvalSet", "EVAL_SETS", "generate", "samples", "content_hash", "eval_prompts"]
