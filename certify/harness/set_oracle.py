"""The set oracle of a selection (``certify.catalog.cell_extensions.SetOracle``).

A selection whose scores are computed in a narrow dtype can rank two nearly equal scores in the
opposite order to float64, and neither order is wrong: the bitwise oracle cannot judge such rows.
The set oracle asks what any correct selection satisfies:
- every id is in range [0, n) and no id repeats in its row (the poison of an unwritten id is out of
  range, so an unwritten slot fails here);
- the selected set is a top-k of the float64 scores within the derived bound b: for every selected i
  and every j left out, s_j - s_i <= b_i + b_j (some scores within b of the float64 ones rank exactly
  this set first); with ``ordered``, consecutive slots satisfy the same inequality;
- every other output equals, within the cell's bands, the spec's float64 result computed from the
  variant's own selection (``given``).

Metrics: ``<ids>.bound_used``, the largest (s_j - s_i) / (b_i + b_j) over boundary pairs (<= 1 passes),
``<ids>.order_bound_used`` likewise over consecutive slots, and ``<ids>.rows_off_float64``, the rows
whose set is not float64's own top-k (near ties the variant resolved the other way).
"""

from __future__ import annotations

import torch

from certify.harness.oracles import Verdict

_INT = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


def check_selection(name: str, ids: torch.Tensor, scores: torch.Tensor, bound: torch.Tensor,
                    ordered: bool = False) -> Verdict:
    """Judge selected ids [rows, k] against float64 scores and bounds [rows, n] (module docstring)."""
    v = Verdict(True)
    if ids.dtype not in _INT or ids.dim() != 2:
        return Verdict(False, problems=[f"{name}: expected integer ids [rows, k], got "
                                        f"{tuple(ids.shape)} {ids.dtype}"])
    if scores.shape != bound.shape or scores.dim() != 2 or scores.shape[0] != ids.shape[0]:
        return Verdict(False, problems=[f"{name}: scores {tuple(scores.shape)} and bound "
                                        f"{tuple(bound.shape)} must be [rows, n] for ids "
                                        f"{tuple(ids.shape)}"])
    s = scores.to(torch.float64)
    b = bound.to(torch.float64)
    if not bool(torch.isfinite(s).all() and torch.isfinite(b).all() and (b >= 0).all()):
        return Verdict(False, problems=[f"{name}: the float64 scores or their bound are not finite "
                                        "(or a bound is negative): the set oracle cannot judge them"])
    rows, n = s.shape
    k = ids.shape[1]
    ids = ids.to(torch.int64)
    bad = (ids < 0) | (ids >= n)
    if bad.any():
        idx = _first(bad)
        v.problems.append(f"{name}: {int(bad.sum())} id(s) outside [0, {n}) (or never written), "
                          f"first at {idx}: {int(ids[idx])}")
        v.passed = False
        return v
    srt = ids.sort(dim=-1).values
    dup = srt[:, 1:] == srt[:, :-1]
    if dup.any():
        row = _first(dup)[0]
        v.problems.append(f"{name}: {int(dup.any(dim=-1).sum())} row(s) repeat an id, first row "
                          f"{row}: {ids[row].tolist()}")
        v.passed = False
        return v
    chosen = torch.zeros(rows, n, dtype=torch.bool)
    chosen.scatter_(1, ids, True)
    s_in, b_in = s.gather(1, ids), b.gather(1, ids)                      # [rows, k]
    # Every (selected i, left-out j) pair: (s_j - s_i) / (b_i + b_j); a pair of equal scores with a
    # zero bound is 0 (no slack needed), a positive gap with a zero bound is inf.
    gap = s.unsqueeze(1) - s_in.unsqueeze(2)                             # [rows, k, n]
    slack = b.unsqueeze(1) + b_in.unsqueeze(2)
    ratio = torch.where(gap <= 0, torch.zeros_like(gap), gap / slack)
    ratio = ratio.masked_fill(chosen.unsqueeze(1), 0.0)
    used = ratio.amax(dim=(1, 2)) if n > k else torch.zeros(rows, dtype=torch.float64)
    v.metrics[f"{name}.bound_used"] = float(used.max()) if rows else 0.0
    off = (gap.masked_fill(chosen.unsqueeze(1), 0.0) > 0).any(dim=2).any(dim=1) if n > k else \
        torch.zeros(rows, dtype=torch.bool)
    v.metrics[f"{name}.rows_off_float64"] = float(off.sum())
    if bool((used > 1).any()):
        row = int(used.argmax())
        i_slot, j = divmod(int(ratio[row].argmax()), n)
        v.problems.append(
            f"{name}: {int((used > 1).sum())} row(s) select a set that is no top-{k} of the float64 "
            f"scores within the bound; worst row {row}: selected id {int(ids[row, i_slot])} "
            f"(score {float(s_in[row, i_slot]):.9g}) below left-out id {j} (score "
            f"{float(s[row, j]):.9g}) by {float(used[row]):.3g} x the bound")
    if ordered and k > 1:
        step = s_in[:, 1:] - s_in[:, :-1]
        room = b_in[:, 1:] + b_in[:, :-1]
        order = torch.where(step <= 0, torch.zeros_like(step), step / room)
        v.metrics[f"{name}.order_bound_used"] = float(order.max()) if rows else 0.0
        if bool((order > 1).any()):
            row, slot = _first(order == order.max())
            v.problems.append(f"{name}: {int((order > 1).any(dim=-1).sum())} row(s) not best first "
                              f"within the bound; worst row {row}, slots {slot} and {slot + 1}")
    v.passed = not v.problems
    return v
