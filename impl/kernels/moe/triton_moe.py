"""The MoE block on Hopper: routed NVFP4 experts as two grouped GEMMs that dequantize in the kernel.

Hopper has no FP4 tensor cores, so the GEMMs run on bf16 operands (MATH.md, "MoE"). An NVFP4 value is
``code * sf * gs``; ``code * sf`` (an e2m1 value times an e4m3 block scale) has at most 6 significant bits
and lies in [2^-10, 2688], so it is exact in bf16. Both operands of a routed GEMM are fed to the tensor
cores as exact ``code * sf`` bf16 values, the products are exact in fp32 and accumulate in fp32, and the
two global scales multiply the sum once (``x_gs * w_gs``): the spec's arithmetic (dequantize each
operand in fp32, fp32 GEMM) in another rounding order, certified to tolerance.

One block's steps:
1. routing (torch): fp32 logits ``x @ W_r^T`` from the exact widening of x and W_r, softmax, the top-k
   by (-p, expert index) with a stable sort, the weights renormalised (spec.ops.moe.moe_route's rule);
2. x quantized to nvfp4 with the layer's input scale (the spec's quantizer, spec.ops.kv_storage), kept
   as the bf16 values ``code * sf``;
3. the (token, slot) pairs sorted by expert into blocks of ``BLOCK_M`` rows, each block one expert's,
   on the device with no host synchronisation (the grid is the worst-case block count; blocks past
   the last exit at once, so a step can be captured in a CUDA graph);
4. ``_gate_up_kernel``: per (block, 64 intermediate columns) the gate and up GEMMs from the same A
   tile, each rounded to bf16, then ``h = silu(g) * u`` in fp32;
5. h quantized with its scale ``h_gs`` (the spec's quantizer: h's only rounding point);
6. ``_down_kernel``: per (block, 64 output channels) the down GEMM, rounded to bf16, written to the
   pair's row;
7. the k slot outputs summed in slot order in fp32 (torch), cast once; the shared expert (bf16 GEMMs
   with the spec's rounding points, its fp32 sigmoid gate) added in fp32 and cast once.

Packed bytes hold element 2i in the low nibble and 2i+1 in the high one. The kernels split each K tile
into its even and odd elements (A's columns 2i and 2i+1 against the low and high nibbles), so a byte is
decoded where it is loaded. e2m1 and e4m3 are decoded with integer arithmetic on the codes (no table,
no fp8 type), the same on the GPU and in Triton's interpreter.

Not batch-invariant: the GEMM tiling groups rows by expert, and the routing and shared-expert GEMMs are
BLAS calls whose blocking follows the row count.
"""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from impl.kernels.gemm import bf16_matmul, widened_matmul
from impl.kernels.triton_support import INTERPRETING, round_to_bf16
from spec.ops.kv_storage import FP8_DTYPE, nvfp4_dequantize, nvfp4_quantize

BLOCK_M = 16   # rows (token, slot pairs) of one expert block: the smallest tensor-core M
# Columns of a program and input elements of one K step. Triton's interpreter pays per operation,
# not per element, so it runs the same kernels over larger tiles.
BLOCK_N = 256 if INTERPRETING else 64
BLOCK_K = 512 if INTERPRETING else 64
# The tensor-core operand dtype: bf16 on the GPU; fp32 in Triton's interpreter, whose dot reads bf16
# operands as their raw bits. code * sf is exact in both, so the products are the same.
OPERAND = tl.float32 if INTERPRETING else tl.bfloat16


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
def _e4m3(byte):
    """An e4m3fn byte (int32, a non-negative finite scale) -> fp32: (8 + m) 2^(e - 10), or m 2^-9
    for e == 0; 2^(e - 10) is built from its exponent bits."""
    e = (byte >> 3) & 15
    m = byte & 7
    pow2 = ((e + 117) << 23).to(tl.float32, bitcast=True)
    return tl.where(e == 0, m.to(tl.float32) * 0.001953125, (8 + m).to(tl.float32) * pow2)


@triton.jit
def _weight_tile(packed_ptr, sf_ptr, rows, row_mask, kb, K: tl.constexpr,
                 HALF_K: tl.constexpr):
    """The low- and high-nibble halves [BN, HALF_K] of a weight tile as exact bf16 code * sf; kb:
    the tile's packed byte columns (those at or past K / 2 read as 0)."""
    mask = row_mask[:, None] & (kb[None, :] < K // 2)
    bytes_ = tl.load(packed_ptr + rows[:, None] * (K // 2) + kb[None, :], mask=mask,
                     other=0).to(tl.int32)
    sf = _e4m3(tl.load(sf_ptr + rows[:, None] * (K // 16) + (kb[None, :] // 8), mask=mask,
                       other=0).to(tl.int32))
    lo = (_e2m1(bytes_ & 15) * sf).to(OPERAND)
    hi = (_e2m1(bytes_ >> 4) * sf).to(OPERAND)
    return lo, hi


@triton.jit
def _gate_up_kernel(xq, rows_of, block_expert, gate_packed, gate_sf, gate_gs, up_packed, up_sf,
                    up_gs, x_gs, h, num_experts, K: tl.constexpr, I: tl.constexpr,
                    TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
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
    HALF: tl.constexpr = BK // 2
    for k0 in range(0, K, BK):
        kb = k0 // 2 + tl.arange(0, HALF)
        a_mask = live[:, None] & (kb[None, :] < K // 2)
        a_even = tl.load(xq + token[:, None] * K + 2 * kb[None, :], mask=a_mask,
                         other=0.0).to(OPERAND)
        a_odd = tl.load(xq + token[:, None] * K + 2 * kb[None, :] + 1, mask=a_mask,
                        other=0.0).to(OPERAND)
        g_lo, g_hi = _weight_tile(gate_packed, gate_sf, w_rows, n_mask, kb, K, HALF)
        acc_g += tl.dot(a_even, tl.trans(g_lo))
        acc_g += tl.dot(a_odd, tl.trans(g_hi))
        u_lo, u_hi = _weight_tile(up_packed, up_sf, w_rows, n_mask, kb, K, HALF)
        acc_u += tl.dot(a_even, tl.trans(u_lo))
        acc_u += tl.dot(a_odd, tl.trans(u_hi))
    xs = tl.load(x_gs)
    g = round_to_bf16(acc_g * (xs * tl.load(gate_gs + e)))
    u = round_to_bf16(acc_u * (xs * tl.load(up_gs + e)))
    hv = g / (1.0 + tl.exp(-g)) * u
    hv = tl.where(live[:, None], hv, 0.0)
    tl.store(h + slots.to(tl.int64)[:, None] * I + n[None, :], hv, mask=n_mask[None, :])


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
    HALF: tl.constexpr = BK // 2
    for k0 in range(0, K, BK):
        kb = k0 // 2 + tl.arange(0, HALF)
        a_mask = kb[None, :] < K // 2
        a_even = tl.load(hq + slots[:, None] * K + 2 * kb[None, :], mask=a_mask,
                         other=0.0).to(OPERAND)
        a_odd = tl.load(hq + slots[:, None] * K + 2 * kb[None, :] + 1, mask=a_mask,
                        other=0.0).to(OPERAND)
        w_lo, w_hi = _weight_tile(down_packed, down_sf, w_rows, n_mask, kb, K, HALF)
        acc += tl.dot(a_even, tl.trans(w_lo))
        acc += tl.dot(a_odd, tl.trans(w_hi))
    y = round_to_bf16(acc * (tl.load(h_gs) * tl.load(down_gs + e)))
    dst = tl.where(live, pair, 0).to(tl.int64)
    tl.store(slot_out + dst[:, None] * C + n[None, :], y, mask=live[:, None] & n_mask[None, :])


# ---------------------------------------------------------------- host side (device tensors only)


def _unit_scale(device: torch.device) -> torch.Tensor:
    return torch.ones((), dtype=torch.float32, device=device)


def quantized_values(x: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """x quantized to nvfp4 with the global scale gs (the spec's quantizer), as the exact bf16
    values ``code * sf`` (the global scale left out)."""
    packed, sf = nvfp4_quantize(x, gs)
    return nvfp4_dequantize(packed, sf, _unit_scale(x.device), torch.float32).to(torch.bfloat16)


def route(x: torch.Tensor, w_router: torch.Tensor, top_k: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """spec.ops.moe.moe_route's rule with one fp32 GEMM: ids [T, k] best first, weights [T, k] fp32."""
    p = torch.softmax(widened_matmul(x, w_router.T), dim=-1)
    rank_key = torch.where(torch.isnan(p), torch.full_like(p, float("-inf")), p)
    ids = torch.sort(rank_key, dim=-1, descending=True, stable=True).indices[:, :top_k]
    p_sel = torch.gather(p, -1, ids)
    return ids, p_sel / p_sel.sum(dim=-1, keepdim=True)


def expert_blocks(expert_ids: torch.Tensor, num_experts: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs grouped by expert into blocks of BLOCK_M rows, on the device.

    Returns (rows_of int32 [max_blocks * BLOCK_M]: the pair (token * k + slot) a block row holds, -1
    for padding; block_expert int32 [max_blocks]: each block's expert, ``num_experts`` past the last
    block). max_blocks = ceil(P / BLOCK_M) + min(P, E) bounds the block count for P pairs.
    """
    flat = expert_ids.reshape(-1)
    P, dev = flat.numel(), flat.device
    max_blocks = -(-P // BLOCK_M) + min(P, num_experts)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat))  # bincount would read the maximum id on the host
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = torch.cumsum(blocks, 0)
    first_pair = torch.cumsum(counts, 0) - counts
    order = torch.sort(flat, stable=True).indices
    e_sorted = flat[order]
    rank = torch.arange(P, device=dev) - first_pair[e_sorted]
    dest = (block_end - blocks)[e_sorted] * BLOCK_M + rank
    rows_of = torch.full((max_blocks * BLOCK_M,), -1, dtype=torch.int32, device=dev)
    rows_of[dest] = order.to(torch.int32)
    block_expert = torch.searchsorted(block_end, torch.arange(max_blocks, device=dev),
                                      right=True).to(torch.int32)
    return rows_of, block_expert


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def routed_experts(x, expert_ids, weights, gate_packed, gate_sf, gate_gs, up_packed, up_sf, up_gs,
                   down_packed, down_sf, down_gs, x_gs, h_gs) -> torch.Tensor:
    """spec.ops.moe.moe_experts: the routed experts' weighted sum [T, C], bf16."""
    T, C = x.shape
    k = expert_ids.shape[1]
    E, I = gate_packed.shape[0], gate_packed.shape[1]
    dev = x.device
    rows_of, block_expert = expert_blocks(expert_ids, E)
    n_blocks = block_expert.shape[0]
    xq = quantized_values(x, x_gs)
    h = torch.zeros(n_blocks * BLOCK_M, I, dtype=torch.float32, device=dev)
    _gate_up_kernel[(n_blocks, triton.cdiv(I, BLOCK_N))](
        xq, rows_of, block_expert, gate_packed, _bytes(gate_sf), gate_gs, up_packed, _bytes(up_sf),
        up_gs, x_gs, h, E, K=C, I=I, TOP_K=k, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K)
    hq = quantized_values(h, h_gs)
    slot_out = torch.empty(T * k, C, dtype=torch.float32, device=dev)
    _down_kernel[(n_blocks, triton.cdiv(C, BLOCK_N))](
        hq, rows_of, block_expert, down_packed, _bytes(down_sf), down_gs, h_gs, slot_out, E,
        K=I, C=C, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K)
    slot_out = slot_out.view(T, k, C)
    w = weights.float()
    out = torch.zeros(T, C, dtype=torch.float32, device=dev)
    for j in range(k):  # slot order, as the spec sums
        out = out + w[:, j, None] * slot_out[:, j]
    return out.to(x.dtype)


def shared_expert(x, w_gate, w_up, w_down, w_sg) -> torch.Tensor:
    """spec.ops.moe.moe_shared_expert with bf16 GEMMs (fp32 accumulation, bf16 outputs: the spec's
    rounding points) and the fp32 gate logit."""
    g = bf16_matmul(x, w_gate.T)
    u = bf16_matmul(x, w_up.T)
    hs = (F.silu(g.float()) * u.float()).to(x.dtype)
    y = bf16_matmul(hs, w_down.T)
    gate = torch.sigmoid(widened_matmul(x, w_sg.reshape(-1, 1))[:, 0])
    return (gate[:, None] * y.float()).to(x.dtype)


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
    routed = routed_experts(x, ids, weights, gate_packed, gate_sf, gate_gs, up_packed, up_sf,
                            up_gs, down_packed, down_sf, down_gs, x_gs, h_gs)
    shared = shared_expert(x, w_gate, w_up, w_down, w_sg)
    out.copy_((routed.float() + shared.float()).to(x.dtype))
