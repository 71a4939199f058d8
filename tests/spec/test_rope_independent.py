"""QK norm + RoPE against public implementations (docs/spec.md, "QK norm + RoPE"): transformers'
Qwen3-Next zero-centred RMSNorm and partial-rotary ``apply_rotary_pos_emb`` (rotate-half, NeoX
pairing, dims past ``rotary_dim`` passed through), and Qwen3-VL's interleaved mRoPE layout
(``Qwen3VLTextRotaryEmbedding.recomposition_frequencies``), in float64 and in bf16.

The angles are ``position * theta^(-2j/64)`` written here in Python floats; cos and sin are taken in
float64 and, for the bf16 path, rounded to fp32 once as the prose says. transformers' functions are
imported, never copied; they are skipped where transformers is absent, except on CI.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from spec.ops.rope import mrope_freq_rows, qk_norm_rope

pytestmark = pytest.mark.premerge

F64 = torch.float64
R, THETA, EPS = 64, 1e7, 1e-6


def _transformers():
    if os.environ.get("CI") != "true":
        pytest.importorskip("transformers")
    from transformers.models.qwen3_next import modeling_qwen3_next as nxt
    from transformers.models.qwen3_vl import modeling_qwen3_vl as vl
    return nxt, vl


def _rows_by_qwen3_vl(vl, sections: tuple[int, int, int]) -> list[int]:
    """Which position row each frequency reads, by Qwen3-VL's recomposition: feed row d the value
    d at every frequency and read what the first half of its output holds."""
    n = sum(sections)
    freq = torch.arange(3, dtype=F64)[:, None, None, None].expand(3, 1, 1, n).clone()
    out = vl.Qwen3VLTextRotaryEmbedding.recomposition_frequencies(
        SimpleNamespace(mrope_section=list(sections)), freq)
    return [int(v) for v in out[0, 0, :n].tolist()]


@pytest.mark.second_formulation("spec.ops.rope:mrope_freq_rows")
@pytest.mark.parametrize("sections", ((11, 11, 10), (24, 20, 20), (8, 12, 12), (16, 4, 12)))
def test_mrope_rows_equal_qwen3_vl_interleaved_layout(sections):
    _, vl = _transformers()
    rows = mrope_freq_rows(2 * sum(sections), sections).tolist()
    assert rows == _rows_by_qwen3_vl(vl, sections)
    # wrong: Qwen2-VL's contiguous layout (t frequencies first, then h, then w).
    contiguous = [0] * sections[0] + [1] * sections[1] + [2] * sections[2]
    assert rows != contiguous


def _angles(positions: torch.Tensor, vl) -> torch.Tensor:
    """[T, 32] angles, ``p * theta^(-2j/64)``; [3, T] positions laid out by Qwen3-VL."""
    freqs = [THETA ** (-2.0 * j / R) for j in range(R // 2)]
    if positions.dim() == 1:
        return torch.tensor([[float(p) * f for f in freqs] for p in positions.tolist()], dtype=F64)
    per_row = torch.tensor([[[float(p) * f for f in freqs] for p in row]
                            for row in positions.tolist()], dtype=F64)[:, None]    # [3, 1, T, 32]
    return vl.Qwen3VLTextRotaryEmbedding.recomposition_frequencies(
        SimpleNamespace(mrope_section=[11, 11, 10]), per_row)[0, :, :R // 2]


def public_qk_norm_rope(q, k, w_q, w_k, positions, nxt, vl):
    """Qwen3-Next's RMSNorm and rotary embedding: float64 inputs stay float64 (the norm's
    ``_norm`` and ``(1 + w)``, the rotation in float64); bf16 inputs go through the norm module
    (fp32 math, one cast) and rotate in fp32 with fp32 cos / sin, cast to bf16 once."""
    ang = _angles(positions, vl)
    cos = torch.cat([torch.cos(ang)] * 2, dim=-1)
    sin = torch.cat([torch.sin(ang)] * 2, dim=-1)
    if q.dtype == F64:
        norm = SimpleNamespace(eps=EPS)
        qh = nxt.Qwen3NextRMSNorm._norm(norm, q) * (1.0 + w_q)
        kh = nxt.Qwen3NextRMSNorm._norm(norm, k) * (1.0 + w_k)
        return nxt.apply_rotary_pos_emb(qh, kh, cos, sin, unsqueeze_dim=1)
    normed = []
    for x, w in ((q, w_q), (k, w_k)):
        mod = nxt.Qwen3NextRMSNorm(x.shape[-1], eps=EPS)
        with torch.no_grad():
            mod.weight.copy_(w.float())
            normed.append(mod(x).float())
    qo, ko = nxt.apply_rotary_pos_emb(*normed, cos.float(), sin.float(), unsqueeze_dim=1)
    return qo.to(q.dtype), ko.to(k.dtype)


def _inputs(seed: int, T: int, dtype):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(T, 4, 96, generator=gen, dtype=F64) * 3.0).to(dtype)
    k = (torch.randn(T, 2, 96, generator=gen, dtype=F64) * 3.0).to(dtype)
    w_q = (0.2 * torch.randn(96, generator=gen, dtype=F64)).to(dtype)
    w_k = (0.2 * torch.randn(96, generator=gen, dtype=F64)).to(dtype)
    return gen, q, k, w_q, w_k


@pytest.mark.second_formulation("spec.ops.rope:qk_norm_rope")
def test_qk_norm_rope_float64_equals_qwen3_next_norm_and_rotary():
    # Angles reach 1.3e5 rad at 131K positions, where the two sides' angles (the spec's
    # torch.pow against Python's **) may differ by an ulp of inv_freq: 2 x 1.1e-16 x 1.3e5 = 3e-11
    # rad, so outputs of magnitude <= 4 (normalised, |1 + w| < 2) differ by at most ~1.2e-10.
    # Measured: 0 (the same bits on these inputs). ATOL 1e-9; a wrong pairing or the plain
    # weight w in place of 1 + w is off by O(1).
    nxt, vl = _transformers()
    gen, q, k, w_q, w_k = _inputs(51, 9, F64)
    plain = torch.randint(0, 131072, (9,), generator=gen)
    plain[:3] = torch.tensor([0, 1, 131071])
    mrope = torch.randint(0, 4096, (3, 9), generator=gen)
    for positions in (plain, mrope):
        got_q, got_k = qk_norm_rope(q, k, w_q, w_k, positions)
        want_q, want_k = public_qk_norm_rope(q, k, w_q, w_k, positions, nxt, vl)
        assert got_q.dtype == F64
        assert torch.allclose(got_q, want_q, rtol=0.0, atol=1e-9)
        assert torch.allclose(got_k, want_k, rtol=0.0, atol=1e-9)
        assert torch.equal(got_q[..., R:], want_q[..., R:])            # passed-through dims
    # wrong: the plain weight w instead of the zero-centred 1 + w.
    bad_q, _ = public_qk_norm_rope(q, k, w_q - 1.0, w_k - 1.0, plain, nxt, vl)
    assert not torch.allclose(qk_norm_rope(q, k, w_q, w_k, plain)[0], bad_q, atol=1e-3)


@pytest.mark.second_formulation("spec.ops.rope:qk_norm_rope")
def test_qk_norm_rope_bf16_equals_qwen3_next_modules_bit_for_bit():
    # Both round at the same points (the norm's one cast to bf16, the fp32 rotation with fp32
    # cos / sin, one cast): the same fp32 operations in the same order, so the bytes agree.
    nxt, vl = _transformers()
    gen, q, k, w_q, w_k = _inputs(52, 33, torch.bfloat16)
    positions = torch.randint(0, 131072, (33,), generator=gen)
    got_q, got_k = qk_norm_rope(q, k, w_q, w_k, positions)
    want_q, want_k = public_qk_norm_rope(q, k, w_q, w_k, positions, nxt, vl)
    assert got_q.dtype == torch.bfloat16
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    # wrong: the rotation applied to the unrounded (fp32) norm output, i.e. no rounding point 1.
    mod = nxt.Qwen3NextRMSNorm(96, eps=EPS)
    with torch.no_grad():
        mod.weight.copy_(w_q.float())
        unrounded = mod(q.float())
    ang = torch.cat([_angles(positions, vl)] * 2, dim=-1)
    bad_q, _ = nxt.apply_rotary_pos_emb(unrounded, unrounded, ang.cos().float(), ang.sin().float(),
                                        unsqueeze_dim=1)
    assert not torch.equal(bad_q.to(torch.bfloat16), got_q)
