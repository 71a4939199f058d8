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

from certify.gaterun import run_gate, write_report
from certify.gates import (
    EvalSetInfo,
    GateError,
    ReferenceStore,
    TaskResult,
    gate_settings,
    load_gate_file,
    load_gates,
    load_target,
)
from certify.gateschema import GateFile

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
    with pytest.raises(GateError) as info:
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
    assert acc.reference == pytest.approx(90.0) and acc.threshold < 90.0 and acc.mde > 0
    assert al.measured == pytest.approx(2.5) and al.threshold == pytest.approx(0.95 * 2.5)
    assert paired.measured == 0 and paired.threshold < 0


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
    from certify.gaterun import run_gates_in_jobs
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
    from certify.gaterun import run_gates_in_jobs
    errors: list[tuple[str, str]] = []
    results = run_gates_in_jobs(_three_gates(), f"{FakeTarget.__module__}:RaisesOnDraft3",
                                ReferenceStore(tmp_path / "refs"), 2, record=True,
                                on_error=lambda g, e: errors.append((g, str(e))))
    assert errors == [("b", "engine broke on draft 3")]
    assert sorted((r.gate, r.status) for r in results) == [("a", "recorded"), ("c", "recorded")]


def test_the_command_runs_gates_in_jobs_and_saves_every_reference(tmp_path):
    """``certify gates run --jobs 2`` in a project of the fake target: a recording run exits 0 and
    saves the references of every job; the next run passes every gate; --jobs 0 is refused."""
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
    from certify.gaterun import run_gates_in_jobs
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
