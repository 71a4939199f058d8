"""The float64 side of moe_route's set oracle (docs/spec.md, "MoE"): the scores the router ranks,
a derived bound on how far its fp32 path may move each of them, and the renormalised weights of a
given selection.

The bound, per (row, expert i), on |p_i(fp32 path) - p_i| in the terms that can reorder a row (a
factor common to the whole row, the max shift and the softmax sum, cancels in every comparison):
- the logit l_i = x . w_i is an fp32 sum of C exact products (bf16 x bf16 fits fp32's 24 bits); its
  error is at most lambda sqrt(C) u A_i, A_i = sum_c |x_c w_ic|, u = 2^-24, with probability at least
  1 - 2 C exp(-lambda^2 / 2) per dot product (Higham and Mary, "A new approach to probabilistic
  rounding error analysis", SIAM J. Sci. Comput. 2019, Theorem 2.4); lambda = 8 gives 8e-11 per dot
  at C = 3072, whatever order the kernel sums in;
- l_i - m rounds once (u |l_i - m| in the exponent), exp is within one ulp (2u), and the division by
  the sum rounds once (u): 3u more, relative;
- below fp32's normal range exp and the division are exact to within a subnormal step each:
  2^-149 + 2^-150 < 2^-148 absolute.
So b_i = p_i expm1(lambda sqrt(C) u A_i + u |l_i - m| + 3u) + 2^-148. Measured on moe_route's
near_ties_t128 data: the fp32 logits' error is at most 2.05 u A_i, against the bound's 443 u A_i.
"""

from __future__ import annotations

import math

import torch

U32 = 2.0 ** -24
LAMBDA = 8.0
SUBNORMAL_ROOM = 2.0 ** -148


def _logits(x: torch.Tensor, w_router: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float64) @ w_router.to(torch.float64).T


def route_scores(x: torch.Tensor, w_router: torch.Tensor, top_k: int) -> torch.Tensor:
    """float64 p = softmax(x @ W_r^T) [T, E]: what moe_route ranks."""
    return torch.softmax(_logits(x, w_router), dim=-1)


def route_score_bound(x: torch.Tensor, w_router: torch.Tensor, top_k: int) -> torch.Tensor:
    """The bound b [T, E] of the module docstring."""
    logits = _logits(x, w_router)
    a = x.to(torch.float64).abs() @ w_router.to(torch.float64).abs().T
    shift = (logits - logits.amax(dim=-1, keepdim=True)).abs()
    rel = LAMBDA * math.sqrt(x.shape[-1]) * U32 * a + U32 * shift + 3 * U32
    return torch.softmax(logits, dim=-1) * torch.expm1(rel) + SUBNORMAL_ROOM


def route_weights_given(x: torch.Tensor, w_router: torch.Tensor, top_k: int,
                        expert_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """moe_route's second result in float64 for the selection ``expert_ids`` [T, k]: the float64 p
    at those ids, in their slot order, over their sum."""
    p_sel = torch.gather(route_scores(x, w_router, top_k), -1, expert_ids.to(torch.int64))
    return {"weights": p_sel / p_sel.sum(dim=-1, keepdim=True)}
