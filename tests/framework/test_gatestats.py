"""The gates' statistics against brute-force enumeration: the exact sign test's p-value, its
conditional and unconditional false-fail rates, the power against the named regression, and the
family-wise split; every closed form here is compared with counting outcomes one by one."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
from scipy.stats import binom

from certify.gating import stats as st

LEVELS = [0.05, 0.0125, 0.05 / 22, 0.05 / 14, 0.2]


def _pattern_tail(m: int, worse: int) -> Fraction:
    """P(B >= worse) by counting the 2^m equally likely directions of m changed samples."""
    hits = sum(1 for signs in itertools.product((0, 1), repeat=m) if sum(signs) >= worse)
    return Fraction(hits, 2 ** m)


@pytest.mark.parametrize("m", range(0, 13))
def test_p_value_is_the_tail_of_every_direction_pattern(m):
    for worse in range(m + 1):
        expected = 1.0 if worse == 0 else float(_pattern_tail(m, worse))
        assert st.sign_p_value(worse, m - worse) == pytest.approx(expected, rel=1e-12, abs=0)


@pytest.mark.parametrize("level", LEVELS)
def test_conditional_size_counts_the_failing_patterns(level):
    for m in range(0, 13):
        verdict = {w: st.fails(w, m - w, level) for w in range(m + 1)}
        failing = [signs for signs in itertools.product((0, 1), repeat=m) if verdict[sum(signs)]]
        assert st.conditional_size(m, level) == pytest.approx(len(failing) / 2 ** m, abs=1e-15)
        k = st.critical_worse(m, level)
        # the failing patterns are exactly those with at least k* samples worse
        assert {sum(s) for s in failing} == (set() if k is None else set(range(k, m + 1)))
        assert st.conditional_size(m, level) <= level


def _null_rejection(n: int, h: float, level: float) -> float:
    """P(fail) over all 4^n per-sample outcomes (ref, now) of an exchangeable null: each sample is
    (right, right) w.p. (1 - 2h) / 2, (wrong, wrong) likewise, and right-to-wrong or wrong-to-right
    w.p. h each. Counted outcome by outcome from the decision rule."""
    probs = {(1, 1): (1 - 2 * h) / 2, (0, 0): (1 - 2 * h) / 2, (1, 0): h, (0, 1): h}
    total, verdicts = 0.0, {}
    for outcome in itertools.product(probs, repeat=n):
        p = 1.0
        for o in outcome:
            p *= probs[o]
        ref, now = [float(a) for a, _ in outcome], [float(b) for _, b in outcome]
        counts = st.sign_counts(ref, now)
        if counts not in verdicts:
            verdicts[counts] = st.fails(*counts, level)
        if verdicts[counts]:
            total += p
    return total


@pytest.mark.parametrize("n", [1, 4, 7])
@pytest.mark.parametrize("h", [0.05, 0.25, 0.5])
@pytest.mark.parametrize("level", [0.05, 0.2])
def test_false_fail_rate_bounds_every_enumerated_null(n, h, level):
    """By enumeration: the rejection probability is the closed form sum_m P(M = m) P(fail | m) with
    M ~ Binomial(n, 2h), never above the stated false-fail rate, which is never above the level;
    at h = 1/2 (every sample changes) it is the conditional size at m = n."""
    brute = _null_rejection(n, h, level)
    closed = sum(binom.pmf(m, n, 2 * h) * st.conditional_size(m, level) for m in range(n + 1))
    assert brute == pytest.approx(closed, abs=1e-12)
    assert brute <= st.false_fail_rate(n, level) + 1e-15 <= level + 1e-15
    if h == 0.5:
        assert brute == pytest.approx(st.conditional_size(n, level), abs=1e-12)


def _brute_conditional_size(m: int, level: float) -> float:
    verdict = {w: st.fails(w, m - w, level) for w in range(m + 1)}
    failing = sum(1 for signs in itertools.product((0, 1), repeat=m) if verdict[sum(signs)])
    return failing / 2 ** m


@pytest.mark.parametrize("level", LEVELS)
def test_false_fail_rate_is_the_largest_conditional_size(level):
    brute = [_brute_conditional_size(m, level) for m in range(13)]
    for n in range(0, 13):
        assert st.false_fail_rate(n, level) == pytest.approx(max(brute[:n + 1]), abs=1e-15)
    for n in (16, 20, 32, 40, 64):
        assert st.false_fail_rate(n, level) == max(st.conditional_size(m, level)
                                                   for m in range(n + 1)) <= level


def test_a_reproduced_reference_has_no_changed_sample_and_passes():
    scores = [1.0, 0.0, 1.0, 1.0]
    assert st.sign_counts(scores, scores) == (0, 0)
    assert st.sign_p_value(0, 0) == 1.0 and not st.fails(0, 0, 0.5)
    # improvements alone never fail
    assert not st.fails(0, 10, 0.2)


@pytest.mark.parametrize("level", LEVELS)
def test_fewest_caught_is_the_smallest_all_worse_count_that_fails(level):
    k = st.fewest_caught(level)
    assert 0.5 ** k <= level < 0.5 ** (k - 1)
    assert st.fails(k, 0, level) and not st.fails(k - 1, 0, level)


@pytest.mark.parametrize("level", [0.05, 0.0125, 0.05 / 22])
@pytest.mark.parametrize("n_right, q", [(6, 0.25), (10, 0.5), (12, 0.25), (12, 0.75)])
def test_power_against_the_named_regression_by_enumeration(level, n_right, q):
    """Every subset of the n_right reference-right samples that flips, with its probability, and the
    decision rule on (flipped, 0): the same number as the closed form."""
    brute = 0.0
    for flips in itertools.product((0, 1), repeat=n_right):
        k = sum(flips)
        if st.fails(k, 0, level):
            brute += q ** k * (1 - q) ** (n_right - k)
    assert st.power(n_right, level, q) == pytest.approx(brute, abs=1e-12)


def test_power_grows_with_samples_and_flip_probability():
    level = 0.0125
    assert st.power(20, level) < st.power(32, level) < st.power(64, level)
    assert st.power(32, level, 0.1) < st.power(32, level, 0.25) < st.power(32, level, 0.5)
    assert st.power(st.fewest_caught(level) - 1, level, 0.9) == 0.0    # too few samples to catch


def test_paired_differences_count_the_variants_loss_against_the_reference_delta():
    ref_variant, ref_other = [1, 1, 0, 1, 0], [1, 1, 1, 1, 0]
    variant, other = [1, 0, 0, 0, 1], [1, 1, 1, 0, 1]
    before = st.differences(ref_variant, ref_other)     # 0, 0, -1, 0, 0
    after = st.differences(variant, other)              # 0, -1, -1, 0, 0
    assert st.sign_counts(before, after) == (1, 0)
    # a change both configurations share (sample 3, sample 4) is neither worse nor better
    assert st.paired_delta(variant, other) == pytest.approx(-40.0)
    with pytest.raises(ValueError):
        st.differences([1, 0], [1])


def test_bonferroni_split_and_tier_rate():
    assert st.check_level(4) == pytest.approx(0.0125)
    sizes = [st.false_fail_rate(n, st.check_level(4)) for n in (32, 32, 20, 32)]
    assert st.tier_false_fail_rate(sizes) == pytest.approx(sum(sizes)) and sum(sizes) <= 0.05
    with pytest.raises(ValueError):
        st.check_level(0)


def test_acceptance_floor_is_ratio_of_reference_never_below_one():
    assert st.acceptance_floor(3.6) == pytest.approx(3.42)
    assert st.acceptance_floor(1.02) == 1.0
    with pytest.raises(ValueError):
        st.acceptance_floor(2.0, 1.5)
