"""QK norm + RoPE of the QSA layers (docs/spec.md, "QK norm + RoPE").

Per token and per q or k head: ``h = rmsnorm(x, w)`` over head_dim with that head kind's weight, then a
rotary position embedding on the first ``rotary_dim`` dims; the remaining dims pass through.

Public definitions followed:
- RoPE: Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding" (2021), with the
  rotate-half pairing of GPT-NeoX: dim j is paired with dim ``j + rotary_dim/2`` (not with j + 1), and
  ``inv_freq_j = theta^(-2j/rotary_dim)`` for j in [0, rotary_dim/2).
- mRoPE: the multimodal RoPE of Qwen2-VL (three position rows t/h/w), in the interleaved form of
  Qwen3-VL: frequency j reads the h row when ``j % 3 == 1 and j < 3*sections[1]``, the w row when
  ``j % 3 == 2 and j < 3*sections[2]``, else the t row. With the sections (11, 11, 10) and 32
  frequencies of docs/spec.md this is its rule written out (a ``j < 3*11`` bound for w would differ
  from ``j < 3*10`` only at j = 32, which does not exist).
- RMSNorm: spec.ops.norms.rmsnorm (Zhang & Sennrich 2019, zero-centred weight as in Qwen3-Next).

V is not an input: "V heads are not touched" (docs/spec.md) holds by construction.

Rounding points (decided here, restated in docs/spec.md; pinned in tests/spec/test_rope.py):
1. The norm output is cast to the activation dtype (rmsnorm's own single cast at its end).
2. The rotation is computed in the accumulation dtype (fp32, or float64 in reference mode) from that
   rounded norm output, and the result is cast to the activation dtype once, at the end. Pass-through
   dims are therefore the norm output bit for bit.
3. The cos/sin table is computed from the exact angle: ``position * inv_freq`` and cos/sin are evaluated
   in float64 and then rounded to the accumulation dtype. An fp32 angle would lose up to ~1e-2 rad at
   131K positions, which is an artefact of one implementation, not of the definition; an
   implementation that builds its table in fp32 is certified against the float64 reference by tolerance.
"""

from __future__ import annotations

import torch

from spec.numerics import acc_dtype, is_reference_mode, out_cast
from spec.ops.norms import rmsnorm

ROTARY_DIM = 64
THETA = 1e7
EPS = 1e-6
MROPE_SECTIONS = (11, 11, 10)  # t, h, w frequency counts; they sum to ROTARY_DIM // 2


def inv_freq(rotary_dim: int = ROTARY_DIM, theta: float = THETA,
             device: torch.device | str | None = None) -> torch.Tensor:
    """``theta^(-2j/rotary_dim)`` for j = 0 .. rotary_dim/2 - 1, float64, shape [rotary_dim // 2]."""
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be positive and even, got {rotary_dim}")
    j = torch.arange(rotary_dim // 2, dtype=torch.float64, device=device)
    return torch.pow(torch.tensor(theta, dtype=torch.float64, device=device), -2.0 * j / rotary_dim)


def mrope_freq_rows(rotary_dim: int = ROTARY_DIM,
                    sections: tuple[int, int, int] = MROPE_SECTIONS) -> torch.Tensor:
    """Which position row (0 = t, 1 = h, 2 = w) each frequency j reads in interleaved mRoPE.

    Returns int64 [rotary_dim // 2]. Row h when ``j % 3 == 1 and j < 3*sections[1]``, row w when
    ``j % 3 == 2 and j < 3*sections[2]``, else row t.
    """
    n_freq = rotary_dim // 2
    if sum(sections) != n_freq:
        raise ValueError(f"mRoPE sections {sections} must sum to rotary_dim / 2 = {n_freq}")
    rows = torch.zeros(n_freq, dtype=torch.int64)
    for j in range(n_freq):
        if j % 3 == 1 and j < 3 * sections[1]:
            rows[j] = 1
        elif j % 3 == 2 and j < 3 * sections[2]:
            rows[j] = 2
    return rows


def rope_angles(positions: torch.Tensor, rotary_dim: int = ROTARY_DIM, theta: float = THETA,
                sections: tuple[int, int, int] = MROPE_SECTIONS) -> torch.Tensor:
    """The rotation angle of every (token, frequency), float64 [T, rotary_dim // 2].

    positions: integer [T] (plain RoPE) or [3, T] (interleaved mRoPE, rows t/h/w). Positions are
    converted to float64, which is exact for any realistic position (< 2^53).
    """
    freqs = inv_freq(rotary_dim, theta, device=positions.device)
    pos = positions.to(torch.float64)
    if positions.dim() == 1:
        return pos[:, None] * freqs[None, :]
    if positions.dim() == 2 and positions.shape[0] == 3:
        rows = mrope_freq_rows(rotary_dim, sections).to(positions.device)
        # pos_per_freq[t, j] = positions[rows[j], t]: each frequency reads its own row.
        pos_per_freq = pos[rows, :].transpose(0, 1)
        return pos_per_freq * freqs[None, :]
    raise ValueError(f"positions must be [T] or [3, T], got shape {tuple(positions.shape)}")


def apply_neox_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` dims of x with the NeoX (rotate-half) pairing.

    x: [T, H, D] in the dtype the rotation is computed in; cos, sin: [T, rotary_dim // 2], same dtype.
    For j < r/2 (r = rotary_dim), the pair (x_j, x_{j+r/2}) becomes
    ``(x_j cos - x_{j+r/2} sin, x_{j+r/2} cos + x_j sin)``. Dims >= r are returned unchanged.
    """
    half = cos.shape[-1]
    rot = 2 * half
    if rot > x.shape[-1]:
        raise ValueError(f"rotary_dim {rot} exceeds head_dim {x.shape[-1]}")
    c = cos[:, None, :]  # broadcast over heads
    s = sin[:, None, :]
    x1 = x[..., :half]
    x2 = x[..., half:rot]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, x[..., rot:]], dim=-1)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, w_q: torch.Tensor, w_k: torch.Tensor,
                 positions: torch.Tensor, rotary_dim: int = ROTARY_DIM, theta: float = THETA,
                 eps: float = EPS,
                 sections: tuple[int, int, int] = MROPE_SECTIONS) -> tuple[torch.Tensor, torch.Tensor]:
    """QK norm then RoPE (plain or interleaved mRoPE) of one step's q and k.

    q: [T, n_q_heads, head_dim], k: [T, n_kv_heads, head_dim], activation dtype (bf16 in the model);
    w_q, w_k: [head_dim] zero-centred rmsnorm weights; positions: integer [T] or [3, T] (mRoPE).
    Returns (q_out, k_out) in the activation dtype of q and k respectively (float64 in reference mode,
    i.e. when any floating input is float64). See the module docstring for the rounding points.
    """
    if q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError("q and k must share T and head_dim")
    if positions.dtype.is_floating_point:
        raise ValueError("positions must be an integer tensor")
    reference = is_reference_mode(q, k, w_q, w_k)
    acc = acc_dtype(q, k, w_q, w_k)
    if reference:
        # Reference mode: every rounding point is an identity, so compute everything in float64.
        q, k, w_q, w_k = (t.to(torch.float64) for t in (q, k, w_q, w_k))

    angles = rope_angles(positions, rotary_dim, theta, sections)
    cos = torch.cos(angles).to(acc)
    sin = torch.sin(angles).to(acc)

    def one_kind(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = rmsnorm(x, w, eps)  # rounding point 1: cast to x's dtype inside rmsnorm
        return out_cast(apply_neox_rope(h.to(acc), cos, sin), x.dtype, reference)

    return one_kind(q, w_q), one_kind(k, w_k)
