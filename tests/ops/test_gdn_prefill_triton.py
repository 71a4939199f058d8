"""The Triton chunked GDN prefill (impl/kernels/gdn/triton_chunked.py) against the spec, on the CPU
through Triton's interpreter at small shapes (2 key heads, 6 value heads, d 32 unless noted).

The cell bands of certify/cells/gdn_prefill.yaml apply: out 2 ulp / 0.5 eps, final_state 256 ulp / 64
eps (derivations there)."""

from __future__ import annotations

import pytest
import torch

from certify.harness.oracles import tolerance
from impl.kernels.gdn import torch_ops, triton_chunked
from spec.ops import gdn

F64 = torch.float64
OUT_BAND = (2, 0.5)
STATE_BAND = (256, 64)


def _inputs(seed: int, B: int, T: int, HK: int = 2, D: int = 32):
    gen = torch.Generator().manual_seed(seed)
    HV = 3 * HK
    bf = torch.bfloat16

    def r(*shape, dtype=torch.float32, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    return dict(q=r(B, T, HK, D, dtype=bf), k=r(B, T, HK, D, dtype=bf), v=r(B, T, HV, D, dtype=bf),
                a=r(B, T, HV, dtype=bf), b=r(B, T, HV, dtype=bf), A_log=r(HV, scale=0.5),
                dt_bias=r(HV), z=r(B, T, HV, D, dtype=bf), norm_w=1 + r(D, scale=0.1),
                state=r(B, HV, D, D, scale=0.5))


def _run(fn, inp, **kw):
    out = torch.full(inp["z"].shape, float("nan"), dtype=torch.bfloat16)
    final = torch.full(inp["state"].shape, float("nan"))
    fn(**{k: v.clone() for k, v in inp.items()}, out=out, final_state=final, **kw)
    return out, final


def _within(out, final, ref_out, ref_final):
    v_out = tolerance("out", out, ref_out, *OUT_BAND)
    v_state = tolerance("final_state", final, ref_final, *STATE_BAND)
    assert v_out.passed, v_out.problems
    assert v_state.passed, v_state.problems


@pytest.mark.premerge
@pytest.mark.parametrize("B,T", [(1, 1), (2, 37), (1, 64), (1, 130)])
def test_triton_chunked_against_the_float64_spec_and_the_torch_variant(B, T):
    inp = _inputs(T, B, T)
    ref = gdn.gdn_prefill(**{k: v.to(F64) for k, v in inp.items()})
    out, final = _run(triton_chunked.gdn_prefill_chunked, inp)
    _within(out, final, ref["out"], ref["final_state"])
    t_out, t_final = _run(torch_ops.gdn_prefill_chunked, inp)
    # the two fp32 chunked forms agree to the same bands (measured against each other)
    _within(out, final, t_out.to(F64), t_final.to(F64))


@pytest.mark.premerge
def test_split_state_columns_equal_the_fused_norm_path():
    """bv < V takes the o scratch + separate norm launch; bv == V fuses the norm. Same arithmetic
    per column, but a dot's summation order may follow its shape (numpy's blocking, the GPU's MMA
    tiles), so the two agree within the bands rather than bitwise; both are checked against float64."""
    inp = _inputs(7, 1, 100)
    ref = gdn.gdn_prefill(**{k: v.to(F64) for k, v in inp.items()})
    fused = _run(triton_chunked.gdn_prefill_chunked, inp, _config={"bv": 32})
    split = _run(triton_chunked.gdn_prefill_chunked, inp, _config={"bv": 16})
    _within(*fused, ref["out"], ref["final_state"])
    _within(*split, ref["out"], ref["final_state"])
    _within(*split, fused[0].to(F64), fused[1].to(F64))


@pytest.mark.premerge
def test_chunked_equals_recurrent_and_the_state_carries_across_calls():
    """docs/spec.md, "GDN layer": the chunked form is the recurrent one; and a prefill of 70 + 60 rows
    (the second from the first's final state) equals one prefill of 130 rows (chunk boundaries differ,
    so within the bands, not bitwise)."""
    inp = _inputs(11, 1, 130)
    out, final = _run(triton_chunked.gdn_prefill_chunked, inp)
    r_out, r_final = _run(torch_ops.gdn_prefill_recurrent, inp)
    _within(out, final, r_out.to(F64), r_final.to(F64))
    rows = ("q", "k", "v", "a", "b", "z")
    head = {n: (x[:, :70].contiguous() if n in rows else x) for n, x in inp.items()}
    out1, mid = _run(triton_chunked.gdn_prefill_chunked, head)
    tail = {n: (x[:, 70:].contiguous() if n in rows else x) for n, x in inp.items()}
    tail["state"] = mid
    out2, final2 = _run(triton_chunked.gdn_prefill_chunked, tail)
    _within(torch.cat([out1, out2], dim=1), final2, out.to(F64), final.to(F64))


@pytest.mark.premerge
def test_final_state_may_alias_the_input_state():
    inp = _inputs(3, 1, 80)
    out, final = _run(triton_chunked.gdn_prefill_chunked, inp)
    state = inp["state"].clone()
    out2 = torch.empty_like(out)
    triton_chunked.gdn_prefill_chunked(**{**inp, "state": state}, out=out2, final_state=state)
    assert torch.equal(out, out2) and torch.equal(state, final)


@pytest.mark.premerge
def test_pure_write_sequence_by_hand():
    """Decay 1 (a + dt_bias = -100), beta ~ 1 (b = 60), orthonormal keys e1, e2 and values rows of
    [[1, 2], [3, 4]] (padded to d 16): the delta rule stores each v under its k, S = sum_i k_i v_i^T."""
    D = 16
    e = torch.eye(D)
    k = torch.stack([e[0], e[1]])[None, :, None, :].to(torch.bfloat16)     # [1, 2, 1, D]
    vals = torch.zeros(2, D)
    vals[0, :2] = torch.tensor([1.0, 2.0])
    vals[1, :2] = torch.tensor([3.0, 4.0])
    v = vals[None, :, None, :].repeat(1, 1, 3, 1).to(torch.bfloat16)       # [1, 2, 3, D]
    inp = dict(q=k.clone(), k=k, v=v, a=torch.full((1, 2, 3), -100.0, dtype=torch.bfloat16),
               b=torch.full((1, 2, 3), 60.0, dtype=torch.bfloat16), A_log=torch.zeros(3),
               dt_bias=torch.zeros(3), z=torch.ones(1, 2, 3, D, dtype=torch.bfloat16),
               norm_w=torch.ones(D), state=torch.zeros(1, 3, D, D))
    _, final = _run(triton_chunked.gdn_prefill_chunked, inp)
    expected = torch.zeros(D, D)
    expected[:2] = vals
    for h in range(3):
        # l2norm's eps (1e-6 inside the sqrt) scales k by 1/sqrt(1 + 1e-6): a 5e-7 relative change.
        assert torch.allclose(final[0, h], expected, rtol=2e-6, atol=1e-6)
