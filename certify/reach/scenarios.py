"""The scenarios the reach tracer runs: data (``[tool.certify] scenarios``), one YAML file.

The framework fixes only the envelope of a scenario (``ScenarioBase``: a ``name`` and a ``why``); what a
scenario says (requests, lengths, storage dtypes, speculation ...) is the target's own pydantic model,
the ``scenario_model`` of its tracer. A malformed file gives one error naming the file, the line and the
field, as the cell files do::

    scenarios:
      - name: decode_b1
        why: one request decoding, the latency case
        ...the target's fields...
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, create_model

from certify.files.problem import FileProblem
from certify.files.yamlfile import field_name, load_validated, locate


class ScenarioBase(BaseModel):
    """What every scenario has; a target's scenario model subclasses it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    why: str = Field(min_length=10, description="what this scenario reaches that the others do not")


def load_scenarios(path: Path, model: type[ScenarioBase]) -> list[ScenarioBase]:
    """Every scenario of the file, validated by the target's ``model``; ``FileProblem`` on the first
    problem (file, line, field)."""
    path = Path(path)
    file_model = create_model("ScenarioFile", __config__=ConfigDict(extra="forbid"),
                              scenarios=(list[model], Field(min_length=1)))
    parsed, lines = load_validated(path, file_model)
    seen: set[str] = set()
    for i, sc in enumerate(parsed.scenarios):
        if sc.name in seen:
            loc = ("scenarios", i, "name")
            raise FileProblem(path, locate(loc, lines), field_name(loc),
                                f"scenario name {sc.name!r} repeats")
        seen.add(sc.name)
    return list(parsed.scenarios)
