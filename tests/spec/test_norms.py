"""rmsnorm: the zero-centred (1 + w) RMSNorm of docs/spec.md, "Norms and embeddings"."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from spec.ops.norms import rmsnorm


@pytest.mark.certify_property("rmsnorm")
@given(seed=st.integers(0, 2 ** 31), d=st.sampled_from([16, 128, 3072]), exp=st.integers(-8, 8))
def test_rmsnorm_has_unit_rms_at_w_zero_and_is_scale_invariant(seed, d, exp):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, d, generator=gen, dtype=torch.float64)
    w = torch.zeros(d, dtype=torch.float64)
    y = rmsnorm(x, w, eps=0.0)
    assert torch.allclose(y.pow(2).mean(-1), torch.ones(4, dtype=torch.float64), rtol=1e-12)
    assert torch.allclose(rmsnorm(x * 2.0 ** exp, w, eps=0.0), y, rtol=1e-12)
    # bf16 path: fp32 math and exactly one rounding, i.e. the float64 result rounded once, up to
    # fp32's own error moving a value across a bf16 rounding boundary (one ulp).
    xb = x.to(torch.bfloat16)
    lowp = rmsnorm(xb, w.float())
    ideal = rmsnorm(xb.double(), w).to(torch.bfloat16)
    diff = (lowp.float() - ideal.float()).abs()
    assert (diff <= ideal.float().abs() * 2 ** -7 + 1e-30).all()


@pytest.mark.certify_guard("rmsnorm")
def test_rmsnorm_guard():
    """x = (3, 4): mean(x^2) = 12.5; w = (0, 1) gives the factors (1, 2)."""
    y = rmsnorm(torch.tensor([3.0, 4.0], dtype=torch.float64), torch.tensor([0.0, 1.0],
                                                                            dtype=torch.float64))
    r = 1 / math.sqrt(12.5 + 1e-6)
    assert y.tolist() == pytest.approx([3 * r, 8 * r])
