"""The mutants' report: one JSON file per op (``<reports>/mutants/<op>.json``) and a summary
(``<reports>/mutants/summary.md``), written atomically by ``certify mutants``, and the lines the op
notes and the coverage report show from them.

An op's score is the share of its counted plausible bugs (the cell file's mutants) that its tests
kill: a mutant declared equivalent is not counted, nor one that no test of this machine's archs
reads (a variant of a GPU arch on a CPU machine: ``not run``); a timeout counts as killed (the tests
caught a hang), and so does a worker killed by a signal inside the tests (a crash the suite shows);
a survivor, or an error (a worker that gave no result, a kill by a test that fails on the unmutated
code too), counts as not killed. The same per variant (a mutant counts for the variant it edits, or
for ``spec``). Operator mutations (``--generic``) are scored beside the cell file's, and per variant
both together (``by_variant_all``): a variant with a handful of written mutants gets its
score over the operator mutations of its code too.
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path

from certify.files.atomic import atomic_write_text, locked
from certify.files.utf8 import read_utf8
from certify.mutants.runner import (CAUGHT, CRASHED, EQUIVALENT, KILLED, NOT_RUN, SURVIVED, TIMEOUT,
                                    Result)

FORMAT = "mutants/1"
DIR = "mutants"


def _tally(results: list[dict]) -> dict:
    counted = [r for r in results if r["status"] not in (EQUIVALENT, NOT_RUN)]
    killed = sum(r["status"] in CAUGHT for r in counted)
    out = {s: sum(r["status"] == s for r in results)
           for s in (KILLED, SURVIVED, TIMEOUT, CRASHED, "error", EQUIVALENT, NOT_RUN)}
    out["counted"] = len(counted)
    out["score"] = round(100.0 * killed / len(counted), 1) if counted else None
    return out


def _record(r: Result) -> dict:
    j = r.job
    rec = {"id": j.id, "kind": j.kind, "variant": j.label, "module": j.module, "bug": j.bug,
           "status": r.status, "killed_by": r.killed_by, "seconds": round(r.seconds, 2),
           "tests_ran": r.ran, "tests": len(j.tests)}
    if r.by_hint:
        rec["by_hint"] = True   # killed by the test that killed it last time, run first
    if j.over_cap:
        rec["over_cap"] = j.over_cap
    if j.where:
        rec["where"] = j.where
    if j.equivalent:
        rec["equivalent"] = j.equivalent
    if r.status not in (KILLED, EQUIVALENT) and r.message:
        rec["message"] = r.message[-600:]
    return rec


def op_report(op: str, results: list[Result], seconds: float, workers: int, archs: list[str],
              generic_asked: int = 0, generic_note: str = "", cap: float | None = None,
              test_seconds: dict[str, float] | None = None) -> dict:
    """The op's report; ``test_seconds``: each test's seconds in this run and the ones before
    (``certify.mutants.hints`` orders the next run by them)."""
    data = [_record(r) for r in results if r.job.kind == "data"]
    generic = [_record(r) for r in results if r.job.kind == "generic"]
    by_variant = {v: _tally([r for r in data if r["variant"] == v])
                  for v in sorted({r["variant"] for r in data})}
    out = {"format": FORMAT, "op": op, "date": _dt.date.today().isoformat(),
           "seconds": round(seconds, 1), "workers": workers, "archs": archs, "cap_s": cap,
           "score": _tally(data), "by_variant": by_variant, "mutants": data}
    if test_seconds:
        out["test_seconds"] = {t: round(s, 2) for t, s in sorted(test_seconds.items())}
    if generic_asked or generic:
        out["generic"] = {"asked": generic_asked, "note": generic_note, "score": _tally(generic),
                          "mutants": generic}
        both = data + generic
        out["by_variant_all"] = {v: _tally([r for r in both if r["variant"] == v])
                                 for v in sorted({r["variant"] for r in both})}
    return out


def write_op_report(reports: Path, report: dict) -> Path:
    path = Path(reports) / DIR / f"{report['op']}.json"
    with locked(path.parent):
        atomic_write_text(path, json.dumps(report, indent=1, sort_keys=True) + "\n")
        atomic_write_text(path.parent / "summary.md", summary_markdown(load_mutants(reports)))
    return path


def load_mutants(reports: Path) -> dict[str, dict]:
    """op -> its mutants report, for every report under ``<reports>/mutants/``."""
    out = {}
    for p in sorted((Path(reports) / DIR).glob("*.json")):
        data = json.loads(read_utf8(p))
        if data.get("format") == FORMAT:
            out[data["op"]] = data
    return out


def score_text(t: dict) -> str:
    if not t["counted"]:
        return "none counted" + (f" ({t[EQUIVALENT]} equivalent)" if t[EQUIVALENT] else "")
    killed = t[KILLED] + t[TIMEOUT] + t.get(CRASHED, 0)
    extra = ", ".join(f"{t[s]} {s}" for s in (SURVIVED, "error", EQUIVALENT, NOT_RUN) if t.get(s))
    return f"{t['score']:g} % ({killed}/{t['counted']} killed" + (f"; {extra}" if extra else "") + ")"


def survivor_line(r: dict) -> str:
    where = f" at {r['where']}" if r.get("where") else ""
    if r["status"] == EQUIVALENT:
        return f"- `{r['id']}` ({r['variant']}{where}): equivalent: {r['equivalent']}"
    if r["status"] == NOT_RUN:
        return f"- `{r['id']}` ({r['variant']}{where}): not run here: {r.get('message', '')}"
    message = " ".join((r.get("message") or "").split())   # one Markdown line, whatever the output
    why = (message[:240] + (" ..." if len(message) > 240 else "")) if message else \
        f"passed all {r['tests_ran']} of the op's tests that read the module"
    if r.get("over_cap"):
        why += f" within the cap ({len(r['over_cap'])} costlier not run: {', '.join(r['over_cap'])})"
    return (f"- `{r['id']}` ({r['variant']}{where}): {r['status']}: {r['bug']}. {why}; owed: a cell "
            f"or test of the op that fails on it, or an `equivalent:` reason in its cell file")


def op_mutants_markdown(op: str, report: dict | None, declared: int) -> list[str]:
    """The op note's section."""
    md = ["## Mutants", ""]
    if report is None:
        md.append(f"{declared} plausible bug(s) in the cell file; not run yet (`certify mutants --op "
                  f"{op}` writes the score)." if declared else
                  "None listed: the cell file has no `mutants:` yet.")
        return md + [""]
    md.append(f"Plausible bugs caught by the op's cells, guard and property tests: "
              f"{score_text(report['score'])}, run {report['date']} in {report['seconds']:g} s "
              f"({report['workers']} worker(s) on {', '.join(report['archs'])}).")
    if "by_variant_all" in report:
        md += ["", "| counts for | cell-file mutants | with operator mutations |", "|---|---|---|"]
        none = _tally([])
        md += [f"| {v} | {score_text(report['by_variant'].get(v, none))} | {score_text(t)} |"
               for v, t in report["by_variant_all"].items()]
    else:
        md += ["", "| counts for | score |", "|---|---|"]
        md += [f"| {v} | {score_text(t)} |" for v, t in report["by_variant"].items()]
    md.append("")
    listed = [r for r in report["mutants"] if r["status"] not in CAUGHT]
    if listed:
        md += ["Not killed:", "", *[survivor_line(r) for r in listed], ""]
    killed = [r for r in report["mutants"] if r["status"] in CAUGHT]
    if killed:
        md += ["Killed:", ""]
        md += [f"- `{r['id']}` ({r['variant']}): {r['bug']}; by `{r['killed_by'] or 'a timeout'}`"
               for r in killed]
        md.append("")
    g = report.get("generic")
    if g:
        md.append(f"Operator mutations of the variants' code (cosmic-ray, {g['asked']} asked): "
                  f"{score_text(g['score'])}." + (f" {g['note']}" if g.get("note") else ""))
        gl = [r for r in g["mutants"] if r["status"] not in CAUGHT]
        if gl:
            md += ["", *[survivor_line(r) for r in gl]]
        md.append("")
    return md


def coverage_mutants_markdown(reports: dict[str, dict], declared: dict[str, int]) -> list[str]:
    """The coverage report's table: every op's score, or that it was not run."""
    md = ["## Mutants", "",
          "Plausible bugs of each op (its cell file's `mutants:`) caught by its own cells, guard and "
          "property tests (`certify mutants`); details and survivors in each op's note.", "",
          "| op | mutants | score | survivors | run |", "|---|---|---|---|---|"]
    for op in sorted(declared):
        r = reports.get(op)
        if r is None:
            md.append(f"| [{op}](ops/{op}.md) | {declared[op]} | not run | | |")
            continue
        t = r["score"]
        md.append(f"| [{op}](ops/{op}.md) | {len(r['mutants'])} | {score_text(t)} | "
                  f"{t[SURVIVED] + t['error']} | {r['date']}, {r['seconds']:g} s |")
    return md + [""]


def summary_markdown(reports: dict[str, dict]) -> str:
    md = ["# Mutants", "", "Generated by `certify mutants`; do not edit by hand. Each op's plausible "
          "bugs and their score; survivors with what is owed, equivalents with their reason.", "",
          "| op | score | by variant (with operator mutations where run) | seconds | date |",
          "|---|---|---|---|---|"]
    for op, r in sorted(reports.items()):
        parts = "; ".join(f"{v}: {score_text(t)}"
                          for v, t in r.get("by_variant_all", r["by_variant"]).items())
        md.append(f"| {op} | {score_text(r['score'])} | {parts} | {r['seconds']:g} | {r['date']} |")
    rest = [(op, m) for op, r in sorted(reports.items())
            for m in r["mutants"] + r.get("generic", {}).get("mutants", [])
            if m["status"] not in CAUGHT]
    if rest:
        md += ["", "## Not killed", ""]
        md += [f"- {op}: " + survivor_line(m)[2:] for op, m in rest]
    return "\n".join(md) + "\n"
