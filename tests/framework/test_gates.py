"""The gate framework on a fake target: file errors name file, line and field; the runner's verdicts,
references keyed by configuration, recording, reports; the pytest items of the real gate files."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict

from certify.gating.judge import Family, tier_families, tier_rate
from certify.gating.report import load_report, render, write_report
from certify.gating.run import GATE_THREADS, rejudge, run_gate
from certify.gating.files import (
    EvalSetInfo,
    FileProblem,
    ReferenceStore,
    TaskResult,
    gate_settings,
    load_gate_file,
    load_gates,
    load_target,
)
from certify.gating.schema import GateFile
from certify.gating.stats import FAMILY_ALPHA, power

ROOT = Path(__file__).resolve().parents[2]


class FakeEngine(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    storage: str = "exact"
    draft: int = 0


class FakeTarget:
    """Scores are a fixed pattern per storage; 'lossy' loses every third sample."""

    def __init__(self, unavailable: str | None = None):
        self.reason = unavailable
        self.runs: list[tuple[dict, str, int]] = []

    def unavailable(self):
        return self.reason

    def identity(self):
        return {"weights": "w1"}

    def arch(self):
        return "cpu"

    def eval_sets(self):
        return {"easy": EvalSetInfo(100, "e" * 64), "hard": EvalSetInfo(50, "h" * 64)}

    def resolve_engine(self, engine):
        return FakeEngine.model_validate(dict(engine)).model_dump()

    def speculative(self, engine):
        return FakeEngine.model_validate(dict(engine)).draft > 0

    def evaluate(self, engine, eval_set, samples, progress=None):
        e = FakeEngine.model_validate(dict(engine))
        self.runs.append((e.model_dump(), eval_set, samples))
        scores = [0.0 if i % 10 == 9 else 1.0 for i in range(samples)]
        if e.storage == "lossy":
            scores = [0.0 if i % 3 == 2 else s for i, s in enumerate(scores)]
        accepted = [[e.draft + 1, e.draft] for _ in range(samples)] if e.draft else []
        if progress:
            progress(samples, samples)
        return TaskResult(scores, accepted, 0.01)


GATE = textwrap.dedent("""\
    gate: {name}
    summary: a gate of the fake target
    why: exercises every kind of check
    tier: premerge
    engine: {{draft: 2}}
    tasks:
      easy: {{eval_set: easy, samples: 40}}
    checks:
      - {{kind: accuracy, task: easy}}
      - {{kind: acceptance_length, task: easy}}
      - {{kind: paired_delta, task: easy}}
    """)


def _write(tmp_path: Path, text: str, name: str = "g") -> Path:
    p = tmp_path / f"{name}.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("edit, line, field, words", [
    (lambda t: t.replace("tier: premerge", "tier: nightly"), 4, "tier", "premerge"),
    (lambda t: t.replace("samples: 40", "sample: 40"), 7, "tasks.easy.sample", "unknown field"),
    (lambda t: t.replace("{kind: accuracy, task: easy}", "{kind: accuracy, task: other}"), 9,
     "checks[0].task", "unknown task"),
    (lambda t: t.replace("eval_set: easy", "eval_set: nope"), 7, "tasks.easy.eval_set",
     "unknown evaluation set"),
    (lambda t: t.replace("samples: 40", "samples: 400"), 7, "tasks.easy.samples", "has 100"),
    (lambda t: t.replace("{draft: 2}", "{draft: 2, colour: red}"), 5, "engine.colour",
     "unknown field"),
    (lambda t: t.replace("{draft: 2}", "{}"), 10, "checks[1].kind", "needs speculation"),
    (lambda t: t.replace("{kind: paired_delta, task: easy}",
                         "{kind: paired_delta, task: easy, against: {draft: 2}}"), 11,
     "checks[2].against", "with itself"),
    (lambda t: t.replace("gate: g", "gate: h"), 1, "gate", "file name"),
])
def test_a_broken_gate_file_names_file_line_and_field(tmp_path, edit, line, field, words):
    path = _write(tmp_path, edit(GATE.format(name="g")))
    with pytest.raises(FileProblem) as info:
        load_gate_file(path, FakeTarget())
    err = info.value
    assert (err.file, err.line, err.field) == (path, line, field), str(err)
    assert words in err.message
    assert str(err).startswith(f"{path}:{line}: {field}: ")


def test_one_broken_file_does_not_stop_the_others(tmp_path):
    _write(tmp_path, GATE.format(name="good"), "good")
    _write(tmp_path, "gate: [unclosed", "bad")
    loaded = load_gates(tmp_path, FakeTarget())
    assert list(loaded.gates) == ["good"] and len(loaded.errors) == 1
    assert loaded.errors[0].field == "(yaml)"


def _gate(name="g", text=GATE) -> GateFile:
    return GateFile.model_validate(__import__("yaml").safe_load(text.format(name=name)))


def test_no_reference_is_not_a_pass_and_record_then_run_passes(tmp_path):
    target, store = FakeTarget(), ReferenceStore(tmp_path / "refs")
    first = run_gate(_gate(), target, store, record=True)
    assert first.status == "recorded"
    assert {c.status for c in first.checks} == {"recorded"}
    assert all("recorded as" in c.detail for c in first.checks)
    assert sorted(first.recorded) == ["easy (against:{})", "easy (gate)"]
    written = store.save()
    assert [p.name for p in written] == ["easy.yaml"]
    # The gate's engine and the identity ran once each, over the same 40 samples.
    assert [(r[0]["draft"], r[2]) for r in target.runs] == [(2, 40), (0, 40)]
    again = run_gate(_gate(), FakeTarget(), ReferenceStore(tmp_path / "refs"))
    assert again.status == "passed", again.summary()
    acc, al, paired = again.checks
    # a deterministic target reproduces its references: no sample changed, p = 1, a pass
    assert acc.reference == pytest.approx(90.0) and (acc.worse, acc.better, acc.p_value) == (0, 0, 1)
    assert "reproduces the reference" in acc.detail
    assert al.measured == pytest.approx(2.5) and al.threshold == pytest.approx(0.95 * 2.5)
    assert "no statistical error rate" in al.detail and al.false_fail_rate is None
    assert paired.measured == 0 and (paired.worse, paired.better) == (0, 0)
    # the gate alone is its family: two statistical checks share alpha
    assert acc.level == paired.level == pytest.approx(FAMILY_ALPHA / 2)
    assert 0 < acc.false_fail_rate <= acc.level and acc.caught_flips == 6
    assert acc.power == pytest.approx(power(36, FAMILY_ALPHA / 2))
    assert again.bitwise is True and first.bitwise is None


def test_a_regression_fails_its_checks(tmp_path):
    store = ReferenceStore(tmp_path / "refs")
    run_gate(_gate(), FakeTarget(), store, record=True)
    store.save()
    lossy = GATE.replace("{draft: 2}", "{draft: 2, storage: lossy}")
    # The lossy configuration's own reference is recorded from an exact run (a regression since).
    exact = run_gate(_gate(text=GATE), FakeTarget(), ReferenceStore(tmp_path / "refs"))
    assert exact.status == "passed"
    refs = ReferenceStore(tmp_path / "refs")
    f = refs.files["easy"]
    moved = [r.model_copy(update={"engine": {**r.engine, "storage": "lossy"}})
             for r in f.references if r.engine["draft"] == 2]
    for r in moved:
        refs.add("easy", f.sha256, r)
    refs.save()
    res = run_gate(_gate(text=lossy), FakeTarget(), ReferenceStore(tmp_path / "refs"))
    assert res.status == "failed"
    status = {c.kind: c.status for c in res.checks}
    assert status == {"accuracy": "failed", "acceptance_length": "passed", "paired_delta": "failed"}


def test_references_of_another_content_or_target_do_not_apply(tmp_path):
    store = ReferenceStore(tmp_path / "refs")
    run_gate(_gate(), FakeTarget(), store, record=True)
    store.save()

    class Other(FakeTarget):
        def identity(self):
            return {"weights": "w2"}

    assert run_gate(_gate(), Other(), ReferenceStore(tmp_path / "refs")).status == "no reference"

    class Rehashed(FakeTarget):
        def eval_sets(self):
            return {"easy": EvalSetInfo(100, "f" * 64)}

    assert run_gate(_gate(), Rehashed(), ReferenceStore(tmp_path / "refs")).status == "no reference"


def test_recording_for_a_new_target_drops_the_old_targets_references(tmp_path):
    store = ReferenceStore(tmp_path / "refs")
    run_gate(_gate(), FakeTarget(), store, record=True)
    store.save()

    class Retrained(FakeTarget):
        def identity(self):
            return {"weights": "w2"}

    store = ReferenceStore(tmp_path / "refs")
    assert len(run_gate(_gate(), Retrained(), store, record=True).recorded) == 2
    store.save()
    refs = ReferenceStore(tmp_path / "refs").files["easy"].references
    assert len(refs) == 2 and {tuple(r.target.items()) for r in refs} == {(("weights", "w2"),)}


def test_record_keeps_existing_references_unless_overwritten(tmp_path):
    store = ReferenceStore(tmp_path / "refs")
    run_gate(_gate(), FakeTarget(), store, record=True)
    assert run_gate(_gate(), FakeTarget(), store, record=True).recorded == []
    assert len(run_gate(_gate(), FakeTarget(), store, record=True, overwrite=True).recorded) == 2


def test_a_broken_reference_file_names_its_line(tmp_path):
    refs = tmp_path / "refs"
    refs.mkdir()
    (refs / "easy.yaml").write_text("eval_set: easy\nsha256: x\nreferences:\n  - {samples: -1}\n")
    store = ReferenceStore(refs)
    assert len(store.errors) == 1 and store.errors[0].line == 4


def test_skipped_gate_keeps_the_reason_and_runs_nothing(tmp_path):
    target = FakeTarget(unavailable="no weights here")
    res = run_gate(_gate(), target, ReferenceStore(tmp_path))
    assert (res.status, res.reason, target.runs) == ("skipped", "no weights here", [])


def test_report_and_summary(tmp_path):
    store = ReferenceStore(tmp_path / "refs")
    res = run_gate(_gate(), FakeTarget(), store, record=True)
    path = write_report(res, tmp_path / "gates")
    data = json.loads(path.read_text())
    assert data["gate"] == "g" and len(data["runs"]) == 2 and data["seconds"] >= 0
    assert "| `g` | premerge | recorded |" in (tmp_path / "gates" / "summary.md").read_text()
    res = run_gate(_gate(), FakeTarget(), ReferenceStore(tmp_path / "other"))
    write_report(res, tmp_path / "gates")
    assert "| `g` | premerge | no reference |" in (tmp_path / "gates" / "summary.md").read_text()


def test_recording_beside_an_existing_reference_keeps_the_check():
    """A check whose reference existed before a --record run is checked as usual (and fails where it
    fails); only the checks that lacked theirs read ``recorded``."""
    store = ReferenceStore(Path("/nonexistent-refs"))
    run_gate(_gate(), FakeTarget(), store, record=True)          # every reference of the easy task
    with_hard = GATE.replace("  easy: {{eval_set: easy, samples: 40}}\n",
                             "  easy: {{eval_set: easy, samples: 40}}\n"
                             "  hard: {{eval_set: hard, samples: 20}}\n")
    assert with_hard != GATE
    with_hard += "  - {{kind: accuracy, task: hard}}\n"

    class Worse(FakeTarget):
        def evaluate(self, engine, eval_set, samples, progress=None):
            res = super().evaluate(engine, eval_set, samples, progress)
            if FakeEngine.model_validate(dict(engine)).draft == 0:
                return res
            return TaskResult([0.0 if i % 2 else s for i, s in enumerate(res.scores)],
                              res.accepted, res.seconds)

    second = run_gate(_gate(text=with_hard), Worse(), store, record=True)
    status = [(c.kind, c.task, c.status) for c in second.checks]
    assert status == [("accuracy", "easy", "failed"), ("acceptance_length", "easy", "passed"),
                      ("paired_delta", "easy", "failed"), ("accuracy", "hard", "recorded")], \
        second.summary()
    assert second.status == "failed"
    assert second.recorded == ["hard (gate)"]


class RaisesOnDraft3(FakeTarget):
    """A target whose engine breaks on one configuration (a job of the parallel runner)."""

    def evaluate(self, engine, eval_set, samples, progress=None):
        if FakeEngine.model_validate(dict(engine)).draft == 3:
            raise RuntimeError("engine broke on draft 3")
        return super().evaluate(engine, eval_set, samples, progress)


def _three_gates() -> list[GateFile]:
    lossy = GATE.replace("{draft: 2}", "{draft: 3, storage: lossy}")
    hard = GATE.replace("eval_set: easy, samples: 40", "eval_set: hard, samples: 20")
    return [_gate("a"), _gate("b", lossy), _gate("c", hard)]


def _ref_keys(store: ReferenceStore) -> set:
    """What a reference says (timestamps and timings left out)."""
    return {(name, json.dumps(r.engine, sort_keys=True), r.samples, str(r.scores), r.accuracy,
             r.acceptance_length) for name, f in store.files.items() for r in f.references}


def test_gates_in_jobs_record_and_check_as_one_process_does(tmp_path):
    from certify.gating.run import run_gates_in_jobs
    spec = f"{FakeTarget.__module__}:FakeTarget"
    one = ReferenceStore(tmp_path / "one")
    sequential = {g.gate: run_gate(g, FakeTarget(), one, record=True) for g in _three_gates()}
    many = ReferenceStore(tmp_path / "many")
    seen: list[str] = []
    parallel = run_gates_in_jobs(_three_gates(), spec, many, 2, record=True,
                                 on_result=lambda r: seen.append(r.gate))
    assert sorted(seen) == ["a", "b", "c"] and [r.gate for r in parallel] == seen
    for r in parallel:
        assert [(c.kind, c.status) for c in r.checks] == \
            [(c.kind, c.status) for c in sequential[r.gate].checks], r.summary()
    # the jobs' references all reach the parent's store: the same set as one process records
    assert _ref_keys(many) == _ref_keys(one) and len(_ref_keys(one)) == 5
    many.save()
    again = run_gates_in_jobs(_three_gates(), spec, ReferenceStore(tmp_path / "many"), 3)
    assert sorted((r.gate, r.status) for r in again) == [("a", "passed"), ("b", "passed"),
                                                         ("c", "passed")]


def test_a_gate_job_that_raises_fails_alone(tmp_path):
    from certify.gating.run import run_gates_in_jobs
    errors: list[tuple[str, str]] = []
    results = run_gates_in_jobs(_three_gates(), f"{FakeTarget.__module__}:RaisesOnDraft3",
                                ReferenceStore(tmp_path / "refs"), 2, record=True,
                                on_error=lambda g, e: errors.append((g, str(e))))
    assert errors == [("b", "engine broke on draft 3")]
    assert sorted((r.gate, r.status) for r in results) == [("a", "recorded"), ("c", "recorded")]


def test_the_command_runs_gates_in_jobs_and_saves_every_reference(tmp_path):
    """``certify gates run --jobs 2`` in a project of the fake target: a recording run exits 0 and
    saves the references of every job; the next run passes every gate and writes its reports under
    runs/gates/, the committed reports/gates/ only with --update-reports; --jobs 0 is refused."""
    (tmp_path / "pyproject.toml").write_text(
        f'[tool.certify]\ngate_target = "{FakeTarget.__module__}:FakeTarget"\n')
    gates = tmp_path / "certify" / "gates"
    gates.mkdir(parents=True)
    for g in _three_gates():
        text = {"a": GATE, "b": GATE.replace("{draft: 2}", "{draft: 3, storage: lossy}"),
                "c": GATE.replace("eval_set: easy, samples: 40", "eval_set: hard, samples: 20")}
        (gates / f"{g.gate}.yaml").write_text(text[g.gate].format(name=g.gate))
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}

    def certify(*args):
        return subprocess.run([sys.executable, "-m", "certify.cli", "gates", "run", *args],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    first = certify("--jobs", "2", "--record", "a", "b", "c")
    assert first.returncode == 0, first.stdout + first.stderr
    assert first.stdout.count("RECORDED") == 3
    assert sorted(p.name for p in (gates / "references").glob("*.yaml")) == ["easy.yaml", "hard.yaml"]
    second = certify("--jobs", "2", "a", "b", "c")
    assert second.returncode == 0 and second.stdout.count("PASSED") == 3, second.stdout
    # a plain run leaves the committed reports alone: its costs and date are this machine's
    assert "| `c` | premerge | passed |" in (tmp_path / "runs/gates/summary.md").read_text()
    assert not (tmp_path / "reports/gates").exists()
    third = certify("--update-reports", "c")
    assert third.returncode == 0, third.stdout + third.stderr
    assert "| `c` | premerge | passed |" in (tmp_path / "reports/gates/summary.md").read_text()
    refused = certify("--jobs", "0", "a")
    assert refused.returncode == 1 and "--jobs must be at least 1" in refused.stderr


def test_the_project_gate_files_load_against_the_target():
    settings = gate_settings(str(ROOT))
    loaded = load_gates(settings.gates, load_target(settings.target))
    assert not loaded.errors, loaded.errors
    tiers = {g.tier for g in loaded.gates.values()}
    assert tiers == {"premerge", "postmerge", "ondemand"}
    assert ReferenceStore(settings.references).errors == []


def test_gate_items_are_collected_with_their_tier_and_skip_with_the_reason():
    # Every gate item, whichever list holds it (the generated lists decide the tiers: certify.lists).
    from impl.gates.target import TARGET
    n = len(list((ROOT / "certify" / "gates").glob("*.yaml")))
    args = [sys.executable, "-m", "pytest", "-p", "no:xdist", "-q", "-rs",
            "-m", "premerge or postmerge or ondemand", "certify/gates"]
    if TARGET.unavailable() is None:
        # a trained checkpoint is present: running the items would run every gate, so collect them
        out = subprocess.run([*args, "--collect-only"], cwd=ROOT, capture_output=True, text=True,
                             timeout=120)
        text = out.stdout + out.stderr
        assert out.returncode == 0, text
        assert re.search(rf"\b{n}(/\d+)? tests? collected", text), text
        return
    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert f"{n} skipped" in text and "no trained checkpoint at checkpoints/flashnext-tiny" in text


def test_gate_jobs_report_each_run_progress_to_the_parent(tmp_path):
    """``on_progress`` hears, in this process, every engine run of every job: per (gate, run) the
    counts rise to the run's total, and the runs are those a sequential run shows."""
    from certify.gating.run import run_gates_in_jobs
    sequential: dict[tuple[str, str], list[int]] = {}
    for g in _three_gates():
        run_gate(g, FakeTarget(), ReferenceStore(tmp_path / "one"), record=True,
                 progress=lambda label, d, t, g=g.gate: sequential.setdefault((g, label), []).append(d))
    events: dict[tuple[str, str], list[tuple[int, int]]] = {}
    run_gates_in_jobs(_three_gates(), f"{FakeTarget.__module__}:FakeTarget",
                      ReferenceStore(tmp_path / "many"), 2, record=True,
                      on_progress=lambda g, label, d, t: events.setdefault((g, label), []).append((d, t)))
    assert sequential and set(events) == set(sequential)
    for key, seen in events.items():
        done = [d for d, _ in seen]
        assert done == sorted(done) and done[-1] == seen[-1][1], (key, seen)
        assert done == sequential[key], key


class Flips(FakeTarget):
    """The fake target with its first ``flips`` right samples wrong in every configuration (a change
    the gate's engine and the identity share)."""

    flips = 6

    def evaluate(self, engine, eval_set, samples, progress=None):
        res = super().evaluate(engine, eval_set, samples, progress)
        right = [i for i, s in enumerate(res.scores) if s == 1.0][:self.flips]
        return TaskResult([0.0 if i in right else s for i, s in enumerate(res.scores)],
                          res.accepted, res.seconds)


def _recorded(tmp_path) -> Path:
    store = ReferenceStore(tmp_path / "refs")
    run_gate(_gate(), FakeTarget(), store, record=True)
    store.save()
    return tmp_path / "refs"


def test_the_level_is_the_tiers_share_and_a_shared_change_is_not_the_variants(tmp_path):
    """Six reference-right samples lost: p = 2^-6 fails a check at 0.05 / 2 and passes one at
    0.05 / 4; the paired check sees the identity lose the same six and stays quiet."""
    refs = _recorded(tmp_path)
    alone = run_gate(_gate(), Flips(), ReferenceStore(refs), family=Family("premerge", 2))
    acc, _, paired = alone.checks
    assert (acc.worse, acc.better, acc.status) == (6, 0, "failed"), alone.summary()
    assert acc.p_value == pytest.approx(2.0 ** -6) and acc.level == pytest.approx(0.025)
    assert (paired.worse, paired.better, paired.status) == (0, 0, "passed")
    assert alone.bitwise is False
    wider = run_gate(_gate(), Flips(), ReferenceStore(refs), family=Family("premerge", 4))
    assert wider.checks[0].status == "passed" and wider.status == "passed", wider.summary()
    assert wider.family == {"tier": "premerge", "checks": 4, "alpha": FAMILY_ALPHA,
                            "level": pytest.approx(0.0125)}


def test_tier_families_count_every_statistical_check_of_a_tier():
    post = _gate("p", GATE.replace("tier: premerge", "tier: postmerge"))
    families = tier_families([_gate("a"), _gate("b"), post])
    assert families["premerge"].checks == 4 and families["postmerge"].checks == 2
    assert families["premerge"].level == pytest.approx(FAMILY_ALPHA / 4)


def test_the_project_tiers_hold_their_family_wise_rate():
    gates = load_gates(gate_settings(str(ROOT)).gates).gates.values()
    families = tier_families(gates)
    assert set(families) == {"premerge", "postmerge", "ondemand"}
    for fam in families.values():
        assert 0 < tier_rate(gates, fam) <= fam.alpha, fam


def test_a_stored_report_is_rejudged_without_the_engine(tmp_path):
    refs = _recorded(tmp_path)
    target = Flips()
    first = run_gate(_gate(), target, ReferenceStore(refs), family=Family("premerge", 4))
    assert first.status == "passed"
    path = write_report(first, tmp_path / "gates")
    stored, _ = load_report(path)
    assert stored.runs[0].scores == "".join("0" if i < 6 or i % 10 == 9 else "1" for i in range(40))
    runs = len(target.runs)
    again = rejudge(stored, _gate(), ReferenceStore(refs), Family("premerge", 4))
    assert [(c.kind, c.status, c.worse, c.p_value) for c in again.checks] == \
        [(c.kind, c.status, c.worse, c.p_value) for c in first.checks]
    stricter = rejudge(stored, _gate(), ReferenceStore(refs), Family("premerge", 2))
    assert stricter.status == "failed" and stricter.rendered and len(target.runs) == runs
    assert stricter.date == first.date          # the run's own date stays; ``rendered`` is new


def test_render_rewrites_reports_with_scores_and_leaves_older_ones(tmp_path):
    refs = _recorded(tmp_path)
    reports = tmp_path / "gates"
    write_report(run_gate(_gate(), Flips(), ReferenceStore(refs), family=Family("premerge", 4)),
                 reports)
    old = {"gate": "old", "tier": "premerge", "status": "passed", "seconds": 1.0, "arch": "cpu",
           "date": "2026-01-01T00:00:00Z", "target": {}, "reason": "", "recorded": [],
           "runs": [{"label": "gate", "task": "easy", "eval_set": "easy", "samples": 40,
                     "engine": {}, "accuracy": 90.0, "acceptance_length": None, "verify_steps": 0,
                     "seconds": 1.0}],
           "checks": [{"kind": "accuracy", "task": "easy", "status": "passed", "measured": 90.0,
                       "reference": 90.0, "threshold": 85.1, "mde": 7.0, "detail": ""}]}
    (reports / "old.json").write_text(json.dumps(old))
    gates = {"g": _gate(), "old": _gate("old")}
    done, left = render(reports, gates, ReferenceStore(refs), {"premerge": Family("premerge", 2)})
    assert done == ["g"] and len(left) == 1 and "no per-sample scores" in left[0]
    assert json.loads((reports / "g.json").read_text())["status"] == "failed"
    summary = (reports / "summary.md").read_text()
    assert "| premerge | 0.05 | 4 | 0.0125 |" in summary           # the tier, from the gate files
    assert "| `old` | premerge | passed |" in summary and "v1 threshold 85.10" in summary
    assert "not stated (v1)" in summary
    row = next(r for r in summary.splitlines() if r.startswith("| `g` | accuracy easy"))
    assert "| failed |" in row and "6 / 0 of 40" in row and "p 0.01562 <= 0.025" in row


class Threads(FakeTarget):
    """Reports, as its acceptance, the intra-op thread count its evaluation ran at."""

    def evaluate(self, engine, eval_set, samples, progress=None):
        import torch
        res = super().evaluate(engine, eval_set, samples, progress)
        return TaskResult(res.scores, [[torch.get_num_threads()]] * samples, res.seconds)


def test_gate_runs_use_the_fixed_thread_count_and_record_the_platform(tmp_path):
    import torch
    before = torch.get_num_threads()
    res = run_gate(_gate(), Threads(), ReferenceStore(tmp_path))
    assert {r.acceptance_length for r in res.runs} == {float(GATE_THREADS)}
    assert torch.get_num_threads() == before
    p = res.platform
    assert p["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert p["threads"] == GATE_THREADS and p["torch"] == torch.__version__
    assert set(p["settings"]) >= {"ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"}


def test_gate_jobs_run_at_the_same_thread_count_as_one_process(tmp_path):
    from certify.gating.run import run_gates_in_jobs
    results = run_gates_in_jobs(_three_gates(), f"{Threads.__module__}:Threads",
                                ReferenceStore(tmp_path), 2)
    assert {r.acceptance_length for res in results for r in res.runs} == {float(GATE_THREADS)}
    assert {res.platform["threads"] for res in results} == {GATE_THREADS}


REFERENCE = textwrap.dedent("""\
    eval_set: easy
    sha256: eeee
    references:
    - accuracy: 75.0
      arch: cpu
      engine: {draft: 0, storage: exact}
      recorded: '2026-01-01T00:00:00Z'
      samples: 4
      scores: '1101'
      seconds: 1.0
      target: {weights: w1}
    - accuracy: 50.0
      arch: cpu
      engine: {draft: 2, storage: exact}
      recorded: '2026-01-01T00:00:00Z'
      samples: 2
      scores: [1.0, 0.0]
      seconds: 1.0
      target: {weights: w1}
    """)


def test_a_consistent_reference_file_loads(tmp_path):
    (tmp_path / "easy.yaml").write_text(REFERENCE)
    store = ReferenceStore(tmp_path)
    assert store.errors == [] and len(store.files["easy"].references) == 2


@pytest.mark.parametrize("edit, line, field, words", [
    (lambda t: t.replace("accuracy: 75.0", "accuracy: 80.0"), 4, "references[0].accuracy",
     "not the mean of its scores"),
    (lambda t: t.replace("scores: '1101'", "scores: '11010'"), 9, "references[0].scores",
     "5 scores for 4 samples"),
    (lambda t: t.replace("samples: 2", "samples: 3"), 17, "references[1].scores",
     "2 scores for 3 samples"),
    (lambda t: t.replace("scores: '1101'", "scores: '1121'"), 9, "references[0].scores",
     "only 0 and 1"),
    (lambda t: t.replace("scores: [1.0, 0.0]", "scores: [1.5, 0.0]"), 17, "references[1].scores",
     "sample 0 is 1.5"),
])
def test_a_reference_that_contradicts_itself_names_file_line_and_field(tmp_path, edit, line, field,
                                                                        words):
    path = tmp_path / "easy.yaml"
    path.write_text(edit(REFERENCE))
    assert path.read_text() != REFERENCE
    store = ReferenceStore(tmp_path)
    assert len(store.errors) == 1 and "easy" not in store.files
    err = store.errors[0]
    assert (err.file, err.line, err.field) == (path, line, field), str(err)
    assert words in err.message


def test_gates_check_reports_an_inconsistent_reference(tmp_path):
    """``certify gates check`` in a project of the fake target exits 1 naming the reference."""
    (tmp_path / "pyproject.toml").write_text(
        f'[tool.certify]\ngate_target = "{FakeTarget.__module__}:FakeTarget"\n')
    gates = tmp_path / "certify" / "gates"
    (gates / "references").mkdir(parents=True)
    (gates / "g.yaml").write_text(GATE.format(name="g"))
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}

    def check():
        return subprocess.run([sys.executable, "-m", "certify.cli", "gates", "check"], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=300)

    (gates / "references" / "easy.yaml").write_text(REFERENCE)
    good = check()
    assert good.returncode == 0, good.stdout + good.stderr
    (gates / "references" / "easy.yaml").write_text(REFERENCE.replace("accuracy: 75.0",
                                                                      "accuracy: 80.0"))
    bad = check()
    assert bad.returncode == 1
    assert "easy.yaml:4: references[0].accuracy: 80.0 is not the mean" in bad.stdout, bad.stdout


def test_the_platform_records_the_capability_torch_dispatched_to():
    """Under ATEN_CPU_CAPABILITY=default torch dispatches to its baseline kernels, and the record
    says so beside the settings as given."""
    code = "import json; from certify.gating.run import numeric_platform; print(json.dumps(numeric_platform()))"
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT), "ATEN_CPU_CAPABILITY": "default",
           "ONEDNN_MAX_CPU_ISA": "SSE41"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    p = json.loads(out.stdout)
    assert p["cpu_capability"] == "DEFAULT"
    assert p["settings"]["ATEN_CPU_CAPABILITY"] == "default"
    assert p["settings"]["ONEDNN_MAX_CPU_ISA"] == "SSE41"


def test_gates_list_shows_the_list_that_runs_each_gate():
    from certify.lists import list_tiers
    listed = list_tiers(ROOT / "test_lists")
    out = subprocess.run([sys.executable, "-m", "certify.cli", "gates", "list"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [ln.split() for ln in out.stdout.splitlines() if ln.strip()]
    assert len(lines) == len(list((ROOT / "certify" / "gates").glob("*.yaml")))
    for tier, name, *_ in lines:
        assert tier == listed[f"certify/gates/{name}.yaml::{name}"], (tier, name)
