"""Edge-case builders of the QSA ops: inputs the seeded random builders of spec/cases/qsa.py never
draw. Seeded from (op, cell) like every builder."""

from __future__ import annotations

import torch

from certify.harness.target import Case
from spec.cases.qsa import EDGE_POSITIONS, TPB, kv_append_case, select_case, topk_expand_case

# The ends of e4m3's range as bf16 values: 448 (the largest finite), values past it up to bf16's
# largest finite and inf (all saturate to 448), 464 (the midpoint to 480, which e4m3fn lacks), and
# below the normal range: 2^-6 * 1.0625 (subnormal-rounded), 2^-9 (the smallest subnormal), 1.5 *
# 2^-10 (rounds up to it), 2^-10 (the half-way tie, to 0 by nearest even), 2^-11 (flushed) and 0.
FP8_LADDER = (448.0, 450.0, 456.0, 464.0, 466.0, 480.0, 496.0, 1024.0, 65280.0, float("inf"),
              0.0166015625, 2.0 ** -9, 1.5 * 2.0 ** -10, 2.0 ** -10, 2.0 ** -11, 0.0)


def _page_edge_rows(positions: torch.Tensor, n: int) -> list[int]:
    """Up to n rows on a page's last slot and n on its first, alternating."""
    last = [int(i) for i in (positions % TPB == TPB - 1).nonzero().flatten()][:n]
    first = [int(i) for i in (positions % TPB == 0).nonzero().flatten()][:n]
    return [r for pair in zip(last, first) for r in pair]


def kv_append_fp8_edges_case(axes: dict, gen: torch.Generator, device) -> Case:
    """qsa_kv_append's case (spec.cases.qsa.kv_append_case) with e4m3's range ends planted in K and
    V: on up to 8 rows at a page's last slot and 8 at its first, every head holds FP8_LADDER in both
    signs (-0.0 among them) at channels 0..31 of K and 32..63 of V, and one row at a page's first
    slot is an all-zero K vector. The rest stays the random rows (|k| up to about 11)."""
    case = kv_append_case(axes, gen, torch.device("cpu"))
    k, v = case.inputs["k"].clone(), case.inputs["v"].clone()
    ladder = torch.tensor(FP8_LADDER, dtype=torch.float32)
    signed = torch.cat([ladder, -ladder]).to(k.dtype)
    width = signed.numel()
    rows = _page_edge_rows(case.inputs["positions"], 8)
    if not rows:
        raise ValueError("the layout has no row at a page boundary to plant the fp8 edges on")
    for i, r in enumerate(rows):
        # the ladder rotated per row, so each value meets several channels
        k[r, :, :width] = torch.roll(signed, i)
        v[r, :, width:2 * width] = torch.roll(signed, -i)
    k[rows[1] if len(rows) > 1 else rows[0]] = 0.0
    case.inputs["k"], case.inputs["v"] = k, v
    case.inputs = {name: (t.to(device) if isinstance(t, torch.Tensor) else
                          tuple(e.to(device) for e in t) if isinstance(t, tuple) else t)
                   for name, t in case.inputs.items()}
    return case


# All-equal score rows: a finite value, zeros of both signs (equal as values), NaN (counts as -inf),
# -inf, and fp32's largest finite value. Only the tie rule (highest index first) decides them.
ALL_EQUAL = (0.75, "signed_zeros", float("nan"), float("-inf"), 3.4028234663852886e38)
SELECT_MIN_T = TPB * (64 + 4)  # t from which a row has more than k = 64 candidate blocks


ALL_EQUAL_POSITIONS = (2399, 2335, 2271, 2207, 2180)  # each >= SELECT_MIN_T, below a 2400 context


def _all_equal_rows(case: Case, first: int) -> None:
    """One row per ALL_EQUAL value, from row ``first`` on, set to that value in every column and
    placed at a t of ALL_EQUAL_POSITIONS (more than k candidates); a stored length, where the case
    has them, is raised to at least t + 1, as for the edge rows."""
    scores, positions = case.inputs["scores"].clone(), case.inputs["positions"].clone()
    if scores.shape[0] < first + len(ALL_EQUAL) or scores.shape[1] * TPB <= max(ALL_EQUAL_POSITIONS):
        raise ValueError("the all-equal rows need more rows, or a context past 2400 tokens")
    for i, value in enumerate(ALL_EQUAL):
        r = first + i
        positions[r] = ALL_EQUAL_POSITIONS[i]
        if value == "signed_zeros":
            negative = torch.arange(scores.shape[1]) % 3 == 0
            scores[r] = torch.where(negative, torch.tensor(-0.0), torch.tensor(0.0))
        else:
            scores[r] = value
    case.inputs["scores"], case.inputs["positions"] = scores, positions
    if "context_lens" in case.inputs:
        case.inputs["context_lens"] = torch.maximum(case.inputs["context_lens"],
                                                    positions.to(torch.int32) + 1)


def select_all_equal_case(axes: dict, gen: torch.Generator, device) -> Case:
    """qsa_select's case (spec.cases.qsa.select_case) with all-equal score rows after its edge rows."""
    case = select_case(axes, gen, torch.device("cpu"))
    _all_equal_rows(case, len(EDGE_POSITIONS))
    case.inputs = {k: v.to(device) for k, v in case.inputs.items()}
    return case


def topk_expand_all_equal_case(axes: dict, gen: torch.Generator, device) -> Case:
    """qsa_topk_expand's case (spec.cases.qsa.topk_expand_case) with all-equal score rows after its
    edge rows."""
    case = topk_expand_case(axes, gen, torch.device("cpu"))
    _all_equal_rows(case, len(EDGE_POSITIONS))
    case.inputs = {k: v.to(device) for k, v in case.inputs.items()}
    return case
