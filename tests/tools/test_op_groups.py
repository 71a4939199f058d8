"""tools/op_groups.py splits the catalog's ops into groups of about equal certification time for
parallel ``certify run`` processes: every op with a target not yet fresh exactly once, the longest
op alone when it outweighs the rest's share, and the groups' times within one op of each other."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import op_groups  # noqa: E402


def test_groups_cover_every_op_once_and_balance():
    seconds = Counter({"a": 70.0, "b": 40.0, "c": 30.0, "d": 20.0, "e": 10.0, "f": 5.0})
    groups = op_groups.groups(3, list(seconds) + ["g"], seconds)
    flat = [op for g in groups for op in g]
    assert sorted(flat) == sorted(list(seconds) + ["g"])
    assert groups[0] == ["a"]                                   # the longest op takes a group alone
    load = [sum(seconds.get(op, 1.0) for op in g) for g in groups]
    assert max(load) - min(load) <= max(seconds.values())


def test_the_script_prints_op_flags_for_every_catalog_op(tmp_path):
    # one outdated target (no receipt here is fresh) weighs a million seconds: its op goes alone
    receipts = tmp_path / "sm_90.jsonl"
    lines = (ROOT / "reports/receipts/sm_90.jsonl").read_text().splitlines()
    made = [json.loads(line) for line in lines if line.strip()]
    record = next(r for r in made if (r["op"], r["variant"], r["cell"])
                  == ("gdn_prefill", "triton_chunked", "long_t8192"))
    receipts.write_text(json.dumps(dict(record, hash="0" * 24, seconds=1e6)) + "\n")
    out = subprocess.run([sys.executable, "tools/op_groups.py", "4", str(receipts)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 4 and lines[0] == "--op gdn_prefill"
    ops = [tok for line in lines for tok in line.split() if tok != "--op"]
    assert len(ops) == len(set(ops)) and len(ops) == len(list((ROOT / "certify/cells").glob("*.yaml")))
