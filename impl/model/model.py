"""The model's forward over one engine step: the trunk and the MTP draft layer, built from ``Ops``.

It computes what spec/model.py computes (the assembly of docs/spec.md, the same decisions: PLE inside
the mixer's HC site, the GDN path chosen per request, verify rows decoded one at a time in the state's storage
dtype), but over the engine's state: paged planes addressed through the engine's block table, the GDN
state pool and conv windows indexed by slot, and every op dispatched through the catalog's variant
rules. A verify step also returns what commit needs to roll back (``VerifyRecord``), and ``commit_gdn``
commits its GDN layers.

The GDN commit (``gdn_commit``, EngineConfig.gdn_commit):
- ``cached`` (the default): the verify step records the state after each of its rows (``gdn_verify``'s
  ``states``) and writes the last row's to the pool; commit copies the accepted row's state
  (``rollback_commit``). The record holds K + 1 states a request and GDN layer, written into the
  layer's verify buffer (``GDNPool.verify_states``): one buffer serves the eager steps and every
  captured verify graph, and the engine's memory plan counts it.
- ``recompute``: the verify step leaves the pool at the pre-verify state and records the rows'
  recurrence inputs (q, k, v, a, b, z after the conv); commit re-runs the accepted rows' recurrence
  from the pool, one ``gdn_decode`` launch a row over the requests that accepted it. The record holds
  views of the rows' projections (about 50 KB a row and layer at the target, against a 3.1 MB fp32
  state); ``gdn_verify`` still computes every row's state for its outputs, one layer at a time, and
  none is kept. Commit pays up to K + 1 decode launches a layer. The spec stores the state after
  every row in its storage dtype exactly as K + 1 decode steps do (spec/model.py), so both commits
  give the same state.
The conv window is a slice of the inputs either way: the verify step records it after every row.

A step is a list of ``Span``s, one per request: the request's slot, its rows in the step, the position
of its first row and its GDN mode (decode: one row; prefill: a chunk of a prompt; verify: K+1 rows).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from impl.model.cache import EngineCache, GDNPool
from impl.model.ops import DTYPE_NAME, Ops
from spec.config import ModelConfig
from spec.model import LayerWeights, Weights
from spec.numerics import acc_dtype, is_reference_mode, out_cast
from spec.ops.ple import ple_history_advance
from spec.ops.qsa import QsaPlanes

CPU = torch.device("cpu")


class Breaks(Protocol):
    """Where the parts of a step that read its spans on the host run (``Model.spanwise``)."""

    def run(self, fn: SpanwiseFn, *tensors: torch.Tensor, shared: str | None = None
            ) -> torch.Tensor: ...


# fn(rows, *tensors) -> a tensor of one row per step row: ``rows`` the step's own, the tensors'
# leading axis its rows
SpanwiseFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Span:
    slot: int
    lo: int
    hi: int
    start: int
    mode: str  # "decode" | "prefill" | "verify"

    @property
    def rows(self) -> int:
        return self.hi - self.lo


@dataclass
class StepRows:
    """The rows of one step (int64 [N]): slot, absolute position, the request's length after the
    step; and ``context``, the longest of those lengths (a host int: it sizes the block table the
    QSA ops read). Built on the host (``build``); the first QSA layer of an eager step leaves the
    block table it copied to the device in ``table`` for the others. A captured step
    (impl/model/graphs.py) holds the rows on the device instead, with ``table`` (the device block
    table of the step's width),
    ``ple_history`` (each row's n-gram history [N, 2], spans of one row only) and ``span_history``
    (each span's request history before the step [S, 2], spans of several rows), so that its
    forward reads no host value."""

    kind: str  # the launch kind QSA cells name: decode | verify | prefill | mixed
    spans: list[Span]
    seq_ids: torch.Tensor
    positions: torch.Tensor
    context_lens: torch.Tensor
    context: int
    table: torch.Tensor | None = None
    ple_history: torch.Tensor | None = None
    span_history: torch.Tensor | None = None
    # [3, N] rotary positions of a step holding a frame prompt (impl/model/vision.py); None: the
    # rows rotate by ``positions``
    rope_positions: torch.Tensor | None = None
    # a breakable prefill graph's breaks (impl/model/prefill_graphs.py): the parts of the forward
    # that read the step's spans run through it; None: they run in line
    breaks: Breaks | None = None

    @classmethod
    def build(cls, spans: list[Span]) -> StepRows:
        seq, pos, ctx = [], [], []
        for sp in spans:
            seq += [sp.slot] * sp.rows
            pos += list(range(sp.start, sp.start + sp.rows))
            ctx += [sp.start + sp.rows] * sp.rows
        as_long = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        return cls(step_kind(spans), spans, as_long(seq), as_long(pos), as_long(ctx),
                   max(ctx, default=0))

    def on(self, device: torch.device) -> StepRows:
        """The rows with their tensors on ``device`` (``host_to_device``): an eager step on a GPU
        makes this one copy, and its ops find the rows there. On the host or meta, the rows
        themselves (the tracer's ops read them on the host)."""
        if torch.device(device).type != "cuda" or self.seq_ids.is_cuda:
            return self
        rows = torch.stack([self.seq_ids, self.positions, self.context_lens])
        seq, pos, ctx = host_to_device(rows, device).unbind(0)
        rope = None if self.rope_positions is None else host_to_device(self.rope_positions, device)
        return replace(self, seq_ids=seq, positions=pos, context_lens=ctx, rope_positions=rope)

    @property
    def rows(self) -> int:
        return int(self.seq_ids.shape[0])

    def qsa_axes(self) -> dict:
        return dict(step=self.kind, batch=len(self.spans), rows=self.rows, context=self.context)


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (on the host) on ``device``. To a GPU it goes through a pinned copy with a
    non-blocking transfer: a plain copy of a host tensor to a GPU synchronises the stream (torch
    waits for the transfer, so for every kernel queued before it), and an eager step with one per
    layer would leave the GPU idle while the host queues each layer's kernels."""
    if torch.device(device).type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.contiguous().pin_memory().to(device, non_blocking=True)


def step_kind(spans: list[Span]) -> str:
    modes = {sp.mode for sp in spans}
    return ("verify" if modes == {"verify"} else "decode" if modes == {"decode"}
            else "prefill" if modes == {"prefill"} else "mixed")


@dataclass(frozen=True)
class GdnRows:
    """A verify step's rows as one GDN layer's recurrence reads them, per request: q, k
    [R, T, HK, K]; v, z [R, T, HV, V]; a, b [R, T, HV]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    z: torch.Tensor


@dataclass
class VerifyRecord:
    """What a verify step leaves for commit, per GDN layer for its verifying requests in step order
    (axis 0): the conv window after each row; with the cached GDN commit the state after each row,
    with the recomputing one the rows' recurrence inputs; and the PLE history after each row. Views
    of the step's tensors, no copy (a captured step leaves them in its static outputs)."""

    states: dict[int, torch.Tensor] = field(default_factory=dict)    # layer -> [R, T, HV, K, V]
    inputs: dict[int, GdnRows] = field(default_factory=dict)         # layer -> rows [R, T, ...]
    windows: dict[int, torch.Tensor] = field(default_factory=dict)   # layer -> [R, T, ch, 3]
    ple_history: torch.Tensor | None = None                          # [R, T, 2] int64, host


def verify_histories(ids: torch.Tensor, spans: list[Span], cache: EngineCache) -> torch.Tensor:
    """[R, T, 2]: each verifying request's n-gram history after each of its rows (host)."""
    out = []
    for sp in spans:
        if sp.mode != "verify":
            continue
        h, after = cache.ple_history[sp.slot], []
        for t in ids[sp.lo:sp.hi]:
            h = ple_history_advance(h, t.reshape(1))
            after.append(h)
        out.append(torch.stack(after))
    return torch.stack(out)


@dataclass
class SelectionSlot:
    """IndexShare's hand-over: ``keep`` asks a layer to leave its selection in ``kept``; ``shared``
    [N, W] gives a layer the selection to use (a row of -2 = score its own)."""

    keep: bool = False
    kept: torch.Tensor | None = None
    shared: torch.Tensor | None = None


@dataclass
class StepOutput:
    logits: torch.Tensor          # [N, V] fp32 (float64 in reference mode)
    hidden: torch.Tensor          # [N, C] the stream mean before the final norm (acc dtype)
    record: VerifyRecord | None = None
    selection: torch.Tensor | None = None   # trunk: the last QSA layer's selected blocks [N, W]
    logit_rows: list[int] | None = None     # the rows ``logits`` holds, in order (None: every row)

    def logits_at(self, row: int) -> torch.Tensor:
        """The logits of step row ``row`` (which must be one the pass read out)."""
        if self.logit_rows is None:
            return self.logits[row]
        return self.logits[self.logit_rows.index(row)]


class Model:
    """The forward of the trunk and the draft layer for one set of weights."""

    def __init__(self, weights: Weights, cfg: ModelConfig, ops: Ops, gdn_commit: str = "cached"):
        self.w = weights
        self.cfg = cfg
        self.ops = ops
        self.gdn_commit = gdn_commit   # "cached" | "recompute" (module doc)
        self.act = weights.dtype
        gdn = cfg.gdn_key_heads, cfg.gdn_value_heads, cfg.gdn_d_k
        self.gdn_geometry = dict(key_heads=gdn[0], value_heads=gdn[1], head_dim=gdn[2])

    # ------------------------------------------------------------------ building blocks

    @staticmethod
    def spanwise(rows: StepRows, fn: SpanwiseFn, *tensors: torch.Tensor,
                 shared: str | None = None) -> torch.Tensor:
        """``fn(rows, *tensors)``: a part of the step that reads its spans on the host (the GDN
        conv and recurrence, the QSA append, selection and attention, the PLE embedding). With
        ``rows.breaks`` (a breakable prefill graph) it runs there, between captured pieces, over
        the step's own rows; the rest of the forward reads no span. ``shared`` names a part whose
        inputs and output are read only around it, so that the parts of one name (each layer's
        mixer) may use one set of buffers; None: its output is read further on (the PLE rows)."""
        if rows.breaks is None:
            return fn(rows, *tensors)
        return rows.breaks.run(fn, *tensors, shared=shared)

    def _linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """A dense projection (op ``linear``) of activations in the model's dtype."""
        return self.ops.linear(x.to(self.act), w)

    def _hc_site(self, X, site, norm_w, sublayer):
        cfg, ops = self.cfg, self.ops
        v, r = ops.hc_inject_norm(X, cfg.eps)
        coef = ops.hc_first_projection(v, r, site.phi, site.bias, cfg.hc_streams, cfg.sinkhorn_iters,
                                       X.shape[-1])
        x_in = ops.hc_pre(X, coef.h_pre, self.act)
        y = sublayer(ops.rmsnorm(x_in, norm_w, cfg.eps))
        return ops.hc_up_projection(X, y, coef.h_res, coef.h_post)

    def _layer(self, X, lw: LayerWeights, li: int | None, e_l, cache: EngineCache, rows: StepRows,
               record: VerifyRecord | None, planes: QsaPlanes | None, selection=None):
        def mixer(u):
            if lw.kind == "gdn":
                y = self._gdn(u, lw.mixer, cache.layers[li], li, rows, record)
            else:
                y = self._qsa(u, lw.mixer, cache, rows, planes, selection)
            if lw.ple is not None:
                y = self.ops.ple_apply(y, e_l, lw.ple.w_gate, lw.ple.w_out, lw.ple.norm_w, self.act)
            return y

        X, _ = self._hc_site(X, lw.hc_mixer, lw.norm_mixer, mixer)
        return self._hc_site(X, lw.hc_moe, lw.norm_moe,
                             lambda u: self.ops.moe(u, lw.moe, self.cfg.moe_top_k))

    # ------------------------------------------------------------------ GDN mixer

    def _gdn(self, u, w, pool: GDNPool, li: int, rows: StepRows, record: VerifyRecord | None):
        cfg, act = self.cfg, self.act
        N = u.shape[0]
        hk, hv, dk, dv, r = (cfg.gdn_key_heads, cfg.gdn_value_heads, cfg.gdn_d_k, cfg.gdn_d_v,
                             cfg.gdn_group)
        qkvz = self._linear(u, w.in_proj_qkvz).view(N, hk, 2 * dk + 2 * r * dv)
        ba = self._linear(u, w.in_proj_ba).view(N, hk, 2 * r)
        z = qkvz[..., 2 * dk + r * dv:].reshape(N, hv, dv)
        b = ba[..., :r].reshape(N, hv)
        a = ba[..., r:].reshape(N, hv)
        mixed = torch.cat([qkvz[..., :dk].reshape(N, hk * dk),
                           qkvz[..., dk:2 * dk].reshape(N, hk * dk),
                           qkvz[..., 2 * dk:2 * dk + r * dv].reshape(N, hv * dv)], dim=-1)

        out = self.spanwise(rows, lambda rs, *t: self._gdn_rows(rs, *t, w, pool, li, record),
                            mixed, a, b, z, shared="gdn")
        return self._linear(out.reshape(N, hv * dv).to(act), w.out_proj)

    def _gdn_rows(self, rows: StepRows, mixed, a, b, z, w, pool: GDNPool, li: int,
                  record: VerifyRecord | None) -> torch.Tensor:
        """The GDN layer's conv and recurrence over each span by its mode: out [N, HV, V]."""
        cfg, ops, act = self.cfg, self.ops, self.act
        N = mixed.shape[0]
        hk, hv, dk, dv = cfg.gdn_key_heads, cfg.gdn_value_heads, cfg.gdn_d_k, cfg.gdn_d_v

        def split(y):
            M = y.shape[0]
            return (y[:, :hk * dk].view(M, hk, dk), y[:, hk * dk:2 * hk * dk].view(M, hk, dk),
                    y[:, 2 * hk * dk:].view(M, hv, dv))

        out = torch.empty(N, hv, dv, dtype=act, device=mixed.device)
        geo = self.gdn_geometry
        decode = [sp for sp in rows.spans if sp.mode == "decode"]
        verify = [sp for sp in rows.spans if sp.mode == "verify"]
        prefill = [sp for sp in rows.spans if sp.mode == "prefill"]
        dev = pool.state.device
        if decode and rows.kind == "decode":   # every row: no gather, the slots are the rows'
            slots = rows.seq_ids.to(dev)
            y, conv = ops.conv_update(mixed, w.conv_w, pool.conv[slots], geometry=geo)
            pool.conv[slots] = conv
            q, k, v = split(y)
            out = ops.gdn_decode(q, k, v, a, b, w.A_log, w.dt_bias, z, w.norm_w, pool.state, slots)
        elif decode:
            idx = host_to_device(torch.tensor([sp.lo for sp in decode]), mixed.device)
            slots = host_to_device(torch.tensor([sp.slot for sp in decode], dtype=torch.int64), dev)
            y, conv = ops.conv_update(mixed[idx], w.conv_w, pool.conv[slots], geometry=geo)
            pool.conv[slots] = conv
            q, k, v = split(y)
            out[idx] = ops.gdn_decode(q, k, v, a[idx], b[idx], w.A_log, w.dt_bias, z[idx], w.norm_w,
                                      pool.state, slots)
        if verify:
            T, Bv = verify[0].rows, len(verify)
            if any(sp.rows != T for sp in verify):
                raise ValueError("a verify step brings the same number of rows for every request")
            if rows.kind == "verify":  # every row, in request order: views, slots on the device
                idx = slice(None)
                slots = rows.seq_ids.view(Bv, T)[:, 0]
            else:
                idx = host_to_device(torch.cat([torch.arange(sp.lo, sp.hi) for sp in verify]),
                                     mixed.device)
                slots = host_to_device(torch.tensor([sp.slot for sp in verify], dtype=torch.int64),
                                       dev)
            x = mixed[idx].view(Bv, T, -1)
            old_window = pool.conv[slots.to(dev)]
            y, conv = ops.conv_prefill(x, w.conv_w, old_window, geometry=geo)
            q, k, v = split(y.reshape(Bv * T, -1))
            shape = lambda t: t.reshape(Bv, T, *t.shape[1:])  # noqa: E731
            scratch = pool.verify_scratch(Bv, T) if self.gdn_commit == "cached" else None
            o, states = ops.gdn_verify(shape(q), shape(k), shape(v), shape(a[idx]), shape(b[idx]),
                                       w.A_log, w.dt_bias, shape(z[idx]), w.norm_w, pool.state,
                                       slots.to(dev), states=scratch)
            out[idx] = o.reshape(Bv * T, hv, dv)
            # Provisionally keep every row (all accepted); commit rolls back to the accepted one.
            # The recomputing commit re-runs the accepted rows from the pre-verify state instead.
            if self.gdn_commit == "cached":
                pool.state[slots.to(dev)] = states[:, -1].to(pool.state.dtype)
            pool.conv[slots.to(dev)] = conv
            if record is not None:
                hist = torch.cat([old_window, x.transpose(1, 2)], dim=2)  # [Bv, ch, 3 + T]
                k_hist = old_window.shape[-1]
                if self.gdn_commit == "cached":
                    record.states[li] = states
                else:
                    record.inputs[li] = GdnRows(*(shape(t) for t in
                                                  (q, k, v, a[idx], b[idx], z[idx])))
                # the window after row i: columns i + 1 .. i + 3 of the history, [Bv, T, ch, 3]
                record.windows[li] = hist.unfold(2, k_hist, 1)[:, :, 1:].transpose(1, 2)
        for sp in prefill:   # the slot as a slice: no index tensor copied from the host
            s = slice(sp.slot, sp.slot + 1)
            x = mixed[sp.lo:sp.hi][None]
            y, conv = ops.conv_prefill(x, w.conv_w, pool.conv[s].clone(), geometry=geo)
            pool.conv[s] = conv
            q, k, v = split(y[0])
            acc = acc_dtype(mixed, w.conv_w)
            o, final = ops.gdn_prefill(q[None], k[None], v[None], a[None, sp.lo:sp.hi],
                                       b[None, sp.lo:sp.hi], w.A_log, w.dt_bias, z[None, sp.lo:sp.hi],
                                       w.norm_w, pool.state[s].to(acc, copy=True))
            pool.state[s] = final.to(pool.state.dtype)
            out[sp.lo:sp.hi] = o[0]
        return out

    def commit_gdn(self, record: VerifyRecord, cache: EngineCache, slots: list[int],
                   num_accepted: torch.Tensor) -> None:
        """Commit a verify step's GDN layers: request r (slot ``slots[r]``, the step's r-th verifying
        request) keeps its state and conv window after row ``num_accepted[r] - 1`` (docs/spec.md,
        "Rollback / commit"), by the configured ``gdn_commit`` (module doc). A captured step's
        record holds padding requests past ``len(slots)``."""
        R = len(slots)
        for li, layer in enumerate(cache.layers):
            if not isinstance(layer, GDNPool):
                continue
            windows = record.windows[li][:R].contiguous()
            records, axes = {"conv_window": windows}, dict(conv_channels=windows.shape[2])
            if self.gdn_commit == "cached":
                states = record.states[li][:R]
                records = {"gdn_state": states, **records}
                axes.update(state_dtype=DTYPE_NAME[layer.state.dtype], value_heads=states.shape[2],
                            head_dim=states.shape[-1])
            kept = self.ops.rollback_commit(records, num_accepted, **axes)
            idx = torch.tensor(slots, device=layer.state.device)
            layer.conv[idx] = kept["conv_window"].to(layer.conv.dtype)
            if self.gdn_commit == "cached":
                layer.state[idx] = kept["gdn_state"].to(layer.state.dtype)
            else:
                self._recompute_gdn(self.w.layers[li].mixer, layer, record.inputs[li], slots,
                                    num_accepted)

    def _recompute_gdn(self, w, pool: GDNPool, rows: GdnRows, slots: list[int],
                       num_accepted: torch.Tensor) -> None:
        """The accepted rows' recurrence re-run from the pre-verify state in the pool: row j in one
        ``gdn_decode`` launch over the requests that accepted it (their outputs are not read)."""
        counts = [int(n) for n in num_accepted]
        for j in range(max(counts, default=0)):
            which = [r for r, n in enumerate(counts) if n > j]
            live = [slots[r] for r in which]
            at = torch.tensor(which, device=rows.q.device)
            q, k, v, a, b, z = (getattr(rows, f)[at, j].contiguous() for f in "qkvabz")
            self.ops.gdn_decode(q, k, v, a, b, w.A_log, w.dt_bias, z, w.norm_w, pool.state,
                                torch.tensor(live, dtype=torch.int64, device=pool.state.device))

    # ------------------------------------------------------------------ QSA mixer

    def _qsa(self, u, w, cache: EngineCache, rows: StepRows, p: QsaPlanes,
             selection: SelectionSlot | None = None):
        """``selection``: where to leave this layer's selected blocks (the trunk's last QSA layer),
        or the shared selection to use (IndexShare in the draft layer: rows with a shared
        selection skip their own index scores and selection)."""
        cfg, ops = self.cfg, self.ops
        N = u.shape[0]
        hq, hkv, dh, hi, di = (cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, cfg.index_heads,
                               cfg.index_dim)
        q = self._linear(u, w.w_q).view(N, hq, dh)
        gate = self._linear(u, w.w_gate).view(N, hq, dh)
        k = self._linear(u, w.w_k).view(N, hkv, dh)
        v = self._linear(u, w.w_v).view(N, hkv, dh)
        q_index = self._linear(u, w.w_qI).view(N, hi, di)
        k_index = ops.rmsnorm(self._linear(u, w.w_kI), w.kI_norm, cfg.eps)
        w_index = self._linear(u, w.w_wI)
        o = self.spanwise(rows, lambda rs, *t: self._qsa_rows(rs, *t, w, cache, p, selection),
                          q, gate, k, v, q_index, k_index, w_index, shared="qsa")
        return self._linear(o.reshape(N, hq * dh), w.w_o)

    def _qsa_rows(self, rows: StepRows, q, gate, k, v, q_index, k_index, w_index, w,
                  cache: EngineCache, p: QsaPlanes, selection: SelectionSlot | None):
        """The QSA layer over the step's rows from their projections: rotary embedding, the
        KV and index append, block selection and the sparse attention, o [N, HQ, D]."""
        cfg, ops, act = self.cfg, self.ops, self.act
        dev = q.device
        hq, hkv, dh, hi, di = (cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, cfg.index_heads,
                               cfg.index_dim)
        axes = rows.qsa_axes()
        rope = rows.positions if rows.rope_positions is None else rows.rope_positions
        q, k = ops.qk_norm_rope(q, k, w.q_norm, w.k_norm, rope.to(dev), cfg.rotary_dim,
                                cfg.rope_theta, cfg.eps, step=rows.kind, context=axes["context"])

        store_k, store_v, load_k, load_v = ops.kv_codec(cache.kv_dtype, w.k_gs, w.v_gs, dh, hkv, act)
        kv_name = {"bf16": "bfloat16"}.get(cache.kv_dtype, cache.kv_dtype)
        # The block table's columns up to the step's longest request: a step's work (index scores,
        # selection) spans the blocks its rows can reach, not every block a slot could hold.
        table = rows.table
        if table is None:
            table = cache.pages.block_table[:, :-(-axes["context"] // cfg.tokens_per_block)]
            if dev.type != "meta":  # over meta pools the tracer's ops read the table on the host
                table = host_to_device(table, dev)
                rows.table = table  # the step's other QSA layers read this copy
        seq_ids, positions = rows.seq_ids, rows.positions
        ops.qsa_kv_append(
            p, table, seq_ids, positions, k, v, store_k, store_v, (w.k_gs, w.v_gs),
            axes=dict(axes, kv_dtype=kv_name, act_dtype=DTYPE_NAME[act], kv_heads=hkv, head_dim=dh))
        ops.qsa_index_store(p, table, seq_ids, positions, k_index, axes=dict(axes, index_dim=di))
        shared = selection.shared if selection is not None else None
        if shared is None:
            scores = ops.qsa_index_scores(q_index, w_index, seq_ids, positions, table, p,
                                          axes=dict(axes, index_heads=hi, index_dim=di))
            selected, tokens = ops.qsa_topk_expand(scores, positions, rows.context_lens,
                                                   cfg.top_k_blocks, cfg.sink_blocks,
                                                   cfg.local_blocks, axes=axes)
        else:
            # IndexShare: rows the trunk has a selection for take it; the others (all -2) score
            # their own. Both ops are row-wise, so running them on the subset changes nothing else.
            selected = shared.clone()
            own = (shared == -2).all(dim=1).nonzero().flatten()
            if own.numel():
                own_axes = dict(axes, rows=int(own.numel()))
                scores = ops.qsa_index_scores(q_index[own.to(dev)], w_index[own.to(dev)],
                                              seq_ids[own], positions[own], table, p,
                                              axes=dict(own_axes, index_heads=hi, index_dim=di))
                selected[own] = ops.qsa_select(scores, positions[own], cfg.top_k_blocks,
                                               cfg.sink_blocks, cfg.local_blocks, axes=own_axes)
            tokens = ops.qsa_expand(selected, positions, rows.context_lens, axes=axes)
        if selection is not None and selection.keep:
            selection.kept = selected
        o = ops.qsa_sparse_gqa(q, gate, tokens, seq_ids, table, p, load_k, load_v,
                               axes=dict(axes, kv_dtype=kv_name, q_heads=hq, kv_heads=hkv,
                                         head_dim=dh))
        return o

    # ------------------------------------------------------------------ read-out

    def _ple(self, rows: StepRows, ids_dev: torch.Tensor, x_emb: torch.Tensor,
             cache: EngineCache) -> torch.Tensor:
        """e [N, L, P]: the one-token spans (decode rows, a prompt's 1-token chunk) in one call with
        a history per row, each longer span in a call of its own with its request's history."""
        cfg, w, act, dev = self.cfg, self.w, self.act, ids_dev.device
        single = [sp for sp in rows.spans if sp.rows == 1]
        hist = rows.ple_history
        if single and hist is None:
            hist = host_to_device(cache.ple_history[torch.tensor([sp.slot for sp in single])], dev)
        if len(single) == rows.rows:                   # every row its own request: no gather
            e = self.ops.ple_embed(ids_dev, hist, x_emb, w.ple, act, "decode_rows",
                                   cfg.num_layers)
        else:
            e = torch.empty(rows.rows, cfg.num_layers, cfg.ple_dim, dtype=act, device=dev)
        if single and len(single) < rows.rows:
            idx = host_to_device(torch.tensor([sp.lo for sp in single]), dev)
            e[idx] = self.ops.ple_embed(ids_dev[idx], hist, x_emb[idx], w.ple, act, "decode_rows",
                                        cfg.num_layers)
        for j, sp in enumerate(rows.spans):
            if sp.rows > 1:
                hist = (rows.span_history[j] if rows.span_history is not None
                        else host_to_device(cache.ple_history[sp.slot], dev))
                start = "new_request" if sp.start == 0 else "continuing"
                e[sp.lo:sp.hi] = self.ops.ple_embed(ids_dev[sp.lo:sp.hi], hist,
                                                    x_emb[sp.lo:sp.hi], w.ple, act, start,
                                                    cfg.num_layers)
        return e

    def _read_out(self, m: torch.Tensor) -> torch.Tensor:
        if m.shape[0] == 0:  # no row of this pass needs logits: nothing to dispatch
            act = torch.float64 if self.act == torch.float64 else torch.float32
            return torch.empty(0, self.cfg.vocab_size, dtype=act, device=m.device)
        h = out_cast(self.ops.rmsnorm(m, self.w.final_norm, self.cfg.eps), self.act,
                     is_reference_mode(m))
        logits = self._linear(h, self.w.lm_head)
        return self.ops.logits_cast(logits) if self.act == torch.bfloat16 else logits

    @staticmethod
    def _streams(x: torch.Tensor, n: int) -> torch.Tensor:
        return x.to(acc_dtype(x))[:, None, :].repeat(1, n, 1)

    # ------------------------------------------------------------------ the passes

    def trunk(self, ids: torch.Tensor, rows: StepRows, cache: EngineCache,
              logit_rows: list[int] | None = None,
              splice: tuple[torch.Tensor, torch.Tensor] | None = None) -> StepOutput:
        """The trunk over one step's rows (``ids`` int64 [N] on the CPU); updates ``cache``. Only
        ``logit_rows`` are read out through the LM head (default: every row): a prompt chunk needs
        the logits of its last row at most, and 8192 rows of a 151936-word head would be 5 GB.
        ``splice``: (step row indices [m], rows [m, C]) that replace those rows' token embeddings
        (a frame prompt's tower rows, docs/spec.md, "Vision input")."""
        dev = self.w.device
        out = self.trunk_forward(ids, host_to_device(ids, dev), rows.on(dev), cache, logit_rows,
                                 splice)
        self.advance(ids, rows.spans, cache)
        return out

    def trunk_forward(self, ids: torch.Tensor, ids_dev: torch.Tensor, rows: StepRows,
                      cache: EngineCache, logit_rows: list[int] | None = None,
                      splice: tuple[torch.Tensor, torch.Tensor] | None = None,
                      handover: SelectionSlot | None = None) -> StepOutput:
        """The trunk's device work over one step (``trunk`` without the host-side bookkeeping of
        ``advance``); a captured step (impl/model/graphs.py, impl/model/prefill_graphs.py) replays
        exactly this. ``handover``: where the last QSA layer leaves its selection (default a new
        slot; a prefill graph passes its own, which its breaks refill at each replay)."""
        w, cfg = self.w, self.cfg
        record = VerifyRecord() if any(sp.mode == "verify" for sp in rows.spans) else None
        x_emb = w.embed[ids_dev]
        if splice is not None:
            at, frame_rows = splice
            x_emb = x_emb.index_copy(0, at.to(x_emb.device), frame_rows.to(x_emb.dtype))
        e = self.spanwise(rows, lambda rs, *t: self._ple(rs, *t, cache), ids_dev, x_emb)
        if record is not None:
            record.ple_history = verify_histories(ids, rows.spans, cache)
        X = self._streams(x_emb, cfg.hc_streams)
        m = X[:, 0]
        last_qsa = max(i for i, lw in enumerate(w.layers) if lw.kind == "qsa")
        handover = handover if handover is not None else SelectionSlot(keep=True)
        for li, lw in enumerate(w.layers):
            planes = cache.layers[li] if lw.kind == "qsa" else None
            X, m = self._layer(X, lw, li, e[:, li], cache, rows, record, planes,
                               handover if li == last_qsa else None)
        return StepOutput(self.read_out_rows(m, logit_rows), m, record, handover.kept, logit_rows)

    def read_out_rows(self, m: torch.Tensor, logit_rows: list[int] | None) -> torch.Tensor:
        """The logits of ``logit_rows`` of the trunk's rows ``m`` (None: every row)."""
        if logit_rows is not None and not logit_rows:   # no index tensor: a captured step
            return self._read_out(m[:0])                 # copies nothing from the host
        every_row = logit_rows is None or logit_rows == list(range(m.shape[0]))
        return self._read_out(m if every_row else m[logit_rows])

    @staticmethod
    def advance(ids: torch.Tensor, spans: list[Span], cache: EngineCache) -> None:
        """The host side of a trunk step: each request's n-gram history and stored length."""
        for sp in spans:
            cache.ple_history[sp.slot] = ple_history_advance(cache.ple_history[sp.slot],
                                                             ids[sp.lo:sp.hi])
            cache.lengths[sp.slot] = sp.start + sp.rows

    def draft(self, h_prev: torch.Tensor, next_ids: torch.Tensor, rows: StepRows,
              cache: EngineCache, shared_selection: torch.Tensor | None = None,
              logit_rows: list[int] | None = None) -> StepOutput:
        """The MTP draft layer over rows (h_prev, next token); updates the draft layer's planes.
        ``shared_selection`` [N, W] (IndexShare): the trunk's selection for rows at positions the
        trunk has computed, rows of -2 where the draft layer scores its own."""
        w, cfg = self.w, self.cfg
        mw = w.mtp
        dev = w.device
        rows = rows.on(dev)
        h_in = self.ops.mtp_draft_input(host_to_device(next_ids, dev), h_prev.to(dev), w.embed,
                                        mw.norm_emb, mw.norm_h, mw.fc, self.act)
        share = SelectionSlot(shared=shared_selection) if shared_selection is not None else None
        X, m = self._layer(self._streams(h_in, cfg.hc_streams), mw.layer, None, None, cache, rows,
                           None, cache.mtp, share)
        for sp in rows.spans:
            cache.mtp_lengths[sp.slot] = sp.start + sp.rows
        return StepOutput(self._read_out(m if logit_rows is None else m[logit_rows]), m,
                          logit_rows=logit_rows)
