"""The MoE block's spec functions against a per-token formulation written independently of them
(docs/spec.md, "MoE"), in float64 on seeded inputs.

Per token, with Python floats: the route by a full sort of the float64 softmax
(``route_by_sorting``), each routed expert as ``down(silu(gate x) * up x)`` where every GEMM is
the nvfp4 quantise-dequantise of its input (per block of 16, ``nvfp4_reference``: e4m3 block scale,
e2m1 code, both decoded from their bit layouts) times the weight decoded element by element from
its nibbles, an fsum dot per output; the slots summed best first; the shared expert as the explicit
SwiGLU with its sigmoid gate (``shared_expert_formula``). These helpers are the ones the spec's
quantiser, router and shared expert are checked against in test_second_formulations_storage.py.

Tolerance: both sides compute the same float64 function from the same quantised operands (the
quantisers round in every mode, and do so identically here: an nvfp4 code can differ only where
a value lies within ~1e-16 of an e2m1 or e4m3 midpoint, which no value on these seeds does). Outputs
of order 1 to 10 are sums of at most 2 x 32 products of partial sums below 10, so the two agree
within ~64 x 10 x 1.1e-16 = 7e-14 absolute (measured: 4.4e-16). ATOL 1e-12 sits above that bound;
a swapped slot weight or a missing renormalisation is off by 1e-2 or more.
"""

from __future__ import annotations

import math

import pytest
import torch

from spec.cases.moe import moe_experts_op, moe_op
from spec.ops.kv_storage import E2M1_GRID, nvfp4_global_scale, nvfp4_quantize
from spec.ops.moe import NvFp4Experts, NvFp4Weight, SharedExpert, moe, moe_experts, nvfp4_expert
from tests.spec.test_second_formulations_model import _nvfp4_element
from tests.spec.test_second_formulations_storage import (E4M3_TABLE, nvfp4_reference,
                                                          route_by_sorting, shared_expert_formula)

pytestmark = pytest.mark.premerge

F64 = torch.float64
ATOL = 1e-12
C, I, E, TOP_K, T = 32, 16, 4, 2, 6


def _close(a, b) -> bool:
    a, b = torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64)
    return a.shape == b.shape and torch.allclose(a, b, rtol=0.0, atol=ATOL)


def _silu(v: float) -> float:
    return v / (1.0 + math.exp(-v))


def _e2m1(code: int) -> float:
    return -E2M1_GRID[code & 7] if code & 8 else E2M1_GRID[code & 7]


def quant_dequant(xs: list[float], gs: float) -> list[float]:
    """nvfp4 round trip of one vector in float64: codes and scales from the per-block reference,
    each element decoded as ``e2m1(code) * e4m3(sf) * gs``."""
    codes, scales = nvfp4_reference(xs, gs, fp32=False)
    return [_e2m1(c) * E4M3_TABLE[scales[i // 16]] * gs for i, c in enumerate(codes)]


def decode(w: NvFp4Weight, e: int) -> list[list[float]]:
    """Expert e's matrix [out, in], element by element from its nibbles."""
    packed, sf, gs = w.packed[e], w.sf[e], float(w.gs[e])
    return [[_nvfp4_element(packed, sf, gs, o, i) for i in range(packed.shape[1] * 2)]
            for o in range(packed.shape[0])]


def _dot(a, b) -> float:
    return math.fsum(p * q for p, q in zip(a, b))


def expert_formula(x: list[float], mats, x_gs: float, h_gs: float) -> list[float]:
    """``down(silu(gate x) * up x)``, each GEMM's input quantised with its layer scale."""
    gate, up, down = mats
    xq = quant_dequant(x, x_gs)
    h = [_silu(_dot(g, xq)) * _dot(u, xq) for g, u in zip(gate, up)]
    hq = quant_dequant(h, h_gs)
    return [_dot(d, hq) for d in down]


def _experts(seed: int):
    gen = torch.Generator().manual_seed(seed)

    def stack(out: int, inp: int) -> NvFp4Weight:
        w = torch.randn(E, out, inp, generator=gen, dtype=F64) / math.sqrt(inp)
        gs = torch.stack([nvfp4_global_scale(w[e].abs().max()) for e in range(E)])
        parts = [nvfp4_quantize(w[e], gs[e]) for e in range(E)]
        return NvFp4Weight(torch.stack([p for p, _ in parts]), torch.stack([s for _, s in parts]),
                           gs)

    gate, up, down = stack(I, C), stack(I, C), stack(C, I)
    x = torch.randn(T, C, generator=gen, dtype=F64)
    x[0, 3] = 9.0                                   # an outlier channel sets its block's scale
    experts = NvFp4Experts(gate, up, down, nvfp4_global_scale(x.abs().max()),
                           nvfp4_global_scale(torch.tensor(4.0)))
    mats = [[decode(w, e) for w in (gate, up, down)] for e in range(E)]
    return gen, x, experts, mats


@pytest.mark.second_formulation("spec.ops.moe:nvfp4_expert", "spec.ops.moe:moe_experts",
                                "spec.cases.moe:moe_experts_op")
def test_routed_experts_equal_the_per_token_formula():
    gen, x, experts, mats = _experts(11)
    x_gs, h_gs = float(experts.x_gs), float(experts.h_gs)
    rows = x.tolist()
    for e in range(E):
        mine = [expert_formula(r, mats[e], x_gs, h_gs) for r in rows]
        assert _close(nvfp4_expert(x, experts, e, F64, True), mine), e
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(T)])
    weights = torch.rand(T, TOP_K, generator=gen, dtype=F64)
    want = [[math.fsum(vals) for vals in zip(*[
        [float(w) * v for v in expert_formula(r, mats[int(e)], x_gs, h_gs)]
        for e, w in zip(ids[t], weights[t])])] for t, r in enumerate(rows)]
    got = moe_experts(x, ids, weights, experts)
    assert got.dtype == F64 and _close(got, want)
    g, u, d = experts.gate, experts.up, experts.down
    op = moe_experts_op(x, ids, weights, g.packed, g.sf, g.gs, u.packed, u.sf, u.gs, d.packed,
                        d.sf, d.gs, experts.x_gs, experts.h_gs)
    assert _close(op, want)
    # wrong: each slot's weight given to the other slot's expert.
    swapped = moe_experts(x, ids, weights.flip(1), experts)
    assert not _close(swapped, want)


@pytest.mark.second_formulation("spec.ops.moe:moe", "spec.cases.moe:moe_op")
def test_moe_block_equals_route_experts_and_shared_expert_per_token():
    gen, x, experts, mats = _experts(12)
    x_gs, h_gs = float(experts.x_gs), float(experts.h_gs)
    w_router = torch.randn(E, C, generator=gen, dtype=F64) * 0.5
    dense = [torch.randn(*s, generator=gen, dtype=F64) / math.sqrt(s[-1])
             for s in ((I, C), (I, C), (C, I), (C,))]
    shared = SharedExpert(*dense)
    wr, sh = w_router.tolist(), [t.tolist() for t in dense]
    want = []
    for r in x.tolist():
        routed = route_by_sorting(r, wr, TOP_K)                      # {expert: weight}, best first
        parts = [[w * v for v in expert_formula(r, mats[e], x_gs, h_gs)] for e, w in routed.items()]
        parts.append(shared_expert_formula(r, *sh))
        want.append([math.fsum(vals) for vals in zip(*parts)])
    got = moe(x, w_router, experts, shared, TOP_K)
    assert got.dtype == F64 and _close(got, want)
    g, u, d = experts.gate, experts.up, experts.down
    op = moe_op(x, w_router, TOP_K, g.packed, g.sf, g.gs, u.packed, u.sf, u.gs, d.packed, d.sf,
                d.gs, experts.x_gs, experts.h_gs, *dense)
    assert _close(op, want)
    # wrong: the routed weights not renormalised to sum 1.
    bad = []
    for r in x.tolist():
        routed = route_by_sorting(r, wr, TOP_K, renormalise=False)
        parts = [[w * v for v in expert_formula(r, mats[e], x_gs, h_gs)] for e, w in routed.items()]
        parts.append(shared_expert_formula(r, *sh))
        bad.append([math.fsum(vals) for vals in zip(*parts)])
    assert not _close(got, bad)
