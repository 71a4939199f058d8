"""The pydantic schema of a gate file, ``<gates dir>/<gate>.yaml``, and of the reference files.

A gate is an engine configuration and the checks that fit in it (DESIGN.md, "Gate"): every task the
checks read runs once on the gate's engine, a paired check also runs it on the configuration it is
compared with, in the same run. The framework does not interpret ``engine``: it is the target's
configuration, passed through to the target (``[tool.certify] gate_target``), which validates it.

    gate: draft3_fp8_kv
    summary: speculation with 3 draft tokens over an fp8 KV cache
    why: the lossy KV storage under speculation, with the draft's acceptance
    tier: postmerge
    engine: {kv_cache_dtype: fp8, speculative: {draft_length: 3}}
    tasks:
      arithmetic: {eval_set: arithmetic, samples: 40}
    checks:
      - {kind: accuracy, task: arithmetic}
      - {kind: acceptance_length, task: arithmetic}
      - {kind: paired_delta, task: arithmetic}          # against the identity configuration, {}
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from certify.gating.stats import ACCEPTANCE_RATIO
from certify.catalog.schema import Tier

_IDENT = r"^[a-z][a-z0-9_]*$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TaskRun(_Strict):
    """One task of a gate: an evaluation set of the target, and how many of its samples (the first n)."""

    eval_set: str = Field(min_length=1)
    samples: int = Field(ge=1, description="the first n samples of the set")


class AccuracyCheck(_Strict):
    """The task's per-sample scores did not get worse than its reference's more often than chance
    allows (the exact one-sided sign test, McNemar's for 0/1 scores, at the tier's Bonferroni share of
    its family-wise rate: certify.gating.stats)."""

    kind: Literal["accuracy"]
    task: str


class AcceptanceCheck(_Strict):
    """The acceptance length is at least ``ratio`` of the reference's, and at least 1.0."""

    kind: Literal["acceptance_length"]
    task: str
    ratio: float = Field(ACCEPTANCE_RATIO, gt=0, le=1)


class PairedDeltaCheck(_Strict):
    """Per sample, score(gate engine) - score(``against``), both measured in this run, did not fall
    below the same difference in the references more often than chance allows (the exact one-sided
    sign test at the tier's share of its family-wise rate: certify.gating.stats)."""

    kind: Literal["paired_delta"]
    task: str
    against: dict[str, Any] = Field(default_factory=dict, description=(
        "the configuration compared with (the target's engine mapping; {} = its identity "
        "configuration)"))


Check = Annotated[Union[AccuracyCheck, AcceptanceCheck, PairedDeltaCheck], Field(discriminator="kind")]


class GateFile(_Strict):
    """One gate; ``gate`` must equal the file's stem."""

    gate: str = Field(pattern=_IDENT)
    summary: str = Field(min_length=10)
    why: str = Field(min_length=10, description="what this gate catches that the others do not")
    tier: Tier
    engine: dict[str, Any] = Field(default_factory=dict, description=(
        "the target's engine configuration, passed through as is ({} = its identity configuration)"))
    tasks: dict[str, TaskRun] = Field(min_length=1)
    checks: tuple[Check, ...] = Field(min_length=1)
    note: str = ""


# ------------------------------------------------------------------------------ references


class Reference(_Strict):
    """One measurement of one evaluation set under one configuration: the statistic a check compares
    with, and what it cost. ``target`` and ``engine`` (the target's full configuration, as it resolved
    the gate's mapping) and ``samples`` are the key."""

    target: dict[str, str]
    engine: dict[str, Any]
    samples: int = Field(ge=1)
    accuracy: float = Field(description="mean score in points (0..100)")
    scores: str | list[float] = Field(description=(
        "per-sample scores, in sample order: a string of 0 / 1 when every score is one of them"))
    acceptance_length: float | None = None
    verify_steps: int | None = None
    seconds: float = Field(ge=0, description="wall time of the measurement")
    arch: str
    recorded: str = Field(description="UTC date and time of the measurement")

    def score_list(self) -> list[float]:
        if isinstance(self.scores, str):
            return [float(c) for c in self.scores]
        return list(self.scores)


class ReferenceFile(_Strict):
    """Every reference of one evaluation set (``<references dir>/<eval_set>.yaml``)."""

    eval_set: str
    sha256: str = Field(description="the set's content hash; references of another content never apply")
    references: tuple[Reference, ...] = ()
