"""The batch-invariance checks of a variant that claims it (``batch_invariant: true``), bitwise: a
row's result depends neither on the other rows of its launch, nor on the batch size, nor on the
rows' order.

The rows of a launch are dim 0 of the tensors the op's contract names (``harness.rows``), by default
of every output sized like the outputs' common dim 0 and of every input of that size; the other
tensors are shared by the rows (weights, a pool addressed through per-row indices). Two calls beside
the certifying one, whose results (``first``) they are checked against:
- ``rows_order``: the rows in a seeded shuffled order, into the first call's output buffers (still
  holding its results: every row's buffer holds another row's result): row i must be the first
  call's row perm[i], a shared buffer the first call's bytes;
- ``batch_size``: a shuffled subset of about a quarter of the rows, then one row, each as a launch
  of its own: row i must be the first call's row sub[i], and an element of a shared in-place buffer either the first
  call's or the one it had before (the rows left out write nothing).
Where ``rows_order`` fails, a plain second call tells a stale read of the dirty buffers from a
dependence on the order (``dirty_reuse``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from certify.harness import oracles
from certify.harness.adversarial import (PASSED, Probe, _tensors, call, clone, failed,
                                         not_run, same_bytes)
from certify.harness.contract import HarnessContract
from certify.harness.target import Case


@dataclass
class RowSplit:
    n: int
    inputs: tuple[str, ...]    # inputs whose dim 0 is the row
    outputs: tuple[str, ...]   # outputs whose dim 0 is the row; the others are shared


def _dim0(x: Any) -> int | None:
    return x.shape[0] if isinstance(x, torch.Tensor) and x.dim() >= 1 else None


def row_split(case: Case, first: dict[str, Any], before: dict[str, Any],
              contract: HarnessContract) -> RowSplit | str:
    """The rows of the case's launch, or why it has none."""
    if contract.no_rows:
        return f"the op has no row axis: {contract.no_rows}"
    declared = contract.rows
    if declared.outputs is not None:
        unknown = [n for n in declared.outputs if n not in case.outputs]
        if unknown:
            return f"harness.rows.outputs names {unknown}, not outputs {sorted(case.outputs)}"
        sizes = {_dim0(first[n]) for n in declared.outputs}
        if not declared.outputs and declared.inputs:  # every output is shared: the inputs count
            sizes = {_dim0(before[i]) for i in declared.inputs if i in before}
    else:
        sizes = {_dim0(first[n]) for n in case.outputs if n not in case.inplace}
    if len(sizes) != 1 or None in sizes:
        return ("the outputs share no dim 0 (declare harness.rows, or harness.no_rows with the "
                "reason)")
    n = sizes.pop()
    outputs = declared.outputs if declared.outputs is not None else tuple(
        o for o in case.outputs if _dim0(first[o]) == n)
    if declared.inputs is not None:
        unknown = [i for i in declared.inputs if i not in case.inputs]
        if unknown:
            return f"harness.rows.inputs names {unknown}, not inputs {sorted(case.inputs)}"
        inputs = declared.inputs
    else:
        inputs = tuple(i for i, v in before.items() if _dim0(v) == n)
    wrong = [i for i in inputs if _dim0(before[i]) != n] + \
        [o for o in outputs if _dim0(first[o]) != n]
    if wrong:
        return f"the row inputs {wrong} do not have {n} rows in dim 0"
    return RowSplit(n, inputs, tuple(outputs))


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _take(x: Any, idx: torch.Tensor) -> Any:
    return x.index_select(0, idx.to(x.device))


def _launch(probe: Probe, split: RowSplit, idx: torch.Tensor) -> dict[str, Any]:
    inputs = probe.fresh_inputs()
    for name in split.inputs:
        inputs[name] = _take(inputs[name], idx).contiguous()
    return inputs


def rows_order(probe: Probe, split: RowSplit, seed: int) -> str:
    perm = torch.randperm(split.n, generator=_generator(seed))
    if torch.equal(perm, torch.arange(split.n)):
        perm = perm.flip(0)
    case = probe.case
    dirty = {n: clone(t) for n, t in probe.first.items() if n not in case.inplace}
    got = call(probe.impl, case, _launch(probe, split, perm), dirty)
    problems = []
    for name in case.outputs:
        want = _take(probe.first[name], perm) if name in split.outputs else probe.first[name]
        p = same_bytes(got[name], want, f"output {name}")
        if p:
            problems.append(p)
    if not problems:
        return PASSED
    return failed(f"rows launched in the order {perm.tolist()[:16]} (into buffers holding the "
                  f"first call's results): " + "; ".join(problems))


def batch_size(probe: Probe, split: RowSplit, seed: int) -> str:
    """Two launches of their own: a shuffled subset of about a quarter of the rows, and one row
    alone (the smallest launch, where a GEMM turns into a GEMV and tile choices differ)."""
    drawn = torch.randperm(split.n, generator=_generator(seed + 1))
    subsets = [drawn[: max(1, split.n // 4)]]
    if split.n // 4 > 1:
        subsets.append(drawn[-1:])
    for sub in subsets:
        problem = _subset_problem(probe, split, sub)
        if problem:
            return failed(problem)
    return PASSED


def _subset_problem(probe: Probe, split: RowSplit, sub: torch.Tensor) -> str | None:
    m = len(sub)
    case = probe.case
    inputs = _launch(probe, split, sub)
    device = next((t.device for v in inputs.values() for t in _tensors(v)), "cpu")
    outs = {}
    for name, s in case.outputs.items():
        if name in case.inplace:
            continue
        shape = (m, *s.shape[1:]) if name in split.outputs else s.shape
        outs[name] = oracles.poison(torch.empty(shape, dtype=s.dtype, device=device))
    got = call(probe.impl, case, inputs, outs)
    problems = []
    for name in case.outputs:
        if name in split.outputs:
            p = same_bytes(got[name], _take(probe.first[name], sub), f"output {name}")
        elif name in case.inplace:
            p = _first_or_before(got[name], probe.first[name], probe.before[case.inplace[name]], name)
        else:
            continue  # a shared output of the whole launch: nothing to compare row by row
        if p:
            problems.append(p)
    if not problems:
        return None
    return (f"rows {sub.tolist()[:16]} launched alone ({m} of {split.n}): " + "; ".join(problems))


def _first_or_before(got: Any, first: Any, before: Any, name: str) -> str | None:
    """Every element of a shared in-place buffer holds the first call's bytes or its old ones."""
    for i, (g, f, b) in enumerate(zip(_tensors(got), _tensors(first), _tensors(before))):
        gb, fb, bb = (oracles.bit_pattern(t.detach().cpu()) for t in (g, f, b))
        bad = (gb != fb) & (gb != bb)
        if bad.any():
            at = tuple(int(k) for k in bad.nonzero()[0])
            part = f"[{i}]" if len(_tensors(got)) > 1 else ""
            return (f"shared in-place {name}{part}: {int(bad.sum())} element(s) hold neither the "
                    f"full launch's bytes nor the old ones, first at {at}")
    return None


def check(probe: Probe, claims: bool, contract: HarnessContract, seed: int) -> dict[str, str]:
    """The verdicts ``rows_order`` and ``batch_size`` (the first call into dirty buffers doubles as
    the ``dirty_reuse`` check where it passes)."""
    if not claims:
        why = not_run("the variant does not claim batch invariance")
        return {"rows_order": why, "batch_size": why}
    split = row_split(probe.case, probe.first, probe.before, contract)
    if isinstance(split, str):
        return {"rows_order": not_run(split), "batch_size": not_run(split)}
    if split.n < 2:
        why = not_run(f"the cell's launch has {split.n} row")
        return {"rows_order": why, "batch_size": why}
    out = {}
    for name, run in (("rows_order", rows_order), ("batch_size", batch_size)):
        try:
            out[name] = run(probe, split, seed)
        except Exception as e:  # noqa: BLE001 - a variant that raises on a launch of other rows
            out[name] = failed(f"the variant raised: {type(e).__name__}: {e}".splitlines()[0])
    return out
