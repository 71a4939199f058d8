"""The Triton QK norm + RoPE keeps the spec's rounding points, not only its band.

The spec rounds the rmsnorm to the activation dtype before the rotation (docs/spec.md, "QK norm + RoPE"). The
cells' band (2 ulp of the row maximum) is wide enough to hide a spec that rotates the unrounded norm,
and the spec's own bf16 path (spec_lowp) is compared with the float64 spec, which shares the change.
The Triton kernel rounds where the spec says, so its output equals the spec's bf16 path element by
element (measured through the interpreter: 0 of 53248 elements differ at this shape; the spec
rotating the unrounded norm moves 7.9 % of them).
"""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import pytest
import torch

from certify.harness.target import run_spec, run_variant
from impl.kernels.norms import triton_qk_norm_rope as kernel
from spec.cases.rope import qk_norm_rope_case
from spec.ops import rope

AXES = {"step": "decode", "rows": 8, "context": 131072, "rope": "plain", "act_dtype": "bfloat16",
        "q_heads": 24, "kv_heads": 2, "head_dim": 256}
AGREE = 0.001   # the share of output elements that may differ from the spec's own bf16 path


@pytest.mark.certify_property("qk_norm_rope")
def test_triton_qk_norm_rope_rounds_where_the_spec_does():
    case = qk_norm_rope_case(AXES, torch.Generator().manual_seed(28), torch.device("cpu"))
    got = run_variant(kernel.qk_norm_rope, case)
    spec = run_spec(rope.qk_norm_rope, case, reference=False)
    for name in ("q_out", "k_out"):
        differ = (got[name].float() != spec[name].float()).float().mean().item()
        assert differ <= AGREE, f"{name}: {differ:.2%} of the outputs differ from the spec's bf16 path"
