"""Property tests and guards of the GDN ops: spec invariants and the variants against the spec."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from certify.catalog.load import load_catalog
from certify.files.paths import project_paths
from certify.harness.oracles import tolerance
from certify.harness.target import variant_callable
from impl.kernels.gdn import torch_ops
from spec.ops import gdn
from spec.ops.norms import gated_rmsnorm

F64 = torch.float64


def _rand(gen, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _step_inputs(seed: int, B: int, T: int, HK: int, D: int, state_dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    HV = 3 * HK
    bf = torch.bfloat16
    return dict(q=_rand(gen, B, T, HK, D, dtype=bf), k=_rand(gen, B, T, HK, D, dtype=bf),
                v=_rand(gen, B, T, HV, D, dtype=bf), a=_rand(gen, B, T, HV, dtype=bf),
                b=_rand(gen, B, T, HV, dtype=bf), A_log=_rand(gen, HV, scale=0.5),
                dt_bias=_rand(gen, HV), z=_rand(gen, B, T, HV, D, dtype=bf),
                norm_w=1 + _rand(gen, D, scale=0.1),
                state_pool=_rand(gen, B + 2, HV, D, D, dtype=state_dtype, scale=0.5),
                slots=torch.randperm(B + 2, generator=gen)[:B].to(torch.int32))


def _run_verify(fn, inp):
    B, T, HV, D = inp["v"].shape
    out = torch.full((B, T, HV, D), float("nan"), dtype=torch.bfloat16)
    states = torch.full((B, T, HV, D, D), float("nan"), dtype=inp["state_pool"].dtype)
    fn(**{k: v.clone() for k, v in inp.items()}, out=out, states=states)
    return out, states


# The variants that run on the CPU, by their cell files' names and callables (one name each).
_CATALOG = load_catalog(project_paths().cells)
_NAMES = ("torch", "triton_fused", "triton_split")
VERIFY_VARIANTS = {n: variant_callable(_CATALOG.ops["gdn_verify"], n) for n in _NAMES}
DECODE_VARIANTS = {n: variant_callable(_CATALOG.ops["gdn_decode"], n) for n in _NAMES}

shapes = st.tuples(st.integers(1, 3), st.integers(1, 5), st.sampled_from([1, 2]),
                   st.sampled_from([4, 16, 64]), st.sampled_from([torch.float32, torch.bfloat16]))


# ---------------------------------------------------------------- gdn_verify / gdn_decode


# The Triton interpreter runs each program in Python: fewer examples keep these under ~30 s.
@pytest.mark.certify_property("gdn_verify")
@settings(max_examples=10)
@given(seed=st.integers(0, 2 ** 31), shape=shapes, data=st.data())
def test_verify_then_commit_equals_verify_of_the_accepted_rows(seed, shape, data):
    """The rollback oracle of docs/spec.md for both variants: the state recorded after row a of a T-row
    verify equals, bit for bit, the last state of the same kernel run on the first a + 1 rows; and the
    variants stay within the cell band of the float64 spec."""
    B, T, HK, D, sd = shape
    inp = _step_inputs(seed, B, T, HK, D, sd)
    a = data.draw(st.integers(0, T - 1), label="accepted")
    head = {k: (v[:, : a + 1].contiguous() if k in "q k v a b z".split() else v)
            for k, v in inp.items()}
    ref = gdn.gdn_verify(**{k: (v.to(F64) if v.is_floating_point() else v) for k, v in inp.items()})
    for name, fn in VERIFY_VARIANTS.items():
        out, states = _run_verify(fn, inp)
        _, states_head = _run_verify(fn, head)
        assert torch.equal(states[:, a], states_head[:, a]), name
        assert tolerance("out", out, ref["out"], 16, 4).passed
        assert tolerance("states", states, ref["states"], 64, 8).passed


@pytest.mark.certify_guard("gdn_verify")
@pytest.mark.parametrize("fn", list(VERIFY_VARIANTS.values()), ids=list(VERIFY_VARIANTS))
def test_guard_two_token_state_by_hand(fn):
    """One value head, d = 2, beta = 1 (b large), decay 1 then 1/2, state starting at 0.

    row 1: k = (1, 0), v = (1, 2): u = v - S^T k = (1, 2); S = k u^T = [[1, 2], [0, 0]].
    row 2: decay 1/2 -> S = [[.5, 1], [0, 0]]; k = (0, 1), v = (3, 4): u = (3, 4) - (0, 0);
           S = [[.5, 1], [3, 4]].
    """
    bf = torch.bfloat16
    inp = dict(q=torch.tensor([[[[1.0, 0.0]], [[0.0, 1.0]]]], dtype=bf),
               k=torch.tensor([[[[1.0, 0.0]], [[0.0, 1.0]]]], dtype=bf),
               v=torch.tensor([[[[1.0, 2.0]], [[3.0, 4.0]]]], dtype=bf),
               # g = -exp(A_log) * softplus(a + dt_bias): a + dt_bias = -100 gives g ~ 0 (decay 1);
               # softplus(x) = ln 2 at x = 0 with A_log = 0 gives g = -ln 2 (decay 1/2).
               a=torch.tensor([[[-100.0], [0.0]]], dtype=bf), b=torch.full((1, 2, 1), 60.0, dtype=bf),
               A_log=torch.zeros(1), dt_bias=torch.zeros(1), z=torch.full((1, 2, 1, 2), 8.0, dtype=bf),
               norm_w=torch.ones(2), state_pool=torch.zeros(1, 1, 2, 2),
               slots=torch.zeros(1, dtype=torch.int32))
    _, states = _run_verify(fn, inp)
    expected = torch.tensor([[[1.0, 2.0], [0.0, 0.0]], [[0.5, 1.0], [3.0, 4.0]]])
    # l2norm's eps (1e-6 inside the sqrt) scales k by 1/sqrt(1 + 1e-6): a 5e-7 relative change.
    assert torch.allclose(states[0, :, 0], expected, rtol=2e-6, atol=1e-6)


@pytest.mark.certify_property("gdn_decode")
@settings(max_examples=10)
@given(seed=st.integers(0, 2 ** 31), shape=shapes)
def test_decode_equals_a_one_row_verify_and_touches_only_its_slots(seed, shape):
    B, _, HK, D, sd = shape
    inp = _step_inputs(seed, B, 1, HK, D, sd)
    dec = {k: (v[:, 0].contiguous() if k in "q k v a b z".split() else v) for k, v in inp.items()}
    for fn, verify in zip(DECODE_VARIANTS.values(), VERIFY_VARIANTS.values()):
        _, states = _run_verify(verify, inp)
        pool = inp["state_pool"].clone()
        out = torch.full(dec["z"].shape, float("nan"), dtype=torch.bfloat16)
        fn(**{**dec, "state_pool": pool}, out=out)
        slots = inp["slots"].long()
        assert torch.equal(pool[slots], states[:, 0])
        untouched = torch.ones(pool.shape[0], dtype=torch.bool)
        untouched[slots] = False
        assert torch.equal(pool[untouched], inp["state_pool"][untouched])


@pytest.mark.certify_guard("gdn_decode")
@pytest.mark.parametrize("fn", list(DECODE_VARIANTS.values()), ids=list(DECODE_VARIANTS))
def test_guard_decode_writes_its_slot_by_hand(fn):
    """From S = [[1, 0], [0, 1]] in slot 1, decay 1/2, beta ~ 1, k = (1, 0), v = (3, 3):
    S -> [[.5, 0], [0, .5]]; u = v - S^T k = (2.5, 3); S -> [[3, 3], [0, .5]]. Slot 0 is untouched."""
    bf = torch.bfloat16
    pool = torch.stack([torch.full((1, 2, 2), 7.0), torch.eye(2)[None]])
    dec = dict(q=torch.tensor([[[1.0, 0.0]]], dtype=bf), k=torch.tensor([[[1.0, 0.0]]], dtype=bf),
               v=torch.tensor([[[3.0, 3.0]]], dtype=bf), a=torch.zeros(1, 1, dtype=bf),
               b=torch.full((1, 1), 60.0, dtype=bf), A_log=torch.zeros(1), dt_bias=torch.zeros(1),
               z=torch.ones(1, 1, 2, dtype=bf), norm_w=torch.ones(2), state_pool=pool,
               slots=torch.ones(1, dtype=torch.int32))
    fn(**dec, out=torch.empty(1, 1, 2, dtype=bf))
    assert torch.allclose(pool[1, 0], torch.tensor([[3.0, 3.0], [0.0, 0.5]]), rtol=2e-6, atol=1e-6)
    assert torch.equal(pool[0], torch.full((1, 2, 2), 7.0))


# ---------------------------------------------------------------- gdn_prefill


@pytest.mark.certify_property("gdn_prefill")
@given(seed=st.integers(0, 2 ** 31), T=st.integers(1, 150), HK=st.sampled_from([1, 2]))
def test_chunked_equals_recurrent_and_the_variants_follow(seed, T, HK):
    """docs/spec.md, "GDN layer": the chunked form (chunk 64) is the same function as the recurrent one."""
    inp = _step_inputs(seed, 1, T, HK, 8, torch.float32)
    inp.pop("slots")
    state = inp.pop("state_pool")[:1]
    f64 = {k: v.to(F64) for k, v in inp.items()}
    g, beta = gdn.gdn_gates(f64["a"], f64["b"], f64["A_log"], f64["dt_bias"])
    o_rec, _, s_rec = gdn.gdn_recurrent(f64["q"], f64["k"], f64["v"], g, beta, state.to(F64))
    o_chk, s_chk = gdn.gdn_chunked(f64["q"], f64["k"], f64["v"], g, beta, state.to(F64))
    assert torch.allclose(o_rec, o_chk, rtol=1e-9, atol=1e-9)
    assert torch.allclose(s_rec, s_chk, rtol=1e-9, atol=1e-9)
    ref = gdn.gdn_prefill(**f64, state=state.to(F64))
    for fn in (torch_ops.gdn_prefill_chunked, torch_ops.gdn_prefill_recurrent):
        out = torch.full(inp["z"].shape, float("nan"), dtype=torch.bfloat16)
        final = torch.full(state.shape, float("nan"))
        fn(**inp, state=state, out=out, final_state=final)
        assert tolerance("out", out, ref["out"], 2, 0.5).passed
        assert tolerance("final_state", final, ref["final_state"], 256, 64).passed


@pytest.mark.certify_guard("gdn_prefill")
def test_guard_prefill_of_a_pure_write_sequence():
    """With decay 1 and beta 1 and orthonormal keys, the delta rule stores each v under its k:
    S = sum_i k_i v_i^T, so the final state of keys e1, e2 and values (1, 2), (3, 4) is [[1, 2], [3, 4]]."""
    f = torch.float64
    q = torch.tensor([[[[1.0, 0.0]], [[0.0, 1.0]]]], dtype=f)
    v = torch.tensor([[[[1.0, 2.0]], [[3.0, 4.0]]]], dtype=f)
    inp = dict(q=q, k=q.clone(), v=v, a=torch.full((1, 2, 1), -100.0, dtype=f),
               b=torch.full((1, 2, 1), 60.0, dtype=f), A_log=torch.zeros(1, dtype=f),
               dt_bias=torch.zeros(1, dtype=f), z=torch.ones(1, 2, 1, 2, dtype=f),
               norm_w=torch.ones(2, dtype=f), state=torch.zeros(1, 1, 2, 2, dtype=f))
    final = gdn.gdn_prefill(**inp)["final_state"][0, 0]
    assert torch.allclose(final, torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=f), rtol=2e-6)
    out = torch.empty(1, 2, 1, 2, dtype=torch.bfloat16)
    fin = torch.empty(1, 1, 2, 2)
    torch_ops.gdn_prefill_chunked(**{k: x.float() if k != "z" else x.bfloat16() for k, x in inp.items()},
                                  out=out, final_state=fin)
    assert torch.allclose(fin[0, 0].double(), final, rtol=1e-5)


# ---------------------------------------------------------------- conv


@pytest.mark.certify_property("gdn_conv_prefill")
@given(seed=st.integers(0, 2 ** 31), T=st.integers(1, 12), C=st.integers(1, 9))
def test_prefill_then_update_equals_prefill_of_the_whole(seed, T, C):
    gen = torch.Generator().manual_seed(seed)
    x = _rand(gen, 2, T + 1, C, dtype=torch.bfloat16)
    w = _rand(gen, C, 4)
    s0 = _rand(gen, 2, C, 3, dtype=torch.bfloat16)
    y_all, s_all = gdn.causal_conv1d(x, w, s0)
    y_head, s_head = gdn.causal_conv1d(x[:, :T], w, s0)
    y_last, s_last = gdn.causal_conv1d_update(x[:, T], w, s_head)
    assert torch.equal(y_all[:, :T], y_head) and torch.equal(y_all[:, T], y_last)
    assert torch.equal(s_all, s_last)
    y = torch.empty_like(y_all)
    s = torch.empty_like(s_all)
    torch_ops.gdn_conv_prefill(x, w, s0, y=y, new_conv_state=s)
    assert torch.equal(s, s_all)
    assert tolerance("y", y, gdn.causal_conv1d(x.double(), w.double(), s0.double())[0], 1, 0.5).passed


@pytest.mark.certify_guard("gdn_conv_prefill")
def test_guard_conv_reads_the_state_before_the_sequence():
    """Weights (1, 0, 0, 0) read x_{t-3}: the first three outputs come from the state (5, 6, 7)."""
    x = torch.tensor([[[1.0], [2.0], [3.0], [4.0]]], dtype=torch.float64)
    state = torch.tensor([[[5.0, 6.0, 7.0]]], dtype=torch.float64)
    y, new_state = gdn.causal_conv1d(x, torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64),
                                     state)
    silu = lambda t: t / (1 + math.exp(-t))  # noqa: E731
    assert y[0, :, 0].tolist() == pytest.approx([silu(5), silu(6), silu(7), silu(1)])
    assert new_state[0, 0].tolist() == [2.0, 3.0, 4.0]


@pytest.mark.certify_property("gdn_conv_update")
@given(seed=st.integers(0, 2 ** 31), B=st.integers(1, 4), C=st.integers(1, 9))
def test_update_rolls_the_state_in_place(seed, B, C):
    gen = torch.Generator().manual_seed(seed)
    x = _rand(gen, B, C, dtype=torch.bfloat16)
    w = _rand(gen, C, 4)
    state = _rand(gen, B, C, 3, dtype=torch.bfloat16)
    y_ref, s_ref = gdn.causal_conv1d_update(x, w, state)
    assert torch.equal(s_ref[..., :2], state[..., 1:]) and torch.equal(s_ref[..., 2], x)
    live = state.clone()
    y = torch.empty_like(y_ref)
    torch_ops.gdn_conv_update(x, w, live, y=y)
    assert torch.equal(live, s_ref)
    assert tolerance("y", y, gdn.causal_conv1d_update(x.double(), w.double(), state.double())[0],
                     1, 0.5).passed


@pytest.mark.certify_guard("gdn_conv_update")
def test_guard_update_with_the_newest_tap_only():
    """Weights (0, 0, 0, 2) read only the new input: y = silu(2 x)."""
    x = torch.tensor([[1.5]], dtype=torch.float64)
    y, s = gdn.causal_conv1d_update(x, torch.tensor([[0.0, 0.0, 0.0, 2.0]], dtype=torch.float64),
                                    torch.tensor([[[9.0, 8.0, 7.0]]], dtype=torch.float64))
    assert y.item() == pytest.approx(3.0 / (1 + math.exp(-3.0)))
    assert s[0, 0].tolist() == [8.0, 7.0, 1.5]


# ---------------------------------------------------------------- gates and norm


@pytest.mark.certify_property("gdn_gates")
@given(seed=st.integers(0, 2 ** 31), scale=st.sampled_from([1.0, 4.0, 10.0]))
def test_gates_are_a_decay_and_a_probability(seed, scale):
    gen = torch.Generator().manual_seed(seed)
    a, b = _rand(gen, 64, 6, scale=scale), _rand(gen, 64, 6, scale=scale)
    A_log, dt_bias = _rand(gen, 6), _rand(gen, 6)
    g, beta = gdn.gdn_gates(a.double(), b.double(), A_log.double(), dt_bias.double())
    assert (g <= 0).all() and ((beta >= 0) & (beta <= 1)).all()
    gg, bb = torch.empty(64, 6), torch.empty(64, 6)
    torch_ops.gdn_gates(a, b, A_log, dt_bias, g=gg, beta=bb)
    # Band 16: see the derivation in certify/cells/gdn_gates.yaml (softplus's condition number).
    assert tolerance("g", gg, g, 16, 4).passed and tolerance("beta", bb, beta, 16, 4).passed
    ref32 = gdn.gdn_gates(a, b, A_log, dt_bias)
    assert torch.equal(gg, ref32[0]) and torch.equal(bb, ref32[1])


@pytest.mark.certify_property("gdn_gates")
def test_gates_of_a_batch_of_sequences_are_those_of_its_rows():
    """a, b [B, T, HV] (the signature's leading dims): the torch gates and the spec's equal their
    results on the same rows flattened to [B * T, HV], bit for bit (each row is its own launch)."""
    gen = torch.Generator().manual_seed(7)
    a, b = _rand(gen, 2, 3, 6, scale=4.0), _rand(gen, 2, 3, 6, scale=4.0)
    A_log, dt_bias = _rand(gen, 6), _rand(gen, 6)
    g3, b3 = torch.empty(2, 3, 6), torch.empty(2, 3, 6)
    torch_ops.gdn_gates(a, b, A_log, dt_bias, g=g3, beta=b3)
    g2, b2 = torch.empty(6, 6), torch.empty(6, 6)
    torch_ops.gdn_gates(a.reshape(6, 6), b.reshape(6, 6), A_log, dt_bias, g=g2, beta=b2)
    assert torch.equal(g3.reshape(6, 6), g2) and torch.equal(b3.reshape(6, 6), b2)
    s3, t3 = gdn.gdn_gates(a, b, A_log, dt_bias)
    assert torch.equal(s3.reshape(6, 6), g2) and torch.equal(t3.reshape(6, 6), b2)


@pytest.mark.certify_guard("gdn_gates")
def test_guard_gates_at_zero():
    """a + dt_bias = 0 and A_log = 0: g = -softplus(0) = -ln 2; b = 0: beta = 1/2."""
    z = torch.zeros(1, 1, dtype=torch.float64)
    g, beta = gdn.gdn_gates(z, z, torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64))
    assert g.item() == pytest.approx(-math.log(2)) and beta.item() == 0.5


@pytest.mark.certify_property("gated_rmsnorm")
@given(seed=st.integers(0, 2 ** 31), scale_exp=st.integers(-4, 4))
def test_gated_norm_is_scale_invariant_in_o(seed, scale_exp):
    gen = torch.Generator().manual_seed(seed)
    o = _rand(gen, 4, 3, 16, scale=0.5)
    z = _rand(gen, 4, 3, 16, dtype=torch.bfloat16)
    w = 1 + _rand(gen, 16, scale=0.1)
    base = gated_rmsnorm(o, z, w)
    scaled = gated_rmsnorm(o * 2.0 ** scale_exp, z, w)
    # A power-of-two scale is exact in fp32 and cancels in o * rsqrt(mean(o^2)) up to eps's weight
    # (under 1e-3 relative here, a quarter of a bf16 ulp), so the two results are each within one ulp
    # of the same ideal: at most 2 ulp apart.
    assert tolerance("out", scaled, base.double(), 2, 0.5).passed
    out = torch.empty_like(base)
    torch_ops.gated_rmsnorm(o, z, w, out=out)
    assert torch.equal(out, base)


@pytest.mark.certify_guard("gated_rmsnorm")
def test_guard_gated_norm_by_hand():
    """o = (3, 4): mean(o^2) = 12.5, so o / rms = (0.8485, 1.1314); z = (0, 2): silu = (0, 1.7616)."""
    f = torch.float64
    out = gated_rmsnorm(torch.tensor([3.0, 4.0], dtype=f), torch.tensor([0.0, 2.0], dtype=f),
                        torch.ones(2, dtype=f))
    r = 1 / math.sqrt(12.5 + 1e-6)
    assert out.tolist() == pytest.approx([0.0, 4 * r * 2 / (1 + math.exp(-2))])
