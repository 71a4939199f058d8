"""The step graphs' host side on the CPU: static inputs, padding requests, the verify record.

``StepGraphs`` with ``EagerCapture`` runs a captured step's forward again at each replay, on the
same static device buffers a CUDA graph reads (impl/model/graphs.py). What it exercises without a
GPU is everything but the capture itself: the rows, slots, positions, lengths and n-gram histories
filled into the static buffer, the table of the bucket's width, padding requests in the scratch
slot, and the verify record handed to commit (its n-gram histories recomputed on the host after the
replay). In batch-invariant mode every pass must still equal the spec's forward bit for bit
(tests/engine/spec_replay.py); in the default mode a full bucket's logits equal the eager step's.
The capture itself is tested on the GPU (tests/engine/test_engine_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

from impl.model.graphs import EagerCapture, StepGraphs
from tests.engine import test_engine as cpu_tests
from tests.engine.spec_replay import first_mismatch


def _graphed(e, k):
    """Step graphs over the engine's last slot as the scratch one: its requests take the lowest
    free slots, and the tests submit fewer than ``max_batch_size``."""
    e.graphs = StepGraphs(e.model, e.cache, e.config.max_batch_size - 1,
                          rows_per_request=k + 1 if k else 1, capture=EagerCapture())
    return e


def _graph_steps(e) -> int:
    return sum(n for kind, n in e.step_kinds.items() if kind in ("decode", "verify"))


@pytest.mark.parametrize("kv,state,k,commit", [
    ("bf16", "fp32", None, "cached"), ("nvfp4", "fp32", 3, "cached"), ("fp8", "bf16", 2, "cached"),
    ("bf16", "bf16", 3, "recompute")])
def test_graphed_steps_match_spec_bitwise(weights, kv, state, k, commit):
    # graphs up to 5 requests (buckets 1, 2, 4, 5): three requests run in bucket 4, one of its
    # requests a padding one
    e = _graphed(cpu_tests._engine(weights, kv=kv, state=state, k=k, commit=commit, batch=6), k)
    if k:  # forced counts 1 .. K + 1 in turn (random weights' drafts are rarely accepted)
        e.force_accept = lambda rid, a: 1 + (e.steps + int(rid[1:])) % (k + 1)
    rep = e.generate(cpu_tests._requests(cpu_tests.LENGTHS))
    assert e.graphs.replays == _graph_steps(e) > 0, (e.graphs.replays, rep.step_kinds)
    assert 4 in {B for _, B, _ in e.graphs.graphs}, sorted(e.graphs.graphs)
    passes = cpu_tests._replay(e, weights)
    assert first_mismatch(passes) is None, first_mismatch(passes)


@pytest.mark.parametrize("k", [None, 3])
def test_a_full_bucket_gives_the_eager_steps_logits(weights, k):
    runs = []
    for graphed in (False, True):
        e = cpu_tests._engine(weights, k=k, invariant=False)
        if graphed:
            _graphed(e, k)
        e.generate(cpu_tests._requests([21, 21, 21], new=8))
        runs.append(e)
    kind = "verify" if k else "decode"
    steps = [[c for c in e.calls if c.kind == "trunk" and all(m == kind for *_, m in c.spans)]
             for e in runs]
    assert runs[1].graphs.replays == len(steps[1]) > 0
    compared = 0
    for i, (a, b) in enumerate(zip(*steps)):
        if a.spans != b.spans:
            break
        if len(a.spans) == 3:
            assert torch.equal(a.logits, b.logits), f"{kind} step {i}: replay differs from eager"
            compared += 1
    assert compared >= 2
