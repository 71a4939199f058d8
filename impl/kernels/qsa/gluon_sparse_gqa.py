"""Gluon decode kernel of gated sparse GQA over nvfp4 pages (spec/ops/qsa.py:qsa_sparse_gqa), sm_90.

Same contract, split-K scheme, combine kernel and numerics as ``triton_sparse_gqa.triton_decode``;
what changes is where a dequantised element goes. In the Triton kernel every K and V element, once
decoded to fp16 in registers, is written to shared memory and read back by ldmatrix in the tensor-core
operand layout: that round trip keeps the L1 / shared-memory pipe busy and the kernel latency-bound
(its profile and its time against bf16 pages: reports/bench/gpu-notes.md, "Sparse GQA decode").
Here the packed bytes are loaded in a layout chosen so that the decoder's output registers already
are the mma.sync operand fragments, and no decoded element touches shared memory:

- A thread of the mma.sync m16n8k16 B fragment holds pairs of elements adjacent along k, and 32-bit
  registers of those pairs. The QK dot sums over d, so d can be visited in any order as long as q is
  visited in the same one: K's logical k order (``_K_SRC``) puts two adjacent bytes of a row on k's
  bit 0, so the decoder's packed fp16 pair (low nibbles of bytes 2i and 2i + 1) is one fragment
  register, each thread loads runs of 16 contiguous bytes, and q is gathered in that order
  (``_Q_PERM``; the kernel recomputes it from the bit positions, ``_physical_d``).
- For PV, V is the B operand with k = tokens: a fragment register pairs two tokens at one d, so each
  decoder call gets bytes of two tokens interleaved (one byte permutation of the two loaded words) and
  its fp16 pair is again one fragment register. The output columns come out in a permuted d order
  (``_N_SRC``), undone when the partial is stored (``_O_PERM``).
- The reshape / permute from the bytes' (token, byte, nibble) coordinates to the logical order is a
  renaming of registers; ``convert_layout(..., assert_trivial=True)`` makes the compiler prove that no
  data moves. What still crosses the two warps through shared memory (they split QK's 32 columns) is
  small: the row max and sum of the logits and p (16 x 32 a tile).
- The raw bytes and block scales stream through a 2-stage cp.async ring in shared memory (9 KB a stage,
  rows XOR-swizzled so that both readers' patterns are free of bank conflicts), issued a tile ahead.

Numerics as triton_decode's nvfp4 path: code * sf exact in fp16, gs in fp32 on the logits and the
output, q scaled per row by a power of two into fp16, p split into two fp16 pieces, fp32 accumulation.
The fp32 sums run over d in another order inside the dots, so the two kernels agree to rounding, not
bitwise (0.5 ulp at 128 rows x 2048 keys on the H200). Gluon has no interpreter: this variant runs on
sm_90 only, and the CPU certifies triton_decode's nvfp4 path instead.

Fixed geometry (the target's): head_dim 256, at most 16 q heads per KV head, 32-token tiles, 2 warps.
"""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from impl.kernels.qsa.kv_tiles import E2M1_TIMES_SF_ASM, FMT_NVFP4
from impl.kernels.triton_support import INTERPRETING
from impl.kernels.qsa.triton_sparse_gqa import TPB, _check, _decode_combine_kernel, _default_splits, \
    _formats, _token_slots_kernel

# the cp.async copy: async_copy_global_to_shared in triton 3.6 (the H200's), async_load from 3.7 on
_cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
# the CTA barrier: thread_barrier in triton 3.6, barrier later
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

HEAD_DIM = 256
TILE = 32               # tokens a tile
GROUP_PAD = 16          # q heads of a group, padded: the dots' M
WARPS = 2
RING = 2                # cp.async ring depth (4 stages are slower: reports/bench/gpu-notes.md)
_PB_BITS = 7            # HEAD_DIM / 2 = 128 packed bytes a row
# the same, as the kernels' compile-time constants
D = gl.constexpr(HEAD_DIM)
BN = gl.constexpr(TILE)
G_PAD = gl.constexpr(GROUP_PAD)
STAGES = gl.constexpr(RING)


def _pb(i: int) -> list[int]:
    return [0, 1 << i]


def _tk(i: int) -> list[int]:
    return [1 << i, 0]


def _ll(regs: list, lanes: list, warps: list, shape: list) -> gl.DistributedLinearLayout:
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=warps,
                                      block_bases=[], shape=shape)


def _as_3d(bases: list) -> list:
    """[token, byte] bases -> [token, byte // 8, byte % 8]: the block-scale axis split out."""
    return [[b[0], b[1] >> 3, b[1] & 7] for b in bases]


# Where each logical bit of K's k (QK's sum index) and of V's n (PV's output column) comes from:
# ("pb", i) = bit i of the packed byte's index in the row, ("nib",) = low (0) or high (1) nibble;
# physical d = 2 * byte + nibble. The lane and warp bits, and which bit pairs a fragment register, are
# fixed by the mma.sync fragments (mma_v2, warps [1, 2]); the order of the other register bits is
# chosen for contiguous loads (tests/ops/test_qsa_sparse_gqa_gluon.py checks the bases against these):
#   B of QK [k = d, n = token]: registers k0, k3..k7, n4; lanes k1, k2, n0, n1, n2; warp n3.
#   B of PV [k = token, n = d]: registers k0, k3, k4, n4..n7; lanes k1, k2, n0, n1, n2; warp n3.
_K_SRC = [("pb", 0), ("pb", 4), ("pb", 5), ("pb", 1), ("pb", 2), ("pb", 3), ("nib",), ("pb", 6)]
_N_SRC = [("pb", 3), ("pb", 4), ("pb", 5), ("pb", 6), ("nib",), ("pb", 0), ("pb", 1), ("pb", 2)]


def physical_d(src: list) -> list[int]:
    """Logical index -> physical d, for a bit-source list like ``_K_SRC``."""
    out = []
    for j in range(HEAD_DIM):
        byte = nib = 0
        for bit, s in enumerate(src):
            if j >> bit & 1:
                if s[0] == "nib":
                    nib = 1
                else:
                    byte |= 1 << s[1]
        out.append(2 * byte + nib)
    return out


def logical_order(src: list) -> tuple[int, ...]:
    """The permutation of the [token, pb6 .. pb0, nibble] view (one axis of 2 per bit, the bytes'
    most significant bit first) that lists the logical bits most significant first."""
    def axis(s):
        return 1 + _PB_BITS if s[0] == "nib" else 1 + (_PB_BITS - 1 - s[1])
    return (0, *(axis(src[j]) for j in reversed(range(len(src)))))


def bit_positions(src: list) -> tuple[int, ...]:
    """For each logical bit, its position in physical d (the nibble is bit 0, byte bit i is i + 1):
    physical d = sum over logical bits b of bit b of the index, shifted to position [b]."""
    return tuple(0 if s[0] == "nib" else 1 + s[1] for s in src)


_SPLIT = gl.constexpr((TILE, *([2] * (_PB_BITS + 1))))
_K_POS = gl.constexpr(bit_positions(_K_SRC))
_N_POS = gl.constexpr(bit_positions(_N_SRC))
_K_ORDER = gl.constexpr(logical_order(_K_SRC))
_V_ORDER = gl.constexpr(logical_order(_N_SRC))
_Q_PERM = physical_d(_K_SRC)
_O_PERM = physical_d(_N_SRC)

# Register layouts of the packed bytes [BN, D / 2] (token, byte): K's thread holds two runs of 16
# contiguous bytes (bytes c .. c + 15 and c + 64 .. c + 79) of each of two tokens, four 16-byte loads;
# V's holds 8 contiguous bytes of eight tokens, read with the bytes first (8-byte loads, ``_V2``) and
# handed to the decoder with token bit 0 first (``_V3``), so that the 4 bytes of one decoder call are
# (t0, b), (t1, b), (t0, b + 1), (t1, b + 1).
_K_REGS = [_pb(0), _pb(1), _pb(2), _pb(3), _pb(6), _tk(4)]
_K_LANES = [_pb(4), _pb(5), _tk(0), _tk(1), _tk(2)]
_K_WARPS = [_tk(3)]
_V_LOAD_REGS = [_pb(0), _pb(1), _pb(2), _tk(0), _tk(3), _tk(4)]
_V_DEC_REGS = [_tk(0), _pb(0), _pb(1), _pb(2), _tk(3), _tk(4)]
_V_LANES = [_tk(1), _tk(2), _pb(3), _pb(4), _pb(5)]
_V_WARPS = [_pb(6)]
_K2 = gl.constexpr(_ll(_K_REGS, _K_LANES, _K_WARPS, [TILE, HEAD_DIM // 2]))
_K3 = gl.constexpr(_ll(_as_3d(_K_REGS), _as_3d(_K_LANES), _as_3d(_K_WARPS), [TILE, HEAD_DIM // 16, 8]))
_V2 = gl.constexpr(_ll(_V_LOAD_REGS, _V_LANES, _V_WARPS, [TILE, HEAD_DIM // 2]))
_V3 = gl.constexpr(_ll(_as_3d(_V_DEC_REGS), _as_3d(_V_LANES), _as_3d(_V_WARPS), [TILE, HEAD_DIM // 16, 8]))

# Shared memory of one stage's bytes [BN, 128]: row r's 16-byte chunks XOR-ed by 64 B (r bit 0),
# 32 B (bit 1) and 64 B (bit 2). K's readers (16 B, 8 threads a phase) meet rows r, r ^ 1; V's (8 B,
# 16 threads a phase) rows r, r ^ 2, r ^ 4, r ^ 6: each phase then covers 32 distinct banks.
_SWIZZLE = {0: 64, 1: 32, 2: 64, 3: 0, 4: 0}
_RAW = gl.constexpr(gl.SharedLinearLayout(
    offset_bases=[[0, 1 << i] for i in range(_PB_BITS)] + [[1 << j, _SWIZZLE[j]] for j in range(5)]))
_SCALES = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
_MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, WARPS],
                                              instr_shape=[16, 8]))
_A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_MMA.value, k_width=2))
_B = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=_MMA.value, k_width=2))
_QL = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [1, WARPS], [1, 0]))
_COPY_BYTES = gl.constexpr(gl.BlockedLayout([1, 16], [4, 8], [WARPS, 1], [1, 0]))
_COPY_SCALES = gl.constexpr(gl.BlockedLayout([1, 8], [16, 2], [WARPS, 1], [1, 0]))


@gluon.jit
def _decoded_operand(packed2, sf, L3: gl.constexpr, ORDER: gl.constexpr, TRANS: gl.constexpr):
    """Packed bytes [BN, D/2] (their register layout) and e4m3 scales [BN, D/16] -> the fp16 tile
    code * sf in the logical order, as the B operand of mma_v2 ([D, BN] for K, [BN, D] for V)."""
    packed = gl.convert_layout(gl.reshape(packed2, [BN, D // 16, 8]), L3, assert_trivial=True)
    sf16 = sf.to(gl.float8e4nv, bitcast=True).to(gl.float16)
    sf16 = gl.broadcast(sf16[:, :, None], packed)[0]
    lo, hi = gl.inline_asm_elementwise(E2M1_TIMES_SF_ASM, "=r,=r,=r,=r,r,r,r", [packed, sf16],
                                       dtype=(gl.float16, gl.float16), is_pure=True, pack=4)
    x = gl.reshape(gl.join(lo, hi), _SPLIT.value)  # [token, pb6 .. pb0, nibble]
    x = gl.reshape(gl.permute(x, ORDER.value), [BN, D])
    if TRANS:
        x = gl.permute(x, [1, 0])
    return gl.convert_layout(x, _B, assert_trivial=True)


@gluon.jit
def _physical_d(j, POS: gl.constexpr):
    """``physical_d`` in the kernel: logical indices j -> physical d, bit b of j moved to POS[b]."""
    d = j * 0
    for b in gl.static_range(len(POS)):
        d = d | (((j >> b) & 1) << POS[b])
    return d


@gluon.jit
def _issue_tile(k_pool, k_sf, v_pool, v_sf, kbuf, vbuf, ksb, vsb, stage, ts_b, ts_s, h,
                HKV: gl.constexpr):
    """cp.async of one tile's K and V bytes and scales into ``stage`` of the ring; token slots ts_b /
    ts_s (-1: nothing, zero-filled) in the two copy layouts' token slices."""
    valid = ts_b >= 0
    slot = gl.where(valid, ts_b.to(gl.int64) * HKV + h, 0)
    cb = gl.arange(0, D // 2, layout=gl.SliceLayout(0, _COPY_BYTES))
    offs = slot[:, None] * (D // 2) + cb[None, :]
    mask = gl.broadcast(valid[:, None], offs)[0]
    _cp_async(kbuf.index(stage), k_pool + offs, mask=mask)
    _cp_async(vbuf.index(stage), v_pool + offs, mask=mask)
    valid_s = ts_s >= 0
    slot_s = gl.where(valid_s, ts_s.to(gl.int64) * HKV + h, 0)
    cs = gl.arange(0, D // 16, layout=gl.SliceLayout(0, _COPY_SCALES))
    offs_s = slot_s[:, None] * (D // 16) + cs[None, :]
    mask_s = gl.broadcast(valid_s[:, None], offs_s)[0]
    _cp_async(ksb.index(stage), k_sf + offs_s, mask=mask_s)
    _cp_async(vsb.index(stage), v_sf + offs_s, mask=mask_s)


@gluon.jit
def _tile_slots(slots_row, tile, last, W, LAYOUT: gl.constexpr):
    """Token slots of ``tile`` in a copy layout's token slice; -1 past the row or the split."""
    n = tile * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, LAYOUT))
    return gl.load(slots_row + n, mask=(n < W) & (tile < last), other=-1)


@gluon.jit
def _decode_split_kernel(q, token_slots, k_pool, k_sf, k_gs, v_pool, v_sf, v_gs,
                         part_o, part_ml, scale, W, tiles_per_split,
                         HQ: gl.constexpr, HKV: gl.constexpr, G: gl.constexpr):
    row = gl.program_id(0).to(gl.int64)
    h = gl.program_id(1).to(gl.int64)
    split = gl.program_id(2).to(gl.int64)
    n_splits = gl.num_programs(2).to(gl.int64)
    kbuf = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, D // 2], _RAW)
    vbuf = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, D // 2], _RAW)
    ksb = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, D // 16], _SCALES)
    vsb = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, D // 16], _SCALES)
    first = gl.program_id(2) * tiles_per_split
    last = first + tiles_per_split
    slots_row = token_slots + row * W
    for i in gl.static_range(STAGES - 1):
        _issue_tile(k_pool, k_sf, v_pool, v_sf, kbuf, vbuf, ksb, vsb, i,
                    _tile_slots(slots_row, first + i, last, W, _COPY_BYTES),
                    _tile_slots(slots_row, first + i, last, W, _COPY_SCALES), h, HKV)
        async_copy.commit_group()
    # q gathered in K's logical k order, each row scaled by a power of two into fp16's range
    # (triton_sparse_gqa._q_operand's rule)
    g = gl.arange(0, G_PAD, layout=gl.SliceLayout(1, _QL))
    kq = _physical_d(gl.arange(0, D, layout=gl.SliceLayout(0, _QL)), _K_POS)
    gm = g < G
    qf = gl.load(q + (row * HQ + h * G + g)[:, None] * D + kq[None, :], mask=gm[:, None],
                 other=0.0).to(gl.float32)
    qmax = gl.max(gl.abs(qf), 1)
    e = gl.minimum(gl.maximum(((qmax.to(gl.int32, bitcast=True) >> 23) & 0xFF) - 127, -112), 127)
    up = ((141 - e) << 23).to(gl.float32, bitcast=True)
    down = ((113 + e) << 23).to(gl.float32, bitcast=True)
    qa = gl.convert_layout((qf * up[:, None]).to(gl.float16), _A)
    s_scale = gl.convert_layout(down * scale * gl.load(k_gs), gl.SliceLayout(1, _MMA))
    m_i = gl.full([G_PAD], -1.0e30, gl.float32, layout=gl.SliceLayout(1, _MMA))
    l_i = gl.zeros([G_PAD], gl.float32, layout=gl.SliceLayout(1, _MMA))
    acc = gl.zeros([G_PAD, D], gl.float32, layout=_MMA)
    # the slots of the tile issued next, loaded one iteration before its copy
    ts_b = _tile_slots(slots_row, first + STAGES - 1, last, W, _COPY_BYTES)
    ts_s = _tile_slots(slots_row, first + STAGES - 1, last, W, _COPY_SCALES)
    for t in range(first, last):
        j = t - first
        nc = t * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, _MMA))
        live = gl.load(slots_row + nc, mask=nc < W, other=-1) >= 0
        async_copy.wait_group(STAGES - 2)
        _cta_barrier()  # tile j landed for every thread; stage (j - 1) % STAGES is free again
        _issue_tile(k_pool, k_sf, v_pool, v_sf, kbuf, vbuf, ksb, vsb, (j + STAGES - 1) % STAGES,
                    ts_b, ts_s, h, HKV)
        async_copy.commit_group()
        ts_b = _tile_slots(slots_row, t + STAGES, last, W, _COPY_BYTES)
        ts_s = _tile_slots(slots_row, t + STAGES, last, W, _COPY_SCALES)
        stage = j % STAGES
        kb = _decoded_operand(kbuf.index(stage).load(_K2), ksb.index(stage).load(gl.SliceLayout(2, _K3)),
                              _K3, _K_ORDER, True)
        s = mma_v2(qa, kb, gl.zeros([G_PAD, BN], gl.float32, layout=_MMA)) * s_scale[:, None]
        s = gl.where(live[None, :], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        alpha = gl.exp(m_i - m_new)
        p = gl.exp(s - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        p_hi = p.to(gl.float16)
        p_lo = (p - p_hi.to(gl.float32)).to(gl.float16)  # p to 2^-22 relative in two fp16 pieces
        vb = _decoded_operand(vbuf.index(stage).load(_V2), vsb.index(stage).load(gl.SliceLayout(2, _V3)),
                              _V3, _V_ORDER, False)
        acc = acc * alpha[:, None]
        acc = mma_v2(gl.convert_layout(p_hi, _A), vb, acc)
        acc = mma_v2(gl.convert_layout(p_lo, _A), vb, acc)
        m_i = m_new
    async_copy.wait_group(0)
    acc = acc * gl.load(v_gs)
    base = (row * HKV + h) * n_splits + split
    go = gl.arange(0, G_PAD, layout=gl.SliceLayout(1, _MMA))
    col = _physical_d(gl.arange(0, D, layout=gl.SliceLayout(0, _MMA)), _N_POS)  # logical n -> d
    gmo = go < G
    gl.store(part_o + (base * G + go)[:, None] * D + col[None, :], acc, mask=gmo[:, None])
    gl.store(part_ml + (base * 2) * G + go, m_i, mask=gmo)
    gl.store(part_ml + (base * 2 + 1) * G + go, l_i, mask=gmo)


def gluon_decode(q: torch.Tensor, gate: torch.Tensor, tokens: torch.Tensor, seq_ids: torch.Tensor,
                 block_table: torch.Tensor, k_cache, v_cache, load=None, load_v=None,
                 scale: float | None = None, *, out: torch.Tensor, num_splits: int | None = None) -> None:
    """Decode rows over nvfp4 pages: the contract of ``triton_sparse_gqa.triton_decode``. Refuses
    (ValueError) other page formats, another head_dim than 256, more than 16 q heads per KV head, and
    Triton's interpreter (which does not run Gluon)."""
    _check(q, gate, tokens, seq_ids, block_table, out)
    n, hq, d = q.shape
    kf, vf, n_kv = _formats(q, k_cache, v_cache, load, load_v)
    if kf.fmt != FMT_NVFP4:
        raise ValueError("gluon_decode reads nvfp4 pages only (bf16 / fp8 pages: triton_decode)")
    if d != HEAD_DIM:
        raise ValueError(f"gluon_decode is built for head_dim {HEAD_DIM}, got {d}")
    g = hq // n_kv
    if g > GROUP_PAD:
        raise ValueError(f"gluon_decode takes at most {GROUP_PAD} q heads per KV head, got {g}")
    if INTERPRETING:
        raise ValueError("gluon_decode is compiled for the GPU only: Triton's interpreter does not run "
                         "Gluon kernels")
    if n == 0:
        return
    if kf.pool.shape[0] * TPB > 2**31:
        raise ValueError("gluon_decode keeps page * 32 + offset in int32: at most 2^26 pages")
    w = tokens.shape[1]
    tiles = max(1, triton.cdiv(w, TILE))
    splits = num_splits or _default_splits(n, n_kv, tiles, q.device, per_sm=2)
    per_split = triton.cdiv(tiles, splits)
    splits = triton.cdiv(tiles, per_split)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    token_slots = torch.empty(n, w, dtype=torch.int32, device=q.device)
    _token_slots_kernel[(n, triton.cdiv(w, 1024))](tokens, seq_ids, block_table, token_slots, w,
                                                   block_table.shape[1], BLOCK=1024, num_warps=4)
    part_o = torch.empty(n * n_kv * splits * g * d, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(n * n_kv * splits * 2 * g, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(n, n_kv, splits)](
        q, token_slots, *kf.args(), *vf.args(), part_o, part_ml, scale, w, per_split,
        HQ=hq, HKV=n_kv, G=g, num_warps=WARPS)
    _decode_combine_kernel[(n, n_kv)](part_o, part_ml, gate, out, splits, HQ=hq, HKV=n_kv, G=g,
                                      G_PAD=GROUP_PAD, D=d, num_warps=4)
