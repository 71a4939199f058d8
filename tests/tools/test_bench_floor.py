"""The bytes floor bench/engine.py holds a generation step to: a decode step's parts, and a
speculative step's (verify of K + 1 rows a request, then K draft passes)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from spec.config import ModelConfig

_PATH = Path(__file__).resolve().parents[2] / "bench" / "engine.py"
_SPEC = importlib.util.spec_from_file_location("bench_engine", _PATH)
bench = sys.modules.setdefault("bench_engine", importlib.util.module_from_spec(_SPEC))
_SPEC.loader.exec_module(bench)

TARGET = ModelConfig.target()
CONTEXT = 1030


@pytest.mark.parametrize("requests", [1, 32, 128])
def test_without_drafts_the_floor_is_the_decode_steps(requests):
    assert bench.step_bytes(TARGET, requests, CONTEXT, "bf16", "fp32", 0) == \
        bench.decode_step_bytes(TARGET, requests, CONTEXT, "bf16", "fp32")


@pytest.mark.parametrize("requests", [1, 32, 128])
@pytest.mark.parametrize("k", [1, 3])
def test_a_speculative_step_reads_a_requests_state_and_keys_once_and_every_rows_logits(requests,
                                                                                          k):
    spec = bench.speculative_step_bytes(TARGET, requests, CONTEXT, "bf16", "fp32", k)
    once = bench.decode_step_bytes(TARGET, requests, CONTEXT, "bf16", "fp32")
    rows = bench.decode_step_bytes(TARGET, requests * (k + 1), CONTEXT, "bf16", "fp32")
    assert spec["GDN state r+w"] == once["GDN state r+w"]
    assert spec["KV selected + index keys"] == once["KV selected + index keys"]
    assert spec["logits"] == requests * (k + 1) * TARGET.vocab_size * 4
    for part in ("dense weights", "routed experts", "embedding + PLE rows"):
        assert spec[part] == rows[part]
    assert once["routed experts"] < spec["routed experts"]


def test_each_draft_pass_reads_the_head_and_the_draft_layer_again():
    one = bench.speculative_step_bytes(TARGET, 32, CONTEXT, "bf16", "fp32", 1)["draft passes"]
    three = bench.speculative_step_bytes(TARGET, 32, CONTEXT, "bf16", "fp32", 3)["draft passes"]
    assert three == pytest.approx(3 * one)
    head = TARGET.vocab_size * TARGET.hidden * 2
    routed = TARGET.num_experts * 3 * TARGET.expert_inter * TARGET.hidden
    dense_mtp = (TARGET.param_breakdown()["mtp"] - TARGET.mtp_layers * routed) * 2
    assert head + dense_mtp < one < head + dense_mtp + TARGET.mtp_layers * routed
