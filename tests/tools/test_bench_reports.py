"""A benchmark run adds its report to the committed file as the newest section: the file's title,
its introduction and the earlier runs' sections (and what was written of them by hand) stay."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_common  # noqa: E402

RUN = ["# Thing bench, GPU X (2026-12-06)", "", "| a | b |", "|---|---|", "| 1 | 2 |", "",
       "## Reading", "", "- a note", ""]


@pytest.fixture(autouse=True)
def _fresh_process_memory(monkeypatch):
    monkeypatch.setattr(bench_common, "_BEFORE", {})


def test_a_new_file_is_the_run_as_written(tmp_path):
    path = tmp_path / "thing.md"
    bench_common.write_report(path, RUN)
    assert path.read_text() == "\n".join(RUN) + "\n"


def test_a_run_goes_first_after_the_files_introduction_and_keeps_the_earlier_sections(tmp_path):
    path = tmp_path / "thing.md"
    before = ["# Thing at the target geometry", "", "Each section is one session.", "",
              "## 2026-12-05", "", "| a | b |", "| 0 | 0 |", "", "### Reading", "",
              "- by hand", "", "## 2026-12-04", "", "old"]
    path.write_text("\n".join(before) + "\n")
    bench_common.write_report(path, RUN)
    text = path.read_text()
    assert text.startswith("# Thing at the target geometry\n\nEach section is one session.\n\n"
                           "## Thing bench, GPU X (2026-12-06)\n")
    assert "\n### Reading\n\n- a note\n\n## 2026-12-05\n" in text     # the run's own sections demoted
    assert text.endswith("### Reading\n\n- by hand\n\n## 2026-12-04\n\nold\n")
    assert text.count("| 1 | 2 |") == 1


def test_a_file_that_is_one_earlier_run_becomes_its_section(tmp_path):
    path = tmp_path / "thing.md"
    path.write_text("# Thing bench, GPU X (2026-12-01)\n\n| a | b |\n| 9 | 9 |\n")
    bench_common.write_report(path, RUN)
    lines = path.read_text().split("\n")
    assert lines[0] == "# Thing bench, GPU X (2026-12-01)"
    assert lines[2] == "## Thing bench, GPU X (2026-12-06)"
    assert "## Thing bench, GPU X (2026-12-01)" in lines and "| 9 | 9 |" in lines


def test_rows_written_as_they_come_replace_the_runs_own_section(tmp_path):
    path = tmp_path / "thing.md"
    path.write_text("# Thing\n\n## 2026-12-05\n\nold\n")
    bench_common.write_report(path, RUN[:5])
    bench_common.write_report(path, RUN)
    text = path.read_text()
    assert text.count("## Thing bench, GPU X (2026-12-06)") == 1
    assert text.count("| 1 | 2 |") == 1 and text.endswith("## 2026-12-05\n\nold\n")


def test_a_report_without_a_title_is_refused_and_the_file_is_left_alone(tmp_path):
    path = tmp_path / "thing.md"
    path.write_text("# Thing\n")
    with pytest.raises(ValueError, match="thing.md: a report starts with a '# ' title"):
        bench_common.write_report(path, ["| a |"])
    assert path.read_text() == "# Thing\n"
