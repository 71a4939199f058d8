"""The breakable prefill graph: the trunk of a context step captured once per token bucket, in
pieces, with the parts that read the step's spans run eagerly between them.

A step holding prompt chunks (a context or mixed step: no verify rows, no frame rows) of n rows in
all runs in the graph of the smallest token bucket P >= n (``TOKEN_BUCKETS`` up to the engine's
``max_num_tokens``). The trunk's row-wise work, which reads no span (the embedding, the
hyper-connection sites, the norms, the projections, PLE's gated apply, the MoE), is captured over P
rows. The parts that read the step's spans on the host (``Model.spanwise``: the PLE embedding, each
GDN layer's conv and recurrence, each QSA layer's rotary embedding, KV and index append, block
selection and sparse attention) are the breaks: the forward is captured as one graph piece before
each break and one after the last, and at each replay every break runs eagerly, between its
pieces, over the step's own n rows, exactly as the eager step runs it. It writes its rows into the
static tensor the next piece reads; the rows past n stay zero. The read-out of the rows that need
logits runs eagerly after the last piece (the rows are known only on the host).

Padding rows (n .. P - 1) carry the pad token through the pieces and never reach a break: no
cache plane, state pool or history sees them, so no scratch request is needed at replay. The
capture's eager warm-up runs go over a context step of P rows of the engine's spare slot (the
scratch slot of impl/model/graphs.py), so the breaks they execute touch only that slot; while the
pieces are captured no break runs (``Breaks``, mode ``capture``).

What a replay equals. At a full bucket (n = P) every kernel runs on the shapes and inputs of the
eager step: the logits are the eager step's bits. A padded step runs the pieces at P rows: a variant
that is not batch-invariant may move a row's last bits, as a different eager batch size does; in
batch-invariant mode a padded step's logits are the eager step's bits too
(tests/engine/test_prefill_graphs.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from impl.model.cache import PAGE, EngineCache
from impl.model.graphs import CAPTURABLE_REFERENCES, HOST_READING_KERNELS, CudaGraphPool
from impl.model.model import Model, SelectionSlot, Span, SpanwiseFn, StepOutput, StepRows

# the axes by which a captured op's launch names its row count
ROW_AXES = frozenset({"rows", "tokens"})
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 3072, 4096, 6144, 8192)


def uncapturable_piece_calls(config, ctx) -> list[str]:
    """The ``op::variant`` pairs a breakable prefill graph of ``config``'s engine would capture, at
    any of its buckets, on ``ctx.arch`` that a graph cannot capture: reference variants outside
    ``CAPTURABLE_REFERENCES`` and the ``HOST_READING_KERNELS`` (impl/model/graphs.py). The pieces'
    calls are traced once on meta weights of the served geometry (impl/model/trace.py,
    ``piece_calls``); every one of them takes its launch's row count as its only row axis, so each
    bucket dispatches them with that axis set to the bucket."""
    from impl.model.dispatch import Dispatcher  # noqa: PLC0415
    from impl.model.trace import Chunk, Scenario, piece_calls  # noqa: PLC0415

    buckets = token_buckets(config.prefill_graph_tokens, config.max_seq_len)
    step = Scenario(name="prefill_graph", why="the context step a prefill graph captures",
                    prefill=(Chunk(chunk=buckets[0], context=buckets[0]),),
                    kv_dtype=config.kv_cache_dtype, state_dtype=config.state_dtype,
                    max_num_tokens=config.max_num_tokens, model=config.model)
    d = Dispatcher(ctx.catalog, ctx.arch, numerics=config.numerics,
                   pinned=config.pinned_variants())
    bad: list[str] = []
    for call in piece_calls(step, ctx.catalog):
        for b in buckets:
            axes = {k: (b if k in ROW_AXES else v) for k, v in call.axes}
            variant = d.choose(call.op, **axes)
            name = f"{call.op}::{variant.name}"
            uncapturable = ((variant.impl == "spec" and call.op not in CAPTURABLE_REFERENCES)
                            or name in HOST_READING_KERNELS)
            if uncapturable and name not in bad:
                bad.append(name)
    return bad


def token_buckets(max_num_tokens: int, max_seq_len: int) -> tuple[int, ...]:
    """The row counts prefill graphs are captured at: ``TOKEN_BUCKETS`` below the largest, and the
    largest: ``max_num_tokens`` rows, at most ``max_seq_len``, since a graph is captured over one
    request's context step of its rows (a larger step runs eagerly)."""
    top = min(max_num_tokens, max_seq_len)
    return tuple(sorted({b for b in TOKEN_BUCKETS if b < top} | {top}))


@dataclass
class _Break:
    fn: SpanwiseFn
    inputs: tuple[torch.Tensor, ...]    # its static input buffers (views of P rows)
    out: torch.Tensor                   # the static tensor the piece after it reads, P rows


@dataclass
class Breaks:
    """A prefill graph's breaks (``StepRows.breaks`` of its static rows), in one of three modes:
    ``record`` (the forward runs eagerly: each break runs and is recorded with its static buffers),
    ``capture`` (the forward is being captured: each break's inputs are copied into its input
    buffers, the copies captured at the end of the piece before it, and the break is recorded with
    the output its recorded run left, ``planned``; it runs nothing, since the pieces around it have
    not run) and ``replay`` (break i runs ``fn`` over the step's own rows, ``rows``, the first
    ``n`` rows of its input buffers, into its output; ``run`` serves the CPU stand-in's forward
    run again, copying the inputs it is given first).

    The static buffers live in ``store``, which every bucket's breaks share: a bucket of P rows
    uses the first P rows of buffers of ``max_rows`` rows (one step replays at a time). A break
    whose output only the next piece reads (``shared``, one name a kind of mixer) uses the buffers
    of its name, the others buffers of their own. A break keeps no tensor of the piece before it,
    so the graph pool reuses a layer's activations for the next layer's, as the eager step does.
    The engine holds the PLE break's buffers and one mixer's of each kind, at its largest bucket
    (``memory.prefill_break_bytes``).
    """

    rows: StepRows | None = None                  # the step's rows, as the eager step builds them
    calls: list[_Break] = field(default_factory=list)
    mode: str = "record"
    planned: list[torch.Tensor] = field(default_factory=list)
    on_break: Callable[[], None] | None = None    # the capture's piece boundary
    after_break: Callable[[], None] | None = None
    store: dict[tuple, torch.Tensor] = field(default_factory=dict)
    max_rows: int | None = None
    _next: int = 0

    def run(self, fn: SpanwiseFn, *tensors: torch.Tensor, shared: str | None = None
            ) -> torch.Tensor:
        if self.mode == "replay":             # a forward run again (the CPU stand-in's replay)
            call = self.calls[self._next]
            self._next = (self._next + 1) % len(self.calls)
            for buffer, t in zip(call.inputs, tensors, strict=True):
                buffer.copy_(t)
            self.replay(call)
            return call.out
        inputs = self._stage(tensors, shared)
        if self.mode == "record":
            call = _Break(fn, inputs, self._compute(fn, inputs, None, shared))
            self.calls.append(call)
            return call.out
        self.on_break()
        call = _Break(fn, inputs, self.planned[len(self.calls)])
        self.calls.append(call)
        self.after_break()
        return call.out

    def replay(self, call: _Break) -> None:
        self._compute(call.fn, call.inputs, call.out)

    def _buffer(self, key: tuple, like: torch.Tensor, P: int) -> torch.Tensor:
        full = self.store.get(key)
        if full is None:
            full = self.store[key] = like.new_zeros(max(P, self.max_rows or 0), *like.shape[1:])
        return full[:P]

    def _stage(self, tensors: tuple[torch.Tensor, ...], shared: str | None
               ) -> tuple[torch.Tensor, ...]:
        """The break's inputs copied into its input buffers."""
        name = shared or len(self.calls)
        staged = []
        for j, t in enumerate(tensors):
            buffer = self._buffer(("in", name, j, tuple(t.shape[1:]), t.dtype, t.device), t,
                                  t.shape[0])
            buffer.copy_(t)
            staged.append(buffer)
        return tuple(staged)

    def _compute(self, fn: SpanwiseFn, tensors: tuple[torch.Tensor, ...],
                 out: torch.Tensor | None, shared: str | None = None) -> torch.Tensor:
        rows = self.rows
        n = rows.rows
        y = fn(rows, *(t[:n] for t in tensors))
        if out is None:
            key = ("out", shared or len(self.calls), tuple(y.shape[1:]), y.dtype, y.device)
            out = self._buffer(key, y, tensors[0].shape[0])
        out[:n] = y
        out[n:].zero_()
        return out


class CudaPieces(CudaGraphPool):
    """Captures a prefill step's forward into one CUDA graph piece per stretch between breaks,
    after two eager runs on a side stream that compile and tune every kernel and leave each
    break's static output; while capturing, a break runs nothing (its inputs are not computed
    until a replay). Every piece of one engine's graphs shares a memory pool."""

    def capture(self, forward: Callable[[], StepOutput], breaks: Breaks) -> Callable[[], StepOutput]:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):                # eager runs: every break runs and takes its output
                breaks.calls.clear()
                forward()
        breaks.planned = [call.out for call in breaks.calls]
        breaks.calls.clear()
        torch.cuda.synchronize(self.device)
        pieces: list[torch.cuda.CUDAGraph] = []

        def begin() -> None:
            pieces.append(torch.cuda.CUDAGraph())
            pieces[-1].capture_begin(pool=self.pool)

        breaks.on_break = lambda: pieces[-1].capture_end()
        breaks.after_break = begin
        breaks.mode = "capture"
        with torch.cuda.stream(side):
            begin()
            out = forward()
            pieces[-1].capture_end()
        torch.cuda.current_stream(self.device).wait_stream(side)
        breaks.on_break = breaks.after_break = None
        breaks.mode = "replay"

        def replay() -> StepOutput:
            for piece, call in zip(pieces, [*breaks.calls, None]):
                piece.replay()
                if call is not None:
                    breaks.replay(call)
            return out
        return replay


class EagerPieces:
    """Runs the step's forward again at each replay, its breaks over the step's own rows into the
    static outputs recorded at capture: the graph's host side on a machine without CUDA."""

    @staticmethod
    def host_buffer(t: torch.Tensor) -> torch.Tensor:
        return t

    @staticmethod
    def capture(forward: Callable[[], StepOutput], breaks: Breaks) -> Callable[[], StepOutput]:
        forward()
        breaks.mode = "replay"
        return forward


@dataclass
class _Graph:
    replay: Callable[[], StepOutput] | None
    breaks: Breaks
    handover: SelectionSlot
    ids: torch.Tensor                 # static device [P] int64: the step's tokens, then pad ids
    staged: torch.Tensor              # host copy of ``ids`` (pinned under CUDA)


class PrefillGraphs:
    """The breakable prefill graphs of one engine (its model and cache), made on first use or by
    ``capture_all``."""

    def __init__(self, model: Model, cache: EngineCache, max_num_tokens: int,
                 capture: CudaPieces | EagerPieces | None = None, scratch: int | None = None,
                 max_seq_len: int | None = None):
        self.model = model
        self.cache = cache
        self.scratch = cache.pages.slots - 1 if scratch is None else scratch
        self.buckets = token_buckets(max_num_tokens, max_seq_len if max_seq_len is not None
                                     else cache.pages.pages_per_slot * PAGE)
        self.device = model.w.device
        self.capturer = capture if capture is not None else CudaPieces(self.device)
        self.graphs: dict[int, _Graph] = {}
        self.store: dict[tuple, torch.Tensor] = {}      # the breaks' buffers (``Breaks``)
        self.replays = 0

    def serves(self, spans: list[Span], modes: set[str], frames: bool) -> bool:
        """Whether a step runs in a prefill graph: it holds a prompt chunk, no verify row and no
        frame row, and fits the largest bucket."""
        return ("prefill" in modes and "verify" not in modes and not frames
                and sum(sp.rows for sp in spans) <= self.buckets[-1])

    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} rows exceed the largest prefill bucket {self.buckets[-1]}")

    def capture_all(self) -> None:
        for b in self.buckets:
            if b not in self.graphs:
                self.capture(b)

    def capture(self, P: int) -> _Graph:
        """The graph of bucket P, captured over a context step of P rows of the scratch slot."""
        cache, dev = self.cache, self.device
        cache.assign(self.scratch)
        cache.ensure_pages(self.scratch, P)
        spans = [Span(self.scratch, 0, P, 0, "prefill" if P > 1 else "decode")]
        own = StepRows.build(spans)
        breaks = Breaks(rows=own, store=self.store, max_rows=self.buckets[-1])
        static = replace(own, breaks=breaks)
        host = self.capturer.host_buffer
        g = _Graph(None, breaks, SelectionSlot(keep=True),
                   torch.full((P,), self.model.cfg.pad_id, dtype=torch.int64, device=dev),
                   host(torch.full((P,), self.model.cfg.pad_id, dtype=torch.int64)))
        host_ids = g.staged.clone()
        g.replay = self.capturer.capture(
            lambda: self.model.trunk_forward(host_ids, g.ids, static, cache, logit_rows=[],
                                             handover=g.handover), breaks)
        cache.assign(self.scratch)
        self.graphs[P] = g
        return g

    def step(self, spans: list[Span], ids: list[int], logit_rows: list[int] | None) -> StepOutput:
        """One context or mixed step of ``spans`` (``ids`` their tokens) by graph replay. The
        hidden rows returned are a view of the graph's static output, valid until the next
        replay; the logits are read out eagerly."""
        n = sum(sp.rows for sp in spans)
        P = self.bucket(n)
        g = self.graphs.get(P) or self.capture(P)
        host_ids = torch.tensor(ids, dtype=torch.int64)
        g.staged[:n] = host_ids
        g.staged[n:] = self.model.cfg.pad_id
        g.ids.copy_(g.staged, non_blocking=True)
        g.breaks.rows = StepRows.build(spans).on(self.device)
        g.handover.kept = None
        out = g.replay()
        self.replays += 1
        hidden = out.hidden[:n]
        logits = self.model.read_out_rows(hidden, logit_rows)
        Model.advance(host_ids, spans, self.cache)
        return StepOutput(logits, hidden, None, g.handover.kept, logit_rows)
