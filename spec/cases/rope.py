"""Input builders of QK norm + RoPE (docs/spec.md, "QK norm + RoPE") at the target geometry."""

from __future__ import annotations

import torch

from certify.harness.target import Case, OutSpec
from spec.cases.common import DTYPES, randn

MAX_POSITION = 131_071  # the last position of a 131K context


def _positions(gen: torch.Generator, step: str, rows: int, context: int) -> torch.Tensor:
    """Absolute positions of one step's rows (int64 [rows]).

    decode: one row per request, each at its request's last position; request 0 sits at the longest
    context (position context - 1), the others anywhere below it.
    prefill: one chunk of consecutive positions ending at the context's last position.
    """
    if not 1 <= rows <= context:
        raise ValueError(f"{rows} rows do not fit a context of {context} tokens")
    if step == "decode":
        pos = torch.randint(0, context, (rows,), generator=gen)
        pos[0] = context - 1
        return pos
    if step == "prefill":
        return torch.arange(context - rows, context)
    raise ValueError(f"unknown step {step!r}")


def _mrope_positions(gen: torch.Generator, rows: int, context: int) -> torch.Tensor:
    """Interleaved-mRoPE positions [3, rows] (t, h, w) of a prompt that ends with an image.

    Qwen2-VL's layout: text tokens before the image carry t = h = w = their index; the image's tokens
    share one t (the index of its first token) and walk a grid of h x w patches from that base; the
    text after the image resumes at base + max(h, w). Here the last ``rows`` tokens of the context are
    the chunk: a text prefix, a 16 x (rows // 16 - 2) patch grid, then text.
    """
    start = context - rows
    grid_w = 16
    grid_h = max(1, rows // grid_w - 2)
    n_img = grid_h * grid_w
    n_pre = (rows - n_img) // 2
    n_post = rows - n_img - n_pre
    pos = torch.empty(3, rows, dtype=torch.int64)
    pre = torch.arange(start, start + n_pre)
    pos[:, :n_pre] = pre
    base = start + n_pre
    hh, ww = torch.meshgrid(torch.arange(grid_h), torch.arange(grid_w), indexing="ij")
    pos[0, n_pre:n_pre + n_img] = base
    pos[1, n_pre:n_pre + n_img] = base + hh.flatten()
    pos[2, n_pre:n_pre + n_img] = base + ww.flatten()
    post = base + max(grid_h, grid_w) + torch.arange(n_post)
    pos[:, n_pre + n_img:] = post
    return pos


def qk_norm_rope_case(axes: dict, gen: torch.Generator, device) -> Case:
    rows, context = axes["rows"], axes["context"]
    n_q, n_kv, d = axes["q_heads"], axes["kv_heads"], axes["head_dim"]
    act = DTYPES[axes["act_dtype"]]
    # q and k projections: unnormalised, with a per-head scale spread (heads differ in magnitude) and
    # one outlier channel that dominates the mean square, as projection outputs have.
    q = randn(gen, rows, n_q, d) * torch.exp(randn(gen, 1, n_q, 1, scale=0.5))
    k = randn(gen, rows, n_kv, d) * torch.exp(randn(gen, 1, n_kv, 1, scale=0.5))
    q[..., 3] *= 12.0
    k[..., 40] *= 12.0  # inside the rotated dims: its pair partner is dim 8
    # Zero-centred norm weights (checkpoint dtype bf16), trained away from 0.
    w_q = randn(gen, d, scale=0.2, dtype=torch.bfloat16, device=device)
    w_k = randn(gen, d, scale=0.2, dtype=torch.bfloat16, device=device)
    if axes["rope"] == "mrope":
        positions = _mrope_positions(gen, rows, context)
    else:
        positions = _positions(gen, axes["step"], rows, context)
    if positions.max() > MAX_POSITION:
        raise ValueError("positions beyond a 131K context")
    return Case(inputs={"q": q.to(act).to(device), "k": k.to(act).to(device), "w_q": w_q, "w_k": w_k,
                        "positions": positions.to(device)},
                outputs={"q_out": OutSpec((rows, n_q, d), act), "k_out": OutSpec((rows, n_kv, d), act)})
