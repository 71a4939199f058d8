"""What every task shares: the sample, its token layout for evaluation and for training, and scoring.

A task is a seeded generator (``generate(rng, params) -> Sample``) plus a scoring rule
(``score(sample, generated_ids) -> 0.0 | 1.0``). Evaluation feeds ``prompt_ids`` to the engine and
scores what it generates; training teaches ``training_ids`` with loss on the answer turns only
(``training_example``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Protocol

from pydantic import BaseModel, ConfigDict

from impl.tasks.tokenizer import BOS, END, END_REPEAT, decode, encode


@dataclass(frozen=True)
class Sample:
    """One task instance.

    prompt: the text the model reads (``BOS`` is prepended); answer: the text it must produce (``END``
    follows). ``more``: training only, further (query, answer) turns appended after the answer, so a
    long context teaches several answers (the evaluation sets never have them). ``meta``: facts about
    the instance that scoring or reporting reads (e.g. the queried record's depth).
    """

    task: str
    prompt: str
    answer: str
    more: tuple[tuple[str, str], ...] = ()
    meta: dict[str, int | str] = field(default_factory=dict, compare=False, hash=False)

    def prompt_ids(self) -> list[int]:
        return [BOS, *encode(self.prompt)]

    def answer_ids(self) -> list[int]:
        return [*encode(self.answer), END]

    def training_example(self) -> tuple[list[int], list[bool]]:
        """(token ids, target mask): ``ids[i + 1]`` is the target of position i, taught where
        ``mask[i + 1]``. Taught: every answer turn and the closing ``END`` repeats; not taught: the
        prompt and the query turns, which are random (filler, keys) or given."""
        ids, mask = self.prompt_ids(), [False] * (1 + len(encode(self.prompt)))
        turns = [("", self.answer), *self.more]
        for query, answer in turns:
            q, a = encode(query), encode(answer)
            ids += q + a
            mask += [False] * len(q) + [True] * len(a)
        ids += [END] * END_REPEAT
        mask += [True] * END_REPEAT
        return ids, mask

    def record(self) -> dict[str, str]:
        """The evaluated content of the sample (what a set's content hash covers)."""
        return {"task": self.task, "prompt": self.prompt, "answer": self.answer}


class Params(BaseModel):
    """A task's generator parameters (each task subclasses it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Task(Protocol):
    name: str
    params_model: type[Params]

    def generate(self, rng: random.Random, params: Params, index: int) -> Sample:
        """One sample; ``index`` lets an evaluation set stratify (e.g. by depth)."""

    def score(self, sample: Sample, generated: list[int]) -> float:
        """1.0 when the generation (read up to its first END) is right, else 0.0."""

    def max_new_tokens(self, params: Params) -> int:
        """Enough tokens for the longest answer of these parameters and its END."""


def exact_match(sample: Sample, generated: list[int]) -> float:
    """The whole answer, character for character, then END (a missing END is wrong too)."""
    if END not in generated:
        return 0.0
    return 1.0 if decode(generated) == sample.answer else 0.0


ScoreFn = Callable[[Sample, list[int]], float]
