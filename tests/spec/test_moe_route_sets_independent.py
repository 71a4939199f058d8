"""moe_route's set-oracle functions (spec/ops/moe_route_sets.py) against a per-row formulation in
Python floats, written from the module's docstring and docs/spec.md, "MoE": each logit an exact
``math.fsum`` of its products, the softmax with the row max subtracted, the bound term by term
(``lambda sqrt(C) u A_i + u |l_i - m| + 3u`` through ``math.expm1``), and the weights of a given
selection as the selected probabilities over their sum.

Tolerance: the two sides compute the same float64 functions; the spec's matrix products round each
of C = 64 partial sums (relative 64 x 1.1e-16 of sum |x w|, below 1e-13 on these inputs of order 1),
and softmax, expm1 and the division add a few ulps, so RTOL 1e-12 holds with room; a dropped term of
the bound (3u alone is 1.8e-7 relative) or a selection taken in another slot order is off by far more.
"""

from __future__ import annotations

import math

import pytest
import torch

from spec.ops.moe_route_sets import (LAMBDA, SUBNORMAL_ROOM, U32, route_score_bound, route_scores,
                                     route_weights_given)

pytestmark = pytest.mark.premerge

T, C, E, TOP_K = 5, 64, 12, 3
RTOL = 1e-12


def _inputs(seed: int = 7):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, C, generator=gen).to(torch.bfloat16)
    w = (torch.randn(E, C, generator=gen) / math.sqrt(C)).to(torch.bfloat16)
    return x, w


def _row_logits(x_row: list[float], w: list[list[float]]) -> list[float]:
    return [math.fsum(a * b for a, b in zip(x_row, w_e)) for w_e in w]


def _row_softmax(logits: list[float]) -> list[float]:
    m = max(logits)
    e = [math.exp(v - m) for v in logits]
    s = math.fsum(e)
    return [v / s for v in e]


def _close(a: torch.Tensor, b: list[list[float]]) -> bool:
    return torch.allclose(a, torch.tensor(b, dtype=torch.float64), rtol=RTOL, atol=0.0)


@pytest.mark.second_formulation("spec.ops.moe_route_sets:route_scores")
def test_route_scores_equal_a_per_row_softmax_of_exact_logits():
    x, w = _inputs()
    xs, ws = x.double().tolist(), w.double().tolist()
    assert _close(route_scores(x, w, TOP_K), [_row_softmax(_row_logits(r, ws)) for r in xs])


@pytest.mark.second_formulation("spec.ops.moe_route_sets:route_score_bound")
def test_route_score_bound_equals_its_docstring_term_by_term():
    x, w = _inputs(8)
    xs, ws = x.double().tolist(), w.double().tolist()
    rows = []
    for r in xs:
        logits = _row_logits(r, ws)
        p = _row_softmax(logits)
        m = max(logits)
        row = []
        for i, w_e in enumerate(ws):
            a_i = math.fsum(abs(a * b) for a, b in zip(r, w_e))
            rel = LAMBDA * math.sqrt(C) * U32 * a_i + U32 * abs(logits[i] - m) + 3 * U32
            row.append(p[i] * math.expm1(rel) + SUBNORMAL_ROOM)
        rows.append(row)
    assert _close(route_score_bound(x, w, TOP_K), rows)


@pytest.mark.second_formulation("spec.ops.moe_route_sets:route_weights_given")
def test_weights_of_a_given_selection_are_its_probabilities_over_their_sum_in_slot_order():
    x, w = _inputs(9)
    gen = torch.Generator().manual_seed(10)
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(T)]).to(torch.int32)
    ws = w.double().tolist()
    want = []
    for r, sel in zip(x.double().tolist(), ids.tolist()):
        p = _row_softmax(_row_logits(r, ws))
        total = math.fsum(p[e] for e in sel)
        want.append([p[e] / total for e in sel])
    assert _close(route_weights_given(x, w, TOP_K, ids)["weights"], want)
