"""A row of the Triton rows kernel attends its own selection only, whatever else its tile holds.

The rows kernel runs the rows of one request together over the union of their selected tokens, each
row weighted by its own multiplicity (0 for a token it did not select). A kernel that lets a token of
another row into a row's running maximum still gives that row's softmax in exact arithmetic (its p
is 0), so the cells' random keys pass it; a key whose logit for this row lies far above the row's own
(here by about 1000, past exp's fp32 range of 87) underflows every p of the row to 0 and zeroes its
output. The key sits at the last verify row's own token, which the request's first row does not
select.
"""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import pytest
import torch

from certify.harness.target import run_spec, run_variant
from impl.kernels.qsa.triton_sparse_gqa import triton_rows
from spec.cases.qsa import sparse_gqa_case
from spec.ops import qsa

AXES = {"step": "verify", "batch": 2, "rows": 8, "context": 2048, "kv_dtype": "bfloat16",
        "act_dtype": "bfloat16", "q_heads": 24, "kv_heads": 2, "head_dim": 256}


@pytest.mark.certify_property("qsa_sparse_gqa")
def test_a_token_of_another_row_leaves_a_rows_output_alone():
    case = sparse_gqa_case(AXES, torch.Generator().manual_seed(28), torch.device("cpu"))
    x = case.inputs
    rows = [r for r in range(x["q"].shape[0]) if int(x["seq_ids"][r]) == 0]
    first = min(rows, key=lambda r: int(x["tokens"][r].max()))
    last = max(rows, key=lambda r: int(x["tokens"][r].max()))
    token = int(x["tokens"][last].max())
    assert token not in x["tokens"][first].tolist()
    page, offset = qsa.slot_of(x["block_table"], torch.tensor([0]), torch.tensor([token]))
    group = x["q"].shape[1] // x["k_cache"].shape[2]
    for h in range(x["k_cache"].shape[2]):   # logit q . k / 16 of about 1000 for the first row
        q = x["q"][first, h * group].float()
        x["k_cache"][page, offset, h] = (q * (16000.0 / q.pow(2).sum())).to(torch.bfloat16)
    got = run_variant(triton_rows, case)["out"][first].float()
    ref = run_spec(qsa.qsa_sparse_gqa, case, reference=False)["out"][first].float()
    assert ref.abs().max() > 0
    differ = (got != ref).float().mean().item()
    assert differ <= 0.01, f"{differ:.2%} of the first row's outputs differ from the spec's bf16 path"
