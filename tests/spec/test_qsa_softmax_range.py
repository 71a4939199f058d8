"""The sparse GQA softmax holds logits past exp's fp32 range (docs/spec.md, "QSA: sparse attention
with a block index" item 6: the softmax subtracts the row maximum and runs in fp32).

The cells' random keys give logits of a few units, where exp(l) and exp(l - max) round alike; a
softmax that adds the maximum, or forgets to subtract it, passes them. Here one request's queries
are scaled so that every logit of its rows lies near 120 (exp overflows fp32 past 88.7): the fp32
path must stay finite and give the float64 path's result within the op's bf16 output rounding.
"""

from __future__ import annotations

import pytest
import torch

from certify.harness.target import run_spec
from spec.cases.qsa import sparse_gqa_case
from spec.ops import qsa

pytestmark = pytest.mark.premerge

AXES = {"step": "verify", "batch": 2, "rows": 8, "context": 2048, "kv_dtype": "bfloat16",
        "act_dtype": "bfloat16", "q_heads": 24, "kv_heads": 2, "head_dim": 256}


@pytest.mark.certify_property("qsa_sparse_gqa")
def test_logits_past_exps_fp32_range_stay_finite():
    case = sparse_gqa_case(AXES, torch.Generator().manual_seed(47), torch.device("cpu"))
    x = case.inputs
    rows = x["seq_ids"] == 0
    k_mean = x["k_cache"].float().mean(dim=(0, 1))          # [kv_heads, D]
    group = x["q"].shape[1] // k_mean.shape[0]
    # each q head along its KV head's mean key, at a length that puts q . k / 16 near 120
    direction = k_mean.repeat_interleave(group, dim=0)
    q = direction * (120.0 * 16 / direction.pow(2).sum(-1, keepdim=True))
    x["q"][rows] = q.to(x["q"].dtype)
    got = run_spec(qsa.qsa_sparse_gqa, case, reference=False)["out"].float()
    want = run_spec(qsa.qsa_sparse_gqa, case, reference=True)["out"].float()
    assert torch.isfinite(got).all(), "the fp32 softmax overflowed"
    scale = want.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    assert ((got - want).abs() / scale).max() <= 2 ** -7, "the fp32 path left the float64 one"
