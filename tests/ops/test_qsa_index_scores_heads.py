"""The Triton index scores with fewer than 16 index heads (the tiny model's 4 of dim 32): the
wrapper pads the heads with zeros, and the scores keep the cell's band against float64 (the band's
derivation counts additions of exact products; fewer heads only remove terms)."""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import pytest
import torch

from certify.harness.oracles import tolerance
from impl.kernels.qsa.triton_index import index_scores
from spec.cases.qsa import index_scores_case
from spec.ops.qsa import qsa_index_scores

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter arch is the CPU's")


def test_four_index_heads_keep_the_band():
    axes = dict(step="decode", batch=4, rows=4, context=300, plane_dtype="bfloat16",
                act_dtype="bfloat16", index_heads=4, index_dim=32)
    case = index_scores_case(axes, torch.Generator().manual_seed(5), "cpu")
    x = case.inputs
    scores = torch.full(case.outputs["scores"].shape, float("nan"))
    index_scores(x["q_index"], x["w_index"], x["seq_ids"], x["positions"], x["block_table"],
                 x["block_keys"], scores)
    wide = {k: (v.double() if v.is_floating_point() else v) for k, v in x.items()}
    ref = qsa_index_scores(wide["q_index"], wide["w_index"], wide["seq_ids"], wide["positions"],
                           wide["block_table"], wide["block_keys"], wide["block_key_valid"])
    assert torch.isfinite(scores).sum() > 0
    v = tolerance("scores", scores, ref, 16, 3, allow_matching_inf=True)
    assert v.passed, v.problems
