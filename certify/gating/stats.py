"""The statistics of a gate's checks: exact one-sided sign tests on per-sample paired scores, their
exact false-fail rates and their power, and each tier's family-wise false-fail rate.

The design they fit. A gate runs a deterministic engine on the same fixed samples its reference was
measured on, and a reference stores its per-sample scores. So the current run and the reference are
paired sample by sample, and the only question is whether the samples that changed changed for the
worse more often than chance allows.

- **accuracy**: per sample, the reference's score r_i and this run's s_i. ``worse`` (b) counts the
  samples with s_i < r_i (right in the reference, wrong now), ``better`` (c) those with s_i > r_i.
- **paired_delta**: per sample, the variant-minus-comparison difference measured now,
  d_i = v_i - a_i, and the same difference in the references, e_i = rv_i - ra_i. ``worse`` counts
  the samples with d_i < e_i (the variant lost ground against the configuration it is compared
  with), ``better`` those with d_i > e_i. A change both configurations share (drift of the
  comparison run itself) leaves d_i = e_i and counts as neither: that is what the paired check
  separates from the accuracy check.

Both are the one-sided sign test (for 0/1 scores the accuracy test is the exact McNemar test). The
null hypothesis "no regression" is that this run and the reference run are exchangeable: two
measurements of the same engine, differing at most by run-to-run noise, samples independent of one
another. Then, given the m = b + c samples that changed, each changed for the worse with probability
1/2, so b ~ Binomial(m, 1/2), whatever the per-sample accuracies and noise are. A check fails when

    P(B >= b | m) <= level            (the exact one-sided p-value; 1 when b = 0)

The test is exact (no normal approximation) and conditional, so it holds at any n, however small.
Its **false-fail rate** is the exact size: the largest probability, over every null distribution of
the discordant count m <= n, that it fails, which is max over m <= n of P(B >= k*(m) | m) with k*(m)
the smallest failing b. Being discrete, it attains at most ``level`` and usually less; that attained
value is what a check states. A deterministic engine that reproduces its reference exactly has no
changed samples (m = 0, p = 1) and passes: a correct verdict, not a gap, since nothing changed.

**Power** is stated against one named regression: every sample the reference got right (for a
paired check, every sample the reference's variant got right) turns wrong independently with
probability ``REGRESSION_FLIP`` and nothing else changes. Then c = 0, b ~ Binomial(n_right, flip), and
the check fails exactly when b >= k, the fewest flipped samples it catches (2^-k <= level), so
power = P(Binomial(n_right, flip) >= k), computed exactly with scipy.stats.binom. Each check also
states k itself: any regression that flips k reference-right samples and nothing else fails it.

**Family-wise rate per tier.** Every tier (premerge, postmerge, ondemand) holds its family-wise
false-fail rate at ``FAMILY_ALPHA`` by an equal Bonferroni split over all statistical checks of the
tier's gates: each check's level is FAMILY_ALPHA / (statistical checks in the tier). Bonferroni rather
than Holm because a gate is judged on its own (one pytest item, one worker process): Holm's step-down
needs every p-value of the tier before any verdict, Bonferroni's share is known from the gate files
alone, and it holds under any dependence between checks (checks of one gate share its engine runs,
gates share references). The tier's stated rate is the sum of its checks' exact sizes, the union
bound, which is at most FAMILY_ALPHA.

**acceptance_length** is not a statistical test: a deterministic floor (``ACCEPTANCE_RATIO`` of the
reference's acceptance length, never below 1.0) with no statistical error rate; it is not part of a
tier's family.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.stats import binom

STATISTICS = "exact sign test (McNemar), Bonferroni per tier"  # what a report's checks were judged by
STATISTICS_VERSION = 2     # 1 was the two-sample normal approximation; reports record the version
FAMILY_ALPHA = 0.05        # each tier's family-wise false-fail rate is at most this
REGRESSION_FLIP = 0.25     # the named regression: each reference-right sample turns wrong w.p. 0.25
ACCEPTANCE_RATIO = 0.95
STATISTICAL_KINDS = ("accuracy", "paired_delta")


def check_level(family_checks: int, family_alpha: float = FAMILY_ALPHA) -> float:
    """The level of one check: its equal Bonferroni share of the tier's family-wise rate."""
    if family_checks < 1:
        raise ValueError(f"a family needs at least one check, got {family_checks}")
    if not 0.0 < family_alpha < 1.0:
        raise ValueError(f"the family-wise rate must lie in (0, 1), got {family_alpha}")
    return family_alpha / family_checks


def sign_counts(before: Sequence[float], after: Sequence[float]) -> tuple[int, int]:
    """(worse, better): the samples with after_i < before_i and with after_i > before_i."""
    if len(before) != len(after):
        raise ValueError(f"paired scores need the same number of samples, got {len(before)} and "
                         f"{len(after)}")
    worse = sum(1 for x, y in zip(before, after) if y < x)
    better = sum(1 for x, y in zip(before, after) if y > x)
    return worse, better


def differences(variant: Sequence[float], other: Sequence[float]) -> list[float]:
    """Per sample, variant_i - other_i (a paired check's per-sample delta)."""
    if len(variant) != len(other) or not variant:
        raise ValueError("paired scores need the same, non-zero number of samples")
    return [a - b for a, b in zip(variant, other)]


def sign_p_value(worse: int, better: int) -> float:
    """P(B >= worse) for B ~ Binomial(worse + better, 1/2): the exact one-sided p-value (1 when
    nothing got worse, including when nothing changed)."""
    if worse < 0 or better < 0:
        raise ValueError("counts must be >= 0")
    if worse == 0:
        return 1.0
    return float(binom.sf(worse - 1, worse + better, 0.5))


def fails(worse: int, better: int, level: float) -> bool:
    """The verdict of the sign test at ``level``."""
    return sign_p_value(worse, better) <= level


def critical_worse(m: int, level: float) -> int | None:
    """k*(m): the fewest ``worse`` among m changed samples that fail at ``level`` (None: none do)."""
    if m < 0:
        raise ValueError("m must be >= 0")
    tails = binom.sf(np.arange(m + 1) - 1, m, 0.5)        # P(B >= k), k = 0..m
    failing = np.nonzero(tails[1:] <= level)[0]
    return int(failing[0]) + 1 if failing.size else None


def conditional_size(m: int, level: float) -> float:
    """P(fail | m changed samples) under the null: P(B >= k*(m)), 0 where no count fails."""
    k = critical_worse(m, level)
    return 0.0 if k is None else float(binom.sf(k - 1, m, 0.5))


def false_fail_rate(n: int, level: float) -> float:
    """The exact size of the check over n samples: max over m <= n of the conditional size (at most
    ``level``; the discreteness of the test makes it smaller)."""
    if n < 0:
        raise ValueError("n must be >= 0")
    return max(conditional_size(m, level) for m in range(n + 1))


def fewest_caught(level: float) -> int:
    """The fewest reference-right samples turned wrong (nothing else changed) that fail the check:
    the smallest k with 2^-k <= level."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"a level in (0, 1) is needed, got {level}")
    k = 1
    while sign_p_value(k, 0) > level:
        k += 1
    return k


def power(n_right: int, level: float, flip: float = REGRESSION_FLIP) -> float:
    """P(fail) under the named regression: each of the n_right reference-right samples turns wrong
    independently with probability ``flip``, nothing else changes (module docstring)."""
    if n_right < 0 or not 0.0 <= flip <= 1.0:
        raise ValueError(f"need n_right >= 0 and flip in [0, 1], got {n_right}, {flip}")
    return float(binom.sf(fewest_caught(level) - 1, n_right, flip))


def tier_false_fail_rate(sizes: Sequence[float]) -> float:
    """A tier's family-wise false-fail rate: at most the sum of its checks' exact sizes (the union
    bound, valid under any dependence between them)."""
    return min(1.0, float(sum(sizes)))


def is_binary(scores: Sequence[float]) -> bool:
    return all(s in (0.0, 1.0) for s in scores)


def mean_points(scores: Sequence[float]) -> float:
    """The mean score in points (0..100)."""
    if not scores:
        raise ValueError("no scores")
    return 100.0 * sum(scores) / len(scores)


def paired_delta(variant: Sequence[float], other: Sequence[float]) -> float:
    """mean(variant_i - other_i) in points."""
    return mean_points(variant) - mean_points(other)


def acceptance_floor(ref: float, ratio: float = ACCEPTANCE_RATIO) -> float:
    """``ratio`` of the reference's acceptance length, never below 1.0 (every verify step emits one
    token, so an acceptance length below 1 is impossible and a floor below it checks nothing)."""
    if not 0.0 < ratio <= 1.0:
        raise ValueError("the acceptance ratio must lie in (0, 1]")
    return max(1.0, ratio * ref)


__all__ = ["STATISTICS", "STATISTICS_VERSION", "FAMILY_ALPHA", "REGRESSION_FLIP", "ACCEPTANCE_RATIO",
           "STATISTICAL_KINDS", "check_level", "sign_counts", "differences", "sign_p_value", "fails",
           "critical_worse", "conditional_size", "false_fail_rate", "fewest_caught", "power",
           "tier_false_fail_rate", "is_binary", "mean_points", "paired_delta", "acceptance_floor"]
