"""Gluon state pass of the chunked GDN prefill for sm_90 (warp-group MMA, TMA), between triton_chunked's
prologue and gated norm: certified against ``spec.ops.gdn.gdn_prefill`` (certify/cells/gdn_prefill.yaml).

Same chunked form and numerics as ``triton_chunked`` (its docstring has the algebra), and the same three
kinds of launch: the Triton prologue per (chunk, key head), this sequential state pass per (value head,
64 state columns), then the Triton gated RMSNorm. What differs:

- The launches are pipelined over ranges of chunks (``default_schedule``: three of falling length for
  one sequence of 64 chunks or more, two equal ones for a batch with 64 chunks of work and 32 chunks
  of every sequence, else one): the state pass of range i, on a high-priority stream, continues from
  range i - 1's final state while the prologue of range i + 1 fills the SMs it leaves, and the norm of
  range i follows on a third stream.
  Every range computes what one range would, so the result is bitwise the same for any cut into
  ranges (checked on the H200: reports/bench/gdn_prefill.md, sections 0000 and 00000).
- The prologue (``_prep_kernel`` with PIECES) also writes, for each (chunk, value head), the three bf16
  pieces of Aib [t, i] and the two of the decayed scores QKD [t, i] = e^{G_t - G_i} rq_t rk_i q^_t . k^_i
  (i <= t), the operands that depend on the chunk only: the sequential pass neither splits Aib nor forms
  QKD, and each arrives by TMA into its own buffer, refilled for the next chunk once consumed.
- The state pass runs transposed: the state tile is held as S^T [64 columns, 128 keys], the accumulator
  of a warp-group MMA, and every product of a chunk has the state columns as its rows (M = 64):

      KS^T = S^T K^T        U^T = (V^T - KS^T diag(e^G rk)) Aib^T        S^T <- e^{G_C} S^T + U^T diag(d) K
      qS^T = S^T Q^T        o^T = U^T QKD^T + qS^T diag(e^G rq)

  Its left operands (the bf16 pieces of S^T, of the right-hand side, then of the scaled deltas in the
  right-hand side's buffer, and of U^T) are written once to shared memory; the right operands are
  tiles there: k, q, v by TMA in a 2-stage ring, one chunk ahead (an mbarrier a stage), and the
  prologue's pieces.
- 8 warps: the two warp groups split each product's columns (warps [4, 2]), so both issue wgmma and
  each thread holds half of every tile (237-241 registers and no spills at every cell, triton 3.6;
  one warp group spills at 255 registers).
- o goes to an fp32 buffer whose sequences are padded to whole chunks, so a chunk's 64 rows are
  stored unmasked (a partial last chunk's rows past T are zeros there, and the norm never reads
  them): a store masked at T costs 10-11 spilled values in every specialisation where T is not a
  multiple of 16 (triton 3.6).
- The waits follow the state's chain (KS^T, U^T, the update); the products that reach only o stay
  in flight past them. The row factors and v are read while KS^T is in flight; qS^T is issued after
  U^T's products and finishes while the deltas and U^T are split; the next chunk's S^T pieces are
  split and stored while o's products finish. The results are bitwise those of waiting for KS^T and
  qS^T, then for the update and o, together, and the state pass is faster for it (the same-run
  timings: reports/bench/kernel-notes.md, "Order of the state pass's waits").
- Rows past a sequence's end: k, q and v are read through [tokens, heads x 128] views, so a partial last
  chunk reads the next sequence's rows (zeros past the tensor). They are set to zero in shared memory
  before use, as triton_chunked's masked loads would read them (Aib's rows and columns past T are zeros
  too: beta = 0 there), so no value of another sequence reaches this one.

Numerics. Every product that reaches the state is fp32-accurate, as in triton_chunked: q and k are
exact bf16 operands; an fp32 operand is split into three bf16 pieces (x = x1 + x2 + x3, each the
nearest bf16 of what the previous left: about 2^-24 relative together); a product of two fp32
operands (the right-hand side and Aib) splits both and keeps the six piece products down to 2^-16
relative (1*1, 1*2, 2*1, 1*3, 2*2, 3*1), about 2^-24 like tf32x3. The output's own products, which
reach only o (qS^T and U^T QKD^T), keep what holds each of o's two terms within 2^-16 relative of
itself (their sum can cancel, so not every element of o): two pieces of S^T against q, and the three
piece products 1*1, 1*2, 2*1 of U^T and QKD. o is rounded to bf16 after the gated
norm (unit roundoff 2^-8 relative), so 2^-16 is about 2^-8 of that rounding: against every piece
product down to 2^-24 the final state is bitwise the same and every cell's out error unchanged, with
0.26 % of out's elements one rounding apart (reports/bench/gdn_prefill.md, section 00000, item 3;
reports/bench/kernel-notes.md, "GDN prefill"). A tf32 operand (2^-11) is too coarse for o
(triton_chunked's docstring). Accumulation is fp32 throughout. The sums run in another order than triton_chunked's, so
the two agree to rounding, not bitwise.

Gluon has no interpreter: this variant runs on sm_90 only, and the CPU certifies triton_chunked.
Fixed geometry (the target's): d_k = d_v = 128, chunk 64, 64 state columns a program, 8 warps, bf16
q / k / v, fp32 state; 208 KB of shared memory a program.
"""

from __future__ import annotations

import math

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, \
    warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from impl.kernels.gdn import triton_chunked as tc
from impl.kernels.triton_support import INTERPRETING

# the TMA load: async_copy_global_to_shared in triton 3.6 (the H200's), async_load later
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# the CTA barrier: thread_barrier in triton 3.6, barrier later
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

CHUNK = 64
HEAD = 128          # d_k = d_v
COLS = 64           # state columns a program: the wgmma's M
PIECE_PLANES = gl.constexpr(tc.PIECE_PLANES.value)    # the prologue's planes a (chunk, value head):
AIB_PLANES = gl.constexpr(tc.AIB_PLANES.value)        # Aib's pieces first,
QKD_PLANES = gl.constexpr(tc.QKD_PLANES.value)        # then QKD's
# the products that reach only o, as wgmma groups: qS^T (pieces of S^T against q) and U^T QKD^T (piece
# products); the waits on the state's chain leave exactly these in flight, so the counts are tied here
QS_PIECES = gl.constexpr(2)
O_PRODUCTS = gl.constexpr(3)
WARPS = 8

# accumulators: [COLS, CHUNK] (KS^T, qS^T, U^T, o^T) and [COLS, HEAD] (S^T)
ACC_C = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16]))
ACC_H = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 64, 16]))
ALONG_T = gl.constexpr(gl.SliceLayout(0, ACC_C.value))     # a vector over the columns (t) of ACC_C
ALONG_R = gl.constexpr(gl.SliceLayout(1, ACC_C.value))     # a vector over its rows
ROWS_H = gl.constexpr(gl.SliceLayout(1, ACC_H.value))
COLS_H = gl.constexpr(gl.SliceLayout(0, ACC_H.value))
# shared tiles the wgmma reads: bf16, 128-byte swizzle
SH_MMA = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
# generic reads and writes of the k, q [64, 128] and v [64, 64] tiles (16-byte vectors of a row)
LD_KQ = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0]))
LD_V = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0]))
# the piece products of two split fp32 operands, smallest first (0 = the leading piece): every product
# of relative order down to 2^-16, (3, 1), (2, 2), (1, 3), (2, 1), (1, 2), (1, 1) in pieces counted from 1
PIECE_PAIRS = ((2, 0), (1, 1), (0, 2), (1, 0), (0, 1), (0, 0))
_X_PIECE = gl.constexpr(tuple(x for x, _ in PIECE_PAIRS))
_Y_PIECE = gl.constexpr(tuple(y for _, y in PIECE_PAIRS))


@gluon.jit
def _split3(x):
    """fp32 -> three bf16 pieces whose sum is x to about 2^-24 relative (round to nearest even each)."""
    x1 = x.to(gl.bfloat16)
    r = x - x1.to(gl.float32)
    x2 = r.to(gl.bfloat16)
    x3 = (r - x2.to(gl.float32)).to(gl.bfloat16)
    return x1, x2, x3


@gluon.jit
def _piece_products(x_s, y_s, acc, n: gl.constexpr):
    """acc + X Y^T for two fp32 operands held as bf16 pieces, x_s's and y_s's [64, 64] tiles: the last
    n of PIECE_PAIRS, smallest first, each an asynchronous wgmma group: n = 6 keeps every product down
    to 2^-16 relative (fp32-accurate), n = 3 those down to 2^-8 (2^-16 relative)."""
    for k in gl.static_range(6 - n, 6):
        acc = warpgroup_mma(x_s.index(_X_PIECE[k]), y_s.index(_Y_PIECE[k]).permute((1, 0)), acc,
                            is_async=True)
    return acc


@gluon.jit
def _store_pieces3(dst, x):
    """The three bf16 pieces of fp32 x into dst [3, ...] in shared memory (no fence, no barrier)."""
    x1, x2, x3 = _split3(x)
    dst.index(0).store(x1)
    dst.index(1).store(x2)
    dst.index(2).store(x3)


@gluon.jit
def _zero_rows_from(tile, n, layout: gl.constexpr):
    """Rows n.. of a bf16 tile in shared memory set to zero (read and written back in ``layout``)."""
    x = tile.load(layout)
    rows = gl.arange(0, x.shape[0], layout=gl.SliceLayout(1, layout))
    tile.store(gl.where((rows < n)[:, None], x, 0.0).to(x.dtype))


@gluon.jit
def _issue_chunk(k_d, q_d, v_d, k_s, q_s, v_s, bar, c, i_b, i_h, i_hk, v0, T):
    """TMA of chunk c's k, q [64, 128] and v [64, 64 columns] into one ring stage (through
    [tokens, heads x 128] views: see the module's docstring for rows past T)."""
    row0 = i_b * T + c * 64
    mbarrier.expect(bar, 2 * 64 * 128 * 2 + 64 * 64 * 2)
    _tma_load(k_d, [row0, i_hk * 128], bar, k_s)
    _tma_load(q_d, [row0, i_hk * 128], bar, q_s)
    _tma_load(v_d, [row0, i_h * 128 + v0], bar, v_s)


@gluon.jit
def _issue_pieces(p_d, dst, bar, c, bh, NT, which: gl.constexpr, n: gl.constexpr):
    """TMA of chunk c's first n bf16 pieces of Aib (which = 0) or of QKD (which = 1), both [t, i],
    written by the prologue, into dst [n, 64, 64]."""
    mbarrier.expect(bar, n * 64 * 64 * 2)
    for p in gl.static_range(n):
        row = (bh * NT + c) * (PIECE_PLANES * 64) + (which * AIB_PLANES + p) * 64
        _tma_load(p_d, [row, 0], bar, dst.index(p))


@gluon.jit
def _state_pass_wgmma(q_d, k_d, v_d, p_d, state, final_state, gbuf, rbuf, o_buf, T, NT, c0, c1,
                      HK: gl.constexpr, HV: gl.constexpr):
    pid = gl.program_id(0)
    i_v = pid % 2
    bh = pid // 2
    i_b = bh // HV
    i_h = bh % HV
    i_hk = i_h // (HV // HK)
    v0 = i_v * 64

    k_s = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 128], SH_MMA)
    q_s = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 128], SH_MMA)
    v_s = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], SH_MMA)
    ap_s = gl.allocate_shared_memory(gl.bfloat16, [AIB_PLANES, 64, 64], SH_MMA)   # Aib's pieces [t, i]
    qk_s = gl.allocate_shared_memory(gl.bfloat16, [QKD_PLANES, 64, 64], SH_MMA)   # QKD's pieces [t, i]
    sp_s = gl.allocate_shared_memory(gl.bfloat16, [3, 64, 128], SH_MMA)   # S^T's pieces
    rp_s = gl.allocate_shared_memory(gl.bfloat16, [3, 64, 64], SH_MMA)    # right-hand side's, then deltas'
    up_s = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], SH_MMA)    # U^T's two pieces
    bars = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(4):   # the two ring stages, Aib's pieces, QKD's pieces
        mbarrier.init(bars.index(i), count=1)

    # S^T [64 columns, 128 keys] = state[k, v0 + col]
    cols = v0 + gl.arange(0, 64, layout=ROWS_H)
    keys = gl.arange(0, 128, layout=COLS_H)
    ST = gl.load(state + bh.to(gl.int64) * 16384 + keys[None, :] * 128 + cols[:, None])

    _issue_chunk(k_d, q_d, v_d, k_s.index(0), q_s.index(0), v_s.index(0), bars.index(0), c0,
                 i_b, i_h, i_hk, v0, T)
    _issue_pieces(p_d, ap_s, bars.index(2), c0, bh, NT, 0, AIB_PLANES)
    _issue_pieces(p_d, qk_s, bars.index(3), c0, bh, NT, 1, QKD_PLANES)

    _store_pieces3(sp_s, ST)
    tt = gl.arange(0, 64, layout=ALONG_T)
    ii = gl.arange(0, 64, layout=ALONG_R)
    for c in range(c0, c1):
        j = c - c0      # this launch's iteration: the ring stage and the mbarrier phases
        s = j % 2
        if c + 1 < c1:
            _issue_chunk(k_d, q_d, v_d, k_s.index(1 - s), q_s.index(1 - s), v_s.index(1 - s),
                         bars.index(1 - s), c + 1, i_b, i_h, i_hk, v0, T)
        gb = (bh * NT + c).to(gl.int64) * 64
        G_C = gl.load(gbuf + gb + 63)
        mbarrier.wait(bars.index(s), (j // 2) & 1)
        k_c = k_s.index(s)
        q_c = q_s.index(s)
        if c * 64 + 64 > T:
            # a partial last chunk: its rows past T hold the next sequence's; zero them, so
            # that no value of another sequence (not even an inf or a NaN) reaches this one's products
            _zero_rows_from(k_c, T - c * 64, LD_KQ)
            _zero_rows_from(q_c, T - c * 64, LD_KQ)
            _zero_rows_from(v_s.index(s), T - c * 64, LD_V)
            fence_async_shared()
            _cta_barrier()

        fence_async_shared()    # S^T's pieces, stored before the loop or by the chunk before
        _cta_barrier()
        # KS^T: S^T's three pieces against the exact k tile
        zc = gl.zeros([64, 64], gl.float32, ACC_C)
        ks = warpgroup_mma(sp_s.index(2), k_c.permute((1, 0)), zc, is_async=True)
        ks = warpgroup_mma(sp_s.index(1), k_c.permute((1, 0)), ks, is_async=True)
        ks = warpgroup_mma(sp_s.index(0), k_c.permute((1, 0)), ks, is_async=True)
        # meanwhile: the row factors and v
        G = gl.load(gbuf + gb + tt)
        rk = gl.load(rbuf + 2 * gb + tt)
        vT = v_s.index(s).permute((1, 0)).load(ACC_C).to(gl.float32)
        ks = warpgroup_mma_wait(0, deps=(ks,))

        # U^T = (V^T - KS^T diag(e^G rk)) Aib^T, six piece products
        r1, r2, r3 = _split3(vT - ks * (gl.exp(G) * rk)[None, :])
        rp_s.index(0).store(r1)
        rp_s.index(1).store(r2)
        rp_s.index(2).store(r3)
        fence_async_shared()
        _cta_barrier()
        mbarrier.wait(bars.index(2), j & 1)
        u = _piece_products(rp_s, ap_s, zc, 6)
        # qS^T, for the output only: two pieces of S^T, smallest first (2^-16 relative, see the
        # module's docstring)
        qs = zc
        for p in gl.static_range(QS_PIECES):
            qs = warpgroup_mma(sp_s.index(QS_PIECES - 1 - p), q_c.permute((1, 0)), qs, is_async=True)
        rq = gl.load(rbuf + 2 * gb + 64 + tt)
        u = warpgroup_mma_wait(QS_PIECES, deps=(u,))    # U^T is done; qS^T's groups stay in flight
        _cta_barrier()      # the right-hand side's and Aib's pieces are read: refill Aib's
        if c + 1 < c1:
            _issue_pieces(p_d, ap_s, bars.index(2), c + 1, bh, NT, 0, AIB_PLANES)

        # S^T <- e^{G_C} S^T + (U^T diag(rk e^{G_C - G})) K (the state is the accumulator), and
        # o^T = U^T QKD^T + qS^T diag(e^G rq)
        d1, d2, d3 = _split3(u * (rk * gl.exp(G_C - G))[None, :])
        rp_s.index(0).store(d1)
        rp_s.index(1).store(d2)
        rp_s.index(2).store(d3)
        u1, u2, _ = _split3(u)     # the output's U^T: two pieces (2^-16 relative)
        up_s.index(0).store(u1)
        up_s.index(1).store(u2)
        qs = warpgroup_mma_wait(0, deps=(qs,))
        fence_async_shared()
        _cta_barrier()      # also: every warp group's qS^T is done, so S^T's pieces can be overwritten
        ST = warpgroup_mma(rp_s.index(2), k_c, ST * gl.exp(G_C), is_async=True)
        ST = warpgroup_mma(rp_s.index(1), k_c, ST, is_async=True)
        ST = warpgroup_mma(rp_s.index(0), k_c, ST, is_async=True)
        mbarrier.wait(bars.index(3), j & 1)
        o = _piece_products(up_s, qk_s, qs * (gl.exp(G) * rq)[None, :], O_PRODUCTS)
        ST = warpgroup_mma_wait(O_PRODUCTS, deps=(ST,))     # the update is done; o's groups stay in flight
        if c + 1 < c1:      # the next chunk's S^T pieces while o's products finish
            _store_pieces3(sp_s, ST)
        o = warpgroup_mma_wait(0, deps=(o,))

        o_base = ((i_b * NT + c).to(gl.int64) * 64 * HV + i_h) * 128 + v0    # sequences padded to NT chunks
        gl.store(o_buf + o_base + (tt[None, :] * (HV * 128) + ii[:, None]), o)
        _cta_barrier()     # every warp is done with this stage and the piece buffers before refills
        if c + 1 < c1:
            _issue_pieces(p_d, qk_s, bars.index(3), c + 1, bh, NT, 1, QKD_PLANES)
    cols = v0 + gl.arange(0, 64, layout=ROWS_H)
    keys = gl.arange(0, 128, layout=COLS_H)
    gl.store(final_state + bh.to(gl.int64) * 16384 + keys[None, :] * 128 + cols[:, None], ST)


# The chunks are cut into ranges: the state pass of range i (sequential over its chunks; 96 programs a
# sequence at the target geometry, one an SM, 241 registers a thread, so nothing else fits beside one)
# runs on a high-priority stream while the prologue of range i + 1 fills the SMs it leaves, and the gated
# norm of range i follows on a third stream. The first range's prologue runs alone, and the next range's
# prologue, on the SMs the state pass leaves, must end before that state pass does: so the ranges
# shorten, each RATIO times the one before. Rule (``default_schedule``), the fastest of the schedules
# timed on the H200 (the figures: reports/bench/kernel-notes.md, "Range schedule"):
# - one sequence of 64 chunks or more: three ranges, RATIO 0.6 (faster than two equal ranges or one;
#   other ratios and four ranges are slower);
# - otherwise two equal ranges once there are 64 chunks of work (sequences x chunks) and each range
#   keeps 16 chunks of every sequence, else one. A batch's state-pass programs fill the SMs (192 for
#   two sequences): no prologue runs beside them, so nothing is gained by shortening; shorter work
#   pays more for the extra launches than the overlap hides.
RATIO = 0.6
MIN_CHUNKS_A_RANGE = 16     # of every sequence, for the equal ranges
PREP_WARPS = 4      # the prologue's warps (8 are slower: reports/bench/kernel-notes.md, "Prologue")
_STREAMS: dict = {}


def default_schedule(batch: int, n_chunks: int) -> tuple[int, float]:
    """(ranges, ratio of each range's length to the one before) for ``batch`` sequences of
    ``n_chunks`` chunks each."""
    if batch == 1 and n_chunks >= 64:
        return 3, RATIO
    return max(1, min(2, batch * n_chunks // 32, n_chunks // MIN_CHUNKS_A_RANGE)), 1.0


def range_bounds(n_chunks: int, parts: int, ratio: float = 1.0) -> list[int]:
    """Chunk bounds [0, ..., n_chunks] of ``parts`` ranges (at most one a chunk) whose lengths fall
    geometrically by ``ratio`` from the first (1: equal ranges, the first one the shorter when they
    cannot be), each at least one chunk long."""
    parts = max(1, min(parts, n_chunks))
    weights = [ratio ** i for i in range(parts)]
    total, acc, bounds = sum(weights), 0.0, [0]
    for i in range(parts - 1):
        acc += weights[i]
        cut = math.floor(n_chunks * acc / total + 1e-9)
        bounds.append(max(bounds[-1] + 1, min(cut, n_chunks - (parts - 1 - i))))
    return bounds + [n_chunks]


def _stages(q, k, v, a, b, A_log, dt_bias, z, norm_w, state, out, final_state, parts: int,
            ratio: float = 1.0) -> list:
    """The launches of one prefill as [(prologue, state pass, gated norm)], one triple per range of
    chunks (none for T = 0); state pass i continues from state pass i - 1's final_state."""
    B, T, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    tc.check_prefill_args(q, k, v, a, b, A_log, dt_bias, z, norm_w, state, out, final_state)
    if (K, V) != (HEAD, HEAD) or HV % HK:
        raise ValueError(f"gluon_chunked supports d_k = d_v = {HEAD} and whole key-head groups "
                         f"(got K={K} V={V} HK={HK} HV={HV})")
    if q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16:
        raise ValueError("gluon_chunked reads bf16 q, k and v (TMA tiles of the tensor-core operands)")
    if INTERPRETING:
        raise ValueError("gluon_chunked: Triton's interpreter does not run Gluon kernels (sm_90 only)")
    if T == 0:
        return []
    NT = triton.cdiv(T, CHUNK)
    dev = v.device
    gbuf = torch.empty(B * HV * NT * CHUNK, dtype=torch.float32, device=dev)
    rbuf = torch.empty(2 * B * HV * NT * CHUNK, dtype=torch.float32, device=dev)
    ai_buf = torch.empty(B * HV * NT * CHUNK * CHUNK, dtype=torch.float32, device=dev)   # prologue scratch
    pc_buf = torch.empty(B * HV * NT * PIECE_PLANES.value * CHUNK * CHUNK, dtype=torch.bfloat16, device=dev)
    # o in fp32 for the norm, each sequence padded to whole chunks: the state pass stores a chunk's 64
    # rows unmasked (the partial last chunk's rows past T are zeros, never read; see the docstring)
    o_buf = torch.empty(B * NT * CHUNK * HV * V, dtype=torch.float32, device=dev)
    k_d = TensorDescriptor.from_tensor(k.view(B * T, HK * K), [64, 128], SH_MMA.value)
    q_d = TensorDescriptor.from_tensor(q.view(B * T, HK * K), [64, 128], SH_MMA.value)
    v_d = TensorDescriptor.from_tensor(v.view(B * T, HV * V), [64, 64], SH_MMA.value)
    p_d = TensorDescriptor.from_tensor(pc_buf.view(-1, 64), [64, 64], SH_MMA.value)
    bounds = range_bounds(NT, parts, ratio)

    def prep(c0, c1):
        return lambda: tc._prep_kernel[(c1 - c0, B * HK)](
            q, k, a, b, A_log, dt_bias, gbuf, rbuf, ai_buf, pc_buf, T, NT, c0, K ** -0.5, tc.L2_EPS,
            HK=HK, HV=HV, K=K, DOT="bf16", TLOAD=True, PIECES=True, num_warps=PREP_WARPS)

    def state_pass(c0, c1):
        src = state if c0 == 0 else final_state
        return lambda: _state_pass_wgmma[(B * HV * (V // COLS),)](
            q_d, k_d, v_d, p_d, src, final_state, gbuf, rbuf, o_buf, T, NT, c0, c1, HK=HK, HV=HV,
            num_warps=WARPS)

    def norm(c0, c1):
        row0, n_rows = c0 * CHUNK * HV, (min(c1 * CHUNK, T) - c0 * CHUNK) * HV   # rows of each sequence
        return lambda: tc._gated_norm_kernel[(triton.cdiv(n_rows, 16), B)](
            o_buf, z, norm_w, out, n_rows, row0, T * HV, NT * CHUNK * HV, tc.NORM_EPS, V=V, R=16,
            num_warps=4)

    return [(prep(c0, c1), state_pass(c0, c1), norm(c0, c1)) for c0, c1 in zip(bounds, bounds[1:])]


def launch_plan(q, k, v, a, b, A_log, dt_bias, z, norm_w, state, out, final_state) -> list:
    """The launches of one prefill in one range of chunks, as [(name, callable)] in order (the
    benchmark times each)."""
    stages = _stages(q, k, v, a, b, A_log, dt_bias, z, norm_w, state, out, final_state, 1)
    if not stages:
        return [("copy", lambda: final_state.copy_(state))]
    ((prep, state_pass, norm),) = stages
    return [("prep", prep), ("state_pass", state_pass), ("norm", norm)]


def _side_streams(main: torch.cuda.Stream) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """(high-priority stream for the state passes, stream for the norms), neither of them the caller's
    stream ``main``: PyTorch hands streams out of a round-robin pool, so a new one can be the caller's,
    and a norm queued on the caller's stream would hold the next range's prologue behind the state
    pass it waits for."""
    pairs = _STREAMS.setdefault(main.device, [])
    for high, low in pairs:
        if main != high and main != low:
            return high, low
    for _ in range(64):
        high, low = torch.cuda.Stream(main.device, priority=-1), torch.cuda.Stream(main.device)
        if main != high and main != low:
            pairs.append((high, low))
            return high, low
    raise RuntimeError("gluon_chunked: no side streams other than the caller's")


def gdn_prefill_chunked(q, k, v, a, b, A_log, dt_bias, z, norm_w, state, *, out, final_state,
                        _schedule: tuple[int, float] | None = None) -> None:
    """Chunked GDN prefill (sm_90), same contract as triton_chunked.gdn_prefill_chunked, pipelined over
    ranges of chunks (``default_schedule``; ``_schedule`` = (ranges, ratio) overrides it). The streams
    fork from and join the caller's current stream through events, so the call is ordered like a single
    launch and can be captured in a CUDA graph. Every range computes the same values as one range does:
    the result is bitwise the same for any cut into ranges."""
    B, T = q.shape[:2]
    parts, ratio = default_schedule(B, triton.cdiv(T, CHUNK)) if _schedule is None else _schedule
    stages = _stages(q, k, v, a, b, A_log, dt_bias, z, norm_w, state, out, final_state, parts, ratio)
    if not stages:
        final_state.copy_(state)
        return
    if len(stages) == 1 or v.device.type != "cuda":    # v on the CPU: a compile-only check
        for launch in (x for stage in stages for x in stage):
            launch()
        return
    main = torch.cuda.current_stream(v.device)
    high, low = _side_streams(main)
    high.wait_stream(main)
    low.wait_stream(main)
    try:
        for prep, state_pass, norm in stages:
            prep()
            high.wait_event(main.record_event())
            with torch.cuda.stream(high):
                state_pass()
            low.wait_event(high.record_event())
            with torch.cuda.stream(low):
                norm()
    finally:    # joined even when a launch raises, so nothing later on the caller's stream overtakes them
        main.wait_stream(high)
        main.wait_stream(low)
