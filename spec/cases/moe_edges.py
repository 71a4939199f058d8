"""Edge-case builders of the MoE ops: inputs the seeded random builders of spec/cases/moe.py never
draw. Seeded from (op, cell) like every builder."""

from __future__ import annotations

import torch

from certify.harness.target import Case, OutSpec
from spec.cases.moe import ACT, _hidden_rows, _router, experts_case

NEAR_TIE_GAP = 1e-9   # |float64 logit gap| the tuned pairs end below (the fp32 logits err by ~1e-6)
UNDERFLOW_SPREAD = 130.0  # logit spread of the underflow rows: fp32 exp(l - m) is 0 below -103.3


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(ACT).to(torch.float64)


def tune_pair(x_row: torch.Tensor, w64: torch.Tensor, a: int, b: int, stages: int = 12
              ) -> torch.Tensor:
    """Edit a few channels of one bf16 row (float64 holding bf16 values) so that the float64 logits
    of experts a and b end within NEAR_TIE_GAP of each other: each stage moves, among the channels
    whose move is at most 4 times the smallest one (so the other logits barely move), the one whose
    bf16-rounded move leaves the smallest residual gap."""
    x = x_row.clone()
    d = w64[a] - w64[b]
    for _ in range(stages):
        g = float(x @ d)
        if abs(g) < NEAR_TIE_GAP:
            break
        safe = d.abs() > 0
        target = torch.where(safe, x - g / torch.where(safe, d, torch.ones_like(d)), x)
        moved = _bf16(target)
        small = (target - x).abs() <= 4 * abs(g) / float(d.abs().max())
        residual = (g + (moved - x) * d).abs().masked_fill(~(safe & small), float("inf"))
        c = int(residual.argmin())
        x[c] = moved[c]
    return x


def route_near_ties_case(axes: dict, gen: torch.Generator, device) -> Case:
    """moe_route with near ties: rows 0 .. T/2 - 1 tuned so that their k-th and (k+1)-th float64
    logits differ by less than NEAR_TIE_GAP (far below the fp32 logits' error), the next T/8 rows
    likewise at slots 3 / 4 (the slot order), T/16 rows whose softmax underflows in fp32 (four
    experts UNDERFLOW_SPREAD above the rest, so slots 5 .. k hold experts whose fp32 p is 0) and plain
    rows after them. Outputs both results of moe_route: the ids (judged as a set) and the weights."""
    T, C, E, k = axes["tokens"], axes["hidden"], axes["experts"], axes["top_k"]
    x = _bf16(_hidden_rows(gen, T, C))
    w = _bf16(_router(gen, E, C))
    n_edge, n_order, n_under = T // 2, T // 8, T // 16
    for t in range(n_edge + n_order):
        slot = k - 1 if t < n_edge else 2
        for _ in range(4):  # a move that reorders the row's neighbours is tuned again from there
            order = torch.sort(x[t] @ w.T, descending=True, stable=True).indices
            x[t] = tune_pair(x[t], w, int(order[slot]), int(order[slot + 1]))
            s = torch.sort(x[t] @ w.T, descending=True).values
            if float(s[slot] - s[slot + 1]) < NEAR_TIE_GAP:
                break
    for t in range(n_edge + n_order, n_edge + n_order + n_under):
        top = torch.randperm(E, generator=gen)[:4]
        direction = w[top].sum(dim=0)
        lead = w[top] @ direction
        rest = torch.ones(E, dtype=torch.bool)
        rest[top] = False
        spread = float(lead.min() - (w[rest] @ direction).max())
        x[t] = _bf16(direction * (UNDERFLOW_SPREAD / spread))
    return Case(inputs={"x": x.to(ACT).to(device), "w_router": w.to(ACT).to(device), "top_k": k},
                outputs={"expert_ids": OutSpec((T, k), torch.int64),
                         "weights": OutSpec((T, k), torch.float32)})


NVFP4_BLOCK = 16
ZERO_WEIGHT_BLOCKS = 8  # all-zero blocks planted in each matrix of every expert


def experts_zero_blocks_case(axes: dict, gen: torch.Generator, device) -> Case:
    """moe_nvfp4_experts' case (spec.cases.moe.experts_case) with all-zero nvfp4 blocks: row T // 2 of
    x all zeros (a padding token: every block of its x and of its h is zero, scale 0 and codes 0),
    one 16-element block of zeros in each other row of x (block t mod C/16 of row t), and in every
    expert's gate, up and down matrices the blocks (r, r) for r < 8 stored as all-zero (scale byte
    0, codes 0). The ids and weights stay the router's on the drawn x."""
    case = experts_case(axes, gen, torch.device("cpu"))
    x = case.inputs["x"].clone()
    T, C = x.shape
    for t in range(T):
        b = t % (C // NVFP4_BLOCK)
        x[t, NVFP4_BLOCK * b:NVFP4_BLOCK * (b + 1)] = 0.0
    x[T // 2] = 0.0
    case.inputs["x"] = x
    for name in ("gate", "up", "down"):
        packed, sf = case.inputs[f"{name}_packed"].clone(), case.inputs[f"{name}_sf"].clone()
        for r in range(ZERO_WEIGHT_BLOCKS):
            sf[:, r, r] = 0
            packed[:, r, (NVFP4_BLOCK // 2) * r:(NVFP4_BLOCK // 2) * (r + 1)] = 0
        case.inputs[f"{name}_packed"], case.inputs[f"{name}_sf"] = packed, sf
    case.inputs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v)
                   for k, v in case.inputs.items()}
    return case
