"""Tests of the MoE ops of spec.ops.moe: ``moe_route``, ``moe_nvfp4_experts``, ``moe_shared_expert``,
``moe``.

Public definition: the Qwen3-Next sparse MoE block of HF transformers (softmax router over all experts,
top-k renormalised to sum 1, SwiGLU experts, sigmoid-gated shared expert added to the routed sum), with
NVFP4 experts (NVIDIA's NVFP4 format: e2m1 codes, 16-element blocks, e4m3 block scales, fp32 global
scale).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from spec.ops.kv_storage import nvfp4_dequantize, nvfp4_global_scale, nvfp4_quantize
from spec.ops.moe import (
    NvFp4Experts,
    NvFp4Weight,
    SharedExpert,
    moe,
    moe_experts,
    moe_route,
    moe_shared_expert,
    nvfp4_expert,
    nvfp4_linear,
    rowwise_matmul,
)

SEEDS = st.integers(min_value=0, max_value=2**31 - 1)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _experts(g: torch.Generator, n_experts: int, hidden: int, inter: int) -> NvFp4Experts:
    """Random NVFP4 experts: dense weights ~ N(0, 1/fan_in) quantized with per-matrix global scales."""
    def dense(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(n_experts, out_f, in_f, generator=g, dtype=torch.float64) / math.sqrt(in_f)
    return NvFp4Experts(
        gate=NvFp4Weight.from_dense(dense(inter, hidden)),
        up=NvFp4Weight.from_dense(dense(inter, hidden)),
        down=NvFp4Weight.from_dense(dense(hidden, inter)),
        x_gs=nvfp4_global_scale(4.0),   # hidden activations ~ N(0, 1): amax ~ 4
        h_gs=nvfp4_global_scale(2.0),
    )


def _shared(g: torch.Generator, hidden: int, inter: int, dtype: torch.dtype) -> SharedExpert:
    def dense(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, dtype=torch.float64) / math.sqrt(shape[-1])).to(dtype)
    return SharedExpert(dense(inter, hidden), dense(inter, hidden), dense(hidden, inter), dense(hidden))


def _nvfp4_roundtrip(v: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    return nvfp4_dequantize(*nvfp4_quantize(v, gs), gs, v.dtype)


# ---------------------------------------------------------------- moe_route


@pytest.mark.certify_guard("moe_route")
def test_moe_route_guard():
    # x = [1, 1]: the logit of expert e is the sum of its router row: [1, 3, 2, 3, 2].
    x = torch.tensor([[1.0, 1.0]])
    w_router = torch.tensor([[0.5, 0.5], [1.5, 1.5], [1.0, 1.0], [2.0, 1.0], [0.0, 2.0]])
    ids, weights = moe_route(x, w_router, top_k=3)
    # Experts 1 and 3 tie at logit 3 (lower index first); 2 and 4 tie at logit 2 for the last slot:
    # the lower index, 2, wins it.
    assert ids.tolist() == [[1, 3, 2]] and ids.dtype == torch.int64
    # Renormalised over the three: e^3, e^3, e^2 -> 1 / (2 + 1/e) twice, then (1/e) / (2 + 1/e).
    a = 1.0 / (2.0 + math.exp(-1.0))  # 0.42231...
    assert weights.dtype == torch.float32
    torch.testing.assert_close(weights, torch.tensor([[a, a, 1.0 - 2 * a]]), rtol=1e-6, atol=0)
    ids2, w2 = moe_route(x, w_router, top_k=2)
    assert ids2.tolist() == [[1, 3]] and w2.tolist() == [[0.5, 0.5]]


def _reference_ranking(logits: list[list[int]], top_k: int) -> list[list[int]]:
    """Experts sorted by (-logit, index): exact for integer logits, where p ranks as the logit does."""
    return [sorted(range(len(row)), key=lambda e: (-row[e], e))[:top_k] for row in logits]


@pytest.mark.certify_property("moe_route")
@given(seed=SEEDS, n_tokens=st.integers(1, 8), n_experts=st.integers(2, 24),
       hidden=st.integers(1, 8), data=st.data(),
       dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.float64]))
def test_moe_route_property(seed, n_tokens, n_experts, hidden, data, dtype):
    top_k = data.draw(st.integers(1, n_experts), label="top_k")
    g = _gen(seed)
    # Small integers times 0.25: every logit is an exact multiple of 0.25 (so the matmul is exact in
    # any order), ties are frequent, and duplicated router rows force exact ties between experts.
    x_int = torch.randint(-2, 3, (n_tokens, hidden), generator=g)
    w_int = torch.randint(-3, 4, (n_experts, hidden), generator=g)
    dup = torch.randint(0, n_experts, (n_experts,), generator=g)
    copy = torch.rand(n_experts, generator=g) < 0.3
    w_int = torch.where(copy[:, None], w_int[dup], w_int)
    if bool((x_int == 0).all()):
        x_int[0, 0] = 1  # never an all-zero input
    ids, weights = moe_route(x_int.to(dtype), (w_int * 0.25).to(dtype), top_k)

    assert ids.shape == (n_tokens, top_k) and ids.dtype == torch.int64
    # Ranking by (-p, expert index): ties go to the lower expert index, in membership and in order.
    logits_x4 = (x_int @ w_int.T).tolist()
    assert ids.tolist() == _reference_ranking(logits_x4, top_k)
    # Weights: the renormalised probabilities, summing to 1, best first.
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert weights.dtype == acc
    eps = torch.finfo(acc).eps
    torch.testing.assert_close(weights.sum(-1).double(), torch.ones(n_tokens, dtype=torch.float64),
                               rtol=0, atol=4 * top_k * eps)
    assert bool((weights[:, :-1] >= weights[:, 1:]).all())
    p = torch.softmax((x_int @ w_int.T).double() * 0.25, dim=-1)
    p_sel = torch.gather(p, 1, ids)
    torch.testing.assert_close(weights.double(), p_sel / p_sel.sum(-1, keepdim=True),
                               rtol=16 * eps, atol=0)

    # General data: logits are not rounded before the softmax (weights match float64 to fp32
    # rounding), and each row's routing does not depend on the other rows, bit for bit.
    x = torch.randn(n_tokens, hidden, generator=g, dtype=torch.float64).to(dtype)
    w_router = torch.randn(n_experts, hidden, generator=g, dtype=torch.float64).to(dtype)
    ids, weights = moe_route(x, w_router, top_k)
    p = torch.softmax(x.double() @ w_router.double().T, dim=-1)
    p_sel = torch.gather(p, 1, ids)
    torch.testing.assert_close(weights.double(), p_sel / p_sel.sum(-1, keepdim=True),
                               rtol=64 * eps, atol=0)
    for t in range(n_tokens):
        ids_t, w_t = moe_route(x[t:t + 1], w_router, top_k)
        assert torch.equal(ids_t, ids[t:t + 1]) and torch.equal(w_t, weights[t:t + 1])


def test_moe_route_nan_logit_poisons_its_row_only():
    x = torch.tensor([[1.0, float("nan")], [1.0, 2.0]])
    ids, weights = moe_route(x, torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]), top_k=2)
    assert ids[0].tolist() == [0, 1] and bool(torch.isnan(weights[0]).all())
    assert ids[1].tolist() == [2, 1] and bool(torch.isfinite(weights[1]).all())


# ---------------------------------------------------------------- nvfp4_linear (part of the experts)


@given(seed=SEEDS, n_tokens=st.integers(1, 4), in_blocks=st.integers(1, 3), out_f=st.integers(1, 8))
def test_nvfp4_linear_is_quantize_dequantize_gemm(seed, n_tokens, in_blocks, out_f):
    g = _gen(seed)
    in_f = 16 * in_blocks
    w = NvFp4Weight.from_dense(torch.randn(out_f, in_f, generator=g, dtype=torch.float64))
    x_gs = nvfp4_global_scale(4.0)
    x = torch.randn(n_tokens, in_f, generator=g, dtype=torch.float64)
    y = nvfp4_linear(x, w.packed, w.sf, w.gs, x_gs)
    assert y.dtype == torch.float64 and y.shape == (n_tokens, out_f)
    x_q = _nvfp4_roundtrip(x, x_gs)
    expect = x_q @ w.dequantize(torch.float64).T
    torch.testing.assert_close(y, expect, rtol=1e-12, atol=1e-12)
    # An input already on the nvfp4 grid is not changed by the activation quantizer.
    torch.testing.assert_close(nvfp4_linear(x_q, w.packed, w.sf, w.gs, x_gs), expect,
                               rtol=1e-12, atol=1e-12)
    # fp32 mode: the same function with fp32 operands.
    y32 = nvfp4_linear(x.float(), w.packed, w.sf, w.gs, x_gs)
    assert y32.dtype == torch.float32


# ---------------------------------------------------------------- moe_nvfp4_experts


def _guard_experts() -> NvFp4Experts:
    """Two experts, hidden 16, intermediate 16; all global scales 1. Only intermediate channel 0 is
    used: gate and up row 0 = [1.5, 3, 0, ...] (block scale 3/6 = 0.5, exact). Expert 0's down matrix
    has 3 at [0, 0] (scale 0.5), expert 1's has -1.5 at [1, 0] (scale 0.25): both exact in nvfp4."""
    gate = torch.zeros(2, 16, 16)
    gate[:, 0, :2] = torch.tensor([1.5, 3.0])
    down = torch.zeros(2, 16, 16)
    down[0, 0, 0] = 3.0
    down[1, 1, 0] = -1.5
    one = torch.ones(2)
    return NvFp4Experts(NvFp4Weight.from_dense(gate, one), NvFp4Weight.from_dense(gate.clone(), one),
                        NvFp4Weight.from_dense(down, one), torch.tensor(1.0), torch.tensor(1.0))


@pytest.mark.certify_guard("moe_nvfp4_experts")
def test_moe_nvfp4_experts_guard():
    # x = [3, -1, 0.5, 0, ...]: block scale 3/6 = 0.5, codes 6, -2, 1 -> quantized exactly.
    x = torch.zeros(1, 16)
    x[0, :3] = torch.tensor([3.0, -1.0, 0.5])
    # gate = up = 1.5 * 3 + 3 * (-1) = 1.5 on channel 0, 0 elsewhere; h = silu(1.5) * 1.5 = 1.83954.
    # h is quantized with h_gs = 1: sf = e4m3(1.83954 / 6 = 0.30659) = 0.3125 (10 * 2^-5, the nearest
    # step of 2^-5), code = e2m1(1.83954 / 0.3125 = 5.887) = 6, so h -> 6 * 0.3125 = 1.875.
    # Expert 0 gives 3 * 1.875 = 5.625 on channel 0; expert 1 gives -1.5 * 1.875 = -2.8125 on channel 1.
    out = moe_experts(x, torch.tensor([[1, 0]]), torch.tensor([[0.75, 0.25]]), _guard_experts())
    # 0.25 * 5.625 = 1.40625 and 0.75 * -2.8125 = -2.109375: exact in fp32 (and in bf16).
    expect = torch.zeros(1, 16)
    expect[0, :2] = torch.tensor([1.40625, -2.109375])
    assert out.dtype == torch.float32 and torch.equal(out, expect)
    out_bf16 = moe_experts(x.bfloat16(), torch.tensor([[1, 0]]), torch.tensor([[0.75, 0.25]]),
                           _guard_experts())
    assert out_bf16.dtype == torch.bfloat16 and torch.equal(out_bf16.float(), expect)


def _experts_reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                       ex: NvFp4Experts) -> torch.Tensor:
    """float64, token by token and slot by slot, from the dense dequantized weights."""
    gate, up, down = (w.dequantize(torch.float64) for w in (ex.gate, ex.up, ex.down))
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        xq = _nvfp4_roundtrip(x[t:t + 1], ex.x_gs)[0]
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = F.silu(gate[e] @ xq) * (up[e] @ xq)
            hq = _nvfp4_roundtrip(h[None], ex.h_gs)[0]
            out[t] += weights[t, j].double() * (down[e] @ hq)
    return out


def _experts_reference_bf16(xb: torch.Tensor, ids: torch.Tensor, w32: torch.Tensor,
                            ex: NvFp4Experts) -> torch.Tensor:
    """The bf16-mode rounding points of spec.ops.moe, written out token by token."""
    def bf16(v: torch.Tensor) -> torch.Tensor:
        return v.bfloat16().float()
    gate, up, down = (w.dequantize(torch.float32) for w in (ex.gate, ex.up, ex.down))
    out = torch.zeros(xb.shape, dtype=torch.float32)
    for t in range(xb.shape[0]):
        xq = _nvfp4_roundtrip(xb[t:t + 1].float(), ex.x_gs)
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g_, u_ = bf16(rowwise_matmul(xq, gate[e].T)), bf16(rowwise_matmul(xq, up[e].T))
            hq = _nvfp4_roundtrip(F.silu(g_) * u_, ex.h_gs)
            out[t] = out[t] + w32[t, j] * bf16(rowwise_matmul(hq, down[e].T))[0]
    return out.bfloat16()


@pytest.mark.certify_property("moe_nvfp4_experts")
@given(seed=SEEDS, n_tokens=st.integers(1, 6), n_experts=st.integers(2, 8),
       hidden_blocks=st.integers(1, 2), inter_blocks=st.integers(1, 2), data=st.data())
def test_moe_nvfp4_experts_property(seed, n_tokens, n_experts, hidden_blocks, inter_blocks, data):
    top_k = data.draw(st.integers(1, min(n_experts, 3)), label="top_k")
    g = _gen(seed)
    hidden, inter = 16 * hidden_blocks, 16 * inter_blocks
    ex = _experts(g, n_experts, hidden, inter)
    x = torch.randn(n_tokens, hidden, generator=g, dtype=torch.float64)
    ids, weights = moe_route(x, torch.randn(n_experts, hidden, generator=g, dtype=torch.float64), top_k)

    # 1. float64 mode is the definition evaluated token by token: right expert, right slot weight,
    #    gate/up/down in their roles, x and h quantized with their own global scales.
    out64 = moe_experts(x, ids, weights, ex)
    assert out64.dtype == torch.float64 and out64.shape == (n_tokens, hidden)
    torch.testing.assert_close(out64, _experts_reference(x, ids, weights, ex), rtol=1e-12, atol=1e-12)

    # 2. bf16 mode: one slot with weight 1 is that expert's stored (bf16-rounded) output, exactly.
    xb = x.bfloat16()
    w32 = weights.float()
    single = moe_experts(xb, ids[:, :1], torch.ones(n_tokens, 1), ex)
    for t in range(n_tokens):
        alone = nvfp4_expert(xb[t:t + 1].float(), ex, int(ids[t, 0]), torch.bfloat16, False)
        assert torch.equal(single[t:t + 1].float(), alone)
    # 3. bf16 mode is the documented chain of rounding points, bit for bit: x quantized with x_gs,
    #    gate/up outputs rounded to bf16, h = silu(g) * u in fp32 quantized with h_gs (no bf16
    #    rounding of h), down output rounded to bf16, slots summed in fp32 in slot order.
    out_b = moe_experts(xb, ids, w32, ex)
    assert out_b.dtype == torch.bfloat16
    assert torch.equal(out_b, _experts_reference_bf16(xb, ids, w32, ex))
    # 4. Row-wise: a row's output does not depend on the other rows routed with it.
    for t in range(n_tokens):
        torch.testing.assert_close(moe_experts(xb[t:t + 1], ids[t:t + 1], w32[t:t + 1], ex),
                                   out_b[t:t + 1], rtol=0, atol=0)


# ---------------------------------------------------------------- moe_shared_expert


@pytest.mark.certify_guard("moe_shared_expert")
def test_moe_shared_expert_guard():
    x = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    w_gate = torch.tensor([[1.0, 0.5]], dtype=torch.float64)   # g = 1 + 1 = 2
    w_up = torch.tensor([[0.5, 0.25]], dtype=torch.float64)    # u = 0.5 + 0.5 = 1
    w_down = torch.tensor([[1.0], [-2.0]], dtype=torch.float64)
    w_sg = torch.tensor([1.0, -0.5], dtype=torch.float64)      # x . w_sg = 0 -> sigmoid = 0.5
    out = moe_shared_expert(x, w_gate, w_up, w_down, w_sg)
    # h = silu(2) * 1 = 2 / (1 + e^-2) = 1.7615941559557649; y = [h, -2h]; out = 0.5 * y.
    h = 2.0 / (1.0 + math.exp(-2.0))
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, torch.tensor([[0.5 * h, -h]], dtype=torch.float64),
                               rtol=1e-15, atol=0)
    torch.testing.assert_close(out, torch.tensor([[0.8807970779778824, -1.7615941559557649]],
                                                 dtype=torch.float64), rtol=1e-15, atol=0)


@pytest.mark.certify_property("moe_shared_expert")
@given(seed=SEEDS, n_tokens=st.integers(1, 6), hidden=st.integers(1, 32), inter=st.integers(1, 32))
def test_moe_shared_expert_property(seed, n_tokens, hidden, inter):
    g = _gen(seed)
    s64 = _shared(g, hidden, inter, torch.float64)
    x = torch.randn(n_tokens, hidden, generator=g, dtype=torch.float64)
    args = (s64.w_gate, s64.w_up, s64.w_down, s64.w_sg)
    out64 = moe_shared_expert(x, *args)
    # 1. float64 is the formula, row by row.
    for t in range(n_tokens):
        xt = x[t]
        y = s64.w_down @ (F.silu(s64.w_gate @ xt) * (s64.w_up @ xt))
        torch.testing.assert_close(out64[t], torch.sigmoid(xt @ s64.w_sg) * y, rtol=1e-12, atol=1e-12)
    # 2. bf16 mode is within the rounding of its four bf16 rounding points of the float64 result
    #    (relative to the row's largest magnitude).
    sb = [a.bfloat16() for a in args]
    out_b = moe_shared_expert(x.bfloat16(), *sb)
    ref = moe_shared_expert(x.bfloat16().double(), *[a.double() for a in sb])
    assert out_b.dtype == torch.bfloat16
    scale = ref.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    assert bool((((out_b.double() - ref).abs() / scale) <= 2.0**-5).all())
    # ... and bit for bit the documented chain: g, u, h and y rounded to bf16, the gate in fp32.
    xf = x.bfloat16().float()
    wg, wu, wd, wsg = (a.float() for a in sb)
    def bf16(v: torch.Tensor) -> torch.Tensor:
        return v.bfloat16().float()
    h = bf16(F.silu(bf16(rowwise_matmul(xf, wg.T))) * bf16(rowwise_matmul(xf, wu.T)))
    y = bf16(rowwise_matmul(h, wd.T))
    gate = torch.sigmoid(rowwise_matmul(xf, wsg[:, None]))
    assert torch.equal(out_b, (gate * y).bfloat16())
    for t in range(n_tokens):  # row-wise
        assert torch.equal(moe_shared_expert(x[t:t + 1].bfloat16(), *sb), out_b[t:t + 1])
    # 3. The sigmoid gate only shrinks: |out| <= |gate-free output|; w_sg -> 0 halves it exactly.
    half = moe_shared_expert(x, s64.w_gate, s64.w_up, s64.w_down, s64.w_sg * 0.0)
    toward_x0 = 1e4 * torch.where(x[0] >= 0, 1.0, -1.0).double()  # x_0 . w_sg >> 0: gate = 1
    full = moe_shared_expert(x, s64.w_gate, s64.w_up, s64.w_down, toward_x0)
    assert bool((out64.abs() <= 2 * half.abs() + 1e-15).all())
    torch.testing.assert_close(full[0], 2 * half[0], rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- moe


@pytest.mark.certify_guard("moe")
def test_moe_guard():
    ex = _guard_experts()
    x = torch.zeros(1, 16, dtype=torch.float64)
    x[0, :3] = torch.tensor([3.0, -1.0, 0.5])
    # Two identical router rows: p = [0.5, 0.5], ids [0, 1] (tie -> lower first), weights [0.5, 0.5].
    w_router = torch.ones(2, 16, dtype=torch.float64)
    # Routed (guard above): 0.5 * 5.625 on channel 0 and 0.5 * -2.8125 on channel 1.
    # Shared: g = 0.5 * 3 + 0.5 * -1 = 1, u = 3 - 1 = 2, h = 2 silu(1) = 2 / (1 + e^-1) = 1.46212;
    # down puts 2h on channel 2; gate x . w_sg = 3 - 3 = 0 -> 0.5; shared = h on channel 2.
    w_gate = torch.zeros(1, 16, dtype=torch.float64)
    w_gate[0, :2] = 0.5
    w_up = torch.zeros(1, 16, dtype=torch.float64)
    w_up[0, :2] = 1.0
    w_down = torch.zeros(16, 1, dtype=torch.float64)
    w_down[2, 0] = 2.0
    w_sg = torch.zeros(16, dtype=torch.float64)
    w_sg[:2] = torch.tensor([1.0, 3.0])
    out = moe(x, w_router, ex, SharedExpert(w_gate, w_up, w_down, w_sg), top_k=2)
    h = 2.0 / (1.0 + math.exp(-1.0))  # 1.4621171572600098
    expect = torch.zeros(1, 16, dtype=torch.float64)
    expect[0, :3] = torch.tensor([2.8125, -1.40625, h], dtype=torch.float64)
    torch.testing.assert_close(out, expect, rtol=1e-15, atol=0)


@pytest.mark.certify_property("moe")
@given(seed=SEEDS, n_tokens=st.integers(1, 5), n_experts=st.integers(2, 8),
       hidden_blocks=st.integers(1, 2), data=st.data(),
       dtype=st.sampled_from([torch.bfloat16, torch.float64]))
def test_moe_property(seed, n_tokens, n_experts, hidden_blocks, data, dtype):
    top_k = data.draw(st.integers(1, min(n_experts, 3)), label="top_k")
    g = _gen(seed)
    hidden = 16 * hidden_blocks
    ex = _experts(g, n_experts, hidden, 16)
    shared = _shared(g, hidden, 8, dtype)
    w_router = torch.randn(n_experts, hidden, generator=g, dtype=torch.float64).to(dtype)
    x = torch.randn(n_tokens, hidden, generator=g, dtype=torch.float64).to(dtype)
    out = moe(x, w_router, ex, shared, top_k)
    assert out.dtype == dtype and out.shape == x.shape

    # 1. moe is routed + shared, added in the acc dtype and cast once: exactly.
    ids, weights = moe_route(x, w_router, top_k)
    routed = moe_experts(x, ids, weights, ex)
    sh = moe_shared_expert(x, shared.w_gate, shared.w_up, shared.w_down, shared.w_sg)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert torch.equal(out, (routed.to(acc) + sh.to(acc)).to(dtype))

    # 2. Relabelling the experts (router rows and expert tables permuted together) changes nothing
    #    (float64; with distinct probabilities the slot order is unchanged too).
    if dtype == torch.float64:
        perm = torch.randperm(n_experts, generator=g)
        def take(w: NvFp4Weight) -> NvFp4Weight:
            return NvFp4Weight(w.packed[perm], w.sf[perm], w.gs[perm])
        ex_p = NvFp4Experts(take(ex.gate), take(ex.up), take(ex.down), ex.x_gs, ex.h_gs)
        out_p = moe(x, w_router[perm], ex_p, shared, top_k)
        torch.testing.assert_close(out_p, out, rtol=1e-12, atol=1e-12)
