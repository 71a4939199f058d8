"""Edge-case builders of the hyper-connection ops: inputs the seeded random builders of
spec/cases/hc.py never draw. Seeded from (op, cell) like every builder."""

from __future__ import annotations

import torch

from certify.harness.target import Case, OutSpec
from spec.cases.hc import _streams

# Token RMS values of the near-zero rows: from where eps = 1e-6 is the whole mean square (1e-5:
# r = 999.95) to where it equals it (1e-3: r = 707.1), so every r lies in [707, 1000].
NEAR_ZERO_RMS = (1e-5, 1e-4, 3e-4, 1e-3)


def inject_norm_zero_rows_case(axes: dict, gen: torch.Generator, device) -> Case:
    """hc_inject_norm on padding and near-zero tokens only: rows 0 .. T/4 - 1 all zeros (row 1 all
    -0.0), one row a single nonzero value 1e-3, the others the random streams scaled to the token
    RMS values of NEAR_ZERO_RMS in turn. Every r is then within x1.42 of the others, so each is
    measured near its own magnitude."""
    T, n, C = axes["tokens"], axes["streams"], axes["hidden"]
    X = _streams(gen, T, n, C, token_scale=(1.0, 1.0))
    rms = X.pow(2).mean(dim=(1, 2), keepdim=True).sqrt()
    targets = torch.tensor([NEAR_ZERO_RMS[t % len(NEAR_ZERO_RMS)] for t in range(T)])
    X = X / rms * targets.view(T, 1, 1)
    zero = max(1, T // 4)
    X[:zero] = 0.0
    if zero > 1:
        X[1] = -0.0
    spike = min(zero, T - 1)
    X[spike] = 0.0
    X[spike, int(torch.randint(0, n, (), generator=gen)), int(torch.randint(0, C, (), generator=gen))] = 1e-3
    return Case(inputs={"X": X.to(device)},
                outputs={"v": OutSpec((T, n * C), torch.float32),
                         "r": OutSpec((T,), torch.float32)})
