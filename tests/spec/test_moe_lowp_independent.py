"""The MoE spec's bf16 path (the one the spec_lowp variants run) against a token-by-token restatement of
its documented rounding points (docs/spec.md, "MoE" and "Notation and numerics"), bit for bit, on
inputs chosen so that the two rounding points the random cells almost never exercise are seen.

- Slot order. The routed sum runs over the k slots in slot order in fp32 and is cast once to bf16.
  Summing the same fp32 terms in another order changes an fp32 sum by a rounding only now and then,
  and the bf16 cast hides most of those: on this launch (128 tokens x 3072 channels, 10 slots, the
  cells' geometry) the reversed order moves a few bf16 outputs (measured: 15 of 393216). The test
  first shows that the reversed order moves some outputs of its own restatement, so equality with
  the slot order is a check that can fail.
- The final sum. ``moe`` adds the stored routed and shared outputs (each bf16) in fp32 and casts once.
  A bf16 value is an fp16 value too unless it lies outside fp16's normal range, so a detour of the
  shared output through fp16 is invisible at the cells' magnitudes. Here both down projections are
  scaled so that the two parts are ~1e-6 to 1e-5, inside fp16's subnormal range (below 2^-14), where
  fp16 keeps fewer bits than bf16; the test shows that an fp16 detour moves outputs at these inputs
  (measured: 3605 of 6144).

Neither side tolerates anything: each side evaluates the same rounding points on the same operands.
The per-token restatement decodes the nvfp4 weights itself (``(code * sf) * gs`` in fp32, e2m1 codes
from the nibbles) and runs each GEMM as the spec's one-row fp32 product (``rowwise_matmul``: the fp32
summation order inside a GEMM is the BLAS's, the same call on the same row gives the same bits); the
nvfp4 quantiser of x and h is the spec's (op kv_nvfp4, certified on its own).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from spec.cases.moe import experts_case
from spec.numerics import rowwise_matmul
from spec.ops.kv_storage import FP8_DTYPE, nvfp4_global_scale, nvfp4_quantize
from spec.ops.moe import (NvFp4Experts, NvFp4Weight, SharedExpert, moe, moe_experts, moe_route,
                          moe_shared_expert)

pytestmark = pytest.mark.premerge

BF16, F32 = torch.bfloat16, torch.float32
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP16_MIN_NORMAL = 2.0**-14


def decode(packed: torch.Tensor, sf: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """nvfp4 bytes [..., D // 2] (element 2i in the low nibble), e4m3 scales [..., D // 16] and a
    global scale -> ``(code * sf) * gs`` in fp32, [..., D]."""
    table = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=F32)
    nib = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()
    code_sf = table[nib] * sf.float().repeat_interleave(16, dim=-1)     # exact: 3 x 4 mantissa bits
    return code_sf * gs.float()


def roundtrip(v: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """v [1, D] fp32 through the nvfp4 quantiser with global scale gs, decoded to fp32."""
    packed, sf = nvfp4_quantize(v, gs)
    return decode(packed, sf, gs)


def bf16(v: torch.Tensor) -> torch.Tensor:
    return v.to(BF16).to(F32)


# ---------------------------------------------------------------- moe_nvfp4_experts: slot order


AXES = {"tokens": 128, "experts": 16, "hidden": 3072, "expert_inter": 512, "top_k": 10}


def slot_outputs(inp: dict) -> torch.Tensor:
    """[T, k, C] fp32: token t's expert in slot j, token by token, with the routed expert's rounding
    points: x quantised with x_gs; gate and up outputs rounded to bf16; h = silu(g) * u in fp32,
    quantised with h_gs and no bf16 rounding before; the down output rounded to bf16."""
    mats = {n: [decode(inp[f"{n}_packed"][e], inp[f"{n}_sf"][e].view(FP8_DTYPE), inp[f"{n}_gs"][e])
                for e in range(inp["gate_packed"].shape[0])] for n in ("gate", "up", "down")}
    x, ids = inp["x"], inp["expert_ids"]
    out = torch.empty(*ids.shape, x.shape[1], dtype=F32)
    for t in range(x.shape[0]):
        xq = roundtrip(x[t:t + 1].float(), inp["x_gs"])        # once per token
        for j, e in enumerate(ids[t].tolist()):
            g = bf16(rowwise_matmul(xq, mats["gate"][e].T))
            u = bf16(rowwise_matmul(xq, mats["up"][e].T))
            hq = roundtrip(F.silu(g) * u, inp["h_gs"])
            out[t, j] = bf16(rowwise_matmul(hq, mats["down"][e].T))[0]
    return out


def slot_sum(slots: torch.Tensor, weights: torch.Tensor, order: list[int]) -> torch.Tensor:
    """``sum_j w_j * slot_j`` per token in fp32, slots taken in ``order``, from 0, cast once to bf16."""
    assert sorted(order) == list(range(slots.shape[1]))
    out = torch.empty(slots.shape[0], slots.shape[2], dtype=BF16)
    for t in range(slots.shape[0]):
        acc = torch.zeros(slots.shape[2], dtype=F32)
        for j in order:
            acc = acc + weights[t, j].float() * slots[t, j]
        out[t] = acc.to(BF16)
    return out


@pytest.mark.certify_property("moe_nvfp4_experts")
@pytest.mark.second_formulation("spec.ops.moe:moe_experts")
def test_routed_sum_runs_over_the_slots_in_slot_order_bit_for_bit():
    inp = experts_case(AXES, torch.Generator().manual_seed(2024), torch.device("cpu")).inputs
    assert inp["x"].dtype == BF16 and inp["weights"].dtype == F32
    k = inp["expert_ids"].shape[1]
    slots = slot_outputs(inp)
    forward = slot_sum(slots, inp["weights"], list(range(k)))
    # The test's power: on these inputs the slot order shows in the bf16 outputs.
    backward = slot_sum(slots, inp["weights"], list(range(k))[::-1])
    moved = int((forward != backward).sum())
    assert moved > 0, "the reversed slot order moves no output here: the test could not see it"
    experts = NvFp4Experts(*(NvFp4Weight(inp[f"{n}_packed"], inp[f"{n}_sf"].view(FP8_DTYPE),
                                         inp[f"{n}_gs"]) for n in ("gate", "up", "down")),
                           inp["x_gs"], inp["h_gs"])
    got = moe_experts(inp["x"], inp["expert_ids"], inp["weights"], experts)
    assert got.dtype == BF16
    differ = int((got != forward).sum())
    assert differ == 0, (f"{differ} outputs differ from the slot-order sum (the reversed order "
                         f"moves {moved}; the spec matches it at {int((got == backward).sum())})")


# ---------------------------------------------------------------- moe: routed + shared


T, C, E, I, I_S, TOP_K = 24, 256, 8, 64, 64, 4
DOWN_SCALE = 1e-5   # both down projections: outputs ~1e-6 to 1e-5, fp16 subnormals


def block_inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)

    def dense(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * (scale / math.sqrt(shape[-1]))

    x = dense(T, C, scale=math.sqrt(C)).to(BF16)
    w_router = dense(E, C, scale=1.5).to(BF16)
    experts = NvFp4Experts(NvFp4Weight.from_dense(dense(E, I, C)),
                           NvFp4Weight.from_dense(dense(E, I, C)),
                           NvFp4Weight.from_dense(dense(E, C, I, scale=DOWN_SCALE)),
                           nvfp4_global_scale(x.float().abs().max()), nvfp4_global_scale(8.0))
    shared = SharedExpert(dense(I_S, C).to(BF16), dense(I_S, C).to(BF16),
                          dense(C, I_S, scale=DOWN_SCALE).to(BF16), dense(C, scale=2.0).to(BF16))
    return x, w_router, experts, shared


@pytest.mark.certify_property("moe")
@pytest.mark.second_formulation("spec.ops.moe:moe")
def test_block_adds_routed_and_shared_in_fp32_at_fp16_subnormal_magnitudes():
    x, w_router, experts, shared = block_inputs(7)
    ids, weights = moe_route(x, w_router, TOP_K)
    routed = moe_experts(x, ids, weights, experts)
    sh = moe_shared_expert(x, shared.w_gate, shared.w_up, shared.w_down, shared.w_sg)
    assert routed.dtype == sh.dtype == BF16
    # The inputs reach the range where fp16 keeps fewer bits than bf16 ...
    for part in (routed, sh):
        mag = part.float().abs()
        assert bool((mag < FP16_MIN_NORMAL).all()) and float((mag > 0).float().mean()) > 0.99
    # ... and the sum as documented: both stored parts widened to fp32, added there, cast once.
    want = torch.empty(T, C, dtype=BF16)
    for t in range(T):
        want[t] = (routed[t].float() + sh[t].float()).to(BF16)
    # The test's power: the shared part through fp16 first moves outputs at these inputs.
    detour = (routed.float() + sh.half().float()).to(BF16)
    moved = int((detour != want).sum())
    assert moved > 0, "an fp16 detour of the shared part moves nothing here: the test could not see it"
    got = moe(x, w_router, experts, shared, TOP_K)
    assert got.dtype == BF16
    differ = int((got != want).sum())
    assert differ == 0, (f"{differ} of {want.numel()} outputs differ from bf16(fp32(routed) + "
                         f"fp32(shared)) (an fp16 detour of the shared part moves {moved})")
