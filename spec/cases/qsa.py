"""Input builders of the QSA ops (docs/spec.md, "QSA: sparse attention with a block index") at the
target geometry: 24 q heads over 2 KV heads, head_dim 256, 16 index heads of dim 128, 32-token blocks
(= pages), top-k 64 blocks plus a window of 1 sink and 2 local blocks.

Every builder starts from one *step layout*: which requests take part in the launch, how many tokens
each held before it and holds after it, and the (shuffled) rows the step runs. The axes ``step``,
``batch``, ``rows`` and ``context`` describe it:

- ``decode``: one row per request (rows == batch), at its last position;
- ``verify``: K + 1 consecutive rows per request (rows == batch * (K + 1), K in 1..7), the MTP verify;
- ``prefill``: one chunk of rows / batch consecutive positions per request;
- ``mixed``: batch - 1 decode rows and one prefill chunk of the remaining rows, in one launch.

Request 0 always reaches exactly ``context`` tokens (the longest context of the launch); the others end
anywhere from their own row count up to it, except three placed at block edges: request 1 ends on a
block's last token, request 2's first new token opens a page, request 3 is a short prompt (<= 64
tokens). Block tables give each block a distinct page of a shuffled pool; only the blocks the op
touches get a page (the others are -1, never read), so a 131K-context table costs what its touched
blocks cost. Pages and slots no token of this step owns hold another
request's content (finite garbage, never NaN), which an op must leave alone.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from certify.harness.target import Case, OutSpec
from spec.cases.common import DTYPES, randn
from spec.ops.kv_storage import (fp8_load, fp8_quantize, nvfp4_global_scale, nvfp4_load,
                                 nvfp4_quantize)

TPB = 32  # tokens per block == page size
TOP_K, SINK, LOCAL = 64, 1, 2
WIDTH_BLOCKS = TOP_K + SINK + LOCAL  # a selection row: 67 block ids


# ---------------------------------------------------------------------------------------------------
# Step layout and paging
# ---------------------------------------------------------------------------------------------------

@dataclass
class Layout:
    """One launch: per request, tokens held before and after the step; per row, (seq, position)."""

    before: list[int]
    after: list[int]
    seq_ids: torch.Tensor    # int32 [rows], shuffled
    positions: torch.Tensor  # int32 [rows]

    @property
    def batch(self) -> int:
        return len(self.after)


def _draw_len(gen: torch.Generator, lo: int, hi: int) -> int:
    return int(torch.randint(lo, hi + 1, (1,), generator=gen))


def step_layout(axes: dict, gen: torch.Generator) -> Layout:
    step, B, rows, ctx = axes["step"], axes["batch"], axes["rows"], axes["context"]
    if step == "decode":
        if rows != B:
            raise ValueError("a decode step has one row per request")
        new = [1] * B
    elif step == "verify":
        if rows % B or not 2 <= rows // B <= 8:
            raise ValueError("a verify step has K + 1 rows per request, K in 1..7")
        new = [rows // B] * B
    elif step == "prefill":
        if rows % B:
            raise ValueError("prefill rows split evenly over the requests")
        new = [rows // B] * B
    elif step == "mixed":
        if not 1 <= B - 1 < rows:
            raise ValueError("a mixed step has batch - 1 decode rows and one chunk")
        new = [rows - (B - 1)] + [1] * (B - 1)
    else:
        raise ValueError(f"unknown step {step!r}")
    if max(new) > ctx:
        raise ValueError("a request's new rows exceed the context")
    after = [ctx] + [_draw_len(gen, n, ctx) for n in new[1:]]
    # Block edges on purpose: a request whose last new token completes a block (offset 31), and one
    # whose first new token opens a fresh page (offset 0).
    if B > 1 and after[1] - after[1] % TPB >= new[1]:
        after[1] -= after[1] % TPB
    if B > 2:
        start = after[2] - new[2]
        shift = (-start) % TPB
        if after[2] + shift <= ctx:
            after[2] += shift
    # A request with a short prompt: its rows sit in blocks 0 and 1, where the window is everything.
    if B > 3 and new[3] <= 2 * TPB:
        after[3] = _draw_len(gen, new[3], min(ctx, 2 * TPB))
    before = [a - n for a, n in zip(after, new)]
    seq = [s for s in range(B) for _ in range(after[s] - before[s])]
    pos = [j for s in range(B) for j in range(before[s], after[s])]
    order = torch.randperm(len(seq), generator=gen)
    return Layout(before, after, torch.tensor(seq, dtype=torch.int32)[order],
                  torch.tensor(pos, dtype=torch.int32)[order])


def page_table(gen: torch.Generator, blocks: list[set[int]], width: int, spare: int
               ) -> tuple[torch.Tensor, int]:
    """A block table [B, width] giving each listed block a distinct page of a shuffled pool of
    sum(len) + spare pages; entries of unlisted blocks are -1."""
    need = sum(len(b) for b in blocks)
    num_pages = need + spare
    perm = torch.randperm(num_pages, generator=gen).tolist()
    table = torch.full((len(blocks), width), -1, dtype=torch.int32)
    for s, bs in enumerate(blocks):
        for b in sorted(bs):
            table[s, b] = perm.pop()
    return table, num_pages


def _width(ctx: int) -> int:
    return math.ceil(ctx / TPB)


def _touched(layout: Layout) -> list[set[int]]:
    return [set(range(layout.before[s] // TPB, _width(layout.after[s]))) if layout.after[s] >
            layout.before[s] else set() for s in range(layout.batch)]


def _rms_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows scaled to unit RMS over the last dim (the magnitude of an rmsnorm output)."""
    return x / x.pow(2).mean(dim=-1, keepdim=True).sqrt()


# ---------------------------------------------------------------------------------------------------
# 1. KV append
# ---------------------------------------------------------------------------------------------------

def _kv_store_dtype(axes: dict) -> torch.dtype:
    if axes["kv_dtype"] not in ("bfloat16",):
        raise ValueError(f"{axes['kv_dtype']} KV goes through the store / load seam with pools the "
                         "spec64 oracle would widen to float64; not built here (see not_certified)")
    return DTYPES[axes["kv_dtype"]]


def _fp8_store(x: torch.Tensor) -> tuple[torch.Tensor]:
    """The fp8 storage seam: one e4m3 pool."""
    return (fp8_quantize(x),)


def _kv_pools(kv_dtype: str, x: torch.Tensor, gs: torch.Tensor):
    """A pool holding ``x`` (another request's content) in the KV storage dtype, the store seam that
    writes it, and the names of its output pools, in the spec's result order ([P, 32, n_kv, D] x).

    fp8 is one e4m3 pool; nvfp4 is (uint8 codes, e4m3 scales) with ``functools.partial(nvfp4_quantize,
    gs=gs)`` as store (the seam's documented way to bind a format's parameter, readable by a kernel)."""
    if kv_dtype == "bfloat16":
        return x.to(torch.bfloat16), None, ("cache",)
    if kv_dtype == "fp8":
        return fp8_quantize(x), _fp8_store, ("cache",)
    if kv_dtype == "nvfp4":
        return nvfp4_quantize(x, gs), functools.partial(nvfp4_quantize, gs=gs), ("codes", "scales")
    raise ValueError(f"unknown KV storage dtype {kv_dtype!r}")


def _on(x, device):
    """Tensors (and tuples of them) moved to ``device``; anything else (a store callable) as is."""
    if isinstance(x, tuple):
        return tuple(_on(e, device) for e in x)
    return x.to(device) if isinstance(x, torch.Tensor) else x


def kv_append_case(axes: dict, gen: torch.Generator, device) -> Case:
    """bf16 / fp8 / nvfp4 KV: the pools and the store seam of spec/ops/kv_storage.py. The quantised
    formats are certified bitwise against the spec in its own dtypes (``against: spec``): the store is
    the quantiser, whose rounding is the op, and a float64 widening of an e4m3 pool would not fit it."""
    n_kv, d = axes["kv_heads"], axes["head_dim"]
    lay = step_layout(axes, gen)
    touched = _touched(lay)
    table, P = page_table(gen, touched, _width(max(lay.after)), spare=6)
    # The pool as another request left it: finite K/V everywhere, positions of that request.
    k_old = randn(gen, P, TPB, n_kv, d)
    v_old = randn(gen, P, TPB, n_kv, d, scale=2.0)
    pos_plane = torch.randint(0, 131072, (P, TPB), generator=gen, dtype=torch.int32)
    for s in range(lay.batch):
        for b in touched[s]:
            page = int(table[s, b])
            for off in range(TPB):
                j = TPB * b + off
                # Earlier tokens of this request keep their position; slots at or past the first new
                # token are empty (-1) until written.
                pos_plane[page, off] = j if j < lay.before[s] else -1
    n = lay.seq_ids.numel()
    # k after QK norm + RoPE: unit RMS per head with an outlier channel; v: a plain projection.
    k = _rms_rows(randn(gen, n, n_kv, d) * (1 + 4 * (torch.arange(d) == 5)))
    v = randn(gen, n, n_kv, d, scale=2.0)
    act = DTYPES[axes["act_dtype"]]
    # nvfp4 global scales as a calibrated layer holds them: the largest block scale lands near 448
    # with some headroom, so block scales span e4m3's normal range (fp8 and bf16 ignore them).
    k_gs = nvfp4_global_scale(1.25 * float(k.abs().max()))
    v_gs = nvfp4_global_scale(1.25 * float(v.abs().max()))
    k_cache, store_k, parts = _kv_pools(axes["kv_dtype"], k_old, k_gs)
    v_cache, store_v, _ = _kv_pools(axes["kv_dtype"], v_old, v_gs)
    inputs = {"k_cache": k_cache, "v_cache": v_cache, "pos_plane": pos_plane, "block_table": table,
              "seq_ids": lay.seq_ids, "positions": lay.positions, "k": k.to(act), "v": v.to(act),
              "store": store_k, "store_v": store_v}
    outputs: dict[str, OutSpec] = {}
    for kv, cache in (("k", k_cache), ("v", v_cache)):
        pools = (cache,) if isinstance(cache, torch.Tensor) else cache
        for part, pool in zip(parts, pools):
            outputs[f"new_{kv}_{part}"] = OutSpec(tuple(pool.shape), pool.dtype)
    outputs["new_pos_plane"] = OutSpec(tuple(pos_plane.shape), torch.int32)
    return Case(inputs={n_: _on(t, device) for n_, t in inputs.items()}, outputs=outputs)


# ---------------------------------------------------------------------------------------------------
# 2. Index store and block compression
# ---------------------------------------------------------------------------------------------------

def _index_keys(gen: torch.Generator, n: int, seq_dir: torch.Tensor) -> torch.Tensor:
    """n index keys of one request: rmsnorm'd (unit RMS), sharing the request's direction so that
    block means are not ~0 (float32 [n, index_dim])."""
    dim = seq_dir.shape[0]
    return _rms_rows(0.6 * seq_dir + 0.8 * randn(gen, n, dim))


def index_store_case(axes: dict, gen: torch.Generator, device) -> Case:
    dim = axes["index_dim"]
    store = DTYPES[axes["plane_dtype"]]
    lay = step_layout(axes, gen)
    touched = _touched(lay)
    table, P = page_table(gen, touched, _width(max(lay.after)), spare=6)
    seq_dir = [randn(gen, dim) for _ in range(lay.batch)]
    # Another request's planes: finite keys, finite block keys, some of them valid.
    index_plane = randn(gen, P, TPB, dim, dtype=store)
    block_keys = randn(gen, P, dim, scale=0.5, dtype=store)
    block_key_valid = torch.rand(P, generator=gen) < 0.5
    for s in range(lay.batch):
        for b in touched[s]:
            page = int(table[s, b])
            held = max(0, min(TPB, lay.before[s] - TPB * b))  # tokens of block b stored before
            if held:
                index_plane[page, :held] = _index_keys(gen, held, seq_dir[s]).to(store)
                block_key_valid[page] = False  # a partial block has no key
            # held == 0: a freshly assigned page, recycled with whatever validity it had.
    n = lay.seq_ids.numel()
    k_index = torch.empty(n, dim)
    for s in range(lay.batch):
        rows = (lay.seq_ids == s).nonzero().flatten()
        k_index[rows] = _index_keys(gen, rows.numel(), seq_dir[s])
    inputs = {"index_plane": index_plane, "block_keys": block_keys, "block_key_valid": block_key_valid,
              "block_table": table, "seq_ids": lay.seq_ids, "positions": lay.positions,
              "k_index": k_index.to(DTYPES[axes["act_dtype"]])}
    return Case(inputs={n_: t.to(device) for n_, t in inputs.items()},
                outputs={"new_index_plane": OutSpec(tuple(index_plane.shape), store),
                         "new_block_keys": OutSpec(tuple(block_keys.shape), store),
                         "new_block_key_valid": OutSpec((P,), torch.bool)})


# ---------------------------------------------------------------------------------------------------
# 3. Index scores
# ---------------------------------------------------------------------------------------------------

def _block_keys_of(gen: torch.Generator, n_blocks: int, dim: int) -> torch.Tensor:
    """Block keys of one request: means of 32 unit-RMS keys that share the request's direction (0.6)
    and a per-block topic (0.5), with the per-token rest averaged down by sqrt(32)."""
    seq_dir = randn(gen, dim)
    topic = randn(gen, n_blocks, dim)
    noise = randn(gen, n_blocks, dim) / math.sqrt(TPB)
    return 0.6 * seq_dir + 0.5 * topic + 0.6 * noise


def index_scores_case(axes: dict, gen: torch.Generator, device) -> Case:
    heads, dim = axes["index_heads"], axes["index_dim"]
    store = DTYPES[axes["plane_dtype"]]
    act = DTYPES[axes["act_dtype"]]
    lay = step_layout(axes, gen)
    width = _width(max(lay.after))
    # Every block a row can score needs a page; the partial last block has a page but no key.
    blocks = [set(range(_width(a))) for a in lay.after]
    table, P = page_table(gen, blocks, width, spare=4)
    block_keys = randn(gen, P, dim, scale=0.5)
    block_key_valid = torch.rand(P, generator=gen) < 0.5
    for s, a in enumerate(lay.after):
        pages = table[s, :_width(a)].long()
        block_keys[pages] = _block_keys_of(gen, pages.numel(), dim)
        block_key_valid[pages] = True
        if a % TPB:
            block_key_valid[pages[-1]] = False
    n = lay.seq_ids.numel()
    q_index = randn(gen, n, heads, dim)
    # Index head weights of both signs, as a learned projection gives (scaled by heads^-1/2).
    w_index = randn(gen, n, heads, scale=1.0 / math.sqrt(heads))
    inputs = {"q_index": q_index.to(act), "w_index": w_index.to(act), "seq_ids": lay.seq_ids,
              "positions": lay.positions, "block_table": table, "block_keys": block_keys.to(store),
              "block_key_valid": block_key_valid}
    return Case(inputs={n_: t.to(device) for n_, t in inputs.items()},
                outputs={"scores": OutSpec((n, width), torch.float32)})


# ---------------------------------------------------------------------------------------------------
# 4. Canonical selection
# ---------------------------------------------------------------------------------------------------

def _window(t: int) -> set[int]:
    own = t // TPB
    return {0} | set(range(max(0, own - LOCAL + 1), own + 1))


def _score_row(gen: torch.Generator, width: int, t: int, pattern: str) -> torch.Tensor:
    """One score row as qsa_index_scores returns it (fp32, -inf past the complete blocks), with the
    tie pattern a test needs."""
    n_done = (t + 1) // TPB
    row = torch.full((width,), float("-inf"))
    # Sums of a few relu'd, weighted dots: mostly positive, a long right tail.
    raw = torch.relu(randn(gen, n_done, 4, scale=3.0)) @ randn(gen, 4, scale=0.5, shift=0.3)
    cands = [b for b in range(n_done) if b not in _window(t)]
    live_few = int(torch.randint(TOP_K // 2, TOP_K, (1,), generator=gen))  # fewer than k
    if pattern == "tie_at_tau" and len(cands) > TOP_K:
        # A run of 12 equal scores straddling the k-th place: 6 slots for 12 ties, highest index first.
        ranked = sorted(cands, key=lambda b: -float(raw[b]))
        raw[ranked[TOP_K - 6: TOP_K + 6]] = float(raw[ranked[TOP_K - 1]])
    elif pattern == "dead_blocks" and len(cands) > TOP_K:
        # Blocks whose every index head has a negative dot score exactly 0: +0.0, or -0.0 where every
        # weighted zero is negative. With fewer than k live blocks tau is 0, and +0.0 and -0.0 tie.
        live = torch.tensor(cands)[torch.randperm(len(cands), generator=gen)[:live_few]]
        zeros = torch.where(torch.rand(n_done, generator=gen) < 0.5, -0.0, 0.0)
        keep = torch.zeros(n_done, dtype=torch.bool)
        keep[live] = True
        raw = torch.where(keep, raw.abs() + 0.01, zeros)
    elif pattern == "nan" and len(cands) > TOP_K:
        # NaN counts as -inf (docs/spec.md, "QSA" item 4): with fewer than k finite candidates the
        # remaining slots go to NaN blocks, highest index first; a NaN never outranks a finite score.
        finite = torch.tensor(cands)[torch.randperm(len(cands), generator=gen)[:live_few]]
        keep = torch.zeros(n_done, dtype=torch.bool)
        keep[finite] = True
        raw = torch.where(keep, raw, float("nan"))
    elif pattern == "coarse":
        # A 0.5 grid: ties at every rank, not only at tau.
        raw = torch.round(raw * 2.0) / 2.0
    row[:n_done] = raw
    return row


# Positions at the window's and top-k's edges: t in blocks 0 and 1, t on a block's last token (its own
# block complete) or first token, and t where the candidates number exactly k and k + 1.
EDGE_POSITIONS = (0, 31, 32, 63, 64, 95, 96, 100, 1023, 1024,
                  TPB * (TOP_K + 3) - 1,  # 67 complete blocks, window {0, 65, 66}: exactly 64 candidates
                  TPB * (TOP_K + 3),      # own block 67 partial: still 64 candidates
                  TPB * (TOP_K + 4) - 1,  # 68 complete blocks: 65 candidates, one left out
                  TPB * (TOP_K + 4) + 5)
SCORE_PATTERNS = {"mixed_ties": ("plain", "tie_at_tau", "dead_blocks", "nan"),
                  "coarse": ("coarse", "tie_at_tau")}


def select_case(axes: dict, gen: torch.Generator, device) -> Case:
    lay = step_layout(axes, gen)
    width = _width(max(lay.after))
    pos = lay.positions.clone()
    if axes["edge_rows"]:
        if pos.numel() < len(EDGE_POSITIONS) or max(EDGE_POSITIONS) >= axes["context"]:
            raise ValueError(f"edge rows need rows >= {len(EDGE_POSITIONS)} and a longer context")
        pos[:len(EDGE_POSITIONS)] = torch.tensor(EDGE_POSITIONS, dtype=pos.dtype)
    patterns = SCORE_PATTERNS[axes["score_pattern"]]
    rows = [_score_row(gen, width, int(t), patterns[r % len(patterns)]) for r, t in enumerate(pos.tolist())]
    scores = torch.stack(rows)
    return Case(inputs={"scores": scores.to(device), "positions": pos.to(device)},
                outputs={"selected": OutSpec((pos.numel(), WIDTH_BLOCKS), torch.int64)})


# ---------------------------------------------------------------------------------------------------
# 5. Expansion
# ---------------------------------------------------------------------------------------------------

def _selection(gen: torch.Generator, t: int) -> list[int]:
    """A selection row as qsa_select returns it: the window plus min(64, candidates) other complete
    blocks, ascending."""
    n_done = (t + 1) // TPB
    window = _window(t)
    cands = [b for b in range(n_done) if b not in window]
    if len(cands) > TOP_K:
        pick = torch.randperm(len(cands), generator=gen)[:TOP_K].tolist()
        cands = [cands[i] for i in pick]
    return sorted(window | set(cands))


def _selection_rows(gen: torch.Generator, positions: torch.Tensor) -> torch.Tensor:
    out = torch.full((positions.numel(), WIDTH_BLOCKS), -1, dtype=torch.int64)
    for r, t in enumerate(positions.tolist()):
        ids = _selection(gen, t)
        out[r, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
    return out


def expand_case(axes: dict, gen: torch.Generator, device) -> Case:
    lay = step_layout(axes, gen)
    selected = _selection_rows(gen, lay.positions)
    # The request's stored length: in a prefill chunk the later rows' tokens are already stored, so
    # the t cut (not the length) ends a row; a decode row's length is t + 1.
    context_lens = torch.tensor([lay.after[int(s)] for s in lay.seq_ids], dtype=torch.int32)
    n = lay.positions.numel()
    return Case(inputs={"selected": selected.to(device), "positions": lay.positions.to(device),
                        "context_lens": context_lens.to(device)},
                outputs={"tokens": OutSpec((n, TPB * WIDTH_BLOCKS), torch.int64)})


# ---------------------------------------------------------------------------------------------------
# 6. Sparse GQA
# ---------------------------------------------------------------------------------------------------

def _tokens_of(blocks: list[int], t: int) -> list[int]:
    return [j for b in blocks for j in range(TPB * b, TPB * (b + 1)) if j <= t]


def sparse_gqa_case(axes: dict, gen: torch.Generator, device) -> Case:
    n_q, n_kv, d = axes["q_heads"], axes["kv_heads"], axes["head_dim"]
    act = DTYPES[axes["act_dtype"]]
    lay = step_layout(axes, gen)
    n = lay.positions.numel()
    sel = [_selection(gen, int(t)) for t in lay.positions.tolist()]
    blocks: list[set[int]] = [set() for _ in range(lay.batch)]
    for r, s in enumerate(lay.seq_ids.tolist()):
        blocks[s] |= set(sel[r])
    table, P = page_table(gen, blocks, _width(max(lay.after)), spare=2)
    # Keys after QK norm + RoPE: unit RMS per head, with a direction shared by the request's keys (a
    # key bias) that q leans on; q's scale varies per row, so the softmax is flat on some rows and
    # peaked on others. Values: a plain projection. Pages are only the selected blocks' (union over
    # the request's rows); the pool's other content is finite garbage.
    k_vals = randn(gen, P, TPB, n_kv, d)
    v_vals = randn(gen, P, TPB, n_kv, d)
    bias = randn(gen, lay.batch, n_kv, d)
    for s in range(lay.batch):
        pages = table[s][table[s] >= 0].long()
        kk = 0.8 * randn(gen, pages.numel(), TPB, n_kv, d) + 0.6 * bias[s]
        k_vals[pages] = _rms_rows(kk)
        v_vals[pages] = randn(gen, pages.numel(), TPB, n_kv, d)
    # The K/V as the forward stores them (bf16 after QK norm + RoPE), then the storage format with the
    # load that reads it back: the float64 reference dequantises the very codes the variant reads
    # (e4m3 and e2m1 values widen exactly; the harness keeps narrow code dtypes as stored).
    k_vals, v_vals = k_vals.to(act).float(), v_vals.to(act).float()
    k_cache, load_k = _kv_read_side(axes["kv_dtype"], k_vals)
    v_cache, load_v = _kv_read_side(axes["kv_dtype"], v_vals)
    q = torch.empty(n, n_q, d)
    for r, s in enumerate(lay.seq_ids.tolist()):
        # q leans on the request's key bias (kv head h // 12) with a per-row spread of sharpness.
        sharp = float(torch.empty(1).uniform_(0.5, 3.0, generator=gen))
        q[r] = sharp * (0.5 * bias[s].repeat_interleave(n_q // n_kv, dim=0) + randn(gen, n_q, d))
    gate = randn(gen, n, n_q, d, scale=2.0)
    tokens = torch.full((n, TPB * WIDTH_BLOCKS), -1, dtype=torch.int64)
    for r, t in enumerate(lay.positions.tolist()):
        toks = _tokens_of(sel[r], t)
        tokens[r, :len(toks)] = torch.tensor(toks, dtype=torch.int64)
    inputs = {"q": q.to(act), "gate": gate.to(act), "tokens": tokens, "seq_ids": lay.seq_ids,
              "block_table": table, "k_cache": k_cache, "v_cache": v_cache, "load": load_k,
              "load_v": load_v}
    return Case(inputs={n_: _on(t, device) for n_, t in inputs.items()},
                outputs={"out": OutSpec((n, n_q, d), act)})


def _kv_read_side(kv_dtype: str, x: torch.Tensor):
    """(pools, load) holding x ([P, 32, n_kv, D] fp32 of bf16 values) in the KV storage dtype, with
    the spec/ops/kv_storage.py load that dequantises it (None: the bf16 pool's cast). nvfp4's global
    scale is the conventional amax / (6 * 448) of the pool's bf16 amax: an fp32 with a full mantissa,
    so the read-back (code * sf) * gs really rounds (to fp32, then bf16)."""
    gs = nvfp4_global_scale(float(x.abs().max()))
    pools, _, _ = _kv_pools(kv_dtype, x, gs)
    if kv_dtype == "bfloat16":
        return pools, None
    if kv_dtype == "fp8":
        return pools, fp8_load
    return pools, functools.partial(nvfp4_load, gs=gs)


# ---------------------------------------------------------------------------------------------------
# 4 + 5. Selection fused with expansion
# ---------------------------------------------------------------------------------------------------

def topk_expand_case(axes: dict, gen: torch.Generator, device) -> Case:
    """qsa_select's score rows (tie patterns, edge rows, shuffled rows) with qsa_expand's stored
    lengths: a prefill row's later tokens are already stored (length > t + 1), so the t cut ends it."""
    start = gen.get_state()
    sel = select_case(axes, gen, "cpu")
    scores, pos = sel.inputs["scores"], sel.inputs["positions"]
    # select_case draws its layout from ``gen`` first: replaying that draw from the same generator
    # state gives the same layout, hence each row's request and stored length.
    replay = torch.Generator()
    replay.set_state(start)
    lay = step_layout(axes, replay)
    lens = torch.tensor([lay.after[int(s)] for s in lay.seq_ids], dtype=torch.int32)
    # An edge row's position is placed by hand, not by its request: its stored length is raised to
    # at least t + 1, as the forward appends a row's token before the row attends.
    lens = torch.maximum(lens, pos.to(torch.int32) + 1) if axes["edge_rows"] else lens
    n = pos.numel()
    return Case(inputs={"scores": scores.to(device), "positions": pos.to(device),
                        "context_lens": lens.to(device)},
                outputs={"selected": OutSpec((n, WIDTH_BLOCKS), torch.int64),
                         "tokens": OutSpec((n, TPB * WIDTH_BLOCKS), torch.int64)})
