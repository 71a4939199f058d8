"""Input builders and op adapters of the hyper-connection ops (docs/spec.md, "Hyper-connections").

Geometry: n = 4 streams of width C = 3072, 20 Sinkhorn iterations. The streams are the residual
state, kept in fp32 by the spec (never rounded to bf16); the sublayer output y arrives in bf16.
"""

from __future__ import annotations

import math

import torch

from certify.harness.target import Case, OutSpec
from spec.cases.common import randn
from spec.ops.hc import hc_first_projection, hc_inject_norm, sinkhorn

ACT = torch.bfloat16


# -------------------------------------------------------- adapters (the ops' spec functions)


def hc_first_projection_op(v: torch.Tensor, r: torch.Tensor, phi: torch.Tensor, bias: torch.Tensor
                           ) -> dict[str, torch.Tensor]:
    """Op ``hc_first_projection``: the spec's ``HCCoefficients`` as named outputs."""
    h = hc_first_projection(v, r, phi, bias)
    return {"h_pre": h.h_pre, "h_post": h.h_post, "h_res": h.h_res}


# ---------------------------------------------------------------- data


def _streams(gen: torch.Generator, T: int, n: int, C: int, token_scale: tuple[float, float]
             ) -> torch.Tensor:
    """Residual streams X [T, n, C] fp32 a few layers in: a shared part (the embedding and what all
    streams carried forward) plus per-stream deviations, per-channel gains with a few massive
    channels, and a per-token magnitude drawn log-uniformly in ``token_scale``."""
    gain = torch.exp(randn(gen, C, scale=0.4))
    gain[torch.randperm(C, generator=gen)[:4]] *= 30.0  # massive activations
    shared = randn(gen, T, 1, C)
    X = (shared + 0.5 * randn(gen, T, n, C)) * gain
    lo, hi = (math.log(s) for s in token_scale)
    scale = torch.exp(torch.rand(T, 1, 1, generator=gen) * (hi - lo) + lo)
    return X * scale


def _phi_bias(gen: torch.Generator, n: int, C: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Phi [n*C, 2n + n^2] and bias: logits of std ~1 around a static part, H_res biased towards
    the identity (+3 on the diagonal logits), as a trained residual mixer is."""
    width = 2 * n + n * n
    phi = randn(gen, n * C, width, scale=1.0 / math.sqrt(n * C))
    bias = randn(gen, width, scale=0.5)
    bias[2 * n:] += 3.0 * torch.eye(n).flatten()
    return phi, bias


# ---------------------------------------------------------------- builders


def inject_norm_case(axes: dict, gen: torch.Generator, device) -> Case:
    T, n, C = axes["tokens"], axes["streams"], axes["hidden"]
    X = _streams(gen, T, n, C, token_scale=(0.5, 2.0))
    return Case(inputs={"X": X.to(device)},
                outputs={"v": OutSpec((T, n * C), torch.float32),
                         "r": OutSpec((T,), torch.float32)})


def first_projection_case(axes: dict, gen: torch.Generator, device) -> Case:
    T, n, C = axes["tokens"], axes["streams"], axes["hidden"]
    v, r = hc_inject_norm(_streams(gen, T, n, C, token_scale=(0.5, 2.0)))
    phi, bias = _phi_bias(gen, n, C)
    return Case(inputs={"v": v.to(device), "r": r.to(device), "phi": phi.to(device),
                        "bias": bias.to(device)},
                outputs={"h_pre": OutSpec((T, n), torch.float32),
                         "h_post": OutSpec((T, n), torch.float32),
                         "h_res": OutSpec((T, n, n), torch.float32)})


def sinkhorn_case(axes: dict, gen: torch.Generator, device) -> Case:
    """M = exp(l_res - max) as hc_first_projection forms it. ``logits``: ``mixer`` (identity-biased
    logits of std 1, a trained residual mixer) or ``wide`` (uniform in [-8, 8], entries spanning
    e^16, where Sinkhorn contracts slowly and rounding errors have 20 rounds to accumulate)."""
    T, n = axes["tokens"], axes["streams"]
    if axes["logits"] == "wide":
        logits = torch.rand(T, n, n, generator=gen) * 16.0 - 8.0
    else:
        logits = randn(gen, T, n, n) + 3.0 * torch.eye(n)
    M = torch.exp(logits - logits.amax(dim=(-2, -1), keepdim=True))
    return Case(inputs={"M": M.to(device)}, outputs={"H": OutSpec((T, n, n), torch.float32)})


def pre_case(axes: dict, gen: torch.Generator, device) -> Case:
    T, n, C = axes["tokens"], axes["streams"], axes["hidden"]
    X = _streams(gen, T, n, C, token_scale=(0.5, 8.0))
    h_pre = torch.sigmoid(randn(gen, T, n, scale=1.5))
    return Case(inputs={"X": X.to(device), "h_pre": h_pre.to(device)},
                outputs={"x_in": OutSpec((T, C), ACT)})


def up_projection_case(axes: dict, gen: torch.Generator, device) -> Case:
    """X' = H_res X + H_post y: H_res from Sinkhorn on identity-biased logits (doubly stochastic up
    to its residual), H_post = 2 sigmoid(l), y a sublayer output in bf16 of the streams' order of
    magnitude."""
    T, n, C = axes["tokens"], axes["streams"], axes["hidden"]
    X = _streams(gen, T, n, C, token_scale=(0.5, 8.0))
    logits = randn(gen, T, n, n) + 3.0 * torch.eye(n)
    h_res = sinkhorn(torch.exp(logits - logits.amax(dim=(-2, -1), keepdim=True)))
    h_post = 2.0 * torch.sigmoid(randn(gen, T, n))
    y = (randn(gen, T, C) * X.abs().mean(dim=(1, 2), keepdim=False)[:, None]).to(ACT)
    return Case(inputs={"X": X.to(device), "y": y.to(device), "h_res": h_res.to(device),
                        "h_post": h_post.to(device)},
                outputs={"X_new": OutSpec((T, n, C), torch.float32),
                         "m": OutSpec((T, C), torch.float32)})
