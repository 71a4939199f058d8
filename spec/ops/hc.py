"""Hyper-connections, manifold-constrained form with n = 4 streams (docs/spec.md, "Hyper-connections").

The residual stream of each token is widened to ``n`` streams X [n, C]. Every sublayer F (the mixer, then
the MoE) sits in one HC site, whose coefficients are computed per token from the streams themselves:

1. inject + norm: ``v = vec(X)`` [n*C], ``r = rsqrt(mean(v^2) + eps)``;
2. first projection: ``l = (v * r) @ Phi + bias`` split into l_pre [n], l_post [n], l_res [n, n];
   ``H_pre = sigmoid(l_pre)``, ``H_post = 2 sigmoid(l_post)``, ``H_res = sinkhorn(exp(l_res))``;
3. pre-mix: ``x_in = sum_i H_pre[i] X[i]``; the sublayer computes ``y = F(rmsnorm(x_in))``;
4. up projection: ``X'[i] = sum_j H_res[i, j] X[j] + H_post[i] y``, and ``m = mean_i X'[i]``.

Public definitions followed: Zhu et al., "Hyper-Connections" (2024), for the n-stream residual with
pre / post / residual mixing weights computed from the input (dynamic hyper-connections); the
manifold-constrained variant, "mHC: Manifold-Constrained Hyper-Connections" (DeepSeek-AI, 2025,
arXiv:2512.24880), which projects the residual mixing matrix onto the doubly stochastic matrices (the
Birkhoff polytope) with Sinkhorn-Knopp iterations (Sinkhorn & Knopp, 1967), so that stream mixing
preserves the mean of the streams and cannot amplify them. docs/spec.md calls this site layout the
model's own: docs/spec.md, not the papers, is the definition this module executes.

Shapes: tokens are batched in the leading dim. X [T, n, C]; v [T, n*C]; r [T]; Phi [n*C, 2n + n^2];
bias [2n + n^2]; H_pre, H_post [T, n]; H_res [T, n, n]; y, x_in, m [T, C].

Decisions left to the spec by docs/spec.md (pinned in tests/spec/test_hc.py):
- Streams are kept in the accumulation dtype (fp32; float64 in reference mode). ``hc_up_projection``
  returns X' and m unrounded: the residual streams are never stored in the activation dtype, so
  repeated updates do not accumulate bf16 rounding over 48 layers x 2 sites.
- All coefficient math (the RMS factor, the projection, sigmoid, exp, Sinkhorn) runs in the
  accumulation dtype, with no activation rounding point: these are 24 numbers a token.
- The one activation rounding point of a site is ``x_in``: ``hc_pre`` casts it to the activation dtype
  (default bf16) once, at the end, because it is the sublayer's input. The sublayer output y arrives
  in whatever dtype the sublayer produced and is widened exactly.
- eps of the inject norm is 1e-6, the model's rmsnorm eps.
- The logit vector is split in the listing order of docs/spec.md, ``l = [l_pre | l_post | l_res]``, and l_res
  is read row-major: ``l_res[i, j] = l[2n + i*n + j]`` (row i = the output stream of X').
- ``exp(l_res)`` is evaluated as ``exp(l_res - max(l_res))`` (max over the n*n entries of the token).
  Sinkhorn's first column normalisation divides out any positive factor common to the whole matrix,
  so the result is the same function; the shift only keeps exp finite for large logits. (A token
  whose l_res entries span more than ~87 in fp32 could still underflow a whole column to 0 and give
  NaN; the spec adds no eps to hide that, since trained logits stay far inside the range.)
- Sums over streams run in a fixed order, stream 0 first, so the result is canonical.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from spec.numerics import acc_dtype, is_reference_mode, out_cast, rowwise_matmul

N_STREAMS = 4
SINKHORN_ITERS = 20
EPS = 1e-6


class HCCoefficients(NamedTuple):
    """The per-token coefficients of one HC site (accumulation dtype)."""

    h_pre: torch.Tensor   # [T, n], in (0, 1)
    h_post: torch.Tensor  # [T, n], in (0, 2)
    h_res: torch.Tensor   # [T, n, n], doubly stochastic up to Sinkhorn's residual


def _stream_sum(weights: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """``sum_j weights[..., j] * streams[:, j]`` accumulated stream 0 first (a fixed order).

    weights [T, n] (or [T, n] broadcastable rows); streams [T, n, C]. Returns [T, C].
    """
    total = weights[:, 0, None] * streams[:, 0]
    for j in range(1, streams.shape[1]):
        total = total + weights[:, j, None] * streams[:, j]
    return total


def hc_inject_norm(X: torch.Tensor, eps: float = EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1 of a site: ``v = vec(X)``, ``r = rsqrt(mean(v^2) + eps)``.

    X [T, n, C] (any float dtype). Returns (v [T, n*C], r [T]) in the accumulation dtype; v is X
    flattened stream-major (stream 0's C values first), exactly (a widening, no rounding).
    """
    acc = acc_dtype(X)
    v = X.to(acc).reshape(X.shape[0], -1)
    r = torch.rsqrt(v.pow(2).mean(dim=-1) + eps)
    return v, r


def sinkhorn(M: torch.Tensor, iters: int = SINKHORN_ITERS) -> torch.Tensor:
    """Sinkhorn-Knopp on positive matrices: ``iters`` rounds, each normalising columns then rows.

    M [..., n, n] with positive entries. After every round the rows sum to 1 (up to one rounding per
    entry); the column sums converge to 1 geometrically (Birkhoff-Hopf contraction, rate at most
    tanh(Delta/4)^2 a round where Delta is M's projective diameter). tests/spec/test_hc.py states the
    residual measured after 20 rounds for exp of logits in [-1, 1]. Computes in M's dtype.
    """
    if M.device.type == "meta":  # meta: shapes only (the reach tracer); one round has every shape
        iters = min(iters, 1)
    for _ in range(iters):
        M = M / M.sum(dim=-2, keepdim=True)  # columns sum to 1
        M = M / M.sum(dim=-1, keepdim=True)  # rows sum to 1
    return M


def hc_first_projection(v: torch.Tensor, r: torch.Tensor, phi: torch.Tensor, bias: torch.Tensor,
                        n: int = N_STREAMS, sinkhorn_iters: int = SINKHORN_ITERS) -> HCCoefficients:
    """Step 2 of a site: ``l = (v * r) @ Phi + bias``; H_pre, H_post, H_res from the split of l.

    v [T, n*C], r [T] (from ``hc_inject_norm``); phi [n*C, 2n + n^2]; bias [2n + n^2].
    Split ``l = [l_pre (n) | l_post (n) | l_res (n*n, row-major)]``; ``H_pre = sigmoid(l_pre)``,
    ``H_post = 2 sigmoid(l_post)``, ``H_res = sinkhorn(exp(l_res))``. Everything in the accumulation
    dtype of (v, r, phi, bias); no rounding point.
    """
    acc = acc_dtype(v, r, phi, bias)
    width = 2 * n + n * n
    if phi.shape[-1] != width or bias.shape[-1] != width:
        raise ValueError(f"Phi and bias must have {width} = 2n + n^2 columns for n = {n}")
    # Row by row, so a token's coefficients do not depend on the other tokens of the launch.
    logits = rowwise_matmul(v.to(acc) * r.to(acc)[:, None], phi.to(acc)) + bias.to(acc)
    l_pre = logits[:, :n]
    l_post = logits[:, n:2 * n]
    l_res = logits[:, 2 * n:].reshape(-1, n, n)
    # A per-matrix shift: Sinkhorn's first column normalisation cancels it, exp stays finite.
    shift = l_res.amax(dim=(-2, -1), keepdim=True)
    h_res = sinkhorn(torch.exp(l_res - shift), sinkhorn_iters)
    return HCCoefficients(torch.sigmoid(l_pre), 2.0 * torch.sigmoid(l_post), h_res)


def hc_pre(X: torch.Tensor, h_pre: torch.Tensor, act_dtype: torch.dtype = torch.bfloat16
           ) -> torch.Tensor:
    """Step 3 of a site: the sublayer input ``x_in = sum_i H_pre[i] X[i]``.

    X [T, n, C]; h_pre [T, n]. The sum runs in the accumulation dtype, stream 0 first, and is cast to
    ``act_dtype`` once (the site's one activation rounding point; float64 stays float64).
    Returns x_in [T, C].
    """
    acc = acc_dtype(X, h_pre)
    x_in = _stream_sum(h_pre.to(acc), X.to(acc))
    return out_cast(x_in, act_dtype, is_reference_mode(X, h_pre))


def hc_up_projection(X: torch.Tensor, y: torch.Tensor, h_res: torch.Tensor, h_post: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 4 of a site: ``X'[i] = sum_j H_res[i, j] X[j] + H_post[i] y`` and ``m = mean_i X'[i]``.

    X [T, n, C] (the streams before the site); y [T, C] (the sublayer output, widened exactly);
    h_res [T, n, n]; h_post [T, n]. Returns (X' [T, n, C], m [T, C]), both in the accumulation dtype:
    streams are never rounded to the activation dtype. Each X'[i] sums j = 0..n-1 in order and adds
    the gated y last; m is ``(X'[0] + X'[1] + ... + X'[n-1]) / n`` in that order.
    """
    acc = acc_dtype(X, y, h_res, h_post)
    Xf, yf, res, post = X.to(acc), y.to(acc), h_res.to(acc), h_post.to(acc)
    n = X.shape[1]
    if Xf.device.type == "meta":  # meta: shapes only (the reach tracer), without the ordered sums
        streams = res @ Xf + post[..., None] * yf[:, None]
        return streams, streams.mean(dim=1)
    new_streams = [_stream_sum(res[:, i], Xf) + post[:, i, None] * yf for i in range(n)]
    m = new_streams[0]
    for stream in new_streams[1:]:
        m = m + stream
    return torch.stack(new_streams, dim=1), m / n
