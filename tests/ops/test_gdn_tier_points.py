"""Where FlashInfer's sm_90 prefill rounds: the points of gdn_prefill's bf16_operands tier, each
shown on the H200 (skipped without a CUDA device and flashinfer).

At one chunk of 64 rows (no carry between chunks, where the rounding's effects compound and hide
one another) FlashInfer's result is compared with the tier's float64 spec path, with that path less
one rounding point at a time, and with the exact spec. The tier holds where FlashInfer is much
nearer its path than the exact spec, and every point is FlashInfer's where leaving it out moves the
path further from FlashInfer's result (in out or in the final state).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from certify.catalog.load import load_op_file
from certify.files.paths import project_paths
from certify.harness.requirements import installed
from certify.harness.target import build_case, run_spec, run_variant, variant_callable
from spec.ops import gdn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not installed("flashinfer"),
                                reason="needs a CUDA device and flashinfer")
MOVES = 1.1   # leaving a point out moves the path at least 10 % further from FlashInfer


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    r = ref.double().cpu()
    return float((got.double().cpu() - r).norm() / r.norm())


def test_each_rounding_point_of_the_tier_is_flashinfers():
    op = load_op_file(project_paths().cells / "gdn_prefill.yaml")
    cell = op.cell("short_t37").model_copy(update={"id": "points_b2_t64",
                                                   "axes": {"batch": 2, "seq_len": 64}})
    case = build_case(op, cell, torch.device("cuda"))
    got = run_variant(variant_callable(op, "flashinfer_chunked"), case)

    def distance(spec) -> tuple[float, float]:
        ref = run_spec(spec, case, reference=True)
        return _rel(got["out"], ref["out"]), _rel(got["final_state"], ref["final_state"])

    full = distance(gdn.gdn_prefill_bf16_operands)
    exact = distance(gdn.gdn_prefill)
    rows = {"tier": full, "exact": exact}
    for point in gdn.BF16_OPERAND_POINTS:
        rows[f"tier less {point}"] = distance(partial(gdn.gdn_prefill_bf16_operands,
                                                      skip=frozenset({point})))
    for name, (o, s) in rows.items():
        print(f"{name:32s} out {o:.3e}  final_state {s:.3e}")
    assert full[1] < exact[1] / 4, "FlashInfer's state is not much nearer the tier than exact"
    not_moved = [name for name, (o, s) in rows.items() if name.startswith("tier less")
                 and o < MOVES * full[0] and s < MOVES * full[1]]
    assert not not_moved, f"points FlashInfer does not round at (or hides): {not_moved}"
