"""Perf records: ``<reports>/perf/<arch>.jsonl``, one JSON record a line, the latest per
(op, variant, axes), sorted, each rewrite atomic and under the directory's lock (as receipts are).

A record is a median time of one variant at one shape, measured on the arch by a benchmark script
with the script's method (CUDA-graph replays where the call can be captured), with the versions it
ran under. A line that does not load is an error naming the file, the line and the field.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from certify.files.atomic import atomic_write_text, locked
from certify.files.paths import ProjectPaths
from certify.files.problem import FileProblem

AxisValue = int | str | bool


class PerfRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    op: str
    variant: str
    arch: str
    axes: dict[str, AxisValue] = Field(description="every axis of the op at the timed shape")
    us: float = Field(gt=0, description="median microseconds of one call")
    how: str = Field(description="'graph' (CUDA-graph replays), 'plain' (launches) or 'once' "
                                 "(one call after a warm-up, for a call over half a second)")
    script: str = Field(description="the benchmark that measured it")
    date: str
    versions: dict[str, str] = {}

    @property
    def key(self) -> tuple[str, str, tuple[tuple[str, AxisValue], ...]]:
        return (self.op, self.variant, tuple(sorted(self.axes.items())))


def perf_dir(paths: ProjectPaths) -> Path:
    return paths.reports / "perf"


def load_perf(directory: Path) -> list[PerfRecord]:
    """Every record of every ``<arch>.jsonl`` in ``directory`` (none when it does not exist)."""
    return [r for path in sorted(Path(directory).glob("*.jsonl")) for r in load_perf_file(path)]


def load_perf_file(path: Path) -> list[PerfRecord]:
    """The records of one arch file; a line that does not load raises ``FileProblem``."""
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = PerfRecord.model_validate_json(line)
        except ValidationError as e:
            err = e.errors()[0]
            field = ".".join(str(p) for p in err["loc"]) or "(record)"
            raise FileProblem(path, n, field, err["msg"]) from None
        if rec.arch != path.stem:
            raise FileProblem(path, n, "arch", f"{rec.arch!r} in the {path.stem!r} file")
        out.append(rec)
    return out


def write_perf(directory: Path, records: list[PerfRecord]) -> list[Path]:
    """Merge ``records`` into their arch files: a record replaces the one of the same key."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    with locked(directory):
        by_arch: dict[str, list[PerfRecord]] = {}
        for r in records:
            by_arch.setdefault(r.arch, []).append(r)
        for arch, new in sorted(by_arch.items()):
            path = directory / f"{arch}.jsonl"
            book = {r.key: r for r in (load_perf_file(path) if path.is_file() else [])}
            book.update({r.key: r for r in new})
            lines = [json.dumps(r.model_dump(), sort_keys=True) for _, r in sorted(
                book.items(), key=lambda kv: json.dumps(kv[0], default=str))]
            atomic_write_text(path, "\n".join(lines) + "\n")
            written.append(path)
    return written

