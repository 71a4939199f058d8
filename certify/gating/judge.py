"""A gate's verdicts: every check of a gate judged from the per-sample scores of this run and of its
references, with the statistics of certify.gating.stats.

A statistical check (accuracy, paired_delta) runs at its tier's Bonferroni share of the family-wise
rate (``Family``): the tier's family is every statistical check of every gate file of that tier, so
the verdict of one gate is decided by its own run, at a level known from the gate files. Each such
check states what it can do whatever this run measured: its exact false-fail rate, the fewest
flipped samples it catches, and its power against the named regression (the stats docstring).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from certify.gating import stats as st
from certify.gating.files import TaskResult, config_key
from certify.gating.schema import AcceptanceCheck, AccuracyCheck, GateFile, PairedDeltaCheck, Reference

RefOf = Callable[[str, str], "Reference | None"]      # (run label, task) -> its reference


@dataclass
class CheckResult:
    kind: str
    task: str
    status: str                          # passed | failed | no reference | recorded
    measured: float | None = None        # points; a paired check: the delta; acceptance: tokens/step
    reference: float | None = None
    threshold: float | None = None       # acceptance_length: its floor (a deterministic check)
    samples: int | None = None
    worse: int | None = None             # statistical checks: samples changed for the worse ...
    better: int | None = None            # ... and for the better against the reference
    p_value: float | None = None         # exact one-sided sign-test p-value
    level: float | None = None           # fails when p_value <= level (the tier's Bonferroni share)
    false_fail_rate: float | None = None  # the exact size of the check at this level and n
    caught_flips: int | None = None      # flipping this many reference-right samples always fails
    power: float | None = None           # against stats.REGRESSION_FLIP (needs the reference)
    detail: str = ""


@dataclass(frozen=True)
class Family:
    """The statistical checks that share a tier's family-wise false-fail rate."""

    tier: str
    checks: int
    alpha: float = st.FAMILY_ALPHA

    @property
    def level(self) -> float:
        return st.check_level(self.checks, self.alpha)


def statistical_checks(gate: GateFile) -> int:
    return sum(1 for c in gate.checks if c.kind in st.STATISTICAL_KINDS)


def tier_families(gates: Iterable[GateFile], alpha: float = st.FAMILY_ALPHA) -> dict[str, Family]:
    """Per tier, the family of every statistical check of its gates."""
    counts: dict[str, int] = {}
    for g in gates:
        counts[g.tier] = counts.get(g.tier, 0) + statistical_checks(g)
    return {tier: Family(tier, n, alpha) for tier, n in counts.items() if n}


def own_family(gate: GateFile) -> Family:
    """A gate judged outside any set of gate files (a test's own gate): its checks alone."""
    return Family(gate.tier, max(1, statistical_checks(gate)))


def tier_rate(gates: Iterable[GateFile], family: Family) -> float:
    """The family-wise false-fail rate of ``family``'s tier over ``gates``: the sum of its checks'
    exact sizes at the family's level (each check's n is its task's sample count)."""
    sizes = [st.false_fail_rate(g.tasks[c.task].samples, family.level)
             for g in gates if g.tier == family.tier
             for c in g.checks if c.kind in st.STATISTICAL_KINDS]
    return st.tier_false_fail_rate(sizes)


def _design(n: int, level: float, n_right: int | None) -> dict:
    return dict(samples=n, level=level, false_fail_rate=st.false_fail_rate(n, level),
                caught_flips=st.fewest_caught(level),
                power=None if n_right is None else st.power(n_right, level))


def _design_text(c: CheckResult, right: str) -> str:
    power = "" if c.power is None else \
        f"; power {c.power:.3f} if each of {right} turns wrong w.p. {st.REGRESSION_FLIP:g}"
    return (f"false-fail rate {c.false_fail_rate:.4f} (exact, level {c.level:.4g}); catches "
            f"{c.caught_flips} flipped samples{power}")


def _verdict(c: CheckResult) -> CheckResult:
    c.p_value = st.sign_p_value(c.worse, c.better)
    c.status = "failed" if c.p_value <= c.level else "passed"
    return c


def _changes(c: CheckResult) -> str:
    if c.worse == c.better == 0:
        return f"no sample changed of {c.samples} (reproduces the reference: passes)"
    return (f"{c.worse} worse, {c.better} better of {c.samples}: p {c.p_value:.4g} "
            f"{'<=' if c.status == 'failed' else '>'} {c.level:.4g}")


def _right(scores: list[float]) -> int:
    """The samples that can get worse (a score above 0)."""
    return sum(1 for s in scores if s > 0)


def accuracy(check: AccuracyCheck, res: TaskResult, ref: Reference | None,
             family: Family) -> CheckResult:
    n = len(res.scores)
    measured = st.mean_points(res.scores)
    if ref is None:
        c = CheckResult("accuracy", check.task, "no reference", measured,
                        **_design(n, family.level, None))
        c.detail = (f"{measured:.2f} measured; no reference for this configuration; "
                    + _design_text(c, ""))
        return c
    rs = ref.score_list()
    worse, better = st.sign_counts(rs, res.scores)
    c = _verdict(CheckResult("accuracy", check.task, "", measured, ref.accuracy, worse=worse,
                             better=better, **_design(n, family.level, _right(rs))))
    c.detail = (f"{measured:.2f} vs ref {ref.accuracy:.2f}: {_changes(c)}; "
                + _design_text(c, f"the {_right(rs)} reference-right samples"))
    return c


def acceptance(check: AcceptanceCheck, res: TaskResult, ref: Reference | None) -> CheckResult:
    measured = res.acceptance_length
    if measured is None:
        return CheckResult("acceptance_length", check.task, "failed",
                           detail="no verify step ran: the configuration did not speculate")
    if ref is None or ref.acceptance_length is None:
        return CheckResult("acceptance_length", check.task, "no reference", measured,
                           detail=f"{measured:.3f} measured; no reference for this configuration")
    floor = st.acceptance_floor(ref.acceptance_length, check.ratio)
    ok = measured >= floor
    return CheckResult("acceptance_length", check.task, "passed" if ok else "failed", measured,
                       ref.acceptance_length, floor,
                       detail=f"{measured:.3f} vs floor {floor:.3f} ({check.ratio} of ref "
                              f"{ref.acceptance_length:.3f}, never below 1.0; {res.verify_steps} "
                              "verify steps; a deterministic floor, no statistical error rate)")


def paired(check: PairedDeltaCheck, res: TaskResult, other: TaskResult, ref: Reference | None,
           ref_other: Reference | None, family: Family) -> CheckResult:
    n = len(res.scores)
    now = st.differences(res.scores, other.scores)
    measured = st.paired_delta(res.scores, other.scores)
    if ref is None or ref_other is None:
        flips = sum(1 for d in now if d != 0)
        c = CheckResult("paired_delta", check.task, "no reference", measured,
                        **_design(n, family.level, None))
        c.detail = (f"{measured:+.2f} measured ({flips} of {n} samples differ); no reference pair "
                    "for these configurations; " + _design_text(c, ""))
        return c
    rv, ro = ref.score_list(), ref_other.score_list()
    worse, better = st.sign_counts(st.differences(rv, ro), now)
    c = _verdict(CheckResult("paired_delta", check.task, "", measured, st.paired_delta(rv, ro),
                             worse=worse, better=better,
                             **_design(n, family.level, _right(rv))))
    c.detail = (f"{measured:+.2f} vs ref {c.reference:+.2f} (per-sample variant - comparison "
                f"against the references'): {_changes(c)}; "
                + _design_text(c, f"the {_right(rv)} samples the reference's variant got right"))
    return c


def judge(gate: GateFile, results: Mapping[tuple[str, str], TaskResult], ref_of: RefOf,
          family: Family) -> list[CheckResult]:
    """Every check of ``gate``, in file order, from this run's results keyed (run label, task)."""
    out: list[CheckResult] = []
    for c in gate.checks:
        res = results[("gate", c.task)]
        if isinstance(c, AccuracyCheck):
            out.append(accuracy(c, res, ref_of("gate", c.task), family))
        elif isinstance(c, AcceptanceCheck):
            out.append(acceptance(c, res, ref_of("gate", c.task)))
        else:
            label = against_label(c)
            out.append(paired(c, res, results[(label, c.task)], ref_of("gate", c.task),
                              ref_of(label, c.task), family))
    return out


def reproduces(checks: Iterable[CheckResult]) -> bool | None:
    """Whether this run gave every reference's numbers back bitwise (no sample changed, every
    acceptance length equal); None when a check had no reference to compare with."""
    out = True
    for c in checks:
        if c.reference is None:
            return None
        if c.kind == "acceptance_length":
            out &= c.measured == c.reference
        else:
            out &= c.worse == 0 and c.better == 0
    return out


def against_label(check: PairedDeltaCheck) -> str:
    return "against:" + config_key(check.against)


__all__ = ["CheckResult", "Family", "statistical_checks", "tier_families", "own_family", "tier_rate",
           "accuracy", "acceptance", "paired", "judge", "reproduces", "against_label"]
