"""Triton gated sparse GQA over each row's selected tokens (spec/ops/qsa.py:qsa_sparse_gqa).

Two variants, both reading K/V through the block table exactly as the spec's ``slot_of`` and
dequantising bf16 / fp8 / nvfp4 pages in-kernel (impl/kernels/qsa/kv_tiles.py):

- ``triton_decode`` (decode rows): a first pass turns each selected token into its page slot (page * 32
  + offset); then split-K. Program (row, KV head, split) runs an online softmax over
  its slice of the row's token list for all q heads of the KV head's group at once (the group is the M
  dimension of the dots), so each K/V tile is read once per group; it writes an unnormalised partial
  (o, running max, running sum). A second small kernel combines the splits per (row, KV head) and
  applies the rounding points.
- ``triton_rows`` (context / verify / mixed rows): rows of one request are grouped into tiles of
  ``rows_per_tile``; a tile iterates over the union of its rows' tokens (built on the host with torch),
  each K/V tile read once for the group, with a per-row multiplicity (0 = the row did not select the
  token, 2 = listed twice, which the spec attends twice) that masks and weights p.

Numerics. bf16 pages: q, K, V are bf16 values, exact operands of bf16 tensor-core dots with fp32
accumulation, so q . k is fp32-accurate. fp8 / nvfp4 pages: K and V are read as exact fp16 values
(kv_tiles.load_kv_tile_f16; nvfp4's gs multiplies the logits and the output in fp32), and the dots are
fp16: each row of q is scaled by a power of two so that its largest element lies in [2^14, 2^15), which
keeps every element exactly unless it is below 2^-31 of the row's largest (fp16 subnormals: an error of
at most 2^-39 of it, far below the fp32 accumulation's own error); the logits take the factor back.
Then, for every format: logits * scale, max-subtracted exp and the sums in fp32; p kept fp32-accurate
by splitting it into two operands of the dots' type (bf16: hi + lo, 16 significant bits;
fp16: 22 bits, or within 2^-25 absolute where a piece falls below fp16's normal range); o = acc / l
rounded to bf16, then o * sigmoid(gate) in fp32 and one bf16 rounding (``round_to_bf16``, the same on
interpreter and GPU). A row with no token outputs zeros. The kernels are generic in heads and head_dim
(powers of two >= 16 for head_dim).

Launch shapes (``_DECODE_SHAPE``: tile, warps, pipeline stages, programs per SM) are the fastest of
the 36-shape grid that ``bench/qsa_sparse_gqa.py --shapes`` timed on the H200
(reports/bench/qsa_sparse_gqa_shapes.md): two warps a program throughout; bf16 pages in 32-token
tiles through a 3-stage software pipeline (cp.async), fp8 in 64-token tiles through 2 stages, nvfp4
in 32-token tiles through 2 stages (its bytes loaded as a 2-D tile, kv_tiles.py).
"""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import math

import torch
import triton
import triton.language as tl

from impl.kernels.layout import require_contiguous
from impl.kernels.qsa.kv_tiles import FMT_BF16, FMT_FP8, FMT_NVFP4, KvFormat, load_kv_tile_bf16, \
    load_kv_tile_f16, slots_of
from impl.kernels.triton_support import INTERPRETING, round_to_bf16

TPB = 32
# running-max start: finite, so an all-masked tile gives alpha = exp(0), never NaN
_NEG = tl.constexpr(-1.0e30)


@triton.jit
def _bdot(a, b, COMPILED: tl.constexpr):
    """a @ b of two bf16 (or two fp16) tensors with exact products and fp32 accumulation: a
    tensor-core dot when compiled; through fp32 in the interpreter, which multiplies bf16 tensors as
    raw integers."""
    if COMPILED:
        return tl.dot(a, b)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def _q_operand(qf, scale, F16: tl.constexpr):
    """q tile (fp32 values of bf16) -> the dots' operand and the per-row factor of the logits.
    bf16: q as is, factor ``scale``. fp16: each row times 2^(14 - e), e the exponent of its largest
    |q| (exact in fp32, then in fp16 but for elements below 2^-31 of that largest), factor
    scale * 2^(e - 14)."""
    if F16:
        qmax = tl.max(tl.abs(qf), 1)
        # e clamped to [-112, 127] so that both factors are normal fp32 powers of two whose product is
        # exactly 1 (a row whose largest |q| is below 2^-112 is scaled by 2^126 only)
        e = tl.minimum(tl.maximum(((qmax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -112), 127)
        up = ((141 - e) << 23).to(tl.float32, bitcast=True)
        down = ((113 + e) << 23).to(tl.float32, bitcast=True)
        return (qf * up[:, None]).to(tl.float16), down * scale
    else:
        return qf.to(tl.bfloat16), tl.zeros([qf.shape[0]], tl.float32) + scale


@triton.jit
def _split_p(p, F16: tl.constexpr):
    """p (fp32) as two operands of the dots' type whose sum is p to 2^-22 (fp16) / 2^-17 (bf16)
    relative: hi, then the remainder (the subtraction is exact)."""
    if F16:
        hi = p.to(tl.float16)
        return hi, (p - hi.to(tl.float32)).to(tl.float16)
    else:
        hi = round_to_bf16(p)
        return hi.to(tl.bfloat16), round_to_bf16(p - hi).to(tl.bfloat16)


@triton.jit
def _softmax_pv_step(qt, kt, vt, live, weight, m_i, l_i, acc, s_scale, COMPILED: tl.constexpr,
                     F16: tl.constexpr):
    """One online-softmax step over a K/V tile: logits of live (M, N) pairs (the dot times the row
    factor ``s_scale`` [M]), p weighted by the token's multiplicity, acc rescaled and accumulated
    with p split into two operands."""
    s = _bdot(qt, tl.trans(kt), COMPILED) * s_scale[:, None]
    s = tl.where(live, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None]) * weight
    l_i = l_i * alpha + tl.sum(p, 1)
    p_hi, p_lo = _split_p(p, F16)
    acc = acc * alpha[:, None] + _bdot(p_hi, vt, COMPILED) + _bdot(p_lo, vt, COMPILED)
    return m_new, l_i, acc


@triton.jit
def _load_kv(pool, pool_sf, slot, valid, FMT: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
             HW: tl.constexpr):
    """A K or V tile in the dots' type: bf16 for bf16 pages, exact fp16 for fp8 / nvfp4 pages."""
    if FMT == 0:
        return load_kv_tile_bf16(pool, slot, valid, D)
    else:
        return load_kv_tile_f16(pool, pool_sf, slot, valid, FMT, D, BLOCK_N, HW)


@triton.jit
def _gate_store(o, gate, out, offs, mask):
    """o (fp32, normalised) -> bf16, then o * sigmoid(gate) in fp32 and one bf16 rounding."""
    o = round_to_bf16(o)
    g = tl.load(gate + offs, mask=mask, other=0.0).to(tl.float32)
    y = round_to_bf16(o * (1.0 / (1.0 + tl.exp(-g))))
    tl.store(out + offs, y.to(out.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------
# Decode: split-K then combine
# ---------------------------------------------------------------------------------------------------

@triton.jit
def _token_slots_kernel(tokens, seq_ids, block_table, token_slots, W, table_w, BLOCK: tl.constexpr):
    """token_slots[row, i] = page * 32 + offset of tokens[row, i] (``slots_of`` without the KV head),
    -1 where it reads nothing. One pass before the split kernel, so that its loop waits on one load
    (this slot) before the K/V loads instead of two (the token, then its page), which shortens the
    decode step (reports/bench/gpu-notes.md, "Sparse GQA decode")."""
    row = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    tok = tl.load(tokens + row * W + n, mask=n < W, other=-1).to(tl.int64)
    seq = tl.load(seq_ids + row).to(tl.int64)
    slot, valid = slots_of(tok, seq, block_table, table_w, 0, 1, tok >= 0)
    tl.store(token_slots + row * W + n, tl.where(valid, slot, -1).to(tl.int32), mask=n < W)


@triton.jit
def _decode_split_kernel(q, token_slots, k_pool, k_sf, k_gs, v_pool, v_sf, v_gs,
                         part_o, part_ml, scale, W, tiles_per_split,
                         HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                         D: tl.constexpr, BLOCK_N: tl.constexpr, FMT: tl.constexpr,
                         COMPILED: tl.constexpr, STAGES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2).to(tl.int64)
    n_splits = tl.num_programs(2).to(tl.int64)
    g = tl.arange(0, G_PAD)
    gm = g < G
    d = tl.arange(0, D)
    qf = tl.load(q + (row * HQ + h * G + g)[:, None] * D + d[None, :], mask=gm[:, None], other=0.0)
    qt, s_scale = _q_operand(qf.to(tl.float32), scale, FMT != 0)
    if FMT == 2:
        s_scale = s_scale * tl.load(k_gs)
    m_i = tl.full([G_PAD], _NEG, tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    # int32 loop bounds and token offsets (W < 2^31 / BLOCK_N), widened to int64 by row * W below:
    # an int64 induction variable over a loop body that loads tokens, then pages, makes triton 3.6's
    # remove-layout-conversions pass emit an invalid arith.select (reports/bench/gpu-notes.md, "The
    # triton 3.6 compile failure"). No branch in the body (a tile of padding reads nothing through its
    # masks), so the software pipeliner can take the loop.
    first = tl.program_id(2) * tiles_per_split
    for t in tl.range(first, first + tiles_per_split, num_stages=STAGES):
        n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        ts = tl.load(token_slots + row * W + n, mask=n < W, other=-1).to(tl.int64)
        valid = ts >= 0
        slot = tl.where(valid, ts * HKV + h, 0)
        kt = _load_kv(k_pool, k_sf, slot, valid, FMT, D, BLOCK_N, COMPILED)
        vt = _load_kv(v_pool, v_sf, slot, valid, FMT, D, BLOCK_N, COMPILED)
        m_i, l_i, acc = _softmax_pv_step(qt, kt, vt, valid[None, :], 1.0, m_i, l_i, acc, s_scale,
                                         COMPILED, FMT != 0)
    if FMT == 2:
        acc = acc * tl.load(v_gs)
    base = (row * HKV + h) * n_splits + split
    tl.store(part_o + (base * G + g)[:, None] * D + d[None, :], acc, mask=gm[:, None])
    tl.store(part_ml + (base * 2) * G + g, m_i, mask=gm)
    tl.store(part_ml + (base * 2 + 1) * G + g, l_i, mask=gm)


@triton.jit
def _decode_combine_kernel(part_o, part_ml, gate, out, n_splits, HQ: tl.constexpr,
                           HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    g = tl.arange(0, G_PAD)
    gm = g < G
    d = tl.arange(0, D)
    m_run = tl.full([G_PAD], _NEG, tl.float32)
    l_run = tl.zeros([G_PAD], tl.float32)
    o_run = tl.zeros([G_PAD, D], tl.float32)
    for s in range(0, n_splits):
        base = (row * HKV + h) * n_splits + s
        m_s = tl.load(part_ml + (base * 2) * G + g, mask=gm, other=_NEG)
        l_s = tl.load(part_ml + (base * 2 + 1) * G + g, mask=gm, other=0.0)
        o_s = tl.load(part_o + (base * G + g)[:, None] * D + d[None, :], mask=gm[:, None], other=0.0)
        m_new = tl.maximum(m_run, m_s)
        a = tl.exp(m_run - m_new)
        b = tl.exp(m_s - m_new)
        l_run = l_run * a + l_s * b
        o_run = o_run * a[:, None] + o_s * b[:, None]
        m_run = m_new
    # an empty row (no token in any split) is an empty sum: zeros, as the spec
    o = tl.where(l_run[:, None] > 0, o_run / tl.where(l_run > 0, l_run, 1.0)[:, None], 0.0)
    offs = (row * HQ + h * G + g)[:, None] * D + d[None, :]
    _gate_store(o, gate, out, offs, gm[:, None])


def _check(q, gate, tokens, seq_ids, block_table, out):
    n, hq, d = q.shape
    if q.dtype != torch.bfloat16 or gate.dtype != torch.bfloat16 or out.dtype != torch.bfloat16:
        raise ValueError("the Triton sparse GQA rounds to bf16: q, gate and out must be bf16")
    if d < 16 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {d}")
    require_contiguous("the sparse GQA kernels", q=q, gate=gate, tokens=tokens, seq_ids=seq_ids,
                       block_table=block_table, out=out)
    if tokens.shape[0] != n or seq_ids.shape[0] != n or gate.shape != q.shape or out.shape != q.shape:
        raise ValueError("q, gate, tokens, seq_ids and out disagree on the rows")


# triton 3.6's OptimizeDotOperands pass fails on a dot with M = 64 whose operand comes from the prmt
# nvfp4 decoder (tools/sm90_compile_check.py; M <= 32 compiles): nvfp4 pages take at most 32 rows of q
# heads a dot.
_NVFP4_MAX_M = 32


def _nvfp4_group_pad(g: int) -> int:
    """The q heads of one KV head, padded as the dots' M, checked against ``_NVFP4_MAX_M``."""
    g_pad = max(16, triton.next_power_of_2(g))
    if g_pad > _NVFP4_MAX_M:
        raise ValueError(f"nvfp4 pages: at most {_NVFP4_MAX_M} q heads per KV head (got {g}): "
                         "triton 3.6 cannot compile the nvfp4 reader into a larger dot")
    return g_pad


# Decode launch shape per page format on a GPU: (tokens a tile, warps, pipeline stages, programs per
# SM to aim for): the fastest of the grid `bench/qsa_sparse_gqa.py --shapes` timed on the H200 at 128
# rows x 2048 tokens (reports/bench/qsa_sparse_gqa_shapes.md).
_DECODE_SHAPE = {FMT_BF16: (32, 2, 3, 2), FMT_FP8: (64, 2, 2, 2), FMT_NVFP4: (32, 2, 2, 2)}


def _default_splits(rows: int, n_kv: int, tiles: int, device: torch.device, per_sm: int = 4) -> int:
    """Splits per (row, KV head): enough programs for ``per_sm`` per SM on a GPU (2 in the
    interpreter, which still exercises the combine), never more splits than tiles."""
    if INTERPRETING or device.type != "cuda":
        target = 2
    else:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        target = math.ceil(per_sm * sms / max(1, rows * n_kv))
    return max(1, min(tiles, target))


def _formats(q: torch.Tensor, k_cache, v_cache, load, load_v) -> tuple[KvFormat, KvFormat, int]:
    """The K and V storage formats (one format for both) and the KV head count, checked against q."""
    hq, d = q.shape[1], q.shape[2]
    load_v = load if load_v is None else load_v
    n_kv = (k_cache if isinstance(k_cache, torch.Tensor) else k_cache[0]).shape[2]
    kf, vf = KvFormat(k_cache, load, n_kv, d), KvFormat(v_cache, load_v, n_kv, d)
    if kf.fmt != vf.fmt:
        raise ValueError("K and V must share a storage format")
    if hq % n_kv:
        raise ValueError(f"n_q_heads {hq} is not a multiple of n_kv_heads {n_kv}")
    return kf, vf, n_kv


def triton_decode(q: torch.Tensor, gate: torch.Tensor, tokens: torch.Tensor, seq_ids: torch.Tensor,
                  block_table: torch.Tensor, k_cache, v_cache, load=None, load_v=None,
                  scale: float | None = None, *, out: torch.Tensor, num_splits: int | None = None,
                  block_n: int | None = None, shape: tuple[int, int, int, int] | None = None) -> None:
    """Decode rows: q, gate [N, HQ, D] bf16; tokens int [N, W] (-1 padding); seq_ids [N];
    block_table int32 [B, max_pages]; caches / loads as spec/ops/qsa.py:qsa_sparse_gqa. Writes out
    [N, HQ, D] bf16 completely. ``shape`` (tokens a tile, warps, stages, programs per SM) replaces
    the format's ``_DECODE_SHAPE`` entry (bench/qsa_sparse_gqa.py --shapes times the candidates;
    without it the interpreter takes 64-token tiles)."""
    _check(q, gate, tokens, seq_ids, block_table, out)
    n, hq, d = q.shape
    kf, vf, n_kv = _formats(q, k_cache, v_cache, load, load_v)
    if n == 0:
        return
    if kf.pool.shape[0] * TPB > 2**31:
        raise ValueError("triton_decode keeps page * 32 + offset in int32: at most 2^26 pages")
    g = hq // n_kv
    g_pad = max(16, triton.next_power_of_2(g))  # the dots' M is at least 16
    if kf.fmt == FMT_NVFP4:
        _nvfp4_group_pad(g)
    w = tokens.shape[1]
    shape_n, warps, stages, per_sm = shape or _DECODE_SHAPE[kf.fmt]
    block_n = block_n or (shape_n if shape or not INTERPRETING else 64)
    tiles = max(1, triton.cdiv(w, block_n))
    splits = num_splits or _default_splits(n, n_kv, tiles, q.device, per_sm)
    per_split = triton.cdiv(tiles, splits)
    splits = triton.cdiv(tiles, per_split)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    token_slots = torch.empty(n, w, dtype=torch.int32, device=q.device)
    _token_slots_kernel[(n, triton.cdiv(w, 1024))](tokens, seq_ids, block_table, token_slots, w,
                                                   block_table.shape[1], BLOCK=1024, num_warps=4)
    part_o = torch.empty(n * n_kv * splits * g * d, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(n * n_kv * splits * 2 * g, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(n, n_kv, splits)](
        q, token_slots, *kf.args(), *vf.args(), part_o, part_ml, scale, w, per_split, HQ=hq,
        HKV=n_kv, G=g, G_PAD=g_pad, D=d, BLOCK_N=block_n, FMT=kf.fmt, COMPILED=not INTERPRETING,
        STAGES=stages, num_warps=warps)
    _decode_combine_kernel[(n, n_kv)](part_o, part_ml, gate, out, splits, HQ=hq, HKV=n_kv, G=g,
                                      G_PAD=g_pad, D=d, num_warps=4)


# ---------------------------------------------------------------------------------------------------
# Rows: a tile of rows of one request over the union of their tokens
# ---------------------------------------------------------------------------------------------------

@triton.jit
def _rows_kernel(q, gate, out, tile_rows, tile_seq, union_tok, union_cnt, union_len, block_table,
                 k_pool, k_sf, k_gs, v_pool, v_sf, v_gs, scale, U, table_w,
                 HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                 D: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr, FMT: tl.constexpr,
                 COMPILED: tl.constexpr):
    tile = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    i = tl.arange(0, R * G_PAD)  # the dots' M: (row of the tile, q head of the group)
    r = i // G_PAD
    gi = i % G_PAD
    row = tl.load(tile_rows + tile * R + r).to(tl.int64)  # -1: an empty place of the tile
    live_m = (row >= 0) & (gi < G)
    d = tl.arange(0, D)
    q_offs = (tl.where(live_m, row, 0) * HQ + h * G + gi)[:, None] * D + d[None, :]
    qf = tl.load(q + q_offs, mask=live_m[:, None], other=0.0)
    qt, s_scale = _q_operand(qf.to(tl.float32), scale, FMT != 0)
    if FMT == 2:
        s_scale = s_scale * tl.load(k_gs)
    seq = tl.load(tile_seq + tile).to(tl.int64)
    n_u = tl.load(union_len + tile)
    m_i = tl.full([R * G_PAD], _NEG, tl.float32)
    l_i = tl.zeros([R * G_PAD], tl.float32)
    acc = tl.zeros([R * G_PAD, D], tl.float32)
    for start in range(0, n_u, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        inb = n < n_u
        tok = tl.load(union_tok + tile * U + n, mask=inb, other=-1).to(tl.int64)
        slot, valid = slots_of(tok, seq, block_table, table_w, h, HKV, tok >= 0)
        # multiplicity of each union token in each row (0: not selected by that row)
        cnt = tl.load(union_cnt + (tile * R + r)[:, None] * U + n[None, :],
                      mask=live_m[:, None] & inb[None, :], other=0).to(tl.float32)
        kt = _load_kv(k_pool, k_sf, slot, valid, FMT, D, BLOCK_N, COMPILED)
        vt = _load_kv(v_pool, v_sf, slot, valid, FMT, D, BLOCK_N, COMPILED)
        live = (cnt > 0) & valid[None, :]
        m_i, l_i, acc = _softmax_pv_step(qt, kt, vt, live, cnt, m_i, l_i, acc, s_scale, COMPILED,
                                         FMT != 0)
    if FMT == 2:
        acc = acc * tl.load(v_gs)
    o = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    _gate_store(o, gate, out, q_offs, live_m[:, None])


_BIG = 1 << 62  # sorts after every token position


def graph_capturing(t: torch.Tensor) -> bool:
    """Whether a launch on ``t``'s device is being captured into a CUDA graph."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def row_tiles(tokens: torch.Tensor, seq_ids: torch.Tensor, rows_per_tile: int,
              static: bool = False):
    """Host-side grouping (torch, on the device): rows of one request, in launch order, in tiles of
    ``rows_per_tile``; per tile the ascending union of its rows' tokens and each row's multiplicity of
    each union token. Returns (tile_rows int64 [T, R] (-1 = empty place), tile_seq [T],
    union int64 [T, U], counts uint8 [T, R, U], union_len int32 [T]).

    Sized exactly (``static=False``), T and U are read on the host (two syncs). Under CUDA-graph
    capture (``static=True``) they take their bounds instead, T = n (a tile a row) and U = R x W,
    read nothing on the host, and give the same tiles in the same order: the places past a tile's
    union and the tiles past the last are empty (-1, length 0), which the kernel skips."""
    n, w = tokens.shape
    dev = tokens.device
    idx = torch.arange(n, device=dev)
    order = torch.argsort(seq_ids.long() * n + idx)  # by request, then launch order
    seq_sorted = seq_ids.long()[order]
    new_grp = torch.ones(n, dtype=torch.bool, device=dev)
    new_grp[1:] = seq_sorted[1:] != seq_sorted[:-1]
    grp_start = torch.cummax(torch.where(new_grp, idx, 0), 0).values
    rank = idx - grp_start
    brk = new_grp | (rank % rows_per_tile == 0)
    tile_id = torch.cumsum(brk.long(), 0) - 1
    n_tiles = n if static else int(tile_id[-1]) + 1
    place = rank % rows_per_tile
    tile_rows = torch.full((n_tiles, rows_per_tile), -1, dtype=torch.int64, device=dev)
    tile_rows[tile_id, place] = order
    # every row of a tile is of the tile's request: each writes the same value
    tile_seq = torch.zeros(n_tiles, dtype=torch.int64, device=dev).index_put_((tile_id,), seq_sorted)
    tt = torch.full((n_tiles, rows_per_tile, w), -1, dtype=torch.int64, device=dev)
    tt[tile_id, place] = tokens[order].long()
    key = torch.where(tt >= 0, tt, _BIG)
    row_sorted = key.sort(dim=2).values                                   # [T, R, W]
    flat = row_sorted.reshape(n_tiles, rows_per_tile * w).sort(dim=1).values
    first = torch.ones_like(flat, dtype=torch.bool)
    first[:, 1:] = flat[:, 1:] != flat[:, :-1]
    first &= flat != _BIG
    union_len = first.sum(1)
    u = rows_per_tile * w if static else max(1, int(union_len.max()))
    union = torch.where(first, flat, _BIG).sort(dim=1).values[:, :u]
    probe = union[:, None, :].expand(n_tiles, rows_per_tile, u).reshape(-1, u).contiguous()
    hay = row_sorted.reshape(-1, w).contiguous()
    cnt = torch.searchsorted(hay, probe, right=True) - torch.searchsorted(hay, probe)
    cnt = torch.where(probe == _BIG, 0, cnt).clamp(max=255).to(torch.uint8)
    union = torch.where(union == _BIG, -1, union).contiguous()
    return (tile_rows.contiguous(), tile_seq, union, cnt.reshape(n_tiles, rows_per_tile, u).contiguous(),
            union_len.to(torch.int32))


def triton_rows(q: torch.Tensor, gate: torch.Tensor, tokens: torch.Tensor, seq_ids: torch.Tensor,
                block_table: torch.Tensor, k_cache, v_cache, load=None, load_v=None,
                scale: float | None = None, *, out: torch.Tensor, rows_per_tile: int = 4,
                block_n: int | None = None) -> None:
    """Context / verify / mixed rows: same contract as ``triton_decode``; rows of one request share
    each K/V tile read (``rows_per_tile`` rows a program; fewer over nvfp4 pages, where the dots' M
    stops at 32)."""
    _check(q, gate, tokens, seq_ids, block_table, out)
    n, hq, d = q.shape
    kf, vf, n_kv = _formats(q, k_cache, v_cache, load, load_v)
    if n == 0:
        return
    g = hq // n_kv
    r = triton.next_power_of_2(rows_per_tile)
    if kf.fmt == FMT_NVFP4:
        # the dots' M at most 32 over nvfp4 pages (``_NVFP4_MAX_M``), on every stack alike so that
        # the CPU certifies the GPU's tiling
        r = max(1, min(r, _NVFP4_MAX_M // _nvfp4_group_pad(g)))
    g_pad = max(triton.next_power_of_2(g), triton.cdiv(16, r))  # the dots' M = r * g_pad >= 16
    tile_rows, tile_seq, union, cnt, union_len = row_tiles(tokens, seq_ids, r,
                                                           static=graph_capturing(q))
    block_n = block_n or (64 if INTERPRETING else 32)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    _rows_kernel[(tile_rows.shape[0], n_kv)](
        q, gate, out, tile_rows, tile_seq, union, cnt, union_len, block_table, *kf.args(),
        *vf.args(), scale, union.shape[1], block_table.shape[1], HQ=hq, HKV=n_kv, G=g, G_PAD=g_pad,
        D=d, R=r, BLOCK_N=block_n, FMT=kf.fmt, COMPILED=not INTERPRETING,
        num_warps=8 if r * g_pad >= 64 else 4)
