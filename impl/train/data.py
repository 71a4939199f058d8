"""Training batches: a seeded task mixture, one task per batch, each batch a pure function of
(seed, phase, step), so a resumed run reads exactly the batches it would have read.

Batches hold about ``tokens`` tokens: many short arithmetic or MQAR examples, or a few long
retrieval contexts (lengths drawn from ``retrieval_lengths``). Generator parameters vary around the
evaluation sets' (MQAR 8 to 48 pairs, 1 to 12 queries; retrieval 1 to ``retrieval_queries`` queries
a context), and an example whose prompt is an evaluation prompt is redrawn.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field

from impl.tasks import TASKS
from impl.tasks.arithmetic import ArithmeticParams
from impl.tasks.evalsets import eval_prompts
from impl.tasks.mqar import MqarParams
from impl.tasks.retrieval import RetrievalParams
from impl.tasks.tokenizer import PAD


class DataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    weights: dict[str, float] = Field(default_factory=lambda: {"arithmetic": 0.4, "mqar": 0.3,
                                                               "retrieval": 0.3})
    tokens: int = Field(65536, ge=64, description="tokens a batch (about)")
    retrieval_lengths: tuple[int, ...] = (512, 1024, 2048, 4096, 8192)
    retrieval_queries: int = Field(4, ge=1, le=8, description="queries a context: 1 to this")
    max_batch: int = Field(512, ge=1)


@dataclass
class Batch:
    task: str
    ids: torch.Tensor          # int64 [B, T], right-padded with PAD
    taught: torch.Tensor       # bool [B, T]: ids[:, t] is a target (predicted at t - 1)
    prompt_lens: torch.Tensor  # int64 [B]


def _params(task: str, rng: random.Random, cfg: DataConfig):
    if task == "arithmetic":
        return ArithmeticParams()
    if task == "mqar":
        pairs = rng.randint(8, 48)
        return MqarParams(pairs=pairs, queries=rng.randint(1, min(12, pairs)))
    length = rng.choice(cfg.retrieval_lengths)
    return RetrievalParams(length=length, queries=rng.randint(1, cfg.retrieval_queries),
                           stratified=False)


def make_batch(seed: int, phase: str, step: int, cfg: DataConfig) -> Batch:
    rng = random.Random(f"train:{seed}:{phase}:{step}")
    names = sorted(cfg.weights)
    task = rng.choices(names, weights=[cfg.weights[n] for n in names])[0]
    params = _params(task, rng, cfg)
    gen, banned = TASKS[task], eval_prompts(task)
    first = gen.generate(rng, params, 0)
    per = len(first.training_example()[0])
    count = max(1, min(cfg.max_batch, cfg.tokens // per))
    examples = [first]
    while len(examples) < count:
        s = gen.generate(rng, params, len(examples))
        if s.prompt not in banned:
            examples.append(s)
    if first.prompt in banned:
        examples[0] = examples[-1]
    seqs = [s.training_example() for s in examples]
    T = max(len(ids) for ids, _ in seqs)
    ids = torch.full((len(seqs), T), PAD, dtype=torch.int64)
    taught = torch.zeros(len(seqs), T, dtype=torch.bool)
    for b, (x, m) in enumerate(seqs):
        ids[b, :len(x)] = torch.tensor(x)
        taught[b, :len(m)] = torch.tensor(m)
    lens = torch.tensor([len(s.prompt_ids()) for s in examples])
    return Batch(task, ids, taught, lens)


__all__ = ["DataConfig", "Batch", "make_batch"]


def ngram_rows(ids: torch.Tensor, hash_cfg) -> torch.Tensor:
    """spec.ops.ple.ple_ngram_hash for every sequence of a batch [B, T] at once (each from the history
    [PAD, PAD]): int64 [B, T, heads]."""
    from spec.ops.ple import _mod_u64, ngram_hash_u64

    B, T = ids.shape
    pad = torch.full((B, 2), hash_cfg.pad_id, dtype=torch.int64)
    seq = torch.cat([pad, ids.to(torch.int64)], 1)
    window = torch.stack([seq[:, 2 - k:2 - k + T] for k in range(3)], -1).reshape(B * T, 3)
    cols = [_mod_u64(ngram_hash_u64(window, m), p) + off for _, m, p, off in hash_cfg.heads()]
    return torch.stack(cols, -1).reshape(B, T, -1)
