"""A disaggregated pair in two processes on the CPU, and the aggregated engine it is held to.

``run_pairs(jobs, store)`` runs the jobs on rank 0 (a ``ContextWorker``) and rank 1 (a
``GenerationWorker``) over gloo (impl/model/disagg/pair.py) and returns every request's tokens and
acceptance counts. The ranks share the parent's weights (torch.multiprocessing passes their
storage, not a copy). ``while_waiting`` runs in the parent meanwhile (the aggregated references), so
the three processes share the two cores. ``PairJob(..., tamper=...)`` changes a hand-off's manifest
before the context rank sends it. ``pair_configs`` and ``spec`` come from the pair module.

Weights: the trained tiny checkpoint, whose draft layer guesses the retrieval answers (acceptance
counts above 1), so a draft layer that reads wrong planes shows in the counts. ``prompt(n, seed)``
is a retrieval prompt of exactly n tokens (for n < 256: BOS and the last n - 1 tokens of a 256-token
one).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

from impl.model.admission import Request
from impl.model.disagg import pair
from impl.model.disagg.handoff import Handoff
# re-exported: the tests import them from here
from impl.model.disagg.pair import PairResult, pair_configs, retrieval_prompt, spec  # noqa: F401

CHECKPOINT = Path(__file__).resolve().parents[2] / "checkpoints" / "flashnext-tiny.safetensors"


@lru_cache(maxsize=1)
def load_weights():
    from impl.model.checkpoint import load_checkpoint

    return load_checkpoint(CHECKPOINT).weights


prompt = retrieval_prompt


def requests(lengths, new: int = 11) -> tuple[Request, ...]:
    return tuple(Request(request_id=f"r{i}_{n}", prompt=prompt(n, i), max_new_tokens=new)
                 for i, n in enumerate(lengths))


@dataclass(frozen=True)
class Tamper:
    """Changes manifest entries of named requests' hand-offs: (request id, manifest key, value)."""

    entries: tuple[tuple[str, str, object], ...]

    def __call__(self, handoff: Handoff) -> Handoff:
        for rid, key, value in self.entries:
            if handoff.request_id == rid:
                handoff.manifest = _set(handoff.manifest, key.split("."), value)
        return handoff


def _set(d: dict, path: list[str], value) -> dict:
    d = dict(d)
    d[path[0]] = value if len(path) == 1 else _set(d[path[0]], path[1:], value)
    return d


@dataclass(frozen=True)
class PairJob(pair.PairJob):
    # (request id, manifest key, value): the context rank changes that manifest entry before it
    # sends the request's hand-off (a hand-off that does not match the generation engine)
    tamper: tuple[tuple[str, str, object], ...] = ()

    def __post_init__(self):
        if self.tamper:
            object.__setattr__(self, "on_send", Tamper(self.tamper))


def run_pairs(jobs: list[PairJob], store: Path, while_waiting: Callable[[], object] | None = None,
              timeout_s: float = 900.0) -> tuple[list[PairResult], object]:
    """Run ``jobs`` on a context and a generation rank over gloo, sharing the tiny checkpoint's
    weights; returns one result per job and what ``while_waiting`` returned."""
    run = pair.run_pairs(jobs, store, load_weights(), while_waiting=while_waiting,
                         timeout_s=timeout_s)
    return run.results, run.waited
