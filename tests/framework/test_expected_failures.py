"""Expected results as data: a cell declares a (variant, arch) that fails, with the reason, as pytest's
strict xfail does. Its failing receipt reads ``expected failure``, ``certify run`` exits 0 when only
expected outcomes occur, and a declared failure that passes is an ``unexpected pass`` that fails the
run and the item until the declaration goes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from certify.catalog.load import load_op_file
from certify.files.problem import FileProblem

ROOT = Path(__file__).resolve().parents[2]
OP = textwrap.dedent("""\
    op: norm_x
    summary: the standalone gated norm, for the expected-failure tests
    spec: spec.ops.norms:gated_rmsnorm
    inputs: spec.cases.gdn:gated_norm_case
    axes:
      rows: {{kind: int, reach: [1, 64]}}
      value_heads: {{kind: choice, values: [2]}}
      head_dim: {{kind: choice, values: [16]}}
    variants:
      - name: torch
        impl: impl.kernels.gdn.torch_ops:gated_rmsnorm
        archs: [cpu]
      - name: high
        impl: tests.framework.broken_variants:gated_rmsnorm_one_percent_high
        archs: [cpu]
    cells:
      - id: rows_4
        axes: {{rows: 4}}
        why: a small case for the expected-failure tests
        tier: premerge
        oracle: {{kind: bitwise, against: spec}}
        expected_failures:
          - variant: {declared}
            arch: cpu
            why: the planted variant is one percent high everywhere
    """)


def _project(tmp: Path, declared: str) -> Path:
    (tmp / "pyproject.toml").write_text('[tool.certify]\ncells = "cells"\nreceipts = "receipts"\n')
    (tmp / "cells").mkdir(exist_ok=True)
    (tmp / "cells" / "norm_x.yaml").write_text(OP.format(declared=declared))
    return tmp


def _run(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args], cwd=tmp, env=env, capture_output=True,
                          text=True, timeout=300)


def test_a_declared_failure_is_expected_and_the_run_passes(tmp_path):
    project = _project(tmp_path, "high")
    res = _run(project, "-m", "certify.cli", "run")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 passed, 0 not passed, 1 expected failure(s), 0 unexpected pass(es)" in res.stdout
    assert "the planted variant is one percent high" in res.stdout
    res = _run(project, "-m", "pytest", "-p", "certify.pytest_plugin", "-q", "-p",
               "no:cacheprovider", "cells")
    assert "1 passed, 1 xfailed" in res.stdout, res.stdout + res.stderr

    # Freshness is judged where the project is (its root decides which modules its hashes cover).
    res = _run(project, "-c", FRESHNESS)
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
    project = _project(tmp_path, "torch")
    res = _run(project, "-m", "certify.cli", "run")
    assert res.returncode == 1
    assert "UNEXPECTED PASS norm_x::torch::rows_4::cpu" in res.stdout, res.stdout
    assert "FAILED norm_x::high::rows_4::cpu" in res.stdout, res.stdout
    res = _run(project, "-m", "pytest", "-p", "certify.pytest_plugin", "-q", "-p",
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
