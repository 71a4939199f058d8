"""The statistics of a gate's checks: one-sided thresholds with their minimum detectable effects.

A check compares a statistic measured now (a task's accuracy, or a variant's paired accuracy delta
against the identity configuration) with the same statistic measured when its reference was recorded.
Both are means of n per-sample scores with standard deviation sigma, so under "no regression" their
difference is approximately N(0, 2 sigma^2 / n) (a two-sample test, as TensorRT-LLM's accuracy suite
does it), and the one-sided threshold at false-alarm rate alpha is

    threshold = ref + Phi^-1(alpha) * sqrt(2 sigma^2 / n)

The minimum detectable effect (the regression caught with probability 1 - beta) is

    mde = (Phi^-1(1 - beta) - Phi^-1(alpha)) * sqrt(2 sigma^2 / n)

With TensorRT-LLM's sigma = 50 (points of 100, a Bernoulli score at p = 0.5): n = 1319 gives
ref - 3.20, n = 4096 gives ref - 1.82 (mde 2.75 at beta 0.2); tests/framework/test_gatestats.py pins
them.

sigma comes from the reference's own measurement. For scores of 0 or 1, sigma = 100 sqrt(p (1 - p))
with p estimated as (correct + 1/2) / (n + 1): a reference that got every sample right (or wrong) would
otherwise have sigma 0 and a threshold with no slack at all, where a single lost sample is no evidence
of a regression (with n = 40 and 40 right, the threshold is 95.97: one miss passes, two fail).
For a paired delta d_i = variant_i - identity_i (each -100, 0 or 100), sigma^2 <= E[d^2] = 100^2 m / n
with m the pairs that disagree; the same half-count keeps it above 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from scipy.special import ndtri

ALPHA = 0.05
BETA = 0.2
ACCEPTANCE_RATIO = 0.95


def z(p: float) -> float:
    """Phi^-1(p), the standard normal quantile."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"a probability strictly between 0 and 1 is needed, got {p}")
    return float(ndtri(p))


def standard_error(sigma: float, n: int) -> float:
    """sqrt(2 sigma^2 / n): the spread of the difference of two n-sample means."""
    if n < 1:
        raise ValueError("n must be >= 1")
    if sigma < 0:
        raise ValueError("sigma must be >= 0")
    return math.sqrt(2.0 * sigma * sigma / n)


def threshold(ref: float, sigma: float, n: int, alpha: float = ALPHA) -> float:
    """The lowest value that still passes: ref + Phi^-1(alpha) sqrt(2 sigma^2 / n)."""
    return ref + z(alpha) * standard_error(sigma, n)


def minimum_detectable_effect(sigma: float, n: int, alpha: float = ALPHA, beta: float = BETA) -> float:
    """(Phi^-1(1 - beta) - Phi^-1(alpha)) sqrt(2 sigma^2 / n): the drop caught with power 1 - beta."""
    return (z(1.0 - beta) - z(alpha)) * standard_error(sigma, n)


def is_binary(scores: Sequence[float]) -> bool:
    return all(s in (0.0, 1.0) for s in scores)


def mean_points(scores: Sequence[float]) -> float:
    """The mean score in points (0..100)."""
    if not scores:
        raise ValueError("no scores")
    return 100.0 * sum(scores) / len(scores)


def bernoulli_sigma(correct: float, n: int) -> float:
    """100 sqrt(p (1 - p)) at p = (correct + 1/2) / (n + 1) (see the module docstring)."""
    if n < 1 or not 0 <= correct <= n:
        raise ValueError(f"need 0 <= correct <= n and n >= 1, got {correct} of {n}")
    p = (correct + 0.5) / (n + 1)
    return 100.0 * math.sqrt(p * (1.0 - p))


def score_sigma(scores: Sequence[float]) -> float:
    """sigma of per-sample scores in points: Bernoulli with the half count for 0/1 scores, else the
    sample standard deviation, never below the Bernoulli sigma of one half-count in n (a constant
    score would otherwise leave no slack)."""
    n = len(scores)
    if is_binary(scores):
        return bernoulli_sigma(sum(scores), n)
    m = sum(scores) / n
    sd = math.sqrt(sum((s - m) ** 2 for s in scores) / max(n - 1, 1))
    return max(100.0 * sd, bernoulli_sigma(0, n))


def paired_sigma(variant: Sequence[float], identity: Sequence[float]) -> float:
    """sigma of the paired differences d_i = variant_i - identity_i, in points (module docstring)."""
    if len(variant) != len(identity) or not variant:
        raise ValueError("paired scores need the same, non-zero number of samples")
    n = len(variant)
    second_moment = sum((a - b) ** 2 for a, b in zip(variant, identity))
    return 100.0 * math.sqrt((second_moment + 0.5) / (n + 1))


def paired_delta(variant: Sequence[float], identity: Sequence[float]) -> float:
    """mean(variant_i - identity_i) in points."""
    return mean_points(variant) - mean_points(identity)


def acceptance_floor(ref: float, ratio: float = ACCEPTANCE_RATIO) -> float:
    """``ratio`` of the reference's acceptance length, never below 1.0 (every verify step emits one
    token, so an acceptance length below 1 is impossible and a floor below it checks nothing)."""
    if not 0.0 < ratio <= 1.0:
        raise ValueError("the acceptance ratio must lie in (0, 1]")
    return max(1.0, ratio * ref)


__all__ = ["ALPHA", "BETA", "ACCEPTANCE_RATIO", "z", "standard_error", "threshold",
           "minimum_detectable_effect", "is_binary", "mean_points", "bernoulli_sigma",
           "score_sigma", "paired_sigma", "paired_delta", "acceptance_floor"]
