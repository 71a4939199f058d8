"""The budgets file (``[tool.certify] budgets``): each tier's cost budget and shard count, the cost
estimates for items without a measurement, and the risk weights of the features items exercise.

Loaded with line numbers: a problem is reported as file, line and field (``FileProblem``), like the
cell and gate files. ``certify lists`` reads it; see ``certify.lists`` for how the numbers are used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from certify.files.problem import FileProblem
from certify.files.yamlfile import field_name, load_mapping, load_validated, locate

UNIT_SECONDS = {"cpu_seconds": 1.0, "seconds": 1.0, "gpu_minutes": 60.0, "minutes": 60.0}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TierBudget(_Strict):
    """One tier: what its machine has, how much it may spend, in how many shards it runs."""

    budget: float | None = Field(None, gt=0, description=(
        "the most the tier's list may cost, in ``unit``; none: unlimited (on-demand: the rest)"))
    unit: Literal["cpu_seconds", "seconds", "gpu_minutes", "minutes"] = "seconds"
    shards: int = Field(1, ge=1, le=256, description="LPT shards the tier's list is split into")
    archs: tuple[str, ...] = Field(min_length=1, description="the archs the tier's machine has")
    gpus: int = Field(0, ge=0, description="GPUs of the tier's machine")
    doc: str = ""

    @property
    def budget_seconds(self) -> float | None:
        return None if self.budget is None else self.budget * UNIT_SECONDS[self.unit]


class GateEstimate(_Strict):
    """A gate's estimated cost: an engine start per engine configuration, plus its samples."""

    engine_start: float = Field(ge=0, description="seconds to build one engine (load, warm-up)")
    per_sample: dict[str, float] = Field(default_factory=dict, description="seconds a sample, per eval set")
    default_per_sample: float = Field(gt=0)


class Estimates(_Strict):
    """Costs (seconds) of items without a measured duration; every such item is flagged."""

    measured_only_premerge: bool = Field(True, description=(
        "an item without a measurement is never packed into the pre-merge list (CI's budget is spent "
        "on measured costs only); mandatory items are placed whatever their cost"))
    by_tier: dict[Literal["premerge", "postmerge", "ondemand"], float] = Field(description=(
        "an unmeasured item by its declared tier"))
    by_arch: dict[str, float] = Field(default_factory=dict, description=(
        "an unmeasured item on this arch (overrides by_tier)"))
    gate: GateEstimate


class RiskWeights(_Strict):
    """Risk weights of features. A feature's weight is shared equally among the items that exercise
    it, so an item's risk is the sum over its features of weight / (items exercising the feature), and
    the risk of all items together is the sum of the weights of all features exercised."""

    op: float = Field(ge=0, description="an op (its cells, guard, property test, tests naming it)")
    variant_reached: float = Field(ge=0, description="an (op, variant) the forward reaches")
    variant_per_scenario: float = Field(0, ge=0, description="added per scenario reaching the variant")
    variant_unreached: float = Field(ge=0, description="an (op, variant) no scenario reaches")
    variant_arch: float = Field(ge=0, description="an (op, variant) on one arch (native vs interpreter)")
    cell: float = Field(ge=0, description="a cell (its why), on any of its variants and archs")
    guard: float = Field(ge=0, description="an op's guard")
    property: float = Field(ge=0, description="an op's property test")
    gate: float = Field(ge=0, description="a gate (its engine configuration and checks)")
    engine_setting: float = Field(ge=0, description="one engine setting a gate exercises (key=value)")
    task: float = Field(ge=0, description="one evaluation set a gate reads")
    file: float = Field(ge=0, description="one test file")
    areas: dict[str, float] = Field(default_factory=dict, description=(
        "a test folder (path prefix, longest wins) and its weight, shared by its tests"))
    default_area: float = Field(1.0, ge=0)
    keywords: dict[str, float] = Field(default_factory=dict, description=(
        "a word in a test's id and the weight of the feature it names (e.g. fp8, rollback)"))


class Conditions(_Strict):
    gpu_archs: tuple[str, ...] = Field((), description="archs whose items need a GPU")
    gate_gpus: int = Field(0, ge=0, description="GPUs a gate needs")
    gate_archs: tuple[str, ...] = Field(("cpu",), min_length=1, description="where a gate can run")


class Budgets(_Strict):
    tiers: dict[Literal["premerge", "postmerge", "ondemand"], TierBudget]
    estimates: Estimates
    risk: RiskWeights
    conditions: Conditions = Conditions()
    pinned: dict[Literal["premerge", "postmerge"], dict[str, str]] = Field(
        default_factory=dict, description=(
            "items placed in a tier whatever their cost, like the guards: item id -> why"))
    note: str = ""

    @model_validator(mode="after")
    def _all_tiers(self) -> "Budgets":
        missing = [t for t in ("premerge", "postmerge", "ondemand") if t not in self.tiers]
        if missing:
            raise ValueError(f"every tier needs an entry: missing {', '.join(missing)}")
        return self


def load_budgets(path: Path) -> Budgets:
    path = Path(path)
    if not path.is_file():
        raise FileProblem(path, 1, "(file)", "no budgets file")
    return load_validated(path, Budgets)[0]


def pin_errors(path: Path, budgets: Budgets, item_ids: set[str]) -> list[FileProblem]:
    """A pinned item that matches no item of the universe (a typo, a renamed or removed test) is an
    error naming the line of the pin: left alone, it would pin nothing and say so nowhere."""
    path = Path(path)
    _, lines = load_mapping(path)
    out = []
    for tier, pins in budgets.pinned.items():
        for item_id in pins:
            if item_id not in item_ids:
                loc = ("pinned", tier, item_id)
                out.append(FileProblem(path, locate(loc, lines), field_name(loc),
                                        "pins no test: no item of the item universe (items.json "
                                        "of the lists folder) has this id (`certify lists "
                                        "--collect` re-collects it after a test is added)"))
    return out
