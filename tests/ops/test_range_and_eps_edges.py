"""Inputs at the edges the cells' seeded draws do not reach: bf16 values beyond fp16's range, and rows
whose mean square is of the order of a norm's eps.

- linear: bf16 keeps fp32's exponent range; a product taken in fp16 overflows above 65504. An input
  element of 2^17 makes every output of its row inf in fp16 while the float64 result is finite.
- hc_inject_norm: the cells' streams have a mean square near 1, where eps (1e-6) moves r by about 5e-7
  relative. Streams of magnitude 1e-3 put eps at about a tenth of the mean square, so eps outside
  the square root (or left out) moves r by several percent.
"""

from __future__ import annotations

import pytest
import torch

from impl.kernels.linear.torch_linear import linear as torch_linear
from spec.ops.hc import hc_inject_norm
from spec.ops.linear import linear


@pytest.mark.certify_property("linear")
def test_torch_linear_keeps_bf16_range_beyond_fp16():
    gen = torch.Generator().manual_seed(17)
    x = torch.randn(4, 64, generator=gen).to(torch.bfloat16)
    x[1, 3] = 2.0 ** 17
    w = (torch.randn(32, 64, generator=gen) * 0.1).to(torch.bfloat16)
    out = torch.empty(4, 32, dtype=torch.bfloat16)
    torch_linear(x, w, out=out)
    ref = linear(x.double(), w.double())
    assert torch.isfinite(ref).all()
    assert torch.isfinite(out).all(), "an output overflowed: the product is not taken in bf16's range"
    err = (out.double() - ref).abs() / ref.abs().amax(dim=-1, keepdim=True)
    assert err.max().item() <= 2 ** -8, err.max().item()   # one bf16 rounding of the row maximum


@pytest.mark.certify_property("hc_inject_norm")
def test_triton_inject_norm_follows_the_spec_on_streams_at_the_scale_of_eps():
    from impl.kernels.hc.triton_hc import hc_inject_norm as triton_inject_norm  # noqa: PLC0415

    gen = torch.Generator().manual_seed(5)
    T, n, C = 4, 4, 64
    scale = torch.logspace(-3.5, -2.5, T, dtype=torch.float32)[:, None, None]
    X = torch.randn(T, n, C, generator=gen) * scale
    v, r = torch.empty(T, n * C), torch.empty(T)
    triton_inject_norm(X, v=v, r=r)
    v_ref, r_ref = hc_inject_norm(X.double())
    assert torch.equal(v, X.reshape(T, -1))
    rel = ((r.double() - r_ref) / r_ref).abs().max().item()
    assert rel <= 1e-5, rel   # fp32 sum of 256 squares and one rsqrt: a few 2^-24, far under 1e-5
