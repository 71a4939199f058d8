"""A disaggregated pair in two processes: rank 0 runs a ``ContextWorker``, rank 1 a
``GenerationWorker``, joined in a process group of the jobs' transfer backend.

``run_pairs(jobs, store, weights)`` spawns the two ranks, which run the jobs one after another and
send back every request's tokens, acceptance counts and transfers. The device is the jobs' (every
job of a run on one device): on the CPU both ranks run there over gloo; on CUDA rank r runs on
``cuda:r`` over NCCL (NVLink multicast off: ``NCCL_NVLS_ENABLE=0`` unless set), each rank setting
its device before it joins the group. The process group meets at a file store under ``store``, so
no port is raced for.

``weights`` is either a ``Weights`` on the CPU, which the ranks share (torch.multiprocessing passes
its storage, not a copy) and a CUDA rank copies to its device, or a picklable callable that builds
them on the rank's device (``CheckpointWeights``, ``DrawnWeights``). ``while_waiting`` runs in the
parent while the ranks run (an aggregated reference on the CPU). With ``link_bytes`` the ranks first
measure the link: a tensor of that many bytes sent from rank 0 to rank 1 and back, ``link_reps``
times after a warm round trip; ``PairRun.link_bytes_per_second`` is the median one-way rate.

What a job is made of: ``pair_configs`` (two configs over the same fields, each naming the other as
its peer) and ``retrieval_prompt`` (prompts on which the tiny checkpoint's draft layer is accepted).
"""

from __future__ import annotations

import gc
import os
import random
import statistics
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.multiprocessing as mp

from impl.model.admission import Request
from impl.model.disagg.channel import Transfer
from impl.model.disagg.handoff import Handoff
from impl.model.engine_config import EngineConfig, PeerConfig, SpeculativeConfig
from spec.config import ModelConfig
from spec.model import Weights


def spec(k: int) -> SpeculativeConfig | None:
    """MTP speculation at draft length ``k`` (none at 0)."""
    return SpeculativeConfig(draft_length=k) if k else None


def pair_configs(base: dict, context_k: int, generation_k: int
                 ) -> tuple[EngineConfig, EngineConfig]:
    """(context, generation) configs over the same ``base`` fields, each naming the other; the
    context engine drafts ``context_k`` tokens, the generation engine ``generation_k``."""
    ctx = EngineConfig(**base, speculative=spec(context_k))
    gen = EngineConfig(**base, speculative=spec(generation_k))
    return (EngineConfig(**base, speculative=spec(context_k), role="context",
                         peer=PeerConfig.of(gen)),
            EngineConfig(**base, speculative=spec(generation_k), role="generation",
                         peer=PeerConfig.of(ctx)))


def retrieval_prompt(n: int, seed: int) -> tuple[int, ...]:
    """A retrieval prompt (impl/tasks/retrieval.py) of exactly ``n`` tokens: for n < 256, BOS and
    the last n - 1 tokens of a 256-token one. The trained tiny checkpoint's draft layer guesses its
    answers, so MTP accepts drafts on it."""
    from impl.tasks.retrieval import Retrieval, RetrievalParams

    ids = Retrieval().generate(random.Random(seed), RetrievalParams(length=max(n, 256)),
                               seed).prompt_ids()
    return tuple(ids) if n >= 256 else (ids[0], *ids[len(ids) - (n - 1):])


@dataclass(frozen=True)
class PairJob:
    context: EngineConfig
    generation: EngineConfig
    requests: tuple[Request, ...]
    # applied by the context rank to every hand-off before it is sent (picklable): a test's way to
    # send a hand-off that does not match the generation engine
    on_send: Callable[[Handoff], Handoff] | None = None


@dataclass
class PairResult:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    accepted: dict[str, list[int]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    sent_bytes: int = 0
    context_seconds: float = 0.0
    generation_seconds: float = 0.0
    generation_steps: dict[str, int] = field(default_factory=dict)
    # request id -> the hand-off as the generation rank received it (bytes, payload seconds)
    transfers: dict[str, Transfer] = field(default_factory=dict)


@dataclass
class PairRun:
    results: list[PairResult]
    waited: object = None                     # what ``while_waiting`` returned
    link_seconds: list[float] = field(default_factory=list)   # one-way seconds per repetition
    link_bytes: int = 0
    weight_sums: tuple[float, ...] = ()       # per rank: a checksum of the weights it served

    @property
    def link_bytes_per_second(self) -> float | None:
        if not self.link_seconds:
            return None
        return self.link_bytes / statistics.median(self.link_seconds)


@dataclass(frozen=True)
class CheckpointWeights:
    """A checkpoint's weights, read on the CPU and copied to the rank's device."""

    path: str

    def __call__(self, device: torch.device) -> Weights:
        from impl.model.checkpoint import load_checkpoint
        from impl.model.placement import to_device

        return to_device(load_checkpoint(self.path).weights, device)


@dataclass(frozen=True)
class DrawnWeights:
    """Seeded random bf16 weights of ``cfg``, drawn on the rank's device (spec.model.init_weights:
    on CUDA from the device's generator, the same draws on every card of one kind)."""

    cfg: ModelConfig
    seed: int = 0

    def __call__(self, device: torch.device) -> Weights:
        from spec.model import init_weights

        return init_weights(self.cfg, seed=self.seed, dtype=torch.bfloat16, device=device)


def weight_sum(weights: Weights) -> float:
    """A checksum of the embedding, final norm and LM head: both ranks and the reference must
    serve one model."""
    return float(sum(t.double().sum() for t in (weights.embed, weights.final_norm,
                                                 weights.lm_head)))


def pair_device(jobs: list[PairJob]) -> str:
    devices = {c.device for job in jobs for c in (job.context, job.generation)}
    if len(devices) != 1:
        raise ValueError(f"the jobs of one run share a device; they name {sorted(devices)}")
    return devices.pop()


def rank_device(device: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device == "cuda" else torch.device(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    """Free what a finished engine held before the next one is built (its pools, on CUDA)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure_link(rank: int, device: torch.device, nbytes: int, reps: int) -> list[float]:
    """Round trips of ``nbytes`` between ranks 0 and 1 (one warm, then ``reps`` timed on rank 0):
    the one-way seconds of each, half its round trip."""
    import torch.distributed as dist

    x = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    seconds = []
    for i in range(reps + 1):
        _sync(device)
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        else:
            dist.recv(x, 0)
            dist.send(x, 0)
        _sync(device)
        if i:
            seconds.append((time.perf_counter() - t0) / 2)
    return seconds


def _rank_main(rank: int, jobs: list[PairJob], weights, cfg: ModelConfig | None, init_method: str,
               link: tuple[int, int], out) -> None:
    try:
        import torch.distributed as dist

        from impl.model.disagg.channel import TransferChannel, open_group
        from impl.model.disagg.workers import ContextWorker, GenerationWorker
        from impl.model.engine import Engine
        from impl.model.placement import to_device

        device = rank_device(pair_device(jobs), rank)
        if device.type == "cuda":
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(1)
        weights = weights(device) if callable(weights) else to_device(weights, device)
        open_group(jobs[0].context, rank, 2, init_method, timeout_s=600)
        link_seconds = measure_link(rank, device, *link) if link[0] else []
        found = []
        for job in jobs:
            if rank == 0:
                channel = TransferChannel(peer=1, device=device)
                if job.on_send is not None:
                    channel.send = _hooked(channel.send, job.on_send)
                report = ContextWorker(Engine(job.context, weights, cfg=cfg), channel).run(
                    job.requests)
                found.append(dict(sent_bytes=report.sent_bytes, seconds=report.seconds,
                                  rejected=report.rejected))
            else:
                channel = TransferChannel(peer=0, device=device)
                rep = GenerationWorker(Engine(job.generation, weights, cfg=cfg), channel).serve()
                found.append(dict(
                    tokens={k: r.tokens for k, r in rep.results.items()},
                    accepted={k: r.num_accepted for k, r in rep.results.items()},
                    errors={k: r.error for k, r in rep.results.items() if r.error},
                    seconds=rep.seconds, steps=rep.step_kinds,
                    transfers={t.request_id: t for t in channel.transfers}))
            release(device)
        # NCCL sends return once enqueued: the last hand-off is received before the group goes
        dist.barrier()
        dist.destroy_process_group()
        out.put((rank, "ok", dict(jobs=found, link=link_seconds, weight_sum=weight_sum(weights))))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))


def _hooked(send, on_send):
    def send_hooked(handoff):
        send(on_send(handoff))
    return send_hooked


def run_pairs(jobs: list[PairJob], store: Path, weights, *, cfg: ModelConfig | None = None,
              while_waiting: Callable[[], object] | None = None, timeout_s: float = 900.0,
              link_bytes: int = 0, link_reps: int = 5) -> PairRun:
    """Run ``jobs`` on a context and a generation rank (module docstring); one result per job."""
    pair_device(jobs)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{Path(store) / 'pair_store'}"
    procs = [ctx.Process(target=_rank_main,
                         args=(rank, jobs, weights, cfg, init, (link_bytes, link_reps), out))
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
    for ctx_side, gen_side in zip(got[0]["jobs"], got[1]["jobs"]):
        results.append(PairResult(gen_side["tokens"], gen_side["accepted"],
                                  {**gen_side["errors"], **ctx_side["rejected"]},
                                  ctx_side["sent_bytes"], ctx_side["seconds"], gen_side["seconds"],
                                  gen_side["steps"], gen_side["transfers"]))
    return PairRun(results, waited, got[0]["link"], link_bytes,
                   (got[0]["weight_sum"], got[1]["weight_sum"]))
