"""The norms' eps where it matters: rows whose mean square is of the order of eps (1e-6).

The cells' rows have a mean square near 1 (and an outlier channel far above it), where eps moves the
result by about 1e-6 relative, far below a bf16 ulp: an eps left out, moved outside the square root
or set to 1e-5 passes them. Rows of magnitude 1e-3 put eps at a tenth of the mean square.
"""

from __future__ import annotations

import math

import pytest
import torch

from impl.kernels.gdn import torch_ops
from impl.kernels.norms.triton_rmsnorm import rmsnorm as triton_rmsnorm
from spec.ops.norms import gated_rmsnorm, rmsnorm


@pytest.mark.certify_guard("rmsnorm")
def test_rmsnorm_of_a_row_at_the_scale_of_eps_by_hand():
    """x = (3, 4) * 1e-3: mean(x^2) = 12.5e-6, plus eps 1e-6 gives r = 1 / sqrt(13.5e-6)."""
    x = torch.tensor([3e-3, 4e-3], dtype=torch.float64)
    y = rmsnorm(x, torch.zeros(2, dtype=torch.float64))
    r = 1 / math.sqrt(13.5e-6)
    assert y.tolist() == pytest.approx([3e-3 * r, 4e-3 * r], rel=1e-12)


def _small_rows(seed: int, rows: int, width: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-3.5, -2.5, rows, dtype=torch.float32)[:, None]
    return (torch.randn(rows, width, generator=gen) * scale).to(torch.bfloat16)


@pytest.mark.certify_property("rmsnorm")
def test_triton_rmsnorm_follows_the_spec_on_rows_at_the_scale_of_eps():
    x = _small_rows(1, 16, 256)
    w = torch.randn(256, generator=torch.Generator().manual_seed(2)) * 0.1
    out = torch.empty_like(x)
    triton_rmsnorm(x, w, out=out)
    ref = rmsnorm(x.double(), w.double())
    err = (out.double() - ref).abs() / ref.abs().amax(dim=-1, keepdim=True)
    assert err.max().item() <= 2 ** -8, err.max().item()   # one bf16 rounding of the row maximum


@pytest.mark.certify_property("gated_rmsnorm")
def test_torch_gated_norm_follows_the_spec_on_rows_at_the_scale_of_eps():
    gen = torch.Generator().manual_seed(3)
    o = _small_rows(4, 16, 128).float()
    z = torch.randn(16, 128, generator=gen).to(torch.bfloat16)
    w = 1.0 + 0.1 * torch.randn(128, generator=gen)
    out = torch.empty_like(z)
    torch_ops.gated_rmsnorm(o, z, w, out=out)
    ref = gated_rmsnorm(o.double(), z.double(), w.double())
    err = (out.double() - ref).abs() / ref.abs().amax(dim=-1, keepdim=True)
    assert err.max().item() <= 2 ** -7, err.max().item()   # the norm's two bf16 roundings
