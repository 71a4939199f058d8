"""The gates' reports: ``<reports>/gates/<gate>.json`` (one gate's latest result, with every run's
per-sample scores) and ``summary.md`` (every tier's family-wise false-fail rate, every gate, every
check with its false-fail rate and power), and re-rendering the reports from their stored scores
under the current statistics (``render``) without running the engine.

A report records the statistics version it was judged under; one written before reports kept their
per-sample scores cannot be re-judged, and its rows say so and which statistics judged them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from certify.gating import stats as st
from certify.gating.judge import CheckResult, Family, tier_families, tier_rate
from certify.gating.run import GateResult, RunRecord, rejudge
from certify.gating.files import ReferenceStore
from certify.gating.schema import GateFile
from certify.files.atomic import atomic_write_text
from certify.catalog.schema import TIERS

STATISTICS_NAMES = {
    1: "v1: normal approximation, no per-sample scores kept (re-run to judge under v2)",
    2: f"v2: {st.STATISTICS}",
}


def _fields(cls, data: Mapping[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in names}


def result_from_json(data: Mapping[str, Any]) -> GateResult:
    """A written report back as a ``GateResult`` (fields a version lacks take their defaults; a
    report without a ``statistics`` key was judged under version 1)."""
    out = GateResult(**_fields(GateResult, {**data, "checks": [], "runs": []}))
    out.checks = [CheckResult(**_fields(CheckResult, c)) for c in data.get("checks", [])]
    out.runs = [RunRecord(**_fields(RunRecord, r)) for r in data.get("runs", [])]
    out.statistics = int(data.get("statistics", 1))
    return out


def load_report(path: Path) -> tuple[GateResult, dict[str, Any]]:
    """(the result, the raw mapping: a version-1 check's threshold lives only there)."""
    data = json.loads(Path(path).read_text())
    return result_from_json(data), data


def write_report(result: GateResult, reports_dir: Path,
                 gates: Mapping[str, GateFile] | None = None) -> Path:
    """``<reports>/gates/<gate>.json``: the whole result; then the summary over every gate's latest
    report (``gates``: every gate file, whose tiers' family-wise rates the summary states)."""
    reports_dir.mkdir(parents=True, exist_ok=True)
    path = reports_dir / f"{result.gate}.json"
    atomic_write_text(path, json.dumps(asdict(result), indent=1, sort_keys=True) + "\n")
    write_summary(reports_dir, gates)
    return path


def render(reports_dir: Path, gates: Mapping[str, GateFile], store: ReferenceStore,
           families: Mapping[str, Family] | None = None) -> tuple[list[str], list[str]]:
    """Re-judge every report of ``reports_dir`` whose gate file exists from its stored per-sample
    scores (run.rejudge) and rewrite it and the summary. Returns (re-rendered gates, why each
    other report was left as it is)."""
    families = tier_families(gates.values()) if families is None else families
    done, left = [], []
    for path in sorted(reports_dir.glob("*.json")):
        result, _ = load_report(path)
        gate = gates.get(result.gate)
        if gate is None:
            left.append(f"{result.gate}: no gate file")
            continue
        if result.status == "skipped":
            left.append(f"{result.gate}: skipped when it ran ({result.reason})")
            continue
        try:
            new = rejudge(result, gate, store, families.get(gate.tier))
        except ValueError as e:
            left.append(str(e))
            continue
        atomic_write_text(path, json.dumps(asdict(new), indent=1, sort_keys=True) + "\n")
        done.append(result.gate)
    write_summary(reports_dir, gates)
    return done, left


# ------------------------------------------------------------------------------ summary


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _platform(p: Mapping[str, Any]) -> str:
    if not p:
        return "not recorded"
    settings = ", ".join(f"{k}={v}" for k, v in sorted((p.get("settings") or {}).items())
                         if v is not None and k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"))
    cpu = f" on {p['cpu']}" if p.get("cpu") else ""
    threads = p.get("threads")
    return (f"{p.get('cpu_capability')}{cpu}, {threads} thread{'' if threads == 1 else 's'}, "
            f"torch {p.get('torch')}"
            + (f" ({settings})" if settings else ""))


def _verdict(c: CheckResult, raw: Mapping[str, Any], version: int) -> str:
    if c.kind == "acceptance_length":
        return "-" if c.threshold is None else f"floor {c.threshold:.3f} (deterministic)"
    if version < 2:
        thr = raw.get("threshold")
        return "-" if thr is None else f"v1 threshold {thr:.2f}"
    if c.p_value is None:
        return f"level {c.level:.4g}" if c.level is not None else "-"
    return f"p {c.p_value:.4g} {'<=' if c.status == 'failed' else '>'} {c.level:.4g}"


def _measured(c: CheckResult) -> tuple[str, str]:
    fmt = ".3f" if c.kind == "acceptance_length" else "+.2f" if c.kind == "paired_delta" else ".2f"
    return _f(c.measured, fmt), _f(c.reference, fmt)


def _check_row(r: GateResult, c: CheckResult, raw: Mapping[str, Any]) -> str:
    measured, reference = _measured(c)
    changed = "-" if c.worse is None else f"{c.worse} / {c.better} of {c.samples}"
    stat = c.kind in st.STATISTICAL_KINDS and r.statistics >= 2
    rate = _f(c.false_fail_rate, ".4f") if stat else \
        ("none (floor)" if c.kind == "acceptance_length" else "not stated (v1)")
    caught = _f(c.caught_flips, "d") if stat else "-"
    power = _f(c.power, ".3f") if stat else "-"
    return (f"| `{r.gate}` | {c.kind} {c.task} | {c.status} | {measured} | {reference} | {changed} "
            f"| {_verdict(c, raw, r.statistics)} | {rate} | {caught} | {power} |")


def _tier_rows(results: list[GateResult], gates: Mapping[str, GateFile] | None) -> list[str]:
    rows = []
    if gates:
        for tier, fam in sorted(tier_families(gates.values()).items(),
                                key=lambda kv: TIERS.index(kv[0])):
            rate = tier_rate(gates.values(), fam)
            rows.append(f"| {tier} | {fam.alpha:g} | {fam.checks} | {fam.level:.4g} | {rate:.4f} "
                        "| the gate files |")
        return rows
    for tier in TIERS:
        checks = [c for r in results if r.tier == tier and r.statistics >= 2 for c in r.checks
                  if c.kind in st.STATISTICAL_KINDS and c.false_fail_rate is not None]
        if not checks:
            continue
        rate = st.tier_false_fail_rate([c.false_fail_rate for c in checks])
        rows.append(f"| {tier} | {st.FAMILY_ALPHA:g} | {len(checks)} | {checks[0].level:.4g} | "
                    f"{rate:.4f} | the reports' checks |")
    return rows


_HOW = f"""\
How the checks are judged (statistics v{st.STATISTICS_VERSION}, `certify/gating/stats.py`): each
statistical check pairs this run's per-sample scores with its reference's (accuracy: the scores
themselves; paired_delta: the per-sample difference variant - comparison, against the references'
difference) and counts the samples that got worse and better; under "no regression" (this run and
the reference are two exchangeable runs of the same engine) a changed sample got worse with
probability 1/2, so the exact one-sided sign test (McNemar for 0/1 scores) fails a check when
P(Binomial(worse + better, 1/2) >= worse) <= its level. The level is the check's equal Bonferroni
share of its tier's family-wise rate ({st.FAMILY_ALPHA:g}); a tier's family is every statistical
check of the gate files that declare that `tier:`, whichever test list `certify lists` puts their
items in. The **false-fail rate** is the check's
exact size at that level and n (max over m <= n changed samples of P(fail | m)); the tier's
family-wise rate is the sum of its checks' sizes. **catches** is the fewest reference-right samples
turned wrong, nothing else changed, that always fail the check; **power** is P(fail) when each
reference-right sample (paired: each sample the reference's variant got right) turns wrong
independently with probability {st.REGRESSION_FLIP:g}. A deterministic engine that reproduces its
reference exactly has no changed sample and passes (p = 1): the correct verdict, nothing changed.
acceptance_length is a deterministic floor ({st.ACCEPTANCE_RATIO:g} of the reference's, never
below 1.0) with no statistical error rate, outside every family.
"""

_V1 = f"""\
A row judged under statistics v1 shows that verdict as it was given: a two-sample normal
approximation per check (threshold = reference + Phi^-1(0.05) sqrt(2 sigma^2 / n)), whose nominal 0.05
is up to 0.10-0.12 at n = 32-64 under its own Bernoulli model, with no family-wise control; its
report kept no per-sample scores, so only re-running the gate judges it under v{st.STATISTICS_VERSION}.
"""

_REPEAT = """\
Repeatability: every gate's engine runs with one intra-op thread whatever `--jobs` is
(`certify/gating/run.py`, GATE_THREADS): torch's CPU kernels may split work by thread count and round
differently, so a pinned count makes a re-run on one machine and software bitwise the same run. What
a run's numbers still depend on is its platform (column below): torch's version, the CPU, and the
capability torch dispatched to (ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA cap it); a different
platform can turn a greedy token, and with it a sample or an acceptance length. **bitwise** says
whether the run gave every reference's numbers back exactly (no sample changed, every acceptance
length equal); where it did not, the exact tests judge the changed samples as they are.
"""


def write_summary(reports_dir: Path, gates: Mapping[str, GateFile] | None = None) -> Path:
    loaded = [load_report(p) for p in sorted(reports_dir.glob("*.json"))]
    results = [r for r, _ in loaded]
    order = sorted(loaded, key=lambda rd: (TIERS.index(rd[0].tier) if rd[0].tier in TIERS else 9,
                                           rd[0].gate))
    gate_rows, check_rows = [], []
    for r, raw in order:
        cost = f"{r.seconds:.1f} s on {r.arch}" if r.status != "skipped" else "-"
        stats = STATISTICS_NAMES.get(r.statistics, f"v{r.statistics}") + \
            (f"; re-rendered {r.rendered} from the stored scores" if r.rendered else "")
        bitwise = {True: "yes", False: "no", None: "-"}[r.bitwise]
        gate_rows.append(f"| `{r.gate}` | {r.tier} | {r.status} | {cost} | {r.date} | {bitwise} | "
                         f"{stats} | "
                         f"{_platform(r.platform) if r.status != 'skipped' else r.reason} |")
        for c, rc in zip(r.checks, raw.get("checks", [])):
            check_rows.append(_check_row(r, c, rc))
    tiers = _tier_rows(results, gates)
    out = reports_dir / "summary.md"
    atomic_write_text(
        out, "# Gates: latest results\n\nWritten by `certify gates run` from `reports/gates/<gate>.json`; "
        "`certify gates render` re-judges the stored per-sample scores under the current statistics "
        "without running the engine.\n\n" + _HOW + "\n"
        + (_V1 + "\n" if any(r.statistics < 2 for r in results) else "") + _REPEAT + "\n## Tiers\n\n"
        "| tier | family-wise alpha | statistical checks | level per check | family-wise false-fail "
        "rate (sum of exact sizes) | counted from |\n|---|---|---|---|---|---|\n"
        + "\n".join(tiers) + "\n\n## Gates\n\n"
        "| gate | tier | status | cost | date | bitwise | statistics | platform |\n"
        "|---|---|---|---|---|---|---|---|\n"
        + "\n".join(gate_rows) + "\n\n## Checks\n\n"
        "| gate | check | status | measured | reference | worse / better | verdict | false-fail rate "
        f"| catches | power (flip {st.REGRESSION_FLIP:g}) |\n|---|---|---|---|---|---|---|---|---|---|\n"
        + "\n".join(check_rows) + "\n")
    return out


__all__ = ["STATISTICS_NAMES", "result_from_json", "load_report", "write_report", "render",
           "write_summary"]
