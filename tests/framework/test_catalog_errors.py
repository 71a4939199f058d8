"""A malformed cell file gets one clear error naming the file, the line and the field, and nothing else
in the run is affected."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from certify.files.problem import FileProblem
from certify.catalog.load import load_catalog, load_op_file

GOOD = textwrap.dedent("""\
    op: {op}
    summary: the standalone gated norm, for the loader's tests
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
    cells:
      - id: rows_4
        axes: {{rows: 4}}
        why: a small case for the loader's tests
        tier: premerge
        oracle: {{kind: bitwise, against: spec}}
    """)


def write(tmp: Path, name: str, text: str) -> Path:
    p = tmp / f"{name}.yaml"
    p.write_text(text)
    return p


def test_a_good_file_loads(tmp_path):
    op = load_op_file(write(tmp_path, "good_op", GOOD.format(op="good_op")))
    assert op.cells[0].id == "rows_4"


@pytest.mark.parametrize("edit, line, field, words", [
    # missing why: the error points at the cell (line 14) and names the field.
    (lambda s: s.replace("    why: a small case for the loader's tests\n", ""), 14, "cells[0].why",
     "required field is missing"),
    # a cell naming an unknown variant.
    (lambda s: s.replace("    tier: premerge\n", "    tier: premerge\n    variants: [trition]\n"),
     18, "cells[0].variants[0]", "unknown variant 'trition'"),
    # a wrong type: reach must be two integers.
    (lambda s: s.replace("reach: [1, 64]", "reach: [one, 64]"), 6, "axes.rows.reach[0]",
     "valid integer"),
    # an unknown field (a typo).
    (lambda s: s.replace("    tier: premerge\n", "    teir: premerge\n"), 17, "cells[0].teir",
     "unknown field"),
    # a cell axis outside its domain.
    (lambda s: s.replace("axes: {rows: 4}", "axes: {rows: 400}"), 15, "cells[0].axes.rows",
     "outside the axis domain"),
    # a dispatch rule reading an axis that does not exist.
    (lambda s: s.replace("archs: [cpu]\n", "archs: [cpu]\n    dispatch: batch > 2\n"), 13,
     "variants[0].dispatch", "unknown axes ['batch']"),
])
def test_malformed_files_name_file_line_and_field(tmp_path, edit, line, field, words):
    p = write(tmp_path, "bad_op", edit(GOOD.format(op="bad_op")))
    with pytest.raises(FileProblem) as info:
        load_op_file(p)
    e = info.value
    assert (e.file, e.field) == (p, field)
    assert e.line == line, str(e)
    assert words in e.message
    assert str(e).startswith(f"{p}:{line}: {field}: ")


def test_yaml_syntax_errors_name_the_line(tmp_path):
    p = write(tmp_path, "broken", "op: broken\nsummary: [unclosed\n")
    with pytest.raises(FileProblem) as info:
        load_op_file(p)
    assert info.value.field == "(yaml)" and info.value.line >= 2


def test_the_op_name_must_match_the_file(tmp_path):
    p = write(tmp_path, "other_name", GOOD.format(op="good_op"))
    with pytest.raises(FileProblem, match="must match the file name"):
        load_op_file(p)


def test_one_bad_file_leaves_the_others_loaded(tmp_path):
    write(tmp_path, "good_op", GOOD.format(op="good_op"))
    write(tmp_path, "bad_op", GOOD.format(op="bad_op").replace("tier: premerge", "tier: nightly"))
    cat = load_catalog(tmp_path)
    assert list(cat.ops) == ["good_op"]
    assert len(cat.errors) == 1 and cat.errors[0].field == "cells[0].tier"


def test_pytest_run_reports_the_bad_file_and_runs_the_good_one(tmp_path):
    """The plugin turns a bad file into one failing item; the good file's cells still run and pass."""
    (tmp_path / "pyproject.toml").write_text('[tool.certify]\ncells = "cells"\n')
    cells = tmp_path / "cells"
    cells.mkdir()
    write(cells, "good_op", GOOD.format(op="good_op"))
    write(cells, "bad_op", GOOD.format(op="bad_op").replace("archs: [cpu]", "archs: cpu-only"))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    res = subprocess.run([sys.executable, "-m", "pytest", "-p", "certify.pytest_plugin", "-q",
                          "-p", "no:cacheprovider", "cells"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    out = res.stdout + res.stderr
    assert "1 failed, 1 passed" in out, out
    assert "bad_op.yaml:12: variants[0].archs" in out, out
