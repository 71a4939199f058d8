"""bench/disagg.py's smoke (the tiny model's disaggregated pair on the CPU over gloo, prompts of 32
and 33 tokens, MTP on both engines and on the generation engine only) passes: every request's
tokens and acceptance counts equal the aggregated engine's, and every hand-off is measured. A
request whose tokens differ from the reference fails the bench: its row says so, the verdict names
it, and the script exits non-zero. The smoke runs once; the mismatch is planted in its reference.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("disagg_bench", ROOT / "bench" / "disagg.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module     # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return _bench()


@pytest.fixture(scope="module")
def smoke(bench):
    return bench.run(bench.parse(["--smoke"]))


def test_the_smoke_pair_equals_the_aggregated_engine(bench, smoke):
    assert smoke.passed, bench.verdict(smoke)
    assert [(r.job.mtp, r.prompt) for r in smoke.rows] == [
        ("both", 32), ("both", 33), ("generation", 32), ("generation", 33)]
    assert smoke.run.link_bytes_per_second > 0
    for r in smoke.rows:
        assert r.transfer is not None and r.transfer.payload_bytes > 0 and r.transfer.seconds > 0
        assert r.transfer.bytes > r.transfer.payload_bytes    # the header is counted
    assert bench.verdict(smoke).startswith("PASS")


def _planted(bench, smoke):
    """The smoke's outcome judged against a reference whose first request has one token changed."""
    row = smoke.rows[0]
    args = bench.parse(["--smoke"])
    reqs = bench.requests(args, bench.geometry(args))
    pair = smoke.run.results[0]
    wrong = {rid: list(t) for rid, t in pair.tokens.items()}
    wrong[row.request_id][-1] += 1
    reference = _Report({rid: _Result(t, pair.accepted[rid]) for rid, t in wrong.items()})
    rows = bench.judge(row.job, pair, reference, reqs)
    return dataclasses.replace(smoke, rows=rows + smoke.rows[len(rows):])


@dataclasses.dataclass
class _Result:     # what judge reads of a GenerationResult
    tokens: list[int]
    num_accepted: list[int]
    error: str | None = None


@dataclasses.dataclass
class _Report:     # what judge reads of a GenerationReport
    results: dict


def test_a_token_mismatch_fails_the_bench(bench, smoke, monkeypatch, capsys):
    planted = _planted(bench, smoke)
    bad = planted.rows[0]
    assert not bad.tokens_equal and bad.accepted_equal and not bad.passed
    assert all(r.passed for r in planted.rows[1:])
    assert not planted.passed
    assert bench.verdict(planted).startswith(f"FAIL: 1 of 4 requests differ from the aggregated "
                                             f"engine: bf16/both/{bad.request_id}")
    assert any("| NO |" in line for line in bench.table(planted))
    monkeypatch.setattr(bench, "run", lambda args: planted)
    assert bench.main(["--smoke"]) == 1
    assert "smoke FAILED" in capsys.readouterr().out
