"""``certify diff BASE``: what a change did to the certification, against a git revision.

Both sides are read as snapshots of the generated files: the cell files, the receipts, the reach
file, the test lists and the gate results. BASE's come from git (``git archive``); the other side
is the working tree. A target's status at BASE is what its receipt says (passed / failed / none);
its status now is ``freshness`` against the code as it is now (certified, failed, stale, invalid,
not run), so an edited kernel whose receipts were not re-made shows as stale.

Sections, each counted on the first screen with its first items, details folded below:
- newly certified, newly failing, stale now, targets added or removed;
- bands widened or narrowed (a cell's per-output max_ulp / max_rel_rms, or a bitwise oracle that
  became a tolerance);
- measured errors that moved by more than ``MOVED`` (relative) in a target certified on both sides;
- reach gained or lost: (op, variant, mode) pairs of the reach file;
- gates whose status changed;
- list placements: tests that moved between the pre-merge, post-merge and on-demand lists.
"""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from certify.catalog.load import Catalog, load_catalog
from certify.catalog.plan import targets
from certify.receipts.store import Receipt, freshness, load_receipts

MOVED = 0.10            # a measured error that moved by more than 10 % of its base value
SHOWN = 3               # items named on the first screen, per section
DETAIL_ROWS = 60        # rows of a folded table
LISTS = ("premerge", "postmerge", "ondemand")

Key = tuple[str, str, str, str]   # op, variant, cell, arch


@dataclass
class Snapshot:
    """The generated files of one side."""

    catalog: Catalog
    receipts: dict[str, dict[tuple[str, str, str], Receipt]]
    reach: dict
    gates: dict[str, str]
    lists: dict[str, str]            # test id -> list name

    @classmethod
    def read(cls, root: Path, layout: dict[str, str]) -> Snapshot:
        """The files under ``root`` at ``layout``'s relative paths (``layout_of``)."""
        at = {k: Path(root) / v for k, v in layout.items()}
        catalog = load_catalog(at["cells"]) if at["cells"].is_dir() else Catalog()
        receipts = load_receipts(at["receipts"]) if at["receipts"].is_dir() else {}
        reach = (json.loads(at["reach"].read_text()).get("reach", {}) if at["reach"].exists()
                 else {})
        gates = {}
        for path in sorted(at["gates"].glob("*.json")):
            data = json.loads(path.read_text())
            gates[data.get("gate", path.stem)] = str(data.get("status", "?"))
        lists = {}
        for name in LISTS:
            path = at["lists"] / f"{name}.yml"
            if path.exists():
                data = yaml.safe_load(path.read_text()) or {}
                for block in data.get("blocks") or []:
                    for test in block.get("tests") or []:
                        lists[test] = name
        return cls(catalog, receipts, reach, gates, lists)


def layout_of(paths) -> dict[str, str]:
    """The snapshot's paths relative to the project root (certify.files.paths.ProjectPaths)."""
    rel = lambda p: str(Path(p).relative_to(paths.root))  # noqa: E731
    return {"cells": rel(paths.cells), "receipts": rel(paths.receipts), "reach": rel(paths.reach),
            "gates": rel(Path(paths.reports) / "gates"), "lists": rel(paths.lists)}


def base_snapshot(revision: str, repo: Path, layout: dict[str, str]
                  ) -> tuple[Snapshot, tempfile.TemporaryDirectory]:
    """BASE's generated files, extracted from git into a temporary directory (kept alive by the
    returned handle). A path BASE lacks is simply absent from its snapshot."""
    tmp = tempfile.TemporaryDirectory(prefix="certify-diff-")
    present = subprocess.run(["git", "-C", str(repo), "ls-tree", "--name-only", revision, "--",
                              *layout.values()], capture_output=True, text=True)
    if present.returncode != 0:
        tmp.cleanup()
        raise ValueError(f"git cannot read revision {revision!r}: {present.stderr.strip()}")
    paths = present.stdout.split()
    if paths:
        archive = subprocess.run(["git", "-C", str(repo), "archive", revision, "--", *paths],
                                 capture_output=True, check=True)
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(tmp.name, filter="data")
    return Snapshot.read(Path(tmp.name), layout), tmp


# ------------------------------------------------------------------------------------ comparing


@dataclass
class Diff:
    sections: dict[str, list[list[str]]] = field(default_factory=dict)   # title -> table rows
    headers: dict[str, list[str]] = field(default_factory=dict)
    names: dict[str, int] = field(default_factory=dict)   # title -> columns that name an item

    def add(self, title: str, header: list[str], rows: list[list[str]], names: int = 1) -> None:
        self.headers[title] = header
        self.sections[title] = rows
        self.names[title] = names


def _status_now(head: Snapshot) -> dict[Key, str]:
    out = {}
    for name, op in head.catalog.ops.items():
        for t in targets(op):
            r = head.receipts.get(t.arch, {}).get((name, t.variant.name, t.cell.id))
            out[(name, t.variant.name, t.cell.id, t.arch)] = freshness(r, op, t.variant.name,
                                                                       t.cell, t.arch)
    return out


def _status_base(base: Snapshot) -> dict[Key, str]:
    out = {}
    for name, op in base.catalog.ops.items():
        for t in targets(op):
            r = base.receipts.get(t.arch, {}).get((name, t.variant.name, t.cell.id))
            out[(name, t.variant.name, t.cell.id, t.arch)] = ("not run" if r is None
                                                              else r.status)
    return out


def _name(k: Key) -> str:
    return f"{k[0]}::{k[1]}::{k[2]} ({k[3]})"


def _bands(cat: Catalog) -> dict[tuple[str, str, str], tuple[str, float, float]]:
    out = {}
    for name, op in cat.ops.items():
        for cell in op.cells:
            o = cell.oracle
            if o.kind == "bitwise":
                out[(name, cell.id, "*")] = ("bitwise", 0.0, 0.0)
                continue
            for output, band in o.outputs.items():
                out[(name, cell.id, output)] = ("tolerance", band.max_ulp, band.max_rel_rms)
        for tier, t in op.numerics.items():  # a tier's bands hold in every cell its variants serve
            for output, band in t.outputs.items():
                out[(name, f"{tier} tier", output)] = ("tolerance", band.max_ulp, band.max_rel_rms)
    return out


def _band_rows(base: Snapshot, head: Snapshot) -> tuple[list[list[str]], list[list[str]]]:
    old, new = _bands(base.catalog), _bands(head.catalog)
    widened, narrowed = [], []
    for (op, cell, output), (kind, ulp, rms) in sorted(new.items()):
        if (op, cell, output) in old:
            okind, oulp, orms = old[(op, cell, output)]
            if kind == okind and (ulp, rms) == (oulp, orms):
                continue
            row = [f"{op}::{cell}", output, _band_text(okind, oulp, orms), _band_text(kind, ulp, rms)]
            looser = kind == "tolerance" and (okind == "bitwise" or ulp > oulp or rms > orms)
            (widened if looser else narrowed).append(row)
        elif kind == "tolerance" and (op, cell, "*") in old:
            widened.append([f"{op}::{cell}", output, "bitwise", _band_text(kind, ulp, rms)])
    return widened, narrowed


def _band_text(kind: str, ulp: float, rms: float) -> str:
    return "bitwise" if kind == "bitwise" else f"{ulp:g} ulp, {rms:g} eps rms"


def _moved(base: Snapshot, head: Snapshot, now: dict[Key, str]) -> list[list[str]]:
    rows = []
    for arch, book in head.receipts.items():
        for (op, variant, cell), r in book.items():
            b = base.receipts.get(arch, {}).get((op, variant, cell))
            if b is None or b.status != "passed" or now.get((op, variant, cell, arch)) != "certified":
                continue
            for metric, value in sorted(r.metrics.items()):
                was = b.metrics.get(metric)
                if was is None or metric.endswith(".mismatches"):
                    continue
                if abs(value - was) > MOVED * max(abs(was), 1e-30):
                    rows.append([_name((op, variant, cell, arch)), metric, f"{was:.4g}",
                                 f"{value:.4g}"])
    return rows


def _reach_pairs(reach: dict) -> set[tuple[str, str, str]]:
    return {(op, variant, mode) for op, variants in reach.items()
            for variant, entry in variants.items() for mode in entry.get("modes", {})}


def compare(base: Snapshot, head: Snapshot) -> Diff:
    d = Diff()
    before, now = _status_base(base), _status_now(head)
    certified = [[_name(k), before.get(k, "absent"), s] for k, s in sorted(now.items())
                 if s == "certified" and before.get(k) != "passed"]
    failing = [[_name(k), before.get(k, "absent"), s] for k, s in sorted(now.items())
               if s in ("failed", "invalid", "unexpected pass") and before.get(k) == "passed"]
    stale = [[_name(k), before.get(k, "absent"), s] for k, s in sorted(now.items())
             if s == "stale"]
    added = [[_name(k), "absent", s] for k, s in sorted(now.items()) if k not in before]
    removed = [[_name(k), s, "absent"] for k, s in sorted(before.items()) if k not in now]
    status = ["target", "at base", "now"]
    d.add("newly failing", status, failing)
    d.add("stale now", status, stale)
    d.add("newly certified", status, certified)
    d.add("targets added", status, added)
    d.add("targets removed", status, removed)
    widened, narrowed = _band_rows(base, head)
    d.add("bands widened", ["cell", "output", "at base", "now"], widened, names=2)
    d.add("bands narrowed", ["cell", "output", "at base", "now"], narrowed, names=2)
    d.add(f"measured errors moved > {MOVED:.0%}", ["target", "metric", "at base", "now"],
          _moved(base, head, now), names=2)
    old_reach, new_reach = _reach_pairs(base.reach), _reach_pairs(head.reach)
    d.add("reach gained", ["op", "variant", "mode"],
          [list(p) for p in sorted(new_reach - old_reach)], names=3)
    d.add("reach lost", ["op", "variant", "mode"],
          [list(p) for p in sorted(old_reach - new_reach)], names=3)
    d.add("gates changed", ["gate", "at base", "now"],
          [[g, base.gates.get(g, "absent"), s] for g, s in sorted(head.gates.items())
           if base.gates.get(g) != s]
          + [[g, s, "absent"] for g, s in sorted(base.gates.items()) if g not in head.gates])
    d.add("list placements moved", ["test", "at base", "now"],
          [[t, base.lists.get(t, "absent"), s] for t, s in sorted(head.lists.items())
           if base.lists.get(t) != s]
          + [[t, s, "absent"] for t, s in sorted(base.lists.items()) if t not in head.lists])
    return d


# ------------------------------------------------------------------------------------ rendering


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |"
              for r in rows[:DETAIL_ROWS]]
    if len(rows) > DETAIL_ROWS:
        lines.append(f"\n... and {len(rows) - DETAIL_ROWS} more")
    return lines


def render(d: Diff, base: str) -> str:
    """Markdown sized for a pull-request comment: a summary screen, then folded details."""
    lines = [f"## Certification against {base}", "", "| change | count | first |", "|---|---|---|"]
    for title, rows in d.sections.items():
        first = "; ".join(" ".join(r[:d.names[title]]) for r in rows[:SHOWN])
        more = f" (+{len(rows) - SHOWN})" if len(rows) > SHOWN else ""
        lines.append(f"| {title} | {len(rows)} | {first}{more} |")
    if not any(d.sections.values()):
        lines += ["", "No change to the certification."]
    for title, rows in d.sections.items():
        if rows:
            lines += ["", f"<details><summary>{title} ({len(rows)})</summary>", ""]
            lines += _table(d.headers[title], rows)
            lines += ["", "</details>"]
    return "\n".join(lines) + "\n"
