"""CUDA graphs of the trunk's decode step: captured once per (batch bucket, table width), replayed.

A decode step of n requests runs in the graph of the smallest batch bucket B >= n and the smallest
table width (a power of two of blocks, at least ``MIN_WIDTH``) that holds the step's longest
request. Its B - n padding rows are tokens of a scratch request: the engine's spare slot
(``EngineCache`` holds one slot more than ``max_batch_size``, never given to a request), padding row
j at position j (its pages are held from the start). Padding rows write that slot's state, conv
window and pages only, so the requests' own state is never touched by them; their results are
discarded. They share the scratch slot's GDN state, so what they leave there is not defined (and
not read by any request).

The graph reads its inputs from static device buffers, filled before each replay from the host:
the ids, slots, positions and lengths of the rows, each row's n-gram history, and the block table's
first ``width`` columns. Everything the step computes from them (``Model.trunk_forward``) is in the
graph; the host side of the step (``Model.advance``: histories, lengths) runs after the replay.

What a replay equals. At a full bucket (n = B) and the width the eager step would use, the replay
launches the kernels the eager step launches, on the same inputs: its logits are the eager step's
bits (tests/engine/test_engine_gpu.py). With padding rows or a wider table the kernels see other
shapes, so a row's last bits may move within the ops' bands, like any change of batch size for a
variant that is not batch-invariant. The dispatch rules are evaluated once, at capture, at the
bucket's batch size and at ``width`` blocks of context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from impl.model.cache import PAGE, EngineCache
from impl.model.model import Model, Span, StepOutput, StepRows

# Reference variants a decode step may capture: tensor ops only, no value read on the host.
CAPTURABLE_REFERENCES = frozenset({"rmsnorm"})
# Kernel variants (op::variant) that read values on the host, which a graph cannot capture: the torch
# MoE composition loops over the experts a call selects.
HOST_READING_KERNELS = frozenset({"moe::torch"})
MIN_WIDTH = 8                         # blocks (256 tokens): the narrowest table a graph reads
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


def uncapturable_calls(config, ctx) -> list[str]:
    """The ``op::variant`` pairs a decode step of ``config.max_batch_size`` rows (at its
    ``max_seq_len``) dispatches on ``ctx.arch`` that a graph cannot capture: reference variants
    outside ``CAPTURABLE_REFERENCES`` and the ``HOST_READING_KERNELS``. Traced on meta weights of
    the served geometry (impl/model/trace.py), so the rule ``cuda_graphs_capture_decode_on_cuda``
    refuses before anything is built."""
    from impl.model.dispatch import Dispatcher  # noqa: PLC0415
    from impl.model.ops import KV_CODEC_OPS  # noqa: PLC0415
    from impl.model.trace import Requests, Scenario, forward_calls  # noqa: PLC0415
    from spec.model import init_weights  # noqa: PLC0415

    weights = init_weights(ctx.model, seed=0, dtype=torch.bfloat16, device="meta")
    step = Scenario(name="decode_graph", why="the decode step a graph captures",
                    decode=(Requests(requests=config.max_batch_size, context=config.max_seq_len),),
                    kv_dtype=config.kv_cache_dtype, state_dtype=config.state_dtype,
                    max_num_tokens=max(config.max_batch_size, 1))
    d = Dispatcher(ctx.catalog, ctx.arch, numerics=config.numerics,
                   pinned=config.pinned_variants())
    calls = forward_calls(step, ctx.catalog, ctx.model, weights)
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


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    rows: StepRows                    # the static rows (device tensors) the graph reads
    ids: torch.Tensor                 # static [B] int64
    out: StepOutput | None            # static outputs the graph writes
    staged: torch.Tensor              # pinned host [6, B]: ids, slots, positions, lengths, history
    staged_table: torch.Tensor        # pinned host [slots, width] int32


class DecodeGraphs:
    """The captured decode steps of one engine (its model and cache), made on first use."""

    def __init__(self, model: Model, cache: EngineCache, max_batch_size: int):
        if cache.pages.slots != max_batch_size + 1:
            raise ValueError("decode graphs need the cache's spare slot (max_batch_size + 1 slots)")
        self.model = model
        self.cache = cache
        self.scratch = max_batch_size
        self.buckets = batch_buckets(max_batch_size)
        self.device = model.w.device
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.replays = 0
        # Padding row j stores its token at position j of the scratch slot: no two rows of a
        # launch write one KV slot.
        self.padding_positions = min(self.buckets[-1], cache.pages.pages_per_slot * PAGE)
        cache.assign(self.scratch)
        cache.ensure_pages(self.scratch, self.padding_positions)

    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} decode rows exceed the largest bucket {self.buckets[-1]}")

    # ------------------------------------------------------------------ filling the inputs

    def _fill(self, g: _Graph, spans: list[Span], ids: list[int]) -> None:
        """The static inputs of ``g`` for ``spans`` (padding rows after them), in two copies from
        pinned host buffers (the previous replay's outputs have been read by then)."""
        B, n = g.ids.shape[0], len(spans)
        cache, host = self.cache, g.staged
        host[0, n:] = 0
        host[1, n:] = self.scratch
        host[2, n:] = torch.arange(B - n) % self.padding_positions
        host[4:6, n:] = self.model.cfg.pad_id
        if n:
            host[0, :n] = torch.tensor(ids, dtype=torch.int64)
            host[1, :n] = torch.tensor([sp.slot for sp in spans], dtype=torch.int64)
            host[2, :n] = torch.tensor([sp.start for sp in spans], dtype=torch.int64)
            host[4:6, :n] = cache.ple_history[host[1, :n]].T
        host[3] = host[2] + 1                       # each row's length after the step
        width = g.rows.table.shape[1]
        g.staged_table.copy_(cache.pages.block_table[:, :width])
        dev = host.to(self.device, non_blocking=True)
        g.ids.copy_(dev[0])
        g.rows.seq_ids.copy_(dev[1])
        g.rows.positions.copy_(dev[2])
        g.rows.context_lens.copy_(dev[3])
        g.rows.ple_history.copy_(dev[4:6].T)
        g.rows.table.copy_(g.staged_table, non_blocking=True)

    # ------------------------------------------------------------------ capture

    def _capture(self, B: int, width: int) -> _Graph:
        dev = self.device
        zeros = lambda *shape, dtype=torch.int64: torch.zeros(*shape, dtype=dtype, device=dev)  # noqa: E731
        spans = [Span(self.scratch, r, r + 1, 0, "decode") for r in range(B)]
        rows = StepRows("decode", spans, zeros(B), zeros(B), zeros(B), width * PAGE,
                        table=zeros(self.cache.pages.slots, width, dtype=torch.int32),
                        ple_history=zeros(B, 2))
        g = _Graph(torch.cuda.CUDAGraph(), rows, zeros(B), None,
                   torch.zeros(6, B, dtype=torch.int64).pin_memory(),
                   torch.zeros(self.cache.pages.slots, width, dtype=torch.int32).pin_memory())
        self._fill(g, [], [])                       # every row a padding row: the scratch slot
        host_ids = torch.zeros(B, dtype=torch.int64)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):               # compiles and tunes every kernel first
            for _ in range(2):
                self.model.trunk_forward(host_ids, g.ids, rows, self.cache)
        torch.cuda.current_stream(dev).wait_stream(side)
        with torch.cuda.graph(g.graph, pool=self.pool):
            g.out = self.model.trunk_forward(host_ids, g.ids, rows, self.cache)
        self.graphs[(B, width)] = g
        return g

    # ------------------------------------------------------------------ a step

    def step(self, spans: list[Span], ids: list[int]) -> StepOutput:
        """One decode step of ``spans`` (one row each, ``ids`` their tokens) by graph replay. The
        logits and hidden rows returned are views of the graph's static outputs, valid until the
        next replay."""
        if any(sp.mode != "decode" or sp.rows != 1 for sp in spans):
            raise ValueError("a decode graph runs one decode row per request")
        n = len(spans)
        B = self.bucket(n)
        context = max(sp.start + 1 for sp in spans)
        width = table_width(context, self.cache.pages.pages_per_slot)
        g = self.graphs.get((B, width)) or self._capture(B, width)
        self._fill(g, spans, ids)
        g.graph.replay()
        self.replays += 1
        Model.advance(torch.tensor(ids, dtype=torch.int64), spans, self.cache)
        return StepOutput(g.out.logits[:n], g.out.hidden[:n], logit_rows=None)
