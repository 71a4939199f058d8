"""`certify lists --collect` drops the measurements of items that are no longer collected, and keeps
the others' seconds as they were."""

from __future__ import annotations

from certify.lists import durations_text, load_durations
from certify.lists.records import prune_durations


def test_items_no_longer_collected_lose_their_durations(tmp_path):
    path = tmp_path / "durations.json"
    path.write_text(durations_text({"a.py::kept": 1.5, "a.py::renamed": 2.0, "gone.py::t": 0.5}))
    dropped = prune_durations(path, {"a.py::kept", "a.py::new"})
    assert dropped == ["a.py::renamed", "gone.py::t"]
    assert load_durations(path) == {"a.py::kept": 1.5}


def test_nothing_to_drop_leaves_the_file_byte_for_byte(tmp_path):
    path = tmp_path / "durations.json"
    path.write_text(durations_text({"a.py::t": 1.0}))
    before = path.read_bytes()
    assert prune_durations(path, {"a.py::t", "b.py::t"}) == []
    assert path.read_bytes() == before
