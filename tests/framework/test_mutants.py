"""`certify mutants` in a throwaway project: a planted op whose mutants are killed by its cell or its
guard, survive, or are declared equivalent; the report, the op note, and a working tree that is only
read, interrupted or not."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from certify.catalog.load import load_op_file
from certify.files.problem import FileProblem
from certify.mutants.plan import EditError, apply_edit
from certify.mutants.report import load_mutants, op_mutants_markdown
from tests.framework.tmp_project import ROOT

OPS = '''\
"""A planted op: x + 1 where x > 0, x elsewhere."""
import torch


def shift(x):
    return torch.where(x > 0, x + 1, x)


def shift_impl(x, out):
    out.copy_(torch.where(x > 0, x + 1, x))


def shift_case(axes, gen, device):
    from certify.harness.target import Case, OutSpec
    x = torch.randn(axes["rows"], 8, generator=gen, dtype=torch.float32)
    return Case(inputs={"x": x}, outputs={"out": OutSpec((axes["rows"], 8), torch.float32)})
'''
GUARD = '''\
import pytest
import torch

from planted.ops import shift


@pytest.mark.certify_guard("shift")
def test_shift_guard():
    assert shift(torch.tensor([-1.0, 0.0, 2.0])).tolist() == [-1.0, 0.0, 3.0]
'''
CELLS = textwrap.dedent("""\
    op: shift
    summary: a planted op for the mutants tests
    spec: planted.ops:shift
    inputs: planted.ops:shift_case
    axes:
      rows: {kind: int, reach: [1, 64]}
    variants:
      - name: torch
        impl: planted.ops:shift_impl
        archs: [cpu]
    cells:
      - id: rows_4
        axes: {rows: 4}
        why: a small case for the mutants tests
        tier: premerge
        oracle: {kind: bitwise, against: spec}
    mutants:
      - id: impl_adds_two
        bug: the variant adds two instead of one
        variant: torch
        find: "out.copy_(torch.where(x > 0, x + 1, x))"
        replace: "out.copy_(torch.where(x > 0, x + 2, x))"
      - id: spec_shifts_zero
        bug: the spec shifts zero too
        find: "return torch.where(x > 0, x + 1, x)"
        replace: "return torch.where(x >= 0, x + 1, x)"
      - id: impl_shifts_zero
        bug: the variant shifts zero too, which no cell input holds
        variant: torch
        find: "out.copy_(torch.where(x > 0, x + 1, x))"
        replace: "out.copy_(torch.where(x >= 0, x + 1, x))"
      - id: impl_commuted
        bug: the variant adds in the other order
        variant: torch
        find: "out.copy_(torch.where(x > 0, x + 1, x))"
        replace: "out.copy_(torch.where(x > 0, 1 + x, x))"
        equivalent: fp32 addition commutes exactly, so 1 + x is x + 1 bit for bit
      - id: impl_hangs
        bug: the variant never returns
        variant: torch
        find: "def shift_impl(x, out):"
        replace: "def shift_impl(x, out):\\n    while True:\\n        pass"
      - id: impl_crashes
        bug: the variant reads through a null pointer
        variant: torch
        find: "def shift_impl(x, out):"
        replace: "def shift_impl(x, out):\\n    import ctypes\\n    ctypes.string_at(0)"
    """)


def make_project(tmp: Path) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "pyproject.toml").write_text(
        '[tool.certify]\ncells = "cells"\nreceipts = "receipts"\nreports = "reports"\n'
        'lists = "lists"\n\n[tool.pytest.ini_options]\naddopts = "-p no:cacheprovider"\n')
    (tmp / "conftest.py").write_text('pytest_plugins = ["certify.pytest_plugin"]\n')
    (tmp / "planted").mkdir()
    (tmp / "planted" / "__init__.py").write_text("")
    (tmp / "planted" / "ops.py").write_text(OPS)
    (tmp / "tests").mkdir()
    (tmp / "tests" / "test_planted.py").write_text(GUARD)
    (tmp / "cells").mkdir()
    (tmp / "cells" / "shift.yaml").write_text(CELLS)
    (tmp / "lists").mkdir()
    items = [{"id": "tests/test_planted.py::test_shift_guard", "tier": "premerge", "arch": None,
              "guards": ["shift"]},
             {"id": "cells/shift.yaml::torch[rows_4-cpu]", "tier": "premerge", "arch": "cpu",
              "cell": {"op": "shift", "variant": "torch", "cell": "rows_4"}}]
    (tmp / "lists" / "items.json").write_text(json.dumps({"format": "items/1", "items": items}))
    return tmp


def tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every file under the project but its generated reports."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and "reports" not in p.parts}


def certify_mutants(project: Path, *args: str, tmpdir: Path | None = None,
                    **kw) -> subprocess.Popen | subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    cmd = [sys.executable, "-m", "certify", "mutants", *args]
    if kw.get("background"):
        return subprocess.Popen(cmd, cwd=project, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """The planted project after one `certify mutants` run (the hanging mutant left out)."""
    project = make_project(tmp_path_factory.mktemp("mutants"))
    # a run of some mutants writes no report, so the op runs here without its hanging mutant, which
    # is run on its own below
    (project / "cells" / "shift.yaml").write_text(CELLS.split("  - id: impl_hangs")[0])
    before = tree_digest(project)
    return project, before, certify_mutants(project, "--op", "shift", "--jobs", "2")


def test_each_mutant_is_killed_by_the_test_that_sees_it_or_survives(ran):
    project, _, res = ran
    assert res.returncode == 1, res.stdout + res.stderr   # a survivor fails the command
    report = load_mutants(project / "reports")["shift"]
    by = {m["id"]: m for m in report["mutants"]}
    assert by["impl_adds_two"]["status"] == "killed"
    assert by["impl_adds_two"]["killed_by"] == "cells/shift.yaml::torch[rows_4-cpu]"
    # the cell compares the variant with the mutated spec on inputs without a zero: only the guard sees it
    assert by["spec_shifts_zero"]["status"] == "killed"
    assert by["spec_shifts_zero"]["killed_by"] == "tests/test_planted.py::test_shift_guard"
    assert by["impl_shifts_zero"]["status"] == "survived"
    assert by["impl_shifts_zero"]["tests_ran"] == 2
    assert by["impl_commuted"]["status"] == "equivalent"
    score = report["score"]
    assert (score["killed"], score["survived"], score["equivalent"], score["counted"]) == (2, 1, 1, 3)
    assert score["score"] == pytest.approx(66.7)
    assert report["by_variant"]["spec"]["score"] == 100.0
    assert report["by_variant"]["torch"]["score"] == 50.0
    assert "impl_shifts_zero" in res.stdout and "owed" in res.stdout


def test_the_working_tree_is_only_read(ran):
    project, before, _ = ran
    assert tree_digest(project) == before


def test_the_op_note_gives_the_score_and_each_survivor(ran):
    project, _, _ = ran
    report = load_mutants(project / "reports")["shift"]
    note = "\n".join(op_mutants_markdown("shift", report, 4))
    assert "66.7 % (2/3 killed; 1 survived, 1 equivalent)" in note
    assert "- `impl_shifts_zero` (torch): survived" in note
    assert "equivalent: fp32 addition commutes exactly" in note
    assert "by `tests/test_planted.py::test_shift_guard`" in note
    summary = (project / "reports" / "mutants" / "summary.md").read_text()
    assert "| shift | 66.7 %" in summary
    assert "not run yet" in "\n".join(op_mutants_markdown("shift", None, 4))


def test_an_equivalent_mutant_is_run_on_request_and_must_survive(ran):
    project, before, _ = ran
    res = certify_mutants(project, "--op", "shift", "--mutant", "impl_commuted", "--equivalent")
    assert "impl_commuted: survived" in res.stdout, res.stdout + res.stderr
    assert "no report written" in res.stdout
    assert tree_digest(project) == before


def test_a_hanging_mutant_is_killed_by_its_time_limit(tmp_path):
    project = make_project(tmp_path / "p")
    res = certify_mutants(project, "--op", "shift", "--mutant", "impl_hangs", "--jobs", "1",
                          "--time-limit", "20")
    assert "impl_hangs: timeout" in res.stdout, res.stdout + res.stderr


def test_a_mutant_that_crashes_the_worker_counts_as_caught(tmp_path):
    project = make_project(tmp_path / "p")
    res = certify_mutants(project, "--op", "shift", "--mutant", "impl_crashes", "--jobs", "1")
    assert "impl_crashes: crashed" in res.stdout, res.stdout + res.stderr
    assert res.returncode == 0, res.stdout + res.stderr


def test_an_interrupted_run_leaves_the_tree_and_no_work_folder(tmp_path):
    project = make_project(tmp_path / "p")
    work = tmp_path / "tmp"
    work.mkdir()
    before = tree_digest(project)
    proc = certify_mutants(project, "--op", "shift", "--mutant", "impl_hangs", "--jobs", "1",
                           tmpdir=work, background=True)
    deadline = time.monotonic() + 120
    while not list(work.glob("certify-mutants-*/m0/mutant.py")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert list(work.glob("certify-mutants-*/m0/mutant.py")), "the worker never started"
    time.sleep(3)   # the worker is inside the op's tests now
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0, out
    assert tree_digest(project) == before
    assert not list(work.iterdir()), f"left behind: {list(work.iterdir())}"
    assert not (project / "reports").exists()


def test_an_edit_must_find_its_text_once_and_parse():
    assert apply_edit("a = 1\nb = 2\n", "b = 2", "b = 3", "m") == "a = 1\nb = 3\n"
    with pytest.raises(EditError, match="occurs 0 times"):
        apply_edit("a = 1\n", "b = 2", "b = 3", "m")
    with pytest.raises(EditError, match="occurs 2 times"):
        apply_edit("a = 1\na = 1\n", "a = 1", "a = 2", "m")
    with pytest.raises(EditError, match="does not parse"):
        apply_edit("a = 1\n", "a = 1", "a = (", "m")


def test_a_mutant_of_an_unknown_variant_is_a_file_error(tmp_path):
    text = CELLS.replace("    variant: torch\n", "    variant: tritn\n", 1)
    assert text != CELLS
    (tmp_path / "shift.yaml").write_text(text)
    with pytest.raises(FileProblem) as e:
        load_op_file(tmp_path / "shift.yaml")
    assert e.value.field == "mutants[0].variant" and "tritn" in e.value.message


def test_operator_mutations_stay_in_the_code_the_variant_reaches():
    from certify.mutants.generic import reached_lines  # noqa: PLC0415

    source = ('def helper(x):\n    return x + 1\n\n\ndef unused(x):\n    return x - 1\n\n\n'
              'def impl(x):\n    """Doc."""\n    if x is None:\n        raise ValueError("no x")\n'
              '    return helper(x) * 2\n')
    assert reached_lines(source, "impl") == {2, 11, 13}


def test_operator_mutations_come_from_cosmic_ray_and_run_like_the_cell_files(tmp_path):
    from certify.mutants.generic import MISSING  # noqa: PLC0415

    pytest.importorskip("cosmic_ray", reason=MISSING)
    project = make_project(tmp_path / "p")
    (project / "cells" / "shift.yaml").write_text(CELLS.split("  - id: impl_hangs")[0])
    res = certify_mutants(project, "--op", "shift", "--generic", "3")
    report = load_mutants(project / "reports")["shift"]
    generic = report["generic"]["mutants"]
    # one of the three (1 -> 2 in x + 1) is the cell file's impl_adds_two: it counts there only
    assert len(generic) == 2, res.stdout + res.stderr
    assert "1 of them made a cell-file mutant's source" in report["generic"]["note"]
    for m in generic:   # shift_impl is line 9 and 10 of planted/ops.py: nothing else is mutated
        assert m["id"].startswith("torch.shift_impl.10."), m
        assert m["status"] in ("killed", "survived"), m
    assert sum(m["status"] == "killed" for m in generic) >= 1
    assert report["score"]["counted"] == 3   # the cell file's mutants are scored apart


RENDEZVOUS = '''\
import os
import time

import pytest


@pytest.mark.certify_guard("shift")
def test_two_workers_meet():
    """Passes only when a second worker reaches this test while the first is in it."""
    folder = os.environ["MUTANTS_RENDEZVOUS"]
    open(os.path.join(folder, str(os.getpid())), "w").close()
    deadline = time.monotonic() + 120
    while len(os.listdir(folder)) < 2:
        assert time.monotonic() < deadline, "no second worker arrived"
        time.sleep(0.05)
'''


def test_workers_run_at_once_and_meet_a_test_the_item_universe_lacks(tmp_path, monkeypatch):
    """Two mutants whose tests can pass only together: each worker waits in a guard test until the
    other is in it too. The guard is in no item universe (lists/items.json): its marker is found in
    the test file's text."""
    project = make_project(tmp_path / "p")
    (project / "tests" / "test_rendezvous.py").write_text(RENDEZVOUS)
    meet = tmp_path / "meet"
    meet.mkdir()
    monkeypatch.setenv("MUTANTS_RENDEZVOUS", str(meet))
    res = certify_mutants(project, "--op", "shift", "--mutant", "impl_shifts_zero", "--mutant",
                          "impl_commuted", "--equivalent", "--jobs", "2", "--time-limit", "200")
    assert "impl_shifts_zero: survived" in res.stdout, res.stdout + res.stderr
    assert "impl_commuted: survived" in res.stdout, res.stdout + res.stderr
    assert len(list(meet.iterdir())) == 2   # two worker processes, in the test at the same time


def test_the_cap_leaves_out_the_costliest_tests_but_never_the_variants_own_cheapest_cell(tmp_path):
    project = make_project(tmp_path / "p")
    (project / "lists" / "durations.json").write_text(json.dumps({"format": "durations/1", "durations": {
        "tests/test_planted.py::test_shift_guard": 0.1, "cells/shift.yaml::torch[rows_4-cpu]": 5.0}}))
    res = certify_mutants(project, "--op", "shift", "--list", "--cap", "1")
    lines = {line.split()[1]: line for line in res.stdout.splitlines() if line.startswith("shift ")}
    assert "1 test(s), 0.1 s measured, 1 over the cap" in lines["spec_shifts_zero"], res.stdout
    assert "2 test(s), 5.1 s measured, 0 over the cap" in lines["impl_adds_two"], res.stdout
    res = certify_mutants(project, "--op", "shift", "--list", "--cap", "0")
    assert "2 test(s), 5.1 s measured, 0 over the cap" in res.stdout, res.stdout


def test_a_stale_mutant_is_an_error_naming_its_cell_file_line_and_field(tmp_path):
    """The variant's code changed under a mutant: its find text no longer occurs."""
    project = make_project(tmp_path / "p")
    ops = project / "planted" / "ops.py"
    ops.write_text(ops.read_text().replace("out.copy_(torch.where(x > 0, x + 1, x))",
                                           "out.copy_(x + (x > 0))"))
    res = certify_mutants(project, "--op", "shift", "--list")
    assert res.returncode == 1, res.stdout + res.stderr
    line = next(n for n, text in enumerate(CELLS.splitlines(), 1)
                if text.strip().startswith("find: \"out.copy_(torch.where(x > 0, x + 1, x))\""))
    assert f"shift.yaml:{line}: mutants[0].find: shift/impl_adds_two: the text to replace occurs 0 " \
           "times" in res.stderr, res.stderr
