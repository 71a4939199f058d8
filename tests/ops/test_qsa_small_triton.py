"""The Triton QSA append, index store and index scores (impl/kernels/qsa/) against the spec, on the CPU
through Triton's interpreter at small shapes, with the cells' oracles (certify/cells/qsa_kv_append.yaml:
bitwise against the spec in its own dtypes; qsa_index_store.yaml: bitwise; qsa_index_scores.yaml:
16 ulp of the row maximum / 3 eps RMS against float64).

Per op: a guard whose expected bytes a person can check by hand, and a property test over drawn
layouts (every KV storage dtype for the append) built by the cells' own input builders."""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from certify.harness.target import run_spec, run_variant
from certify.harness.oracles import bitwise, tolerance
from impl.kernels.qsa import triton_append, triton_index
from spec.cases.qsa import index_scores_case, index_store_case, kv_append_case
from spec.ops import kv_storage, qsa

BF = torch.bfloat16
SETTINGS = settings(max_examples=6, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def _layouts(draw, max_rows: int) -> dict:
    """A step layout inside reach, small: (step, batch, rows, context)."""
    step = draw(st.sampled_from(["decode", "verify", "prefill", "mixed"]))
    batch = draw(st.integers(1, 6))
    if step == "decode":
        rows = batch
    elif step == "verify":
        rows = batch * draw(st.integers(2, 8))
    elif step == "prefill":
        rows = batch * draw(st.integers(1, max_rows // batch))
    else:
        batch = max(batch, 2)
        rows = batch - 1 + draw(st.integers(1, max_rows))
    context = draw(st.integers(max(rows, 40), 700))
    return {"step": step, "batch": batch, "rows": rows, "context": context}


def _all_bitwise(case, got: dict, ref: dict) -> None:
    for name in case.outputs:
        v = bitwise(name, got[name], ref[name])
        assert v.passed, v.problems


# ---------------------------------------------------------------- qsa_kv_append


def test_kv_append_guard_by_hand():
    """Two tokens of one request at positions 31 and 32: the first lands in the last slot of the
    request's page for block 0 (page 2), the second in slot 0 of its page for block 1 (page 0). k is
    1.0625 everywhere (an e4m3 tie between 1.0 and 1.125: nearest even gives 1.0 = 0x38) and v is
    -3 (0xC4 in e4m3); in nvfp4 with gs = 1/6 a block's scale is e4m3(amax / 1) (1.0625 -> 1.0, 0x38;
    3 -> 0x44) and the codes are e2m1(1.0625 / (1 * 1/6) ...)."""
    table = torch.tensor([[2, 0]], dtype=torch.int32)
    seq = torch.zeros(2, dtype=torch.int32)
    pos = torch.tensor([31, 32], dtype=torch.int32)
    k = torch.full((2, 1, 16), 1.0625, dtype=BF)
    v = torch.full((2, 1, 16), -3.0, dtype=BF)
    # fp8: by hand, every written byte of K is 0x38 and of V 0xC4; the rest stays 0x11.
    kp = (torch.full((3, 32, 1, 16), 0x11, dtype=torch.uint8).view(kv_storage.FP8_DTYPE),)
    vp = (kp[0].clone(),)
    pp = torch.full((3, 32), -1, dtype=torch.int32)
    triton_append.kv_append(kp, vp, pp, table, seq, pos, k, v, "fp8")
    kb, vb = kp[0].view(torch.uint8), vp[0].view(torch.uint8)
    assert bool((kb[2, 31] == 0x38).all()) and bool((kb[0, 0] == 0x38).all())
    assert bool((vb[2, 31] == 0xC4).all()) and bool((vb[0, 0] == 0xC4).all())
    assert int((kb == 0x11).sum()) == kb.numel() - 32  # nothing else written
    assert pp[2, 31] == 31 and pp[0, 0] == 32 and int((pp == -1).sum()) == 3 * 32 - 2
    # nvfp4 with gs = 1/6: sf = e4m3(amax / (6 gs)) = e4m3(1.0625) = 1.0 (0x38), codes e2m1(1.0625 /
    # (1.0 / 6)) = e2m1(6.375) = 6 (code 7, 0x77 a byte); V: sf = e4m3(3) = 0x44, codes
    # e2m1(-3 / (3 / 6)) = -6 (code 0xF, 0xFF a byte).
    gs = 1.0 / 6.0
    kq = (torch.zeros(3, 32, 1, 8, dtype=torch.uint8),
          torch.zeros(3, 32, 1, 1, dtype=torch.uint8).view(kv_storage.FP8_DTYPE))
    vq = tuple(t.clone() for t in kq)
    triton_append.kv_append(kq, vq, pp, table, seq, pos, k, v, "nvfp4", gs, gs)
    assert bool((kq[0][2, 31] == 0x77).all()) and int(kq[1].view(torch.uint8)[0, 0]) == 0x38
    assert bool((vq[0][0, 0] == 0xFF).all()) and int(vq[1].view(torch.uint8)[2, 31]) == 0x44
    ref = kv_storage.nvfp4_quantize(k[0], torch.tensor(gs, dtype=torch.float32))
    assert torch.equal(kq[0][2, 31], ref[0]) and torch.equal(kq[1][2, 31].view(torch.uint8),
                                                             ref[1].view(torch.uint8))


@st.composite
def _append_axes(draw):
    axes = _layouts(draw, 80)
    axes.update(kv_dtype=draw(st.sampled_from(["bfloat16", "fp8", "nvfp4"])), act_dtype="bfloat16",
                kv_heads=draw(st.sampled_from([1, 2])), head_dim=draw(st.sampled_from([32, 64])))
    return axes


@pytest.mark.premerge
@SETTINGS
@given(axes=_append_axes(), seed=st.integers(0, 2 ** 31 - 1), specials=st.booleans())
def test_kv_append_property(axes, seed, specials):
    """Bitwise equal to the spec's store for every KV dtype, including special k values (the e4m3
    range's edges, ties, subnormals, -0.0, inf, NaN: a NaN confines itself to its nvfp4 block)."""
    case = kv_append_case(axes, torch.Generator().manual_seed(seed), "cpu")
    if specials:
        k = case.inputs["k"]
        vals = torch.tensor([448.0, 480.0, -1e4, float("inf"), -0.0, 2 ** -10, 3 * 2 ** -11,
                             1.0625, 2 ** -7 * 1.0625, float("nan")], dtype=BF)
        flat = k.view(-1)
        flat[:vals.numel()] = vals
    got = run_variant(triton_append.qsa_kv_append, case)
    ref = run_spec(qsa.qsa_kv_append, case, reference=False)
    if not specials:
        _all_bitwise(case, got, ref)
        return
    # With a NaN among k, oracles.bitwise refuses the NaN bytes on principle: compare the raw bytes
    # (the canonical NaN byte 0x7F, of an fp8 element or of a poisoned nvfp4 block scale, included).
    for name in case.outputs:
        _raw_equal(got[name], ref[name])


def _raw_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    view = torch.uint8 if a.element_size() == 1 else {2: torch.int16, 4: torch.int32}[
        a.element_size()]
    assert torch.equal(a.contiguous().view(view), b.contiguous().view(view))


# ---------------------------------------------------------------- qsa_index_store


def test_index_store_guard_by_hand():
    """A request holding 30 tokens gets positions 30, 31 (completing its block on page 1) and 32
    (opening page 3). Keys: slot i of block 0 holds i / 4 (exact in bf16), so the block key is
    (0 + 0.25 + ... + 7.75) / 32 = 124 / 32 = 3.875 in every dim; page 3 becomes invalid."""
    dim = 16
    plane = torch.full((4, 32, dim), 9.0, dtype=BF)
    plane[1, :30] = (torch.arange(30, dtype=torch.float32) / 4)[:, None].to(BF)
    keys = torch.full((4, dim), 5.0, dtype=BF)
    valid = torch.tensor([True, False, True, True])
    table = torch.tensor([[1, 3]], dtype=torch.int32)
    seq = torch.zeros(3, dtype=torch.int32)
    pos = torch.tensor([32, 30, 31], dtype=torch.int32)
    kI = (torch.tensor([1.0, 7.5, 7.75])[:, None].expand(3, dim)).to(BF).contiguous()
    triton_index.index_store(plane, keys, valid, table, seq, pos, kI)
    assert bool((keys[1] == 3.875).all()) and bool((keys[[0, 2, 3]] == 5.0).all())
    assert valid.tolist() == [True, True, True, False]
    assert bool((plane[3, 0] == 1.0).all()) and bool((plane[1, 31] == 7.75).all())
    assert bool((plane[0] == 9.0).all()) and bool((plane[3, 1:] == 9.0).all())


@st.composite
def _store_axes(draw):
    axes = _layouts(draw, 120)
    axes.update(plane_dtype="bfloat16", act_dtype="bfloat16",
                index_dim=draw(st.sampled_from([32, 128])))
    return axes


@pytest.mark.premerge
@SETTINGS
@given(axes=_store_axes(), seed=st.integers(0, 2 ** 31 - 1))
def test_index_store_property(axes, seed):
    """Bitwise equal to the spec (the same fp32 fold), and invariant to the order rows are launched
    in (a completed page is valid whichever row of its page comes first)."""
    case = index_store_case(axes, torch.Generator().manual_seed(seed), "cpu")
    got = run_variant(triton_index.qsa_index_store, case)
    _all_bitwise(case, got, run_spec(qsa.qsa_index_store, case, reference=False))
    perm = torch.randperm(case.inputs["seq_ids"].numel(), generator=torch.Generator().manual_seed(7))
    for name in ("seq_ids", "positions", "k_index"):
        case.inputs[name] = case.inputs[name][perm].contiguous()
    again = run_variant(triton_index.qsa_index_store, case)
    for name in case.outputs:
        _raw_equal(again[name], got[name])


# ---------------------------------------------------------------- qsa_index_scores


def test_index_scores_guard_by_hand():
    """16 index heads of dim 16; row at t = 70 has blocks 0, 1 complete (2 = 70 // 32 partial).
    qI of head h is e_0 * (h - 7) (so dots with kbar = 2 e_0 are 2 (h - 7)), wI = 0.5: the heads
    h > 7 contribute 0.5 * 2 (h - 7), summed over h = 8..15: 36; block 1's key 3 e_0 gives 54."""
    heads, dim = 16, 16
    q = torch.zeros(1, heads, dim)
    q[0, :, 0] = torch.arange(heads) - 7.0
    w = torch.full((1, heads), 0.5)
    keys = torch.full((4, dim), float("nan"))
    keys[2] = 0.0
    keys[2, 0] = 2.0
    keys[0] = 0.0
    keys[0, 0] = 3.0
    table = torch.tensor([[2, 0, 1, 3]], dtype=torch.int32)
    out = torch.full((1, 4), float("nan"))
    triton_index.index_scores(q.to(BF), w.to(BF), torch.zeros(1, dtype=torch.int32),
                              torch.tensor([70], dtype=torch.int32), table, keys.to(BF), out)
    assert out[0, :2].tolist() == [36.0, 54.0]
    assert out[0, 2:].tolist() == [float("-inf")] * 2


@st.composite
def _score_axes(draw):
    axes = _layouts(draw, 64)
    axes.update(plane_dtype="bfloat16", act_dtype="bfloat16", index_heads=16, index_dim=128)
    return axes


@pytest.mark.premerge
@SETTINGS
@given(axes=_score_axes(), seed=st.integers(0, 2 ** 31 - 1))
def test_index_scores_property(axes, seed):
    """Each score within the band derivation's per-score bound 2 * 2^-24 * C (C = sum_h |wI_h| sum_i
    |qI_hi kbar_i|, the magnitude the fp32 additions work at), the cells' band (16 ulp / 3 eps RMS)
    where the table is large enough for its RMS statistics (>= 64 scores; a one-score table can be a
    cancellation C / |s| ~ 500 that no RMS band in eps of |s| describes), -inf exactly where the spec
    has it, and each row a function of its own (seq, t): permuting the rows permutes the scores."""
    case = index_scores_case(axes, torch.Generator().manual_seed(seed), "cpu")
    got = run_variant(triton_index.qsa_index_scores, case)["scores"]
    ref = run_spec(qsa.qsa_index_scores, case, reference=True)["scores"]
    assert torch.equal(torch.isinf(got), torch.isinf(ref)) and not bool(torch.isnan(got).any())
    i = case.inputs
    live = torch.isfinite(ref)
    pages = i["block_table"][i["seq_ids"].long()].long().clamp(min=0)               # [N, W]
    kbar = i["block_keys"].double().abs()[pages]                                     # [N, W, dim]
    mag = torch.einsum("nhd,nwd->nhw", i["q_index"].double().abs(), kbar)
    C = (i["w_index"].double().abs()[:, :, None] * mag).sum(1)                       # [N, W]
    err = (got.double() - ref).abs()
    assert bool((err[live] <= 2 * 2.0 ** -24 * C[live]).all()), float((err / C)[live].max())
    if int(live.sum()) >= 64:
        v = tolerance("scores", got, ref, 16, 3, allow_matching_inf=True)
        assert v.passed, v.problems
    perm = torch.randperm(got.shape[0], generator=torch.Generator().manual_seed(11))
    for name in ("q_index", "w_index", "seq_ids", "positions"):
        case.inputs[name] = case.inputs[name][perm].contiguous()
    again = run_variant(triton_index.qsa_index_scores, case)["scores"]
    assert torch.equal(again, got[perm])
