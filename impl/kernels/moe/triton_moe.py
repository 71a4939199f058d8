"""The MoE block on Hopper: routed NVFP4 experts as two grouped GEMMs that dequantize in the kernel.

Hopper has no FP4 tensor cores, so the GEMMs run on 16-bit operands (docs/spec.md, "MoE"). An NVFP4 value
is ``code * sf * gs``; ``code * sf`` (an e2m1 value times an e4m3 block scale) has at most 6 significant
bits and lies in [2^-10, 2688], so it is exact in bf16 and in fp16. Both operands of a routed GEMM are
fed to the tensor cores as exact ``code * sf`` values, the products are exact in fp32 and accumulate
in fp32, and the two global scales multiply the sum once (``x_gs * w_gs``): the spec's arithmetic (dequantize each
operand in fp32, fp32 GEMM) in another rounding order, certified to tolerance.

One block's steps:
1. routing: fp32 logits ``x @ W_r^T`` from the exact widening of x and W_r and torch's softmax, then
   ``_topk_kernel``: the top-k by (-p, expert index), the weights renormalised (spec.ops.moe.moe_route's
   rule; the renormalising sum taken best first);
2. ``_quantize_kernel``: x quantized to nvfp4 with the layer's input scale, kept as the fp16 values
   ``code * sf`` (``nvfp4_values``: the spec's quantizer, spec.ops.kv_storage.nvfp4_quantize, bit for
   bit, in one launch);
3. ``expert_blocks``: the (token, slot) pairs grouped by expert into blocks of BM rows (``regime``),
   each block one expert's, on the device with no host synchronisation (one launch up to 128 pairs,
   a decode step's; the grid is the worst-case block count and blocks past the last exit at once,
   so a step can be captured in a CUDA graph);
4. ``_gate_up_kernel``: per (block, BN intermediate columns) the gate and up GEMMs from the same A
   tile (at few rows over SPLIT parts of K, added in part order by ``_gate_up_finish``), each
   rounded to bf16, then ``h = silu(g) * u`` in fp32, quantized in the epilogue with its
   scale ``h_gs`` (h's only rounding point; the column tile holds whole 16-element blocks);
5. ``_down_kernel``: per (block, BN output channels) the down GEMM, rounded to bf16, written to the
   pair's row;
6. ``_combine_kernel``: the k slot outputs summed in slot order in fp32, each product and sum rounded
   on its own as the spec's (no fused multiply-add), cast once; in ``moe`` the shared expert (bf16
   GEMMs with the spec's rounding points, its fp32 sigmoid gate) is added in fp32 and cast once.

The global scales are not checked per call (the spec's quantizer reads them on the host to check
them; the weights' loader owns that check): a step launches without a host synchronisation.

Operands. ``code * sf`` is also exact in fp16 (at most 6 significant bits, between 2^-10 and 2688), so
on the GPU both operands are fp16: the activations' quantized values are stored as fp16, and a weight
tile is decoded by the byte-permutation decoder of impl/kernels/qsa/kv_tiles.py (``E2M1_TIMES_SF_ASM``:
table lookups, a sign merge and one packed fp16 multiply by the block scale, which the hardware
converts from e4m3), with no conversion instruction per element; conversions are the slow instructions
on sm_90, and a decode through fp32 (two of them an element) bounds the GEMMs. Packed bytes hold
element 2i in the low nibble and 2i+1 in the high one; the decoded halves are interleaved back into K
order, so A is read as stored. Triton's interpreter, which has neither the table lookup nor fp8
types, decodes with integer arithmetic on the codes into exact fp32 values (``_e2m1_2m14``,
``_e4m3``): the same values, and the same on every CPU.

Not batch-invariant: the GEMM tiling groups rows by expert, and the routing and shared-expert GEMMs are
BLAS calls whose blocking follows the row count.
"""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import torch
import triton
import triton.language as tl

from impl.kernels.gemm import widened_matmul
from impl.kernels.layout import require_contiguous
from impl.kernels.moe.torch_moe import shared_expert
from impl.kernels.qsa.kv_tiles import E2M1_TIMES_SF_ASM
from impl.kernels.triton_support import INTERPRETING, round_to_bf16
from spec.ops.kv_storage import FP8_DTYPE

# Launch configs by regime. An expert block holds BM (token, slot) rows of one expert: 16 (the
# smallest tensor-core M) while most experts get a row or two, 64 once the rows average 8 an expert
# (a prefill chunk), where a larger block decodes each expert's weights for 4x the rows. Per GEMM:
# columns of a program (BN, a multiple of 16: h's quantizer blocks lie inside a tile), input elements
# of one K step (BK), warps and pipeline stages; few rows take narrow tiles, so that a step of ten
# experts still fills the GPU; SPLIT (gate|up only) cuts K into parts run by their own programs, their
# fp32 sums added in part order by ``_gate_up_finish``, so that ten experts' 16 column tiles become
# enough programs to fill the SMs. Triton's interpreter pays per operation, not per element, so it runs
# the same kernels over larger tiles (and two K parts, which certifies the split path on the CPU).
ROWS_PER_EXPERT_FOR_BM64 = 8
if INTERPRETING:
    _GEMMS = {"gate_up": {"BN": 256, "BK": 512, "num_warps": 4, "num_stages": 1},
              "down": {"BN": 256, "BK": 512, "num_warps": 4, "num_stages": 1}}
    CONFIGS = {"few": {**_GEMMS, "gate_up": {**_GEMMS["gate_up"], "SPLIT": 2}},
               "many": _GEMMS, "bm64": _GEMMS}
else:
    CONFIGS = {
        "few": {"gate_up": {"BN": 32, "BK": 128, "num_warps": 4, "num_stages": 2, "SPLIT": 4},
                "down": {"BN": 64, "BK": 128, "num_warps": 4, "num_stages": 2}},
        "many": {"gate_up": {"BN": 64, "BK": 128, "num_warps": 4, "num_stages": 2},
                 "down": {"BN": 128, "BK": 128, "num_warps": 4, "num_stages": 4}},
        "bm64": {"gate_up": {"BN": 64, "BK": 64, "num_warps": 4, "num_stages": 3},
                 "down": {"BN": 128, "BK": 64, "num_warps": 4, "num_stages": 3}},
    }
FEW_PAIRS = 64   # at most this many (token, slot) pairs: the "few" config


def k_parts(K: int, BK: int, want: int) -> int:
    """The most K parts, at most ``want``, that split K into whole BK steps (1 where none does:
    a K of less than one step runs as one masked step)."""
    return max((s for s in range(1, max(1, want) + 1) if K % (s * BK) == 0), default=1)


def regime(pairs: int, num_experts: int) -> tuple[str, int]:
    """(config name, BM) for a step of ``pairs`` (token, slot) pairs over ``num_experts``."""
    if pairs >= ROWS_PER_EXPERT_FOR_BM64 * num_experts:
        return "bm64", 64
    return ("few" if pairs <= FEW_PAIRS else "many"), 16


# The tensor-core operand dtype: fp16 on the GPU; fp32 in Triton's interpreter (numpy's fp16 matmul
# would round its sums to fp16). code * sf is exact in both, so the products are the same. The
# quantized activations are stored as fp16 values (exact), read as the operand dtype.
OPERAND = tl.float32 if INTERPRETING else tl.float16
VALUES = torch.float16
HW = tl.constexpr(not INTERPRETING)   # the byte-permutation decoder and the hardware e4m3 conversion
QUANT_ROWS = 16 if INTERPRETING else 4   # rows of one quantizer program


@triton.jit
def _e2m1(nibble):
    """4-bit e2m1 code (int32) -> its value in fp32: magnitude (2 + m) * 2^(e - 2) for e >= 1, m / 2
    for e == 0 (e = exponent bits, m = mantissa bit), bit 3 the sign."""
    mag = nibble & 7
    e = mag >> 1
    m = mag & 1
    val = tl.where(e == 0, m.to(tl.float32) * 0.5, ((2 + m) << e).to(tl.float32) * 0.25)
    return tl.where((nibble & 8) != 0, -val, val)


@triton.jit
def _e2m1_2m14(code):
    """The low 4 bits of ``code`` (int32), an e2m1 code, -> its value times 2^-14 in fp32, exactly:
    the code's magnitude bits placed as fp16's top exponent bit pair and first mantissa bit (bits
    9-11) and its sign as fp16's (bit 15) make the fp16 number code * 2^-14 (code 0.5 lands on the
    subnormal 2^-15), widened exactly. Four integer operations and one conversion a code; ``_e2m1``
    times 2^-14, bit for bit, signed zero included."""
    bits = ((code << 9) & 0xE00) | ((code << 12) & 0x8000)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e4m3(byte):
    """An e4m3fn byte (int32, a non-negative finite scale) -> fp32. A normal one (e >= 1) is its own
    bits moved into fp32's fields with the exponent rebiased (+120); a subnormal one is m 2^-9."""
    normal = (((byte & 0x7F) << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    return tl.where((byte & 0x78) == 0, (byte & 7).to(tl.float32) * 0.001953125, normal)


@triton.jit
def nvfp4_values(x, gs, R: tl.constexpr, NB: tl.constexpr):
    """[R, NB * 16] fp32 -> the exact fp32 values ``code * sf`` of spec.ops.kv_storage.nvfp4_quantize
    with global scale gs (blocks of 16 along the rows), bit for bit, NaN and signed zeros included.

    Per block: ``sf = e4m3(min(amax / (6 gs), 448))`` to nearest even (normal values by rounding the
    fp32 mantissa to 3 bits on the integer bits, subnormal ones as integer multiples of 2^-9); a NaN
    element makes the block's scale NaN. Per element: ``y = x / (sf gs)``, its e2m1 magnitude the count
    of midpoints it passes (ties to the even code), its sign x's sign bit. A block with scale 0 or NaN
    is all code 0. Divisions are correctly rounded (``div_rn``), as torch's."""
    xb = tl.reshape(x, (R, NB, 16))
    has_nan = tl.max((xb != xb).to(tl.int32), axis=2) != 0
    amax = tl.max(tl.abs(xb), axis=2)
    v = tl.minimum(tl.div_rn(amax, 6.0 * gs), 448.0)
    bits = v.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    sub = ((v * 512.0 + 8388608.0) - 8388608.0) * 0.001953125
    sf = tl.where(v >= 0.015625, normal, sub)
    y = tl.div_rn(xb, tl.where(sf > 0.0, sf * gs, 1.0)[:, :, None])  # dead blocks: no 0 / 0
    mag = tl.abs(y)
    idx = ((mag > 0.25).to(tl.int32) + (mag >= 0.75).to(tl.int32) + (mag > 1.25).to(tl.int32)
           + (mag >= 1.75).to(tl.int32) + (mag > 2.5).to(tl.int32) + (mag >= 3.5).to(tl.int32)
           + (mag > 5.0).to(tl.int32))
    val = _e2m1(idx) * sf[:, :, None]
    negative = (xb.to(tl.uint32, bitcast=True) >> 31) != 0
    val = tl.where(negative, -val, val)
    val = tl.where((sf == 0.0)[:, :, None], 0.0, val)
    val = tl.where(has_nan[:, :, None], float("nan"), val)
    return tl.reshape(val, (R, NB * 16))


@triton.jit
def _quantize_kernel(x, gs_ptr, out, rows, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.program_id(1) * BD + tl.arange(0, BD)
    mask = (r[:, None] < rows) & (c[None, :] < D)
    offs = r.to(tl.int64)[:, None] * D + c[None, :]
    xv = tl.load(x + offs, mask=mask, other=0.0).to(tl.float32)
    val = nvfp4_values(xv, tl.load(gs_ptr), BR, BD // 16)
    tl.store(out + offs, val.to(tl.float16), mask=mask)


@triton.jit
def _weight_tile(packed_ptr, sf_ptr, rows, row_mask, k0, K: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr):
    """The weight tile [BN, BK] at input column k0 as the exact values code * sf in the operand
    dtype, in K order (columns at or past K read as 0). The bytes are loaded as a 2-D [BN, BK / 2]
    tile and viewed [BN, BK / 16, 8], one 16-element scale block on the last axis, so that a block's
    scale broadcasts along it; each scale is converted once."""
    HALF: tl.constexpr = BK // 2
    G: tl.constexpr = BK // 16
    kb = k0 // 2 + tl.arange(0, HALF)
    mask = row_mask[:, None] & (kb[None, :] < K // 2)
    bytes_ = tl.load(packed_ptr + rows[:, None] * (K // 2) + kb[None, :], mask=mask, other=0)
    bytes_ = tl.reshape(bytes_, (BN, G, 8))
    kg = k0 // 16 + tl.arange(0, G)
    gmask = row_mask[:, None] & (kg[None, :] < K // 16)
    sf = tl.load(sf_ptr + rows[:, None] * (K // 16) + kg[None, :], mask=gmask, other=0)
    if HW:
        sf16 = tl.broadcast_to(sf.to(tl.float8e4nv, bitcast=True).to(tl.float16)[:, :, None],
                               (BN, G, 8))
        lo, hi = tl.inline_asm_elementwise(E2M1_TIMES_SF_ASM, "=r,=r,=r,=r,r,r,r", [bytes_, sf16],
                                           dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        codes = bytes_.to(tl.int32)
        sfx = (_e4m3(sf.to(tl.int32)) * 16384.0)[:, :, None]
        lo = _e2m1_2m14(codes) * sfx
        hi = _e2m1_2m14(codes >> 4) * sfx
    # element 2j is the low nibble, 2j + 1 the high one: join on a last axis of 2, flatten
    return tl.reshape(tl.join(lo, hi), (BN, BK)).to(OPERAND)


@triton.jit
def _h_epilogue(acc_g, acc_u, live, n_mask, e, slots, n, x_gs, gate_gs, up_gs, h_gs, hq,
                I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """g and u rounded to bf16, ``h = silu(g) * u`` in fp32, quantized with h_gs, stored to hq."""
    xs = tl.load(x_gs)
    g = round_to_bf16(acc_g * (xs * tl.load(gate_gs + e)))
    u = round_to_bf16(acc_u * (xs * tl.load(up_gs + e)))
    hv = g / (1.0 + tl.exp(-g)) * u
    hv = tl.where(live[:, None] & n_mask[None, :], hv, 0.0)
    hv = nvfp4_values(hv, tl.load(h_gs), BM, BN // 16)
    tl.store(hq + slots.to(tl.int64)[:, None] * I + n[None, :], hv.to(tl.float16),
             mask=n_mask[None, :])


@triton.jit
def _gate_up_kernel(xq, rows_of, block_expert, gate_packed, gate_sf, gate_gs, up_packed, up_sf,
                    up_gs, x_gs, h_gs, hq, part, num_experts, K: tl.constexpr, I: tl.constexpr,
                    TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    SPLIT: tl.constexpr):
    """Program (block, column tile, K part): with SPLIT == 1 the whole K and h's epilogue; with
    SPLIT > 1 the fp32 sums over its K / SPLIT inputs, stored to ``part`` for ``_gate_up_finish``."""
    blk = tl.program_id(0)
    e = tl.load(block_expert + blk)
    if e >= num_experts:
        return
    e = e.to(tl.int64)
    slots = blk * BM + tl.arange(0, BM)
    pair = tl.load(rows_of + slots)
    live = pair >= 0
    token = tl.where(live, pair // TOP_K, 0).to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_mask = n < I
    w_rows = e * I + n
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    KS: tl.constexpr = K // SPLIT
    k_first = tl.program_id(2) * KS
    for k0 in range(k_first, k_first + KS, BK):
        k = k0 + tl.arange(0, BK)
        a = tl.load(xq + token[:, None] * K + k[None, :], mask=live[:, None] & (k[None, :] < K),
                    other=0.0).to(OPERAND)
        acc_g += tl.dot(a, tl.trans(_weight_tile(gate_packed, gate_sf, w_rows, n_mask, k0, K, BN,
                                                 BK)))
        acc_u += tl.dot(a, tl.trans(_weight_tile(up_packed, up_sf, w_rows, n_mask, k0, K, BN, BK)))
    if SPLIT == 1:
        _h_epilogue(acc_g, acc_u, live, n_mask, e, slots, n, x_gs, gate_gs, up_gs, h_gs, hq,
                    I, BM, BN)
    else:
        rows = tl.num_programs(0) * BM
        at = ((tl.program_id(2) * 2 * rows + slots).to(tl.int64)[:, None] * I + n[None, :])
        mask = live[:, None] & n_mask[None, :]
        tl.store(part + at, acc_g, mask=mask)
        tl.store(part + rows * I + at, acc_u, mask=mask)


@triton.jit
def _gate_up_finish(part, rows_of, block_expert, gate_gs, up_gs, x_gs, h_gs, hq, num_experts,
                    I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr):
    """The K parts' fp32 sums added in part order, then h's epilogue (``_h_epilogue``)."""
    blk = tl.program_id(0)
    e = tl.load(block_expert + blk)
    if e >= num_experts:
        return
    e = e.to(tl.int64)
    slots = blk * BM + tl.arange(0, BM)
    live = tl.load(rows_of + slots) >= 0
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_mask = n < I
    rows = tl.num_programs(0) * BM
    mask = live[:, None] & n_mask[None, :]
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        at = ((s * 2 * rows + slots).to(tl.int64)[:, None] * I + n[None, :])
        acc_g = acc_g + tl.load(part + at, mask=mask, other=0.0)
        acc_u = acc_u + tl.load(part + rows * I + at, mask=mask, other=0.0)
    _h_epilogue(acc_g, acc_u, live, n_mask, e, slots, n, x_gs, gate_gs, up_gs, h_gs, hq, I, BM, BN)


@triton.jit
def _down_kernel(hq, rows_of, block_expert, down_packed, down_sf, down_gs, h_gs, slot_out,
                 num_experts, K: tl.constexpr, C: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr):
    blk = tl.program_id(0)
    e = tl.load(block_expert + blk)
    if e >= num_experts:
        return
    e = e.to(tl.int64)
    slots = (blk * BM + tl.arange(0, BM)).to(tl.int64)
    pair = tl.load(rows_of + slots)
    live = pair >= 0
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_mask = n < C
    w_rows = e * C + n
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        a = tl.load(hq + slots[:, None] * K + k[None, :], mask=k[None, :] < K,
                    other=0.0).to(OPERAND)
        acc += tl.dot(a, tl.trans(_weight_tile(down_packed, down_sf, w_rows, n_mask, k0, K, BN,
                                               BK)))
    y = round_to_bf16(acc * (tl.load(h_gs) * tl.load(down_gs + e)))
    dst = tl.where(live, pair, 0).to(tl.int64)
    tl.store(slot_out + dst[:, None] * C + n[None, :], y, mask=live[:, None] & n_mask[None, :])


@triton.jit
def _combine_kernel(slot_out, weights, shared, out, C: tl.constexpr, TOP_K: tl.constexpr,
                    HAS_SHARED: tl.constexpr, BC: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = c < C
    acc = tl.zeros([BC], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        w = tl.load(weights + t * TOP_K + j)
        acc = acc + w * tl.load(slot_out + (t * TOP_K + j) * C + c, mask=mask, other=0.0)
    y = round_to_bf16(acc)
    if HAS_SHARED:
        y = round_to_bf16(y + tl.load(shared + t * C + c, mask=mask, other=0.0).to(tl.float32))
    tl.store(out + t * C + c, y.to(tl.bfloat16), mask=mask)


# ---------------------------------------------------------------- host side (device tensors only)


def quantized_values(x: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """x [T, D] quantized to nvfp4 with the global scale gs (the spec's quantizer, ``nvfp4_values``),
    as the exact fp16 values ``code * sf`` (the global scale left out). One launch."""
    T, D = x.shape
    if D % 16:
        raise ValueError(f"nvfp4 needs the last dim to be a multiple of 16, got {D}")
    out = torch.empty(T, D, dtype=VALUES, device=x.device)
    bd = min(256, triton.next_power_of_2(D))
    _quantize_kernel[(triton.cdiv(T, QUANT_ROWS), triton.cdiv(D, bd))](
        x.contiguous(), gs, out, T, D=D, BR=QUANT_ROWS, BD=bd)
    return out


@triton.jit
def _topk_kernel(p, ids_out, w_out, E, TOP_K: tl.constexpr, BE: tl.constexpr):
    """One row of p [T, E]: the top-k experts by (-p, expert index), NaN p ranked last (as -inf),
    and their p renormalised by their sum, taken best first."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BE)
    pv = tl.load(p + t * E + e, mask=e < E, other=float("nan"))
    key = tl.where(pv != pv, float("-inf"), pv)
    free = e < E
    picked = tl.zeros([BE], dtype=tl.float32)
    total = 0.0
    for j in tl.static_range(TOP_K):
        best = tl.max(tl.where(free, key, float("-inf")), axis=0)
        idx = tl.min(tl.where(free & (key == best), e, BE), axis=0)
        pj = tl.sum(tl.where(e == idx, pv, 0.0), axis=0)
        tl.store(ids_out + t * TOP_K + j, idx.to(tl.int64))
        picked = tl.where(e == j, pj, picked)
        total = total + pj
        free = free & (e != idx)
    tl.store(w_out + t * TOP_K + e, picked / total, mask=e < TOP_K)


def route(x: torch.Tensor, w_router: torch.Tensor, top_k: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """spec.ops.moe.moe_route's rule with one fp32 GEMM and torch's softmax: ids [T, k] best first,
    weights [T, k] fp32. The top-k and the renormalisation are one launch (``_topk_kernel``)."""
    p = torch.softmax(widened_matmul(x, w_router.T), dim=-1).contiguous()
    T, E = p.shape
    ids = torch.empty(T, top_k, dtype=torch.int64, device=p.device)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=p.device)
    if T:
        _topk_kernel[(T,)](p, ids, weights, E, TOP_K=top_k, BE=triton.next_power_of_2(E))
    return ids, weights


@triton.jit
def _blocks_kernel(ids, rows_of, block_expert, P, num_experts, n_slots, max_blocks,
                   BM: tl.constexpr, BP: tl.constexpr, BS: tl.constexpr, BB: tl.constexpr):
    """``expert_blocks`` in one program for P <= BP pairs, from pair-by-pair comparisons: a pair's
    rank among the earlier pairs of its expert, its expert's block count, and the blocks of the
    experts below its own (each expert counted at its first pair)."""
    i = tl.arange(0, BP)
    j = tl.arange(0, BP)
    live_i = i < P
    live_j = j < P
    id_i = tl.load(ids + i, mask=live_i, other=num_experts).to(tl.int32)
    id_j = tl.load(ids + j, mask=live_j, other=num_experts).to(tl.int32)
    same = (id_i[:, None] == id_j[None, :]) & live_i[:, None] & live_j[None, :]
    rank_i = tl.sum((same & (j[None, :] < i[:, None])).to(tl.int32), axis=1)
    blocks_i = (tl.sum(same.to(tl.int32), axis=1) + BM - 1) // BM
    first_i = live_i & (rank_i == 0)
    rank_j = tl.sum((same & (i[:, None] < j[None, :])).to(tl.int32), axis=0)
    blocks_j = (tl.sum(same.to(tl.int32), axis=0) + BM - 1) // BM
    first_j = live_j & (rank_j == 0)
    start_i = tl.sum(tl.where(first_j[None, :] & (id_j[None, :] < id_i[:, None]),
                              blocks_j[None, :], 0), axis=1)
    start_j = tl.sum(tl.where(first_i[:, None] & (id_i[:, None] < id_j[None, :]),
                              blocks_i[:, None], 0), axis=0)
    s = tl.arange(0, BS)
    tl.store(rows_of + s, tl.full([BS], -1, tl.int32), mask=s < n_slots)
    tl.debug_barrier()
    tl.store(rows_of + start_i * BM + rank_i, i, mask=live_i)
    b = tl.arange(0, BB)
    owner = first_j[None, :] & (start_j[None, :] <= b[:, None]) \
        & (b[:, None] < (start_j + blocks_j)[None, :])
    tl.store(block_expert + b, tl.min(tl.where(owner, id_j[None, :], num_experts), axis=1),
             mask=b < max_blocks)


BLOCKS_KERNEL_MAX_PAIRS = 128   # ``_blocks_kernel``'s pair-by-pair tables up to this many pairs


def expert_blocks(expert_ids: torch.Tensor, num_experts: int, bm: int = 16
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs grouped by expert into blocks of ``bm`` rows, on the device.

    Returns (rows_of int32 [max_blocks * bm]: the pair (token * k + slot) a block row holds, -1 for
    padding; block_expert int32 [max_blocks]: each block's expert, ``num_experts`` past the last
    block). max_blocks = ceil(P / bm) + min(P, E) bounds the block count for P pairs. Experts'
    blocks follow in expert order and a block's rows in pair order. Up to
    BLOCKS_KERNEL_MAX_PAIRS pairs one launch (``_blocks_kernel``), else a sort and scans.
    """
    flat = expert_ids.reshape(-1)
    P, dev = flat.numel(), flat.device
    max_blocks = -(-P // bm) + min(P, num_experts)
    if 0 < P <= BLOCKS_KERNEL_MAX_PAIRS:
        rows_of = torch.empty(max_blocks * bm, dtype=torch.int32, device=dev)
        block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
        _blocks_kernel[(1,)](flat.contiguous(), rows_of, block_expert, P, num_experts,
                             max_blocks * bm, max_blocks, BM=bm,
                             BP=max(16, triton.next_power_of_2(P)),
                             BS=triton.next_power_of_2(max_blocks * bm),
                             BB=triton.next_power_of_2(max_blocks), num_warps=8)
        return rows_of, block_expert
    return expert_blocks_sorted(flat, num_experts, bm)


def expert_blocks_sorted(flat: torch.Tensor, num_experts: int, bm: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``expert_blocks`` for any pair count: a stable sort by expert, counts and scans."""
    P, dev = flat.numel(), flat.device
    max_blocks = -(-P // bm) + min(P, num_experts)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat))  # bincount would read the maximum id on the host
    blocks = (counts + bm - 1) // bm
    block_end = torch.cumsum(blocks, 0)
    first_pair = torch.cumsum(counts, 0) - counts
    order = torch.sort(flat, stable=True).indices
    e_sorted = flat[order]
    rank = torch.arange(P, device=dev) - first_pair[e_sorted]
    dest = (block_end - blocks)[e_sorted] * bm + rank
    rows_of = torch.full((max_blocks * bm,), -1, dtype=torch.int32, device=dev)
    rows_of[dest] = order.to(torch.int32)
    block_expert = torch.searchsorted(block_end, torch.arange(max_blocks, device=dev),
                                      right=True).to(torch.int32)
    return rows_of, block_expert


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def routed_experts(x, expert_ids, weights, gate_packed, gate_sf, gate_gs, up_packed, up_sf, up_gs,
                   down_packed, down_sf, down_gs, x_gs, h_gs, shared=None, config=None
                   ) -> torch.Tensor:
    """spec.ops.moe.moe_experts: the routed experts' weighted sum [T, C], bf16; with ``shared`` (the
    shared expert's bf16 output [T, C]) the op ``moe``'s sum ``bf16(routed + shared)`` instead.
    ``config`` overrides the regime's CONFIGS entry per GEMM (the benchmark's sweep)."""
    T, C = x.shape
    k = expert_ids.shape[1]
    E, I = gate_packed.shape[0], gate_packed.shape[1]
    if I % 16 or C % 16:
        raise ValueError(f"nvfp4 blocks of 16: the widths C={C} and I={I} must be multiples of 16")
    require_contiguous("the Triton MoE", expert_ids=expert_ids, gate_packed=gate_packed,
                       gate_sf=gate_sf, gate_gs=gate_gs, up_packed=up_packed, up_sf=up_sf,
                       up_gs=up_gs, down_packed=down_packed, down_sf=down_sf, down_gs=down_gs,
                       x_gs=x_gs, h_gs=h_gs)
    name, bm = regime(expert_ids.numel(), E)
    cfg = {g: {**CONFIGS[name][g], **((config or {}).get(g) or {})} for g in ("gate_up", "down")}
    gu, dn = cfg["gate_up"], cfg["down"]
    dev = x.device
    rows_of, block_expert = expert_blocks(expert_ids, E, bm)
    n_blocks = block_expert.shape[0]
    xq = quantized_values(x, x_gs)
    hq = torch.empty(n_blocks * bm, I, dtype=VALUES, device=dev)
    gu = dict(gu)
    split = k_parts(C, gu["BK"], gu.pop("SPLIT", 1))
    part = torch.empty(split * 2 * n_blocks * bm, I, dtype=torch.float32, device=dev) \
        if split > 1 else hq
    _gate_up_kernel[(n_blocks, triton.cdiv(I, gu["BN"]), split)](
        xq, rows_of, block_expert, gate_packed, _bytes(gate_sf), gate_gs, up_packed, _bytes(up_sf),
        up_gs, x_gs, h_gs, hq, part, E, K=C, I=I, TOP_K=k, BM=bm, SPLIT=split, **gu)
    if split > 1:
        _gate_up_finish[(n_blocks, triton.cdiv(I, gu["BN"]))](
            part, rows_of, block_expert, gate_gs, up_gs, x_gs, h_gs, hq, E, I=I, BM=bm,
            BN=gu["BN"], SPLIT=split)
    slot_out = torch.empty(T * k, C, dtype=torch.float32, device=dev)
    _down_kernel[(n_blocks, triton.cdiv(C, dn["BN"]))](
        hq, rows_of, block_expert, down_packed, _bytes(down_sf), down_gs, h_gs, slot_out, E,
        K=I, C=C, BM=bm, **dn)
    out = torch.empty(T, C, dtype=torch.bfloat16, device=dev)
    bc = min(1024, triton.next_power_of_2(C))
    _combine_kernel[(T, triton.cdiv(C, bc))](
        slot_out, weights.float().contiguous(), shared if shared is not None else out, out, C=C,
        TOP_K=k, HAS_SHARED=shared is not None, BC=bc, enable_fp_fusion=False)
    return out


# ---------------------------------------------------------------- variants (calling convention)


def moe_experts(x, expert_ids, weights, gate_packed, gate_sf, gate_gs, up_packed, up_sf, up_gs,
                down_packed, down_sf, down_gs, x_gs, h_gs, *, out) -> None:
    """Op ``moe_nvfp4_experts``."""
    out.copy_(routed_experts(x, expert_ids, weights, gate_packed, gate_sf, gate_gs, up_packed,
                             up_sf, up_gs, down_packed, down_sf, down_gs, x_gs, h_gs))


def moe(x, w_router, top_k, gate_packed, gate_sf, gate_gs, up_packed, up_sf, up_gs, down_packed,
        down_sf, down_gs, x_gs, h_gs, w_gate, w_up, w_down, w_sg, *, out) -> None:
    """Op ``moe``: routing, the routed experts and the shared expert, added in fp32, cast once."""
    ids, weights = route(x, w_router, top_k)
    shared = shared_expert(x, w_gate, w_up, w_down, w_sg)
    out.copy_(routed_experts(x, ids, weights, gate_packed, gate_sf, gate_gs, up_packed, up_sf,
                             up_gs, down_packed, down_sf, down_gs, x_gs, h_gs, shared=shared))
