"""Sparse mixture of experts with NVFP4 routed experts and a gated shared expert (docs/spec.md, "MoE").

Ops defined here:
- ``moe_route``          : ``moe_route``          softmax router, top-k, renormalised weights.
- ``moe_nvfp4_experts``  : ``moe_experts``        the routed experts' weighted sum.
- ``moe_shared_expert``  : ``moe_shared_expert``  the sigmoid-gated shared expert.
- ``moe``                : ``moe``                routed sum + shared expert.
``nvfp4_linear`` is the GEMM the routed experts are made of (quantize -> dequantize -> GEMM).

Public definition followed: the sparse MoE block of Qwen3-Next in HF transformers
(``transformers/models/qwen3_next/modeling_qwen3_next.py``, ``Qwen3NextSparseMoeBlock``): router
probabilities ``softmax(gate(x))`` taken in fp32 over all experts, the top-k of them, renormalised to
sum 1 (``norm_topk_prob = True`` in Qwen3-Next's config), SwiGLU experts ``down(silu(gate x) * up x)``,
and a shared expert of the same form scaled by ``sigmoid(shared_expert_gate(x))`` and added to the
routed sum. NVFP4 weights and activations: NVIDIA's NVFP4 format (spec.ops.kv_storage).

Where this spec decides what docs/spec.md and the HF block leave open (pinned by tests/spec/test_moe.py):
- Router logits ``x @ W_r^T`` are accumulated in the acc dtype and *not* rounded to the activation dtype
  before the softmax (no rounding point there; HF's bf16 ``nn.Linear`` would round them).
- Top-k tie rule: experts are ordered by (-p, expert index), i.e. equal probabilities go to the lower
  expert index, both for membership at the k-th place and for slot order. ``torch.topk`` (HF) leaves
  ties unspecified. A NaN probability ranks below every number; a NaN logit makes the whole softmax
  row NaN, so such a row selects experts 0..k-1 with NaN weights (the poison stays visible).
- Routing weights stay in the acc dtype (fp32); HF casts them to the activation dtype first.
- The routed sum runs over the k slots in slot order (highest probability first) in the acc dtype,
  with one cast at the end; HF accumulates in bf16 in expert-index order.
- Rounding points of one routed expert (non-reference mode; all identities in float64 mode except the
  nvfp4 quantisers, which always round):
  1. ``x`` is quantized to nvfp4 with the layer's input global scale ``x_gs`` (once per token: the
     quantisation is row-wise, so every expert sees the same quantized row);
  2. the gate and up GEMM outputs are rounded to the activation dtype (they are stored, in the
     two-GEMM form);
  3. ``h = silu(g) * u`` is computed in the acc dtype and goes straight into the down projection's
     nvfp4 quantizer with its own global scale ``h_gs``: the quantizer is h's only rounding point
     (the fused silu-mul-quantize form), there is no bf16 rounding of h before it;
  4. the down GEMM output is rounded to the activation dtype (one expert's stored output).
- Shared expert rounding points: the gate, up and down GEMM outputs and ``h`` (the bf16 operand of the
  down GEMM) are rounded to the activation dtype; the gate logit ``x . w_sg`` and its sigmoid stay in
  the acc dtype; one cast at the end.
- ``moe`` adds the two stored outputs (routed, shared) in the acc dtype and casts once, so
  ``moe == out_cast(moe_experts(...) + moe_shared_expert(...))`` exactly.

GEMMs (``rowwise_matmul``) run in the acc dtype (real fp32, or float64 in reference mode) one row at a
time, each row a separate vector-matrix product on a fresh contiguous copy of the row. A row's result
is then the same whatever other rows share the call: the spec is batch-invariant by construction
(DESIGN.md). The fp32 summation order inside one row is the BLAS's; no implementation is expected to
reproduce it bit for bit, so fp32-mode GEMM outputs are compared by tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spec.numerics import acc_dtype, is_reference_mode, out_cast, round_to, rowwise_matmul
from spec.ops.kv_storage import (
    FP8_DTYPE,
    NVFP4_BLOCK,
    nvfp4_dequantize,
    nvfp4_global_scale,
    nvfp4_quantize,
)

# ---------------------------------------------------------------- GEMM


# ---------------------------------------------------------------- weight containers


@dataclass(frozen=True)
class NvFp4Weight:
    """One NVFP4 weight matrix [out, in], or a stack of them [E, out, in], quantized along ``in``.

    packed: uint8 [..., out, in // 2], two e2m1 codes a byte, element 2i in the low nibble.
    sf:     float8_e4m3fn [..., out, in // 16], one block scale per 16 input elements.
    gs:     fp32 [...] (one global scale per matrix; [] for a single matrix, [E] for a stack),
            dequant side: ``w ~ code * sf * gs``.
    """

    packed: torch.Tensor
    sf: torch.Tensor
    gs: torch.Tensor

    def __post_init__(self) -> None:
        if self.packed.dtype != torch.uint8:
            raise TypeError(f"packed must be uint8, got {self.packed.dtype}")
        if self.sf.dtype != FP8_DTYPE:
            raise TypeError(f"sf must be {FP8_DTYPE}, got {self.sf.dtype}")
        if self.packed.dim() < 2 or self.packed.shape[:-1] != self.sf.shape[:-1]:
            raise ValueError(f"packed {tuple(self.packed.shape)} and sf {tuple(self.sf.shape)} disagree")
        if self.packed.shape[-1] * 2 != self.sf.shape[-1] * NVFP4_BLOCK:
            raise ValueError("packed holds in // 2 bytes a row and sf in // 16 scales a row")
        if tuple(self.gs.shape) != tuple(self.packed.shape[:-2]):
            raise ValueError(f"gs must have shape {tuple(self.packed.shape[:-2])}, "
                             f"got {tuple(self.gs.shape)}")

    @property
    def out_features(self) -> int:
        return self.packed.shape[-2]

    @property
    def in_features(self) -> int:
        return self.packed.shape[-1] * 2

    def __getitem__(self, e: int) -> NvFp4Weight:
        """Matrix ``e`` of a stack."""
        if self.packed.dim() != 3:
            raise IndexError("only a stacked [E, out, in] weight can be indexed")
        return NvFp4Weight(self.packed[e], self.sf[e], self.gs[e])

    @classmethod
    def from_dense(cls, w: torch.Tensor, gs: torch.Tensor | None = None) -> NvFp4Weight:
        """Quantize a dense [out, in] or [E, out, in] weight; ``gs`` defaults to each matrix's
        ``nvfp4_global_scale(amax)`` (fp32, one per matrix)."""
        if w.dim() == 2:
            g = nvfp4_global_scale(w.abs().max().to(torch.float64)) if gs is None else gs.reshape(())
            packed, sf = nvfp4_quantize(w, g)
            return cls(packed, sf, g.to(torch.float32))
        if w.dim() != 3:
            raise ValueError(f"expected [out, in] or [E, out, in], got {tuple(w.shape)}")
        mats = [cls.from_dense(w[e], None if gs is None else gs[e]) for e in range(w.shape[0])]
        return cls(torch.stack([m.packed for m in mats]), torch.stack([m.sf for m in mats]),
                   torch.stack([m.gs for m in mats]))

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense weight ``code * sf * gs`` in ``dtype`` ([out, in] or [E, out, in])."""
        if self.packed.dim() == 2:
            return nvfp4_dequantize(self.packed, self.sf, self.gs, dtype)
        return torch.stack([self[e].dequantize(dtype) for e in range(self.packed.shape[0])])


@dataclass(frozen=True)
class NvFp4Experts:
    """The routed experts of one MoE layer (E experts, hidden C, expert intermediate I).

    gate, up: NvFp4Weight [E, I, C] (blocks along C); down: NvFp4Weight [E, C, I] (blocks along I);
    each matrix has its own weight global scale. x_gs: fp32 [], the layer's input global scale of
    the hidden activations (gate/up input); h_gs: fp32 [], the input global scale of the
    intermediate activation (down input). Both input scales are per layer, shared by all experts.
    """

    gate: NvFp4Weight
    up: NvFp4Weight
    down: NvFp4Weight
    x_gs: torch.Tensor
    h_gs: torch.Tensor

    def __post_init__(self) -> None:
        for name in ("gate", "up", "down"):
            if getattr(self, name).packed.dim() != 3:
                raise ValueError(f"{name} must be a stacked [E, out, in] weight")
        e, i, c = self.gate.packed.shape[0], self.gate.out_features, self.gate.in_features
        if (self.up.packed.shape[0], self.up.out_features, self.up.in_features) != (e, i, c):
            raise ValueError("up must have the shape of gate, [E, I, C]")
        if (self.down.packed.shape[0], self.down.out_features, self.down.in_features) != (e, c, i):
            raise ValueError("down must be [E, C, I]")
        for name in ("x_gs", "h_gs"):
            if getattr(self, name).numel() != 1:
                raise ValueError(f"{name} must be one number")

    @property
    def num_experts(self) -> int:
        return self.gate.packed.shape[0]

    @property
    def hidden(self) -> int:
        return self.gate.in_features

    @property
    def intermediate(self) -> int:
        return self.gate.out_features


@dataclass(frozen=True)
class SharedExpert:
    """The shared expert of one MoE layer, dense weights (bf16, or float64 in reference mode).

    w_gate, w_up: [I_s, C]; w_down: [C, I_s]; w_sg: [C] (the shared-expert gate, a [1, C] linear).
    """

    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    w_sg: torch.Tensor


# ---------------------------------------------------------------- routing


def moe_route(x: torch.Tensor, w_router: torch.Tensor, top_k: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Op ``moe_route``: ``p = softmax(x @ W_r^T)`` over experts, top-k, renormalised.

    x: [T, C] activation dtype; w_router: [E, C]; 1 <= top_k <= E. Computed in acc_dtype(x, w_router)
    (fp32, or float64 in reference mode), logits not rounded. Experts are ranked by (-p, expert
    index): a stable descending sort of p over experts listed in ascending index order, so among equal
    p the lower index ranks first; NaN p ranks last. Returns (expert ids [T, top_k] int64, best
    first; weights [T, top_k] acc dtype, ``p_selected / sum(p_selected)``). The top-1 p is at least
    1/E, so the renormalising sum is never 0.
    """
    if x.dim() != 2 or w_router.dim() != 2 or x.shape[1] != w_router.shape[1]:
        raise ValueError(f"expected x [T, C] and w_router [E, C], got {tuple(x.shape)}, "
                         f"{tuple(w_router.shape)}")
    n_experts = w_router.shape[0]
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k must be in 1..{n_experts}, got {top_k}")
    acc = acc_dtype(x, w_router)
    p = torch.softmax(rowwise_matmul(x.to(acc), w_router.to(acc).T), dim=-1)
    rank_key = torch.where(torch.isnan(p), torch.full_like(p, float("-inf")), p)
    ids = torch.sort(rank_key, dim=-1, descending=True, stable=True).indices[:, :top_k]
    p_sel = torch.gather(p, -1, ids)
    return ids, p_sel / p_sel.sum(dim=-1, keepdim=True)


# ---------------------------------------------------------------- routed NVFP4 experts


def nvfp4_linear(x: torch.Tensor, w_packed: torch.Tensor, w_sf: torch.Tensor, w_gs: torch.Tensor,
                 x_gs: torch.Tensor) -> torch.Tensor:
    """``dequant(quant(x, x_gs)) @ dequant(W)^T``: an NVFP4 x NVFP4 GEMM, as docs/spec.md states it.

    x: [T, in] any float dtype; w_packed uint8 [out, in // 2]; w_sf float8_e4m3fn [out, in // 16];
    w_gs, x_gs: one fp32 number each. x is quantized along ``in`` in blocks of 16 with the input global
    scale x_gs (spec.ops.kv_storage.nvfp4_quantize), both operands are dequantized into the acc dtype
    (acc_dtype(x, w_gs, x_gs): fp32, or float64 in reference mode) and multiplied there.
    Returns [T, out] in the acc dtype, unrounded: the caller owns the output's rounding point.
    """
    acc = acc_dtype(x, w_gs, x_gs)
    x_deq = nvfp4_dequantize(*nvfp4_quantize(x, x_gs), x_gs, acc)
    w_deq = nvfp4_dequantize(w_packed, w_sf, w_gs, acc)
    return rowwise_matmul(x_deq, w_deq.T)


def _nvfp4_matmul(x: torch.Tensor, w: NvFp4Weight, x_gs: torch.Tensor) -> torch.Tensor:
    return nvfp4_linear(x, w.packed, w.sf, w.gs, x_gs)


def nvfp4_expert(x: torch.Tensor, experts: NvFp4Experts, e: int, act_dtype: torch.dtype,
                 reference: bool) -> torch.Tensor:
    """Routed expert ``e`` on rows x [N, C]: ``down_e(silu(gate_e x) * up_e x)`` with the rounding
    points of the module docstring. Returns [N, C] in the acc dtype, holding act_dtype values in
    non-reference mode."""
    g = round_to(_nvfp4_matmul(x, experts.gate[e], experts.x_gs), act_dtype, reference)
    u = round_to(_nvfp4_matmul(x, experts.up[e], experts.x_gs), act_dtype, reference)
    h = F.silu(g) * u  # acc dtype; its rounding point is the down projection's nvfp4 quantizer
    return round_to(_nvfp4_matmul(h, experts.down[e], experts.h_gs), act_dtype, reference)


def moe_experts(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                experts: NvFp4Experts) -> torch.Tensor:
    """Op ``moe_nvfp4_experts``: ``sum_j weights[t, j] * expert_{ids[t, j]}(x_t)``.

    x: [T, C] activation dtype; expert_ids: [T, k] integer in 0..E-1; weights: [T, k] (fp32 from
    ``moe_route``). Each selected expert runs ``nvfp4_expert`` on the rows routed to it; the k slot
    outputs are summed in slot order in acc_dtype(x, weights), then cast once to x's dtype (float64
    stays float64). Every row depends only on its own x, ids and weights.
    """
    if x.dim() != 2 or x.shape[1] != experts.hidden:
        raise ValueError(f"x must be [T, {experts.hidden}], got {tuple(x.shape)}")
    if expert_ids.shape != weights.shape or expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError("expert_ids and weights must both be [T, k] with T = x.shape[0]")
    if bool(((expert_ids < 0) | (expert_ids >= experts.num_experts)).any()):
        raise ValueError(f"expert ids must lie in 0..{experts.num_experts - 1}")
    reference = is_reference_mode(x, weights)
    acc = acc_dtype(x, weights)
    n_tokens, k = expert_ids.shape
    xf = x.to(acc)  # exact widening; it puts the whole expert in the acc dtype
    slot_out = torch.zeros(n_tokens, k, x.shape[1], dtype=acc, device=x.device)
    for e in torch.unique(expert_ids).tolist():
        rows, slots = (expert_ids == e).nonzero(as_tuple=True)
        slot_out[rows, slots] = nvfp4_expert(xf[rows], experts, e, x.dtype, reference).to(acc)
    w = weights.to(acc)
    out = torch.zeros(n_tokens, x.shape[1], dtype=acc, device=x.device)
    for j in range(k):  # fixed slot order: the reduction order is part of the definition
        out = out + w[:, j, None] * slot_out[:, j]
    return out_cast(out, x.dtype, reference)


# ---------------------------------------------------------------- shared expert


def moe_shared_expert(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                      w_down: torch.Tensor, w_sg: torch.Tensor) -> torch.Tensor:
    """Op ``moe_shared_expert``: ``sigmoid(x . w_sg) * down_s(silu(gate_s x) * up_s x)``.

    x: [T, C] activation dtype; w_gate, w_up: [I_s, C]; w_down: [C, I_s]; w_sg: [C] or [1, C].
    Dense weights (not nvfp4). Math in acc_dtype of all inputs; the gate, up and down GEMM outputs
    and h are rounded to x's dtype; the sigmoid gate is not; one cast at the end.
    """
    reference = is_reference_mode(x, w_gate, w_up, w_down, w_sg)
    acc = acc_dtype(x, w_gate, w_up, w_down, w_sg)
    act = x.dtype
    xf = x.to(acc)
    g = round_to(rowwise_matmul(xf, w_gate.to(acc).T), act, reference)
    u = round_to(rowwise_matmul(xf, w_up.to(acc).T), act, reference)
    h = round_to(F.silu(g) * u, act, reference)  # the down GEMM reads it as a stored operand
    y = round_to(rowwise_matmul(h, w_down.to(acc).T), act, reference)
    gate = torch.sigmoid(rowwise_matmul(xf, w_sg.to(acc).reshape(-1, 1))[:, 0])
    return out_cast(gate[:, None] * y, act, reference)


# ---------------------------------------------------------------- the block


def moe(x: torch.Tensor, w_router: torch.Tensor, experts: NvFp4Experts, shared: SharedExpert,
        top_k: int) -> torch.Tensor:
    """Op ``moe``: routed experts (``moe_route`` + ``moe_experts``) plus the shared expert.

    x: [T, C] activation dtype; w_router: [E, C]. The two outputs, each already in x's dtype, are
    added in the acc dtype and cast once. Returns [T, C] in x's dtype (float64 in reference mode).
    """
    ids, weights = moe_route(x, w_router, top_k)
    routed = moe_experts(x, ids, weights, experts)
    shared_out = moe_shared_expert(x, shared.w_gate, shared.w_up, shared.w_down, shared.w_sg)
    inputs = (x, w_router, shared.w_gate, shared.w_up, shared.w_down, shared.w_sg)
    reference = is_reference_mode(*inputs)
    acc = acc_dtype(*inputs)
    return out_cast(routed.to(acc) + shared_out.to(acc), x.dtype, reference)
