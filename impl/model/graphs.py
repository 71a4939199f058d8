"""CUDA graphs of the trunk's decode and verify steps: captured once per (rows a request, batch
bucket, table width), replayed.

A step of n requests of T rows each (T = 1: decode; T = K + 1: an MTP verify step) runs in the graph
of the smallest batch bucket B >= n and the smallest table width (a power of two of blocks, at least
``MIN_WIDTH``) that holds the step's longest request. Its B - n padding requests are rows of a
scratch request: the engine's spare slot (``EngineCache`` holds one slot more than
``max_batch_size``, never given to a request), padding request j at positions j*T .. j*T + T - 1
(its pages are held from the start). Padding rows write that slot's state, conv window and pages
only, so the requests' own state is never touched by them; their results are discarded. They share
the scratch slot's GDN state, so what they leave there is not defined (and not read by any request).

The graph reads its inputs from one static device buffer, filled before each replay from a pinned
host buffer in one copy: the ids, slots, positions and lengths of the rows, each request's n-gram
history, and the block table's first ``width`` columns. Everything the step computes from them
(``Model.trunk_forward``) is in the graph; the host side of the step (``Model.advance``: histories,
lengths; for a verify step the n-gram history after each row that commit keeps) runs after the
replay. What follows a verify step (greedy acceptance, commit, the draft layer) runs eagerly.

What a replay equals. At a full bucket (n = B) and the width the eager step would use, the replay
launches the kernels the eager step launches, on the same inputs: its logits are the eager step's
bits (tests/engine/test_engine_gpu.py). With padding rows or a wider table the kernels see other
shapes, so a row's last bits may move within the ops' bands, like any change of batch size for a
variant that is not batch-invariant. The dispatch rules are evaluated once, at capture, at the
bucket's batch size and at ``width`` blocks of context.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from impl.model.cache import PAGE, EngineCache
from impl.model.model import Model, Span, StepOutput, StepRows, verify_histories

# Reference variants a decode step may capture: tensor ops only, no value read on the host.
CAPTURABLE_REFERENCES = frozenset({"rmsnorm"})
# Kernel variants (op::variant) that read values on the host, which a graph cannot capture: the torch
# MoE composition loops over the experts a call selects.
HOST_READING_KERNELS = frozenset({"moe::torch"})
MIN_WIDTH = 8                         # blocks (256 tokens): the narrowest table a graph reads
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


def uncapturable_calls(config, ctx) -> list[str]:
    """The ``op::variant`` pairs the trunk of a step the engine captures (a decode step of
    ``config.max_batch_size`` rows, or with speculation a verify step of as many requests), at its
    ``max_seq_len``, dispatches on ``ctx.arch`` that a graph cannot capture: reference variants
    outside ``CAPTURABLE_REFERENCES`` and the ``HOST_READING_KERNELS``. Traced on meta weights of
    the served geometry (impl/model/trace.py), so the rule ``cuda_graphs_capture_on_cuda``
    refuses before anything is built."""
    from impl.model.dispatch import Dispatcher  # noqa: PLC0415
    from impl.model.ops import KV_CODEC_OPS  # noqa: PLC0415
    from impl.model.trace import Requests, Scenario, forward_calls  # noqa: PLC0415
    from spec.model import init_weights  # noqa: PLC0415

    weights = init_weights(ctx.model, seed=0, dtype=torch.bfloat16, device="meta")
    requests = (Requests(requests=config.max_batch_size, context=config.max_seq_len),)
    spec = config.speculative
    if spec is None:
        step = Scenario(name="decode_graph", why="the decode step a graph captures",
                        decode=requests, kv_dtype=config.kv_cache_dtype,
                        state_dtype=config.state_dtype, max_num_tokens=max(config.max_batch_size, 1))
    else:
        step = Scenario(name="verify_graph", why="the verify step a graph captures",
                        verify=requests, draft_length=spec.draft_length,
                        index_share=spec.index_share, gdn_commit=config.gdn_commit,
                        kv_dtype=config.kv_cache_dtype, state_dtype=config.state_dtype,
                        max_num_tokens=config.max_batch_size * (spec.draft_length + 1))
    d = Dispatcher(ctx.catalog, ctx.arch, numerics=config.numerics,
                   pinned=config.pinned_variants())
    calls = forward_calls(step, ctx.catalog, ctx.model, weights, trunk_only=True)
    chosen = [(call.op, d.choose(call.op, **dict(call.axes))) for call in calls]
    # The trace runs the reference KV append, which calls the codec ops; a kernel append
    # quantises inside and calls none.
    kernel_append = any(op == "qsa_kv_append" and v.impl != "spec" for op, v in chosen)
    bad = []
    for op, variant in chosen:
        name = f"{op}::{variant.name}"
        reference = (variant.impl == "spec" and op not in CAPTURABLE_REFERENCES
                     and not (kernel_append and op in KV_CODEC_OPS.values()))
        if (reference or name in HOST_READING_KERNELS) and name not in bad:
            bad.append(name)
    return bad


def batch_buckets(max_batch_size: int) -> tuple[int, ...]:
    """The batch sizes graphs are captured at: ``BUCKETS`` up to max_batch_size, and it."""
    return tuple(sorted({b for b in BUCKETS if b < max_batch_size} | {max_batch_size}))


def table_width(context: int, max_width: int) -> int:
    """The table width (blocks) of a step whose longest request holds ``context`` tokens."""
    need = max(1, -(-context // PAGE))
    width = MIN_WIDTH
    while width < need:
        width *= 2
    return min(width, max_width)


class CudaGraphPool:
    """The memory pool one set of an engine's CUDA graphs shares, and the pinned host buffers
    their static inputs are copied from."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    @staticmethod
    def host_buffer(t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory()


class CudaCapture(CudaGraphPool):
    """Captures a step's device work into a CUDA graph, after two eager runs on a side stream that
    compile and tune every kernel; all graphs of one engine share a memory pool."""

    def capture(self, forward: Callable[[], StepOutput]) -> Callable[[], StepOutput]:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                forward()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = forward()

        def replay() -> StepOutput:
            graph.replay()
            return out
        return replay


class EagerCapture:
    """Runs the step's forward again at each replay, on the same static inputs: the step graphs'
    inputs, padding and outputs exercised on a machine without CUDA (tests)."""

    @staticmethod
    def host_buffer(t: torch.Tensor) -> torch.Tensor:
        return t

    @staticmethod
    def capture(forward: Callable[[], StepOutput]) -> Callable[[], StepOutput]:
        return forward


@dataclass
class _Graph:
    replay: Callable[[], StepOutput] | None
    rows: StepRows                    # the static rows (views of ``inputs``) the graph reads
    ids: torch.Tensor                 # static [B*T] int64 (a view of ``inputs``)
    inputs: torch.Tensor              # static device [4*B*T + 2*B] int64
    staged: torch.Tensor              # host copy of ``inputs`` (pinned under CUDA)
    staged_table: torch.Tensor        # host [slots, width] int32 (pinned under CUDA)


class StepGraphs:
    """The captured decode and verify steps of one engine (its model and cache), made on first
    use."""

    def __init__(self, model: Model, cache: EngineCache, max_batch_size: int,
                 rows_per_request: int = 1, capture: CudaCapture | EagerCapture | None = None):
        if cache.pages.slots != max_batch_size + 1:
            raise ValueError("step graphs need the cache's spare slot (max_batch_size + 1 slots)")
        self.model = model
        self.cache = cache
        self.scratch = max_batch_size
        self.buckets = batch_buckets(max_batch_size)
        self.device = model.w.device
        self.capturer = capture if capture is not None else CudaCapture(self.device)
        self.graphs: dict[tuple[int, int, int], _Graph] = {}
        self.replays = 0
        # Padding request j stores its T tokens at positions j*T .. of the scratch slot: no two
        # rows of a launch write one KV slot.
        self.padding_positions = min(self.buckets[-1] * rows_per_request,
                                     cache.pages.pages_per_slot * PAGE)
        cache.assign(self.scratch)
        cache.ensure_pages(self.scratch, self.padding_positions)

    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} requests exceed the largest bucket {self.buckets[-1]}")

    def _padding_start(self, j: int, T: int) -> int:
        start = j * T
        return start if start + T <= self.padding_positions else 0

    # ------------------------------------------------------------------ filling the inputs

    def _fill(self, g: _Graph, spans: list[Span], ids: list[int]) -> None:
        """The static inputs of ``g`` for ``spans`` (padding requests after them), in two copies
        from pinned host buffers (the previous replay's outputs have been read by then)."""
        B, n, T = g.rows.span_history.shape[0], len(spans), g.rows.spans[0].rows
        N = B * T
        host = g.staged
        rows = host[:4 * N].view(4, N)               # ids, slots, positions, lengths
        hist = host[4 * N:].view(B, 2)
        starts = [sp.start for sp in spans] + [self._padding_start(j, T) for j in range(n, B)]
        slots = [sp.slot for sp in spans] + [self.scratch] * (B - n)
        start = torch.tensor(starts, dtype=torch.int64)
        rows[0, :n * T] = torch.tensor(ids, dtype=torch.int64)
        rows[0, n * T:] = 0
        rows[1] = torch.tensor(slots, dtype=torch.int64).repeat_interleave(T)
        rows[2] = (start[:, None] + torch.arange(T)).flatten()
        rows[3] = (start + T).repeat_interleave(T)
        hist[:n] = self.cache.ple_history[torch.tensor(slots[:n], dtype=torch.int64)]
        hist[n:] = self.model.cfg.pad_id
        width = g.rows.table.shape[1]
        g.staged_table.copy_(self.cache.pages.block_table[:, :width])
        g.inputs.copy_(host, non_blocking=True)
        g.rows.table.copy_(g.staged_table, non_blocking=True)

    # ------------------------------------------------------------------ capture

    def _capture(self, T: int, B: int, width: int) -> _Graph:
        dev, N = self.device, B * T
        mode = "decode" if T == 1 else "verify"
        spans = [Span(self.scratch, j * T, (j + 1) * T, self._padding_start(j, T), mode)
                 for j in range(B)]
        inputs = torch.zeros(4 * N + 2 * B, dtype=torch.int64, device=dev)
        seq_ids, positions, lengths = (inputs[i * N:(i + 1) * N] for i in (1, 2, 3))
        hist = inputs[4 * N:].view(B, 2)
        rows = StepRows(mode, spans, seq_ids, positions, lengths, width * PAGE,
                        table=torch.zeros(self.cache.pages.slots, width, dtype=torch.int32,
                                          device=dev),
                        ple_history=hist if T == 1 else None, span_history=hist)
        host = self.capturer.host_buffer
        g = _Graph(None, rows, inputs[:N], inputs,
                   host(torch.zeros(4 * N + 2 * B, dtype=torch.int64)),
                   host(torch.zeros(self.cache.pages.slots, width, dtype=torch.int32)))
        self._fill(g, [], [])                       # every request a padding one: the scratch slot
        host_ids = torch.zeros(N, dtype=torch.int64)
        g.replay = self.capturer.capture(
            lambda: self.model.trunk_forward(host_ids, g.ids, rows, self.cache))
        self.graphs[(T, B, width)] = g
        return g

    # ------------------------------------------------------------------ a step

    def step(self, spans: list[Span], ids: list[int]) -> StepOutput:
        """One decode step (one row a request) or verify step (T rows a request) of ``spans``
        (``ids`` their tokens) by graph replay. The logits, hidden rows, selection and record
        returned are views of the graph's static outputs, valid until the next replay."""
        modes = {sp.mode for sp in spans}
        T = spans[0].rows if spans else 1
        if modes not in ({"decode"}, {"verify"}) or any(sp.rows != T for sp in spans) or \
                (modes == {"verify"}) != (T > 1):
            raise ValueError("a step graph runs decode rows (one a request) or verify rows (the "
                             "same number a request, more than one)")
        n = len(spans)
        B = self.bucket(n)
        context = max(sp.start + sp.rows for sp in spans)
        width = table_width(context, self.cache.pages.pages_per_slot)
        g = self.graphs.get((T, B, width)) or self._capture(T, B, width)
        self._fill(g, spans, ids)
        out = g.replay()
        self.replays += 1
        host_ids = torch.tensor(ids, dtype=torch.int64)
        record = out.record
        if record is not None:                      # the host side of the record: this step's
            record = replace(record, ple_history=verify_histories(host_ids, spans, self.cache))
        Model.advance(host_ids, spans, self.cache)
        m = n * T
        selection = out.selection[:m] if out.selection is not None else None
        return StepOutput(out.logits[:m], out.hidden[:m], record, selection, logit_rows=None)
