"""The scenario file: the framework's envelope (name, why), the target's fields, and errors that name the
file, the line and the field (certify/reach/scenarios.py)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from pydantic import Field

from certify.files.paths import project_paths
from certify.reach import load_tracer
from certify.files.problem import FileProblem
from certify.reach.scenarios import ScenarioBase, load_scenarios

PATHS = project_paths()


class Toy(ScenarioBase):
    """A stand-in target's scenario: the framework names no model."""

    rows: int = Field(ge=1)
    dtype: str = "bf16"


GOOD = textwrap.dedent("""\
    scenarios:
      - name: one_row
        why: the smallest step there is
        rows: 1
      - name: many_rows
        why: a step of many rows
        rows: 64
        dtype: fp8
    """)


def write(tmp: Path, text: str) -> Path:
    p = tmp / "scenarios.yaml"
    p.write_text(text)
    return p


def test_a_good_file_loads(tmp_path):
    loaded = load_scenarios(write(tmp_path, GOOD), Toy)
    assert [s.name for s in loaded] == ["one_row", "many_rows"] and loaded[1].rows == 64


@pytest.mark.parametrize("edit, line, field, words", [
    (lambda s: s.replace("rows: 64", "rows: 0"), 7, "scenarios[1].rows", "greater than or equal"),
    (lambda s: s.replace("    dtype: fp8\n", "    dtpye: fp8\n"), 8, "scenarios[1].dtpye",
     "unknown field"),
    (lambda s: s.replace("    why: the smallest step there is\n", ""), 2, "scenarios[0].why",
     "required field is missing"),
    (lambda s: s.replace("many_rows", "one_row"), 5, "scenarios[1].name", "repeats"),
    (lambda s: s.replace("name: one_row", "name: One Row"), 2, "scenarios[0].name", "pattern"),
    (lambda s: s + "  - [oops\n", 10, "(yaml)", ""),
])
def test_a_bad_file_names_the_line_and_the_field(tmp_path, edit, line, field, words):
    path = write(tmp_path, edit(GOOD))
    with pytest.raises(FileProblem) as err:
        load_scenarios(path, Toy)
    e = err.value
    assert (e.line, e.field) == (line, field), str(e)
    assert words in e.message and str(path) in str(e)


def test_the_project_scenarios_load_with_the_target_model():
    tracer = load_tracer(PATHS.tracer)
    scenarios = load_scenarios(PATHS.scenarios, tracer.scenario_model)
    assert len(scenarios) >= 10 and all(s.why for s in scenarios)


def test_a_target_rule_error_names_the_scenario_field(tmp_path):
    tracer = load_tracer(PATHS.tracer)
    text = textwrap.dedent("""\
        scenarios:
          - name: verify_without_draft
            why: verify rows need a draft length
            verify: [{requests: 2, context: 64}]
        """)
    with pytest.raises(FileProblem) as err:
        load_scenarios(write(tmp_path, text), tracer.scenario_model)
    assert err.value.field == "scenarios[0]" and "draft_length" in err.value.message
