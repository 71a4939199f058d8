"""Property tests and the guard of the QK norm + RoPE spec (spec/ops/rope.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from spec.ops.norms import rmsnorm
from spec.ops.rope import (
    MROPE_SECTIONS,
    apply_neox_rope,
    inv_freq,
    mrope_freq_rows,
    qk_norm_rope,
    rope_angles,
)


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    # Shifted away from zero so that no input is all zeros.
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale + 0.1


@st.composite
def rope_cases(draw: st.DrawFn) -> dict:
    """Small float64 cases: T tokens, q and k heads, head_dim >= rotary_dim, integer positions."""
    half = draw(st.sampled_from([1, 2, 3, 5, 8, 32]))
    rotary_dim = 2 * half
    head_dim = rotary_dim + draw(st.integers(0, 6))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    t = draw(st.integers(1, 5))
    return dict(
        q=_randn(gen, t, draw(st.integers(1, 3)), head_dim),
        k=_randn(gen, t, draw(st.integers(1, 2)), head_dim),
        w_q=_randn(gen, head_dim, scale=0.3),
        w_k=_randn(gen, head_dim, scale=0.3),
        positions=torch.tensor(draw(st.lists(st.integers(0, 200_000), min_size=t, max_size=t))),
        shift=draw(st.integers(-100_000, 100_000)),
        rotary_dim=rotary_dim,
        theta=draw(st.sampled_from([10_000.0, 1e6, 1e7])),
    )


@pytest.mark.certify_property("qk_norm_rope")
@given(rope_cases())
def test_qk_norm_rope_properties(case: dict) -> None:
    """RoFormer's properties in float64: the rotation preserves norms (per rotated pair, hence per
    head), pass-through dims are the norm output, q(m).k(n) depends only on m - n, and interleaved
    mRoPE with equal t/h/w rows is plain RoPE."""
    q, k, w_q, w_k, pos = case["q"], case["k"], case["w_q"], case["w_k"], case["positions"]
    r, theta = case["rotary_dim"], case["theta"]
    kw = dict(rotary_dim=r, theta=theta)

    q_out, k_out = qk_norm_rope(q, k, w_q, w_k, pos, **kw)
    assert q_out.dtype == torch.float64 and q_out.shape == q.shape and k_out.shape == k.shape

    # Position 0 is the identity rotation, so it is the norm alone.
    zeros = torch.zeros_like(pos)
    q_norm, k_norm = qk_norm_rope(q, k, w_q, w_k, zeros, **kw)
    torch.testing.assert_close(q_norm, rmsnorm(q, w_q), rtol=0, atol=0)
    torch.testing.assert_close(k_norm, rmsnorm(k, w_k), rtol=0, atol=0)

    # Norm preservation, per NeoX pair (x_j, x_{j+r/2}), and pass-through dims untouched.
    half = r // 2
    def pair_norms(x: torch.Tensor) -> torch.Tensor:
        return x[..., :half] ** 2 + x[..., half:r] ** 2
    torch.testing.assert_close(pair_norms(q_out), pair_norms(q_norm), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(pair_norms(k_out), pair_norms(k_norm), rtol=1e-12, atol=1e-12)
    assert torch.equal(q_out[..., r:], q_norm[..., r:])
    assert torch.equal(k_out[..., r:], k_norm[..., r:])

    # Relative position: shifting every position by the same amount keeps every q.k dot product.
    shifted = pos + case["shift"] + 100_000  # stays >= 0
    q_s, k_s = qk_norm_rope(q, k, w_q, w_k, shifted, **kw)
    dots = torch.einsum("ihd,jgd->ijhg", q_out, k_out)
    dots_s = torch.einsum("ihd,jgd->ijhg", q_s, k_s)
    torch.testing.assert_close(dots_s, dots, rtol=1e-9, atol=1e-9)

    # mRoPE with t = h = w rows is plain RoPE, bit for bit (same angles, same arithmetic). Sections
    # are those of docs/spec.md (11, 11, 10) at rotary_dim 64, else a split of the same shape.
    sections = MROPE_SECTIONS if r == 64 else (half - 2 * (half // 3), half // 3, half // 3)
    q_m, k_m = qk_norm_rope(q, k, w_q, w_k, pos.expand(3, -1), sections=sections, **kw)
    assert torch.equal(q_m, q_out) and torch.equal(k_m, k_out)


@pytest.mark.certify_guard("qk_norm_rope")
def test_qk_norm_rope_guard() -> None:
    """head_dim 6, rotary_dim 4, theta 100 (inv_freq = [1, 0.1]), eps 0, position 1; plus the mRoPE
    frequency -> row map at rotary_dim 64, written out.

    q = [2, 0, 0, 0, 1, -1]: mean square 1, so the norm is the identity times (1 + w); w_q = 0.5 on
    dim 4 only. The pairs are (0, 2) at angle 1 rad and (1, 3) at angle 0.1 rad:
    dim0 = 2 cos 1, dim2 = 2 sin 1, dims 1 and 3 stay 0, dim4 = 1 * 1.5, dim5 = -1.
    k = [0, 3, 0, 0, 0, 3] has mean square 3, so it normalises to [0, sqrt3, 0, 0, 0, sqrt3]; with
    w_k = 0 the pair (1, 3) rotates by 0.1 rad: dim1 = sqrt3 cos 0.1, dim3 = sqrt3 sin 0.1.
    """
    q = torch.tensor([[[2.0, 0.0, 0.0, 0.0, 1.0, -1.0]]], dtype=torch.float64)
    k = torch.tensor([[[0.0, 3.0, 0.0, 0.0, 0.0, 3.0]]], dtype=torch.float64)
    w_q = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.5, 0.0], dtype=torch.float64)
    w_k = torch.zeros(6, dtype=torch.float64)
    q_out, k_out = qk_norm_rope(q, k, w_q, w_k, torch.tensor([1]), rotary_dim=4, theta=100.0, eps=0.0)
    expected_q = [1.0806046117362795, 0.0, 1.682941969615793, 0.0, 1.5, -1.0]
    expected_k = [0.0, 1.7233977680042012, 0.0, 0.1729165499254989, 0.0, 1.7320508075688772]
    torch.testing.assert_close(q_out[0, 0], torch.tensor(expected_q, dtype=torch.float64),
                               rtol=0, atol=1e-14)
    torch.testing.assert_close(k_out[0, 0], torch.tensor(expected_k, dtype=torch.float64),
                               rtol=0, atol=1e-14)
    # Interleaved mRoPE at rotary_dim 64: frequencies cycle t, h, w; j = 30 is t and j = 31 is h.
    assert mrope_freq_rows().tolist() == [0, 1, 2] * 10 + [0, 1]


def test_inv_freq_literal() -> None:
    """inv_freq_j = theta^(-2j/r): for r = 8, theta = 1e4 it is 1, 0.1, 0.01, 0.001."""
    torch.testing.assert_close(inv_freq(8, 1e4), torch.tensor([1.0, 0.1, 0.01, 0.001], dtype=torch.float64),
                               rtol=1e-15, atol=0)


def test_mrope_row_map_is_mathmd_rule() -> None:
    """The default map (rotary_dim 64, sections 11/11/10) is the rule of docs/spec.md, "QK norm + RoPE"
    written out."""
    t_, h_, w_ = 0, 1, 2
    expected = [t_, h_, w_] * 10 + [t_, h_]  # j = 30 -> t, j = 31 -> h (31 % 3 == 1, 31 < 33)
    assert mrope_freq_rows().tolist() == expected
    literal = [1 if (j % 3 == 1 and j < 33) else 2 if (j % 3 == 2 and j < 33) else 0 for j in range(32)]
    assert mrope_freq_rows().tolist() == literal
    assert expected.count(t_) == 11 and expected.count(h_) == 11 and expected.count(w_) == 10


def test_mrope_reads_its_rows() -> None:
    """Frequency j rotates by position[row(j)] * inv_freq_j: distinct t/h/w rows land where mapped."""
    pos = torch.tensor([[5], [7], [11]])
    angles = rope_angles(pos)[0]
    rows = mrope_freq_rows()
    expected = torch.tensor([[5.0], [7.0], [11.0]], dtype=torch.float64)[rows, 0] * inv_freq()
    assert torch.equal(angles, expected)


def test_bf16_rounding_points() -> None:
    """Decision pin: bf16 in -> bf16 out; the rotation is applied in fp32 to the bf16-rounded norm
    output with cos/sin from float64 angles rounded to fp32, and cast to bf16 once at the end."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(3, 4, 128, generator=gen).to(torch.bfloat16)
    k = torch.randn(3, 2, 128, generator=gen).to(torch.bfloat16)
    w_q = (0.1 * torch.randn(128, generator=gen)).to(torch.bfloat16)
    w_k = (0.1 * torch.randn(128, generator=gen)).to(torch.bfloat16)
    pos = torch.tensor([0, 131_071, 40_000])
    q_out, k_out = qk_norm_rope(q, k, w_q, w_k, pos)
    assert q_out.dtype == torch.bfloat16 and k_out.dtype == torch.bfloat16
    angles = pos.double()[:, None] * inv_freq()[None, :]
    for x, w, out in ((q, w_q, q_out), (k, w_k, k_out)):
        h = rmsnorm(x, w)
        assert h.dtype == torch.bfloat16
        manual = apply_neox_rope(h.float(), torch.cos(angles).float(), torch.sin(angles).float())
        assert torch.equal(out, manual.to(torch.bfloat16))
        assert torch.equal(out[..., 64:], h[..., 64:])  # pass-through dims are the norm output
