"""The speculative-decoding spec functions against formulations written independently of them
(docs/spec.md, "MTP draft layer and speculative decoding"), on seeded inputs.

- ``rollback_commit`` (and the catalog's ``rollback_commit_op``) as a replay: walk each request's
  rows in order, adopting the state recorded after every accepted row, and stop at the first
  rejected one; block keys by counting the blocks whose 32 tokens all lie below the kept length.
  Then the speculative oracle the prose states, on the GDN state: committing entry ``a`` of a
  verify of ``K + 1`` rows equals the state of running only the first ``a + 1`` rows, here the
  chunked loop of test_gdn_independent.py in float64.
- ``greedy_verify_op`` and ``acceptance_length_op`` (the catalog's adapters) against the per-request
  accept loop and the fsum mean the spec's own functions are checked against.
"""

from __future__ import annotations

import math

import pytest
import torch

from spec.cases.mtp import acceptance_length_op, greedy_verify_op, rollback_commit_op
from spec.ops.gdn import gdn_gates, gdn_verify
from spec.ops.mtp import blocks_complete, rollback_commit
from tests.spec.test_gdn_independent import _close, _layer, _state, np_gates, wy
from tests.spec.test_second_formulations_model import second_argmax_row, second_verify

pytestmark = pytest.mark.premerge

F64 = torch.float64
TPB = 32


def commit_by_replay(records: dict[str, torch.Tensor], num_accepted: list[int]):
    """Per request: the state starts as the row-0 record (row 0, the real token, is always kept)
    and takes the record of each later row while that row is accepted."""
    out = {}
    for name, rec in records.items():
        kept = []
        for r, n in enumerate(num_accepted):
            state = rec[r, 0]
            for i in range(1, rec.shape[1]):
                if i >= n:
                    break
                state = rec[r, i]
            kept.append(state)
        out[name] = torch.stack(kept)
    return out


def blocks_by_counting(lengths: list[int]) -> list[int]:
    """Blocks b whose last token 32 b + 31 lies below the kept length."""
    return [sum(1 for b in range(n // TPB + 2) if TPB * b + TPB - 1 < n) for n in lengths]


def _records(seed: int, R: int = 5, K: int = 7):
    gen = torch.Generator().manual_seed(seed)
    rows = K + 1
    start = torch.tensor([30, 31, 32, 95, 1000])[:R]            # around block boundaries
    plane = (start[:, None] + torch.arange(1, rows + 1)[None]).to(torch.int32)
    toks = torch.randint(0, 1000, (R, rows + 1), generator=gen)
    records = {"gdn_state": torch.randn(R, rows, 2, 4, 4, generator=gen, dtype=F64),
               "conv_window": torch.randn(R, rows, 6, 3, generator=gen, dtype=F64),
               "ngram_history": torch.stack([toks[:, i:i + 2] for i in range(rows)], dim=1),
               "plane_len": plane}
    return records, torch.tensor([1, 8, 3, 2, 5])[:R]          # all rejected, all accepted, ...


@pytest.mark.second_formulation("spec.ops.mtp:rollback_commit", "spec.ops.mtp:blocks_complete",
                                "spec.cases.mtp:rollback_commit_op")
def test_rollback_commit_equals_a_replay_of_the_accepted_rows():
    records, num_accepted = _records(21)
    want = commit_by_replay(records, num_accepted.tolist())
    want_blocks = blocks_by_counting(want["plane_len"].tolist())
    got = rollback_commit(records, num_accepted)
    op = rollback_commit_op(records["gdn_state"], records["conv_window"],
                            records["ngram_history"], records["plane_len"], num_accepted)
    for res in (got, op):
        for name in records:
            assert torch.equal(res[name], want[name]), name
        assert res["blocks_complete"].tolist() == want_blocks
    lengths = torch.arange(0, 200, dtype=torch.int32)
    assert blocks_complete(lengths).tolist() == blocks_by_counting(lengths.tolist())
    # the rows of request 0 (start 30) cross block 0's end: only an accepted row 1 keeps its key.
    assert want_blocks[0] == 0 and blocks_by_counting([32]) == [1]
    # wrong: the entry num_accepted instead of num_accepted - 1 (one row late).
    late = commit_by_replay(records, [min(n + 1, 8) for n in num_accepted.tolist()])
    assert not torch.equal(late["gdn_state"], got["gdn_state"])
    with pytest.raises(ValueError):
        rollback_commit(records, torch.tensor([0, 1, 1, 1, 1]))


def test_committing_a_verify_equals_running_only_the_accepted_rows():
    # docs/spec.md, "Speculative oracle", on the GDN state in float64.
    R, K = 3, 4
    x = _layer(31, (R, K + 1))
    pool = _state(32, R)
    slots = torch.arange(R)
    res = gdn_verify(x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"], x["z"],
                     x["norm_w"], pool, slots)
    num_accepted = torch.tensor([1, 5, 3])
    committed = rollback_commit({"gdn_state": res["states"]}, num_accepted)["gdn_state"]
    g, beta = np_gates(x["a"], x["b"], x["A_log"], x["dt_bias"])
    for r, n in enumerate(num_accepted.tolist()):
        sl = (slice(r, r + 1), slice(0, n))
        _, final = wy(x["q"][sl], x["k"][sl], x["v"][sl], g[sl], beta[sl], pool[r:r + 1])
        assert _close(committed[r:r + 1], final), r
    g_spec, _ = gdn_gates(x["a"], x["b"], x["A_log"], x["dt_bias"])
    assert _close(g_spec, torch.from_numpy(g))


@pytest.mark.second_formulation("spec.cases.mtp:greedy_verify_op",
                                "spec.cases.mtp:acceptance_length_op")
def test_the_verify_adapters_equal_the_accept_loop_and_the_fsum_mean():
    gen = torch.Generator().manual_seed(41)
    R, K, V = 5, 3, 6
    logits = torch.randint(-2, 3, (R, K + 1, V), generator=gen).to(torch.float32)   # ties too
    lens = torch.tensor([3, 3, 1, 0, 2])
    drafts = torch.zeros(R, K, dtype=torch.int64)
    for r, agree in enumerate([3, 1, 1, 0, 0]):
        p = [second_argmax_row(logits[r, i].tolist()) for i in range(K + 1)]
        for i in range(K):
            drafts[r, i] = p[i] if i < agree else (p[i] + 1) % V
    got = greedy_verify_op(logits, drafts, lens)
    preds, n_acc, emitted = second_verify(logits, drafts, lens)
    assert got["predictions"].tolist() == preds and got["emitted"].tolist() == emitted
    assert got["num_accepted"].tolist() == n_acc == [4, 2, 2, 1, 1]
    al = acceptance_length_op(got["num_accepted"])["acceptance_length"]
    assert al.dtype == F64 and al.dim() == 0
    assert float(al) == math.fsum(n_acc) / len(n_acc)
    assert float(al) != math.fsum(n - 1 for n in n_acc) / len(n_acc)    # the mean of a: wrong
