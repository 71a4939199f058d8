"""Input builders of the norms (docs/spec.md, "Norms and embeddings")."""

from __future__ import annotations

import torch

from certify.harness.target import Case, OutSpec
from spec.cases.common import DTYPES, randn


def rmsnorm_case(axes: dict, gen: torch.Generator, device) -> Case:
    rows, hidden = axes["rows"], axes["hidden"]
    act = DTYPES[axes["act_dtype"]]
    # Activations with an outlier channel, as residual streams have; weights near 0 ((1 + w) form).
    x = randn(gen, rows, hidden, scale=1.0, device=device)
    x[:, 7] *= 30.0
    return Case(inputs={"x": x.to(act), "w": randn(gen, hidden, scale=0.1, device=device)},
                outputs={"out": OutSpec((rows, hidden), act)})
