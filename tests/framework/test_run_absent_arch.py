"""``certify run --arch A`` on a machine without A is refused before any target runs: a target there
could only error, and its receipt would replace the one made where the arch is."""

from __future__ import annotations

from tests.framework.tmp_project import make_project, run_in


def test_run_refuses_an_arch_this_machine_lacks_and_keeps_its_receipts(tmp_path):
    project = make_project(tmp_path)
    held = tmp_path / "receipts" / "sm_10.jsonl"
    held.parent.mkdir(parents=True, exist_ok=True)
    held.write_text('{"made": "where sm_10 is"}\n')
    res = run_in(project, "-m", "certify.cli", "run", "--arch", "sm_10")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "--arch sm_10: not on this machine" in res.stderr and "it has cpu" in res.stderr
    assert held.read_text() == '{"made": "where sm_10 is"}\n'
    assert sorted(p.name for p in held.parent.iterdir() if not p.name.startswith(".")) == ["sm_10.jsonl"]
    assert run_in(project, "-m", "certify.cli", "run", "--arch", "cpu").returncode == 0
