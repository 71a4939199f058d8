"""The two workers of a disaggregated pair: a context engine that reads prompts and hands each
request over, and a generation engine that continues them.

``ContextWorker.run(requests)`` admits each request on its own (a bad one is reported and the others
run), steps its engine, and after every step hands over each request whose prompt is read (its first
token emitted, its drafts drafted when it drafts): the request's state goes to the channel and its
slot and pages are freed for the next prompt. A request that finishes in its context step (a stop
token first, or ``max_new_tokens`` 1) is handed over finished, without state. At the end it sends
the end of the stream.

``GenerationWorker.serve()`` adopts hand-offs while it has free slots (waiting for one only when it
has nothing to step), steps its engine between them, and returns every handed request's result. A
hand-off that does not match its configuration fails alone: its result carries the
``TransferRejected`` message, and the engine keeps serving the others.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable

from impl.model.admission import Request, admit
from impl.model.disagg.channel import Inbox, TransferChannel
from impl.model.disagg.handoff import Handoff, TransferRejected, adopt, extract
from impl.model.engine import Engine, GenerationReport, GenerationResult


def _check(engine: Engine, channel: TransferChannel, role: str) -> None:
    if engine.config.role != role:
        raise ValueError(f"a {role} worker runs a {role} engine; this one's role is "
                         f"{engine.config.role!r}")
    if channel.device.type != engine.config.device:
        raise ValueError(f"the channel moves {channel.device.type} tensors; the engine's pages "
                         f"are on {engine.config.device}")


@dataclass
class ContextReport:
    rejected: dict[str, str] = field(default_factory=dict)   # request id -> admission error
    handed: list[str] = field(default_factory=list)          # request ids, in hand-off order
    steps: int = 0
    seconds: float = 0.0
    sent_bytes: int = 0


class ContextWorker:
    def __init__(self, engine: Engine, channel: TransferChannel):
        _check(engine, channel, "context")
        self.engine = engine
        self.channel = channel

    def run(self, requests: Iterable[Request]) -> ContextReport:
        engine = self.engine
        accepted, rejected = admit(list(requests), engine.cfg, engine.config)
        report = ContextReport(rejected={e.request_id: str(e) for e in rejected})
        for r in accepted:
            engine.submit(r)
        t0, steps0, finished = time.perf_counter(), engine.steps, len(engine.finished)
        while not engine.idle:
            engine.step()
            for seq in engine.finished[finished:]:
                self._send(extract(engine, seq), report)
            finished = len(engine.finished)
            for seq in sorted(engine.running.values(), key=lambda s: s.arrival):
                if not seq.in_prompt:
                    handoff = extract(engine, seq)
                    engine.detach(seq)
                    self._send(handoff, report)
        self.channel.send_end()
        report.steps = engine.steps - steps0
        report.seconds = time.perf_counter() - t0
        report.sent_bytes = self.channel.sent_bytes
        return report

    def _send(self, handoff: Handoff, report: ContextReport) -> None:
        self.channel.send(handoff)
        report.handed.append(handoff.request_id)


class GenerationWorker:
    def __init__(self, engine: Engine, channel: TransferChannel, inbox_depth: int = 1):
        _check(engine, channel, "generation")
        self.engine = engine
        self.channel = channel
        self.inbox_depth = inbox_depth
        self.rejections: list[TransferRejected] = []

    def serve(self) -> GenerationReport:
        """Serve hand-offs until the stream ends and every adopted request is done."""
        engine = self.engine
        inbox = Inbox(self.channel, self.inbox_depth)
        results: dict[str, GenerationResult] = {}
        t0, steps0, tokens, ended = time.perf_counter(), engine.steps, 0, False
        while not (ended and engine.idle):
            while not ended and engine.free_slots:
                handoff = inbox.get(block=engine.idle)
                if handoff is Inbox.NOTHING:
                    break
                if handoff is None:
                    ended = True
                    break
                self._take(handoff, results)
            if not engine.idle:
                tokens += sum(len(t) for t in engine.step().values())
        for seq in engine.finished:
            rid = seq.request.request_id
            if rid in results and results[rid].error is None:
                results[rid] = GenerationResult(rid, list(seq.output), None, list(seq.accepted))
        return GenerationReport(results, engine.steps - steps0, tokens, time.perf_counter() - t0,
                                dict(engine.step_kinds), engine.dispatcher.variants_ran())

    def _take(self, handoff: Handoff, results: dict[str, GenerationResult]) -> None:
        rid = handoff.request_id
        try:
            seq = adopt(self.engine, handoff)
        except TransferRejected as e:
            self.rejections.append(e)
            # a request id already served keeps its own result
            results.setdefault(rid, GenerationResult(rid, error=str(e)))
            return
        results[rid] = GenerationResult(rid, list(seq.output))
