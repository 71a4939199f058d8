"""The oracles' edge cases: NaN, inf, unwritten outputs, ulp maths, subnormals, signed zeros."""

import math

import pytest
import torch

from certify.harness import oracles


def test_ulp_of_normal_values_is_the_dtype_spacing():
    # bf16 has 8 significant bits: the spacing at 1.0 is 2^-7 and at 3.0 (binade [2, 4)) it is 2^-6.
    got = oracles.ulp_of(torch.tensor([1.0, 3.0, 0.75], dtype=torch.float64), torch.bfloat16)
    assert got.tolist() == [2 ** -7, 2 ** -6, 2 ** -8]
    assert oracles.ulp_of(torch.tensor([1.0], dtype=torch.float64), torch.float32).item() == 2 ** -23


def test_ulp_of_subnormals_and_zero_is_the_subnormal_step():
    fi = torch.finfo(torch.float32)
    step = fi.tiny * fi.eps  # 2^-149, the float32 subnormal spacing
    mags = torch.tensor([0.0, fi.tiny / 8, fi.tiny / 2], dtype=torch.float64)
    assert oracles.ulp_of(mags, torch.float32).tolist() == [step, step, step]
    # A one-step difference between two fp32 subnormals is exactly one ulp.
    a = torch.tensor([[3 * step]], dtype=torch.float32)
    ref = torch.tensor([[2 * step]], dtype=torch.float64)
    v = oracles.tolerance("x", a, ref, max_ulp=1.0, max_rel_rms=1e9)
    assert v.metrics["x.ulp"] == pytest.approx(1.0) and v.passed


def test_tolerance_measures_against_the_row_maximum():
    ref = torch.tensor([[4.0, 0.001]], dtype=torch.float64)
    out = torch.tensor([[4.0, 0.001 + 2 ** -6]], dtype=torch.bfloat16)  # small element off by 2^-6
    v = oracles.tolerance("x", out, ref, max_ulp=1.0, max_rel_rms=100)
    # ulp(4.0) in bf16 is 2^-5; the error is about 2^-6 -> about half an ulp of the row maximum.
    assert 0.4 < v.metrics["x.ulp"] < 0.6 and v.passed


def test_tolerance_fails_beyond_the_band_and_names_the_element():
    ref = torch.ones(2, 8, dtype=torch.float64)
    out = torch.ones(2, 8, dtype=torch.float32)
    out[1, 3] += 2 ** -20  # 8 fp32 ulp at 1.0
    v = oracles.tolerance("y", out, ref, max_ulp=4, max_rel_rms=100)
    assert not v.passed and "(1, 3)" in v.problems[0] and v.metrics["y.ulp"] == pytest.approx(8)


def test_relative_rms_is_in_units_of_eps():
    ref = torch.ones(1, 1000, dtype=torch.float64)
    out = (ref + 2 ** -23).float()  # every element one fp32 eps high
    v = oracles.tolerance("z", out, ref, max_ulp=10, max_rel_rms=0.5)
    assert v.metrics["z.rel_rms"] == pytest.approx(1.0) and not v.passed


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_inf_never_pass(bad):
    ref = torch.zeros(1, 4, dtype=torch.float64)
    out = torch.zeros(1, 4)
    out[0, 2] = bad
    assert not oracles.tolerance("o", out, ref, 1e9, 1e9).passed
    assert not oracles.bitwise("o", out, ref.float()).passed


def test_nan_fails_even_when_the_reference_is_nan():
    ref = torch.tensor([[float("nan")]], dtype=torch.float32)
    assert not oracles.bitwise("o", ref.clone(), ref).passed


def test_matching_inf_passes_only_where_allowed():
    ref = torch.tensor([[-math.inf, 1.0]], dtype=torch.float64)
    out = torch.tensor([[-math.inf, 1.0]])
    assert not oracles.tolerance("s", out, ref, 1, 1).passed
    assert oracles.tolerance("s", out, ref, 1, 1, allow_matching_inf=True).passed
    wrong_sign = torch.tensor([[math.inf, 1.0]])
    assert not oracles.tolerance("s", wrong_sign, ref, 1, 1, allow_matching_inf=True).passed


def test_an_unwritten_element_is_reported_as_such():
    out = oracles.poison(torch.empty(2, 3))
    out[0] = 1.0
    out[1, :2] = 1.0
    ref = torch.ones(2, 3, dtype=torch.float64)
    v = oracles.tolerance("o", out, ref, 1e9, 1e9)
    assert not v.passed and any("not written" in p and "(1, 2)" in p for p in v.problems)


def test_integer_outputs_are_poisoned_and_checked():
    out = oracles.poison(torch.empty(4, dtype=torch.int32))
    out[:3] = torch.tensor([0, 1, 2], dtype=torch.int32)
    v = oracles.bitwise("idx", out, torch.arange(4, dtype=torch.int32))
    assert not v.passed and any("not written" in p for p in v.problems)


def test_signed_zero_is_a_difference_unless_the_spec_says_otherwise():
    out = torch.tensor([-0.0, 1.0])
    ref = torch.tensor([0.0, 1.0])
    assert not oracles.bitwise("o", out, ref).passed
    assert oracles.bitwise("o", out, ref, signed_zero_equal=True).passed


def test_bitwise_needs_the_same_dtype():
    assert not oracles.bitwise("o", torch.ones(2), torch.ones(2, dtype=torch.float64)).passed


def test_closer_to_float64_picks_the_smaller_error():
    ref = torch.tensor([1 / 3], dtype=torch.float64)
    good = ref.float()
    bad = ref.to(torch.bfloat16)
    assert oracles.closer_to_float64(good, bad, ref)[0] == "a"
    assert oracles.closer_to_float64(bad, good, ref)[0] == "b"
    assert oracles.closer_to_float64(good, good.clone(), ref)[0] == "tie"


def test_round_once_avoids_the_double_rounding_of_torch_casts():
    # 1 + 2^-8 + 2^-24 is just above the bf16 tie 1 + 2^-8: the correct bf16 result is 1 + 2^-7.
    x = torch.tensor([1 + 2 ** -8 + 2 ** -24, -(1 + 2 ** -8 + 2 ** -24), 1 + 2 ** -8, 3.0],
                     dtype=torch.float64)
    got = oracles.round_once(x, torch.bfloat16)
    assert got.tolist() == [1 + 2 ** -7, -(1 + 2 ** -7), 1.0, 3.0]  # the exact tie goes to even
    assert x.to(torch.bfloat16)[0].item() == 1.0  # what the plain cast gives


def test_round_once_matches_exact_rounding_on_random_values():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(100_000, generator=gen, dtype=torch.float64) * 3
    got = oracles.round_once(x, torch.bfloat16).double()
    # the exact answer: the nearer of the two bf16 neighbours (ties are measure-zero here)
    lo = x.to(torch.float32).to(torch.bfloat16).double()
    ulp = oracles.ulp_of(lo, torch.bfloat16)
    cands = torch.stack([lo - ulp, lo, lo + ulp])
    best = cands.gather(0, (cands - x).abs().argmin(0, keepdim=True))[0]
    assert torch.equal(got, best)


def test_float8_outputs_are_checked_not_crashed():
    out = torch.tensor([1.0, 2.0], dtype=torch.float8_e4m3fn)
    assert oracles.bitwise("c", out, out.clone()).passed
    assert not oracles.bitwise("c", out, torch.tensor([1.0, 4.0], dtype=torch.float8_e4m3fn)).passed
