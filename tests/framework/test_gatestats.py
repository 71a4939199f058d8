"""The gates' threshold maths against TensorRT-LLM's published numbers, and the sigma rules."""

import math
from statistics import NormalDist

import pytest

from certify import gatestats as st


def test_threshold_matches_tensorrt_llm_gsm8k_and_mmlu():
    # accuracy suite README: sigma 50, alpha 0.05 -> n = 1319: ref - 3.20; n = 4096: ref - 1.82
    assert st.threshold(96.36, 50, 1319) - 96.36 == pytest.approx(-3.20, abs=0.005)
    assert st.threshold(68.17, 50, 4096) - 68.17 == pytest.approx(-1.82, abs=0.005)


@pytest.mark.parametrize("n, theta, gap", [(32, 31.080936, -20.560670), (1024, 5.494385, -3.634647),
                                           (4096, 2.747193, -1.817324), (14042, 1.483729, -0.981517)])
def test_theta_and_threshold_table_of_tensorrt_llm(n, theta, gap):
    """The README's compute_theta_and_thresholds table (sigma 50, alpha 0.05, beta 0.2)."""
    assert st.minimum_detectable_effect(50, n) == pytest.approx(theta, abs=1e-5)
    assert st.threshold(0.0, 50, n) == pytest.approx(gap, abs=1e-5)


def test_quantile_agrees_with_the_standard_library():
    for p in (0.01, 0.05, 0.2, 0.5, 0.8, 0.95):
        assert st.z(p) == pytest.approx(NormalDist().inv_cdf(p), abs=1e-12)
    with pytest.raises(ValueError):
        st.z(0.0)


def test_bernoulli_sigma_keeps_slack_for_a_perfect_reference():
    sigma = st.bernoulli_sigma(40, 40)
    assert sigma > 0
    thr = st.threshold(100.0, sigma, 40)
    assert 95.0 < thr < 97.5          # one miss in 40 passes, two fail
    assert st.bernoulli_sigma(20, 40) == pytest.approx(100 * math.sqrt(20.5 / 41 * 20.5 / 41))


def test_paired_sigma_counts_disagreeing_pairs():
    same = [1, 0, 1, 1]
    assert st.paired_delta(same, same) == 0
    assert st.paired_sigma(same, same) == pytest.approx(100 * math.sqrt(0.5 / 5))
    assert st.paired_sigma([1, 1, 1, 1], [0, 1, 1, 0]) == pytest.approx(100 * math.sqrt(2.5 / 5))
    assert st.paired_delta([1, 1, 1, 1], [0, 1, 1, 0]) == pytest.approx(50.0)


def test_acceptance_floor_is_ratio_of_reference_never_below_one():
    assert st.acceptance_floor(3.6) == pytest.approx(3.42)
    assert st.acceptance_floor(1.02) == 1.0
    with pytest.raises(ValueError):
        st.acceptance_floor(2.0, 1.5)


def test_score_sigma_of_fractional_scores_has_a_floor():
    assert st.score_sigma([0.5] * 10) == pytest.approx(st.bernoulli_sigma(0, 10))
    assert not st.is_binary([0.5, 1.0])
