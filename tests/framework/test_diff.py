"""``certify diff``: a planted band widening and a planted stale kernel both show on the first
screen; the same snapshot on both sides shows no change; the CLI reads a git revision."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from certify.cli import main
from certify.report.diff import Snapshot, compare, layout_of, render
from certify.files.paths import project_paths

PATHS = project_paths()
LAYOUT = layout_of(PATHS)


def _copy(dest: Path) -> Path:
    for rel in LAYOUT.values():
        src = PATHS.root / rel
        if src.is_dir():
            shutil.copytree(src, dest / rel)
        elif src.exists():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, dest / rel)
    return dest


def _first_screen(text: str) -> str:
    return text.split("<details>")[0]


def test_a_planted_band_widening_and_stale_kernel_show_first(tmp_path):
    base = Snapshot.read(_copy(tmp_path / "base"), LAYOUT)
    head_dir = _copy(tmp_path / "head")
    # A widened band: rmsnorm's first tolerance output, max_ulp doubled.
    cells = head_dir / LAYOUT["cells"] / "rmsnorm.yaml"
    doc = yaml.safe_load(cells.read_text())
    cell = next(c for c in doc["cells"] if c["oracle"]["kind"] == "tolerance")
    output, band = next(iter(cell["oracle"]["outputs"].items()))
    band["max_ulp"] *= 2
    cells.write_text(yaml.safe_dump(doc, sort_keys=False))
    # A stale kernel: one gdn_decode receipt recorded for other code (its hash no longer matches).
    book = head_dir / LAYOUT["receipts"] / "cpu.jsonl"
    lines = book.read_text().splitlines()
    i = next(j for j, line in enumerate(lines) if json.loads(line)["op"] == "gdn_decode")
    planted = json.loads(lines[i])
    planted["hash"] = "0" * len(planted["hash"])
    lines[i] = json.dumps(planted)
    book.write_text("\n".join(lines) + "\n")

    text = render(compare(base, Snapshot.read(head_dir, LAYOUT)), "base")
    screen = _first_screen(text)
    assert f"rmsnorm::{cell['id']} {output}" in screen
    stale = f"gdn_decode::{planted['variant']}::{planted['cell']} (cpu)"
    assert stale in screen
    row = next(line for line in screen.splitlines() if line.startswith("| stale now |"))
    assert row.split("|")[2].strip() != "0"
    assert len(screen.splitlines()) <= 25   # one screen


def test_the_same_snapshot_shows_no_change(tmp_path):
    snap = Snapshot.read(_copy(tmp_path / "same"), LAYOUT)
    d = compare(snap, snap)
    assert all(not rows for title, rows in d.sections.items() if title != "stale now")


def test_cli_reads_a_revision_and_refuses_an_unknown_one(capsys):
    assert main(["diff", "HEAD"]) == 0
    assert capsys.readouterr().out.startswith("## Certification against HEAD")
    assert main(["diff", "no-such-revision-xyz"]) == 2
    assert "no-such-revision-xyz" in capsys.readouterr().err
