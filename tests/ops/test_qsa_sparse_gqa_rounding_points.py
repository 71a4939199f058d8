"""The Triton sparse GQA keeps the spec's rounding points, not only its band.

The spec rounds the attention output o to the activation dtype before the gate product (docs/spec.md,
"QSA" item 6). The cells' band hides a spec that gates the unrounded o, and the spec's own bf16 path
(spec_lowp) is compared with the float64 spec, which shares the change. The Triton rows kernel rounds
where the spec says, so its output equals the spec's bf16 path but for a few elements whose fp32
softmax sums fall on the other side of a bf16 rounding boundary (measured through the interpreter:
0.21 % at this shape; the spec gating the unrounded o moves 26 %).
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
AGREE = 0.01   # the share of output elements that may differ from the spec's own bf16 path


@pytest.mark.certify_property("qsa_sparse_gqa")
def test_triton_rows_round_o_where_the_spec_does():
    case = sparse_gqa_case(AXES, torch.Generator().manual_seed(28), torch.device("cpu"))
    got = run_variant(triton_rows, case)
    spec = run_spec(qsa.qsa_sparse_gqa, case, reference=False)
    differ = (got["out"].float() != spec["out"].float()).float().mean().item()
    assert differ <= AGREE, f"{differ:.2%} of the outputs differ from the spec's bf16 path"
