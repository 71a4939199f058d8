"""Gates: load the gate files and the reference files, and the target's side of a gate run.

The framework names no model. Everything about the target comes through the object named by
``[tool.certify] gate_target`` (a ``GateTarget``): which evaluation sets exist, what an engine mapping
resolves to, how a task is run, and why gates cannot run on this machine (e.g. no trained checkpoint),
in which case every gate is skipped with that reason.

A malformed gate or reference file gives one error naming the file, the line and the field, as the
cell files do; the other files still load.

References (``[tool.certify] gate_references``, one YAML file per evaluation set) are keyed by the
configuration that produced them: the target's identity (e.g. its checkpoint's hash), the engine
configuration as the target resolved it, the evaluation set's content hash and the sample count.
Gates whose configurations coincide share their references. A reference is also checked against
itself when it loads (``reference_problem``): its per-sample scores are what every check reads, so
a count that is not its sample count, a score outside 0..1 (a 0 / 1 string holding another
character) or an accuracy that is not the mean of its scores is an error naming the file, the line
and the field, and the file's references are not used.
"""

from __future__ import annotations

import datetime as _dt
import json
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import yaml
from pydantic import ValidationError

from certify.files.problem import FileProblem
from certify.gating.schema import (
    AcceptanceCheck,
    GateFile,
    PairedDeltaCheck,
    Reference,
    ReferenceFile,
)
from certify.harness.target import resolve
from certify.files.paths import project_paths
from certify.files.yamlfile import field_name, load_validated, locate

Progress = Callable[[int, int], None]


# ------------------------------------------------------------------------------ the target's side


@dataclass(frozen=True)
class EvalSetInfo:
    size: int
    sha256: str


@dataclass
class TaskResult:
    """One evaluation set run on one engine configuration."""

    scores: list[float]                                        # per sample, 0..1, in sample order
    accepted: list[list[int]] = field(default_factory=list)    # per sample: tokens per verify step
    seconds: float = 0.0

    @property
    def verify_steps(self) -> int:
        return sum(len(a) for a in self.accepted)

    @property
    def acceptance_length(self) -> float | None:
        steps = self.verify_steps
        return sum(sum(a) for a in self.accepted) / steps if steps else None


class GateTarget(Protocol):
    def unavailable(self) -> str | None:
        """Why gates cannot run here (shown as the skip reason), or None."""

    def identity(self) -> dict[str, str]:
        """What is being evaluated (e.g. the checkpoint's hash): part of every reference's key."""

    def arch(self) -> str:
        """Where evaluations run (recorded with a reference)."""

    def eval_sets(self) -> dict[str, EvalSetInfo]:
        """The evaluation sets a gate may name."""

    def resolve_engine(self, engine: Mapping[str, Any]) -> dict[str, Any]:
        """The full configuration a gate's engine mapping stands for (JSON-able), or a
        ``ValueError`` / pydantic ``ValidationError`` naming the field at fault."""

    def speculative(self, engine: Mapping[str, Any]) -> bool:
        """Whether the configuration runs verify steps (an acceptance length exists)."""

    def evaluate(self, engine: Mapping[str, Any], eval_set: str, samples: int,
                 progress: Progress | None = None) -> TaskResult:
        """Run the first ``samples`` samples of ``eval_set`` on an engine of this configuration."""


@dataclass(frozen=True)
class GateSettings:
    gates: Path
    references: Path
    reports: Path
    target: str | None


def gate_settings(root: str | None = None) -> GateSettings:
    """The gates' paths and target entry point from ``[tool.certify]``."""
    paths = project_paths(root)
    py = paths.root / "pyproject.toml"
    cfg = tomllib.loads(py.read_text()).get("tool", {}).get("certify", {}) if py.is_file() else {}
    return GateSettings(gates=paths.gates,
                        references=paths.root / cfg.get("gate_references", "certify/gates/references"),
                        reports=paths.reports / "gates", target=cfg.get("gate_target"))


def load_target(spec: str | None) -> GateTarget:
    if not spec:
        raise ValueError('no gate target: set [tool.certify] gate_target = "module:object" in '
                         "pyproject.toml")
    obj = resolve(spec)
    return obj() if isinstance(obj, type) else obj


# ------------------------------------------------------------------------------ gate files


def _config_problem(err: Exception) -> tuple[tuple, str]:
    """(location inside the mapping, message) of a target's refusal of an engine mapping."""
    if isinstance(err, ValidationError):
        e = err.errors()[0]
        loc = tuple(p for p in e["loc"] if isinstance(p, (int, str)))
        return loc, e["msg"] if e["type"] != "extra_forbidden" else "unknown field (a typo?)"
    return (), str(err)


def _cross_check(gate: GateFile, target: GateTarget | None) -> tuple[tuple, str] | None:
    for i, check in enumerate(gate.checks):
        if check.task not in gate.tasks:
            return ("checks", i, "task"), f"unknown task {check.task!r} (tasks: {sorted(gate.tasks)})"
    if target is None:
        return None
    sets = target.eval_sets()
    for name, run in gate.tasks.items():
        if run.eval_set not in sets:
            return ("tasks", name, "eval_set"), (f"unknown evaluation set {run.eval_set!r} "
                                                 f"(known: {sorted(sets)})")
        if run.samples > sets[run.eval_set].size:
            return ("tasks", name, "samples"), (f"{run.samples} samples, but {run.eval_set!r} has "
                                                f"{sets[run.eval_set].size}")
    try:
        own = target.resolve_engine(gate.engine)
    except (ValueError, TypeError) as e:
        loc, msg = _config_problem(e)
        return ("engine", *loc), msg
    for i, check in enumerate(gate.checks):
        if isinstance(check, AcceptanceCheck) and not target.speculative(gate.engine):
            return ("checks", i, "kind"), "an acceptance length needs speculation in the gate's engine"
        if isinstance(check, PairedDeltaCheck):
            try:
                other = target.resolve_engine(check.against)
            except (ValueError, TypeError) as e:
                loc, msg = _config_problem(e)
                return ("checks", i, "against", *loc), msg
            if other == own:
                return ("checks", i, "against"), "compares the gate's configuration with itself"
    return None


def load_gate_file(path: Path, target: GateTarget | None = None) -> GateFile:
    """Load and validate one gate file (against the target when given); ``FileProblem`` on the first
    problem, naming file, line and field."""
    path = Path(path)
    gate, lines = load_validated(path, GateFile)
    if gate.gate != path.stem:
        raise FileProblem(path, locate(("gate",), lines), "gate",
                        f"gate {gate.gate!r} must match the file name {path.stem!r}")
    problem = _cross_check(gate, target)
    if problem:
        loc, msg = problem
        raise FileProblem(path, locate(loc, lines), field_name(loc), msg)
    return gate


@dataclass
class Gates:
    gates: dict[str, GateFile] = field(default_factory=dict)
    files: dict[str, Path] = field(default_factory=dict)
    errors: list[FileProblem] = field(default_factory=list)


def load_gates(gates_dir: Path, target: GateTarget | None = None) -> Gates:
    out = Gates()
    for path in sorted(Path(gates_dir).glob("*.yaml")):
        try:
            gate = load_gate_file(path, target)
        except FileProblem as e:
            out.errors.append(e)
            continue
        out.gates[gate.gate] = gate
        out.files[gate.gate] = path
    return out


# ------------------------------------------------------------------------------ references


def config_key(engine: Mapping[str, Any]) -> str:
    """A canonical text of a resolved configuration (what two references are compared by)."""
    return json.dumps(engine, sort_keys=True, separators=(",", ":"))


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


ACCURACY_TOLERANCE = 1e-9   # points: a stored mean differs from the recomputed one by rounding only


def reference_problem(ref: Reference) -> tuple[str, str] | None:
    """(field, message) of the first way ``ref`` contradicts itself, or None."""
    if isinstance(ref.scores, str):
        bad = sorted({ch for ch in ref.scores if ch not in "01"})
        if bad:
            return "scores", (f"a string of scores holds only 0 and 1, this one also {bad} (at "
                              f"sample {next(i for i, ch in enumerate(ref.scores) if ch in bad)})")
    else:
        bad = [(i, s) for i, s in enumerate(ref.scores) if not 0.0 <= s <= 1.0]
        if bad:
            return "scores", f"scores lie in 0..1; sample {bad[0][0]} is {bad[0][1]}"
    n = len(ref.scores)
    if n != ref.samples:
        return "scores", f"{n} scores for {ref.samples} samples"
    mean = 100.0 * sum(ref.score_list()) / n
    if abs(mean - ref.accuracy) > ACCURACY_TOLERANCE:
        return "accuracy", f"{ref.accuracy} is not the mean of its scores ({mean!r} points)"
    return None


class ReferenceStore:
    """The reference files of one directory; ``find`` and ``add`` by key, ``save`` writes them back
    (sorted, so a recorded reference is a readable diff)."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.files: dict[str, ReferenceFile] = {}
        self.errors: list[FileProblem] = []
        self._dirty: set[str] = set()
        for path in sorted(self.dir.glob("*.yaml")) if self.dir.is_dir() else []:
            try:
                ref, lines = load_validated(path, ReferenceFile)
            except FileProblem as problem:
                self.errors.append(problem)
                continue
            if ref.eval_set != path.stem:
                self.errors.append(FileProblem(path, locate(("eval_set",), lines), "eval_set",
                                             f"{ref.eval_set!r} must match the file name"))
                continue
            problems = [(i, p) for i, r in enumerate(ref.references)
                        if (p := reference_problem(r)) is not None]
            if problems:
                i, (name, message) = problems[0]
                loc = ("references", i, name)
                more = len(problems) - 1
                self.errors.append(FileProblem(path, locate(loc, lines), field_name(loc), message + (
                    f" (and {more} more reference{'s' if more > 1 else ''} in this file)"
                    if more else "")))
                continue
            self.files[ref.eval_set] = ref

    def find(self, eval_set: str, sha256: str, target: Mapping[str, str], engine: Mapping[str, Any],
             samples: int) -> Reference | None:
        f = self.files.get(eval_set)
        if f is None or f.sha256 != sha256:
            return None
        key = config_key(engine)
        for r in f.references:
            if r.target == dict(target) and config_key(r.engine) == key and r.samples == samples:
                return r
        return None

    def add(self, eval_set: str, sha256: str, ref: Reference, overwrite: bool = False) -> bool:
        """Store ``ref``; an existing one with its key is kept unless ``overwrite``. A file of another
        content hash is replaced, and references of another target are dropped: neither applies
        again (a target is recorded as the model under test now, e.g. the committed checkpoint's
        hash, so a reference of a replaced model is dead data). Returns whether it was stored."""
        f = self.files.get(eval_set)
        keep = list(f.references) if f is not None and f.sha256 == sha256 else []
        keep = [r for r in keep if r.target == ref.target]
        key = (config_key(ref.target), config_key(ref.engine), ref.samples)
        same = [r for r in keep if (config_key(r.target), config_key(r.engine), r.samples) == key]
        if same and not overwrite:
            return False
        keep = [r for r in keep if r not in same] + [ref]
        keep.sort(key=lambda r: (config_key(r.target), config_key(r.engine), r.samples))
        self.files[eval_set] = ReferenceFile(eval_set=eval_set, sha256=sha256, references=tuple(keep))
        self._dirty.add(eval_set)
        return True

    def save(self) -> list[Path]:
        self.dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in sorted(self._dirty):
            path = self.dir / f"{name}.yaml"
            data = self.files[name].model_dump(mode="json", exclude_none=True)
            header = (f"# References of evaluation set {name!r}, keyed by the configuration that "
                      "produced them.\n# Written by `certify gates run --record`; review before "
                      "committing.\n")
            path.write_text(header + yaml.safe_dump(data, sort_keys=True, width=100,
                                                    default_flow_style=None))
            written.append(path)
        self._dirty.clear()
        return written


__all__ = ["EvalSetInfo", "TaskResult", "GateTarget", "GateSettings", "gate_settings", "load_target",
           "FileProblem", "load_gate_file", "Gates", "load_gates", "config_key", "reference_problem",
           "ReferenceStore", "utc_now"]
