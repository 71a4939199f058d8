"""Expected results as data: a cell declares a (variant, arch) that fails, with the reason, as pytest's
strict xfail does. Its failing receipt reads ``expected failure``, ``certify run`` exits 0 when only
expected outcomes occur, and a declared failure that passes is an ``unexpected pass`` that fails the
run and the item until the declaration goes."""

from __future__ import annotations

import textwrap

import pytest

from certify.catalog.load import load_op_file
from certify.files.problem import FileProblem

from tests.framework.tmp_project import OP, make_project, run_in

def test_a_declared_failure_is_expected_and_the_run_passes(tmp_path):
    project = make_project(tmp_path, "high")
    res = run_in(project, "-m", "certify.cli", "run")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 passed, 0 not passed, 1 expected failure(s), 0 unexpected pass(es)" in res.stdout
    assert "the planted variant is one percent high" in res.stdout
    res = run_in(project, "-m", "pytest", "-p", "certify.pytest_plugin", "-q", "-p",
               "no:cacheprovider", "cells")
    assert "1 passed, 1 xfailed" in res.stdout, res.stdout + res.stderr

    # Freshness is judged where the project is (its root decides which modules its hashes cover).
    res = run_in(project, "-c", FRESHNESS)
    assert res.stdout.split() == ["high=expected_failure", "torch=certified"], res.stdout + res.stderr


FRESHNESS = textwrap.dedent("""\
    from certify.catalog.load import load_catalog
    from certify.receipts.store import freshness, load_receipts
    op = load_catalog("cells").ops["norm_x"]
    books = load_receipts("receipts")
    for v in ("high", "torch"):
        s = freshness(books["cpu"][("norm_x", v, "rows_4")], op, v, op.cell("rows_4"), "cpu")
        print(f"{v}={s.replace(' ', '_')}")
    """)


def test_a_declared_failure_that_passes_fails_the_run_and_the_item(tmp_path):
    project = make_project(tmp_path, "torch")
    res = run_in(project, "-m", "certify.cli", "run")
    assert res.returncode == 1
    assert "UNEXPECTED PASS norm_x::torch::rows_4::cpu" in res.stdout, res.stdout
    assert "FAILED norm_x::high::rows_4::cpu" in res.stdout, res.stdout
    res = run_in(project, "-m", "pytest", "-p", "certify.pytest_plugin", "-q", "-p",
               "no:cacheprovider", "cells")
    assert "2 failed" in res.stdout and "XPASS(strict)" in res.stdout, res.stdout


@pytest.mark.parametrize("entry, field, words", [
    ("{variant: nope, arch: cpu, why: a variant that does not exist}",
     "cells[0].expected_failures[0].variant", "unknown variant 'nope'"),
    ("{variant: torch, arch: sm_90, why: an arch the variant does not run on}",
     "cells[0].expected_failures[0]", "not certified at rows_4 on sm_90"),
    ("{variant: torch, arch: cpu}", "cells[0].expected_failures[0].why", "required field"),
])
def test_a_declaration_that_names_no_target_is_refused_naming_its_field(tmp_path, entry, field,
                                                                        words):
    text = OP.format(declared="high").replace(
        "      - variant: high\n        arch: cpu\n"
        "        why: the planted variant is one percent high everywhere\n", f"      - {entry}\n")
    path = tmp_path / "norm_x.yaml"
    path.write_text(text)
    with pytest.raises(FileProblem) as e:
        load_op_file(path)
    assert e.value.field == field and words in str(e.value), str(e.value)
