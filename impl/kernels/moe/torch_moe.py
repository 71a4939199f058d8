"""The MoE block as a torch composition (spec/ops/moe.py; docs/spec.md, "MoE"): the routed experts as
batched GEMMs over the experts a call selects, with the spec's rounding points.

- ``route(x, w_router, top_k)``: fp32 logits from the exact widening of x and W_r, torch's softmax,
  the top-k by (-p, expert index) as a stable descending sort (NaN ranked last), the weights
  renormalised by their sum (spec.ops.moe.moe_route's rule).
- ``routed_experts``: x quantized by the spec's quantizer (``nvfp4_quantize``); the (token, slot)
  pairs sorted by expert; the selected experts in groups of ``GROUP``, each group's weights decoded
  to the exact bf16 values ``code * sf`` (a 256-entry table a byte, times the block scale: at most 6
  significant bits, exact in bf16) and its rows padded to the group's largest row count, so that a
  group is one batched GEMM a projection. The GEMMs take the exact ``code * sf`` values of both
  operands, sum in fp32 and multiply by the two global scales once; g and u are rounded to bf16,
  ``h = silu(g) * u`` goes in fp32 into the down projection's quantizer, the down output is rounded
  to bf16, and the k slot outputs are summed in slot order in fp32, each product and sum rounded on
  its own (the spec's order), then cast once.
- ``shared_expert``: the shared expert's bf16 GEMMs with the spec's rounding points and its fp32
  sigmoid gate (``impl.kernels.gemm``).

The experts a call selects are read on the host (the group loop), so the block is not capturable in
a CUDA graph; the library picks its GEMM kernels from the shapes, so it is not batch-invariant. It
is the torch peer the Triton kernels (triton_moe.py) are timed against, and the CPU's fast path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from impl.kernels.gemm import bf16_matmul, fp32_matmul, widened_matmul
from spec.ops.kv_storage import E2M1_GRID, FP8_DTYPE, NVFP4_BLOCK, nvfp4_quantize

GROUP = 32   # experts a batched GEMM: bounds the decoded weights a call holds at once

_TABLES: dict[str, torch.Tensor] = {}


def _byte_table(device: torch.device) -> torch.Tensor:
    """bf16 [256, 2]: the e2m1 values of a packed byte's low and high nibble (bit 3 the sign)."""
    key = str(device)
    if key not in _TABLES:
        grid = torch.tensor(E2M1_GRID, dtype=torch.float32)
        codes = torch.arange(16)
        values = torch.where(codes >= 8, -grid[codes & 7], grid[codes & 7])
        byte = torch.arange(256)
        _TABLES[key] = torch.stack((values[byte & 15], values[byte >> 4]), -1).to(
            device=device, dtype=torch.bfloat16)
    return _TABLES[key]


def _values(packed: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """uint8 [..., D / 2] codes and e4m3 [..., D / 16] scales (or their bytes) -> the exact bf16
    ``code * sf`` [..., D]."""
    if sf.dtype == torch.uint8:
        sf = sf.view(FP8_DTYPE)
    codes = _byte_table(packed.device)[packed.to(torch.int32)].flatten(-2)
    blocks = codes.unflatten(-1, (-1, NVFP4_BLOCK))
    return (blocks * sf.to(torch.bfloat16)[..., None]).flatten(-2)


def _grouped_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [G, M, K] @ b [G, N, K]^T in fp32 on operands exact in bf16: fp32 products and sums."""
    if a.device.type == "cuda":
        return torch.bmm(a, b.transpose(1, 2), out_dtype=torch.float32)
    return fp32_matmul(a, b.transpose(1, 2))


def _quantized(x: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """x [..., D] through the spec's nvfp4 quantizer: the exact values ``code * sf`` in bf16 (the
    global scale left out)."""
    packed, sf = nvfp4_quantize(x, gs)
    return _values(packed, sf)


def route(x: torch.Tensor, w_router: torch.Tensor, top_k: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """spec.ops.moe.moe_route's rule with one fp32 GEMM: ids [T, k] best first, weights [T, k] fp32."""
    p = torch.softmax(widened_matmul(x, w_router.T), dim=-1)
    key = torch.where(torch.isnan(p), torch.full_like(p, float("-inf")), p)
    ids = torch.sort(key, dim=-1, descending=True, stable=True).indices[:, :top_k]
    chosen = torch.gather(p, -1, ids)
    return ids, chosen / chosen.sum(dim=-1, keepdim=True)


def shared_expert(x, w_gate, w_up, w_down, w_sg) -> torch.Tensor:
    """spec.ops.moe.moe_shared_expert with bf16 GEMMs (fp32 accumulation, bf16 outputs: the spec's
    rounding points) and the fp32 gate logit."""
    g = bf16_matmul(x, w_gate.T)
    u = bf16_matmul(x, w_up.T)
    hs = (F.silu(g.float()) * u.float()).to(x.dtype)
    y = bf16_matmul(hs, w_down.T)
    gate = torch.sigmoid(widened_matmul(x, w_sg.reshape(-1, 1))[:, 0])
    return (gate[:, None] * y.float()).to(x.dtype)


def _expert_rows(expert_ids: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """The selected experts (ascending) and, per expert, the pairs (token * k + slot) routed to it
    padded with -1 to the largest count: [U, rows]."""
    flat = expert_ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    used, counts = torch.unique_consecutive(flat[order], return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    width = int(counts.max())
    r = torch.arange(width, device=flat.device)
    live = r[None, :] < counts[:, None]
    at = (starts[:, None] + r[None, :]).clamp(max=flat.numel() - 1)
    return used.tolist(), torch.where(live, order[at], -1)


def routed_experts(x, expert_ids, weights, gate_packed, gate_sf, gate_gs, up_packed, up_sf, up_gs,
                   down_packed, down_sf, down_gs, x_gs, h_gs) -> torch.Tensor:
    """spec.ops.moe.moe_experts: the routed experts' weighted sum [T, C] in x's dtype."""
    f32 = torch.float32
    T, C = x.shape
    k = expert_ids.shape[1]
    I = gate_packed.shape[1]  # noqa: E741 (the spec's name)
    if expert_ids.numel() and bool(((expert_ids < 0) | (expert_ids >= gate_packed.shape[0])).any()):
        raise ValueError(f"expert ids must lie in 0..{gate_packed.shape[0] - 1}")
    slot_out = torch.zeros(T * k, C, dtype=f32, device=x.device)
    if T:
        xq = _quantized(x, x_gs.reshape(()))
        used, pairs = _expert_rows(expert_ids)
        live = pairs >= 0
        tokens = torch.where(live, pairs // k, 0)
        x_scale, h_scale = x_gs.reshape(()).to(f32), h_gs.reshape(()).to(f32)
        for g0 in range(0, len(used), GROUP):
            e = torch.tensor(used[g0:g0 + GROUP], device=x.device)
            rows, live_g = tokens[g0:g0 + GROUP], live[g0:g0 + GROUP]
            a = xq[rows] * live_g[..., None]                          # [G, R, C], exact
            gw, uw = _values(gate_packed[e], gate_sf[e]), _values(up_packed[e], up_sf[e])
            g = _grouped_matmul(a, gw) * (x_scale * gate_gs[e].to(f32))[:, None, None]
            u = _grouped_matmul(a, uw) * (x_scale * up_gs[e].to(f32))[:, None, None]
            g, u = g.to(torch.bfloat16).to(f32), u.to(torch.bfloat16).to(f32)
            h = _quantized(F.silu(g) * u, h_gs.reshape(()))           # h's only rounding point
            y = _grouped_matmul(h, _values(down_packed[e], down_sf[e]))
            y = (y * (h_scale * down_gs[e].to(f32))[:, None, None]).to(torch.bfloat16).to(f32)
            slot_out[pairs[g0:g0 + GROUP][live_g]] = y[live_g]
    w = weights.to(f32)
    slots = slot_out.reshape(T, k, C)
    out = torch.zeros(T, C, dtype=f32, device=x.device)
    for j in range(k):   # slot order, each product and sum rounded on its own
        out = out + w[:, j, None] * slots[:, j]
    return out.to(x.dtype)


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

