"""Items run file by file, longest measured file first (certify.pytest_plugin), so that pytest-xdist
starts the long items early."""

from __future__ import annotations

from types import SimpleNamespace

from certify.lists import durations_text
from certify.pytest_plugin import _longest_files_first


def _items(*ids):
    return [SimpleNamespace(nodeid=i) for i in ids]


def test_the_file_of_the_longest_item_runs_first_and_files_keep_their_order(tmp_path):
    durations = tmp_path / "durations.json"
    durations.write_text(durations_text({"a.py::t1": 1.0, "a.py::t2": 2.0, "b.py::t1": 0.5,
                                         "c.yaml::gate": 300.0}))
    items = _items("a.py::t1", "a.py::t2", "b.py::t1", "b.py::t2", "c.yaml::gate", "d.py::new")
    _longest_files_first(items, durations)
    assert [i.nodeid for i in items] == ["c.yaml::gate", "a.py::t1", "a.py::t2", "b.py::t1",
                                         "b.py::t2", "d.py::new"]


def test_without_durations_the_order_is_the_collection_order(tmp_path):
    items = _items("b.py::x", "b.py::z", "a.py::y")
    _longest_files_first(items, tmp_path / "missing.json")
    assert [i.nodeid for i in items] == ["b.py::x", "b.py::z", "a.py::y"]
