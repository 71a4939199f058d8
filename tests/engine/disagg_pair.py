"""A disaggregated pair in two processes on the CPU, and the aggregated engine it is held to.

``run_pairs(jobs, store)`` spawns rank 0 (a ``ContextWorker``) and rank 1 (a ``GenerationWorker``),
joined in a gloo process group through a file store (no port to race for); they run the jobs one
after another and send back every request's tokens and acceptance counts. The ranks share the
parent's weights (torch.multiprocessing passes their storage, not a copy). ``while_waiting`` runs in
the parent meanwhile (the aggregated references), so the three processes share the two cores.

Weights: the trained tiny checkpoint, whose draft layer guesses the retrieval answers (acceptance
counts above 1), so a draft layer that reads wrong planes shows in the counts. ``prompt(n, seed)``
is a retrieval prompt of exactly n tokens (for n < 256: BOS and the last n - 1 tokens of a 256-token
one).
"""

from __future__ import annotations

import random
import traceback
from functools import lru_cache
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.multiprocessing as mp

from impl.model.admission import Request
from impl.model.engine import Engine
from impl.model.engine_config import EngineConfig, PeerConfig, SpeculativeConfig
from impl.tasks.retrieval import Retrieval, RetrievalParams

CHECKPOINT = Path(__file__).resolve().parents[2] / "checkpoints" / "flashnext-tiny.safetensors"


@lru_cache(maxsize=1)
def load_weights():
    from impl.model.checkpoint import load_checkpoint

    return load_checkpoint(CHECKPOINT).weights


def prompt(n: int, seed: int) -> tuple[int, ...]:
    ids = Retrieval().generate(random.Random(seed), RetrievalParams(length=max(n, 256)),
                               seed).prompt_ids()
    return tuple(ids) if n >= 256 else (ids[0], *ids[len(ids) - (n - 1):])


def requests(lengths, new: int = 11) -> tuple[Request, ...]:
    return tuple(Request(request_id=f"r{i}_{n}", prompt=prompt(n, i), max_new_tokens=new)
                 for i, n in enumerate(lengths))


def spec(k: int) -> SpeculativeConfig | None:
    return SpeculativeConfig(draft_length=k) if k else None


def pair_configs(base: dict, context_k: int, generation_k: int
                 ) -> tuple[EngineConfig, EngineConfig]:
    """(context, generation) configs over the same ``base`` fields, each naming the other."""
    ctx = EngineConfig(**base, speculative=spec(context_k))
    gen = EngineConfig(**base, speculative=spec(generation_k))
    return (EngineConfig(**base, speculative=spec(context_k), role="context",
                         peer=PeerConfig.of(gen)),
            EngineConfig(**base, speculative=spec(generation_k), role="generation",
                         peer=PeerConfig.of(ctx)))


@dataclass(frozen=True)
class PairJob:
    context: EngineConfig
    generation: EngineConfig
    requests: tuple[Request, ...]
    # (request id, manifest key, value): the context rank changes that manifest entry before it
    # sends the request's hand-off (a hand-off that does not match the generation engine)
    tamper: tuple[tuple[str, str, object], ...] = ()


@dataclass
class PairResult:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    accepted: dict[str, list[int]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    sent_bytes: int = 0
    context_seconds: float = 0.0
    generation_seconds: float = 0.0
    generation_steps: dict[str, int] = field(default_factory=dict)


def _rank_main(rank: int, jobs: list[PairJob], weights, init_method: str, out) -> None:
    try:
        torch.set_num_threads(1)
        from impl.model.disagg.channel import TransferChannel, open_group
        from impl.model.disagg.workers import ContextWorker, GenerationWorker

        open_group(jobs[0].context, rank, 2, init_method, timeout_s=600)
        found = []
        for job in jobs:
            if rank == 0:
                channel = TransferChannel(peer=1)
                if job.tamper:
                    channel.send = _tampering(channel.send, job.tamper)
                report = ContextWorker(Engine(job.context, weights), channel).run(job.requests)
                found.append(dict(sent_bytes=report.sent_bytes, seconds=report.seconds,
                                  rejected=report.rejected))
            else:
                rep = GenerationWorker(Engine(job.generation, weights),
                                       TransferChannel(peer=0)).serve()
                found.append(dict(
                    tokens={k: r.tokens for k, r in rep.results.items()},
                    accepted={k: r.num_accepted for k, r in rep.results.items()},
                    errors={k: r.error for k, r in rep.results.items() if r.error},
                    seconds=rep.seconds, steps=rep.step_kinds))
        out.put((rank, "ok", found))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))


def _tampering(send, tamper):
    def send_tampered(handoff):
        for rid, key, value in tamper:
            if handoff.request_id == rid:
                handoff.manifest = _set(handoff.manifest, key.split("."), value)
        send(handoff)
    return send_tampered


def _set(d: dict, path: list[str], value) -> dict:
    d = dict(d)
    d[path[0]] = value if len(path) == 1 else _set(d[path[0]], path[1:], value)
    return d


def run_pairs(jobs: list[PairJob], store: Path, while_waiting: Callable[[], object] | None = None,
              timeout_s: float = 900.0) -> tuple[list[PairResult], object]:
    """Run ``jobs`` on a context and a generation rank; returns one result per job and what
    ``while_waiting`` returned."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{store / 'pair_store'}"
    weights = load_weights()
    procs = [ctx.Process(target=_rank_main, args=(rank, jobs, weights, init, out))
             for rank in (0, 1)]
    for p in procs:
        p.start()
    try:
        waited = while_waiting() if while_waiting is not None else None
        got = {}
        for _ in procs:
            rank, status, value = out.get(timeout=timeout_s)
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            got[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join()
    results = []
    for ctx_side, gen_side in zip(got[0], got[1]):
        results.append(PairResult(gen_side["tokens"], gen_side["accepted"],
                                  {**gen_side["errors"], **ctx_side["rejected"]},
                                  ctx_side["sent_bytes"], ctx_side["seconds"], gen_side["seconds"],
                                  gen_side["steps"]))
    return results, waited
