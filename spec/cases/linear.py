"""Input builders of the dense projections (op ``linear``).

x: the bf16 input of a projection, an RMSNorm output (rows of unit rms with a few channels 10x larger,
as the massive activations survive the norm); w: [out, in] bf16 with std 1/sqrt(in) and a few larger
rows, as trained projections have. A projection output then has std ~1 and its row maximum 4-5 std
above it, where the fp32 accumulation's error is smallest against the bf16 result.
"""

from __future__ import annotations

import math

import torch

from certify.harness.target import Case, OutSpec
from spec.cases.common import DTYPES, randn


def linear_case(axes: dict, gen: torch.Generator, device) -> Case:
    T, K, N = axes["rows"], axes["in_features"], axes["out_features"]
    act = DTYPES[axes["act_dtype"]]
    x = randn(gen, T, K)
    x[:, torch.randperm(K, generator=gen)[:4]] *= 10.0
    x = x * torch.rsqrt((x * x).mean(-1, keepdim=True))
    w = randn(gen, N, K, scale=1.0 / math.sqrt(K))
    w[torch.randperm(N, generator=gen)[:8]] *= 4.0
    return Case(inputs={"x": x.to(act).to(device), "w": w.to(act).to(device)},
                outputs={"out": OutSpec((T, N), act)})
