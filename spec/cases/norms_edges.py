"""Edge-case builders of the norms: zero and near-zero vectors, which the seeded random builders
never draw. Seeded from (op, cell) like every builder."""

from __future__ import annotations

import torch

from certify.harness.target import Case
from spec.cases.gdn import gated_norm_case
from spec.cases.norms import rmsnorm_case
from spec.cases.ple import apply_case
from spec.cases.rope import qk_norm_rope_case

# Vector RMS values of the near-zero rows, around the norms' eps = 1e-6 on the mean square: from
# eps alone (1e-5) to the vector dominating it (1e-2).
NEAR_ZERO_RMS = (1e-5, 1e-4, 1e-3, 1e-2)
SUBNORMAL = 1e-39  # below fp32's (and bf16's) smallest normal 1.18e-38: its square underflows to 0


def plant_small_vectors(x: torch.Tensor, gen: torch.Generator, subnormal: bool = True
                        ) -> torch.Tensor:
    """x [..., D] with the first half of its vectors (over the leading dims, in order) replaced: a
    zero vector, a -0.0 vector, a vector holding a single nonzero 1e-3, a vector of subnormals (or,
    without ``subnormal``, a near-zero one like the rest), and then the random vectors scaled to the
    RMS values of NEAR_ZERO_RMS in turn. Returns a new tensor of x's dtype."""
    flat = x.detach().to(torch.float64).reshape(-1, x.shape[-1]).clone()
    n, d = flat.shape
    half = max(5, n // 2)
    if n < half:
        raise ValueError(f"{n} vectors: at least 5 are needed for the zero and near-zero patterns")
    rms = flat.pow(2).mean(dim=-1, keepdim=True).sqrt()
    scale = torch.tensor([NEAR_ZERO_RMS[i % len(NEAR_ZERO_RMS)] for i in range(n)],
                         dtype=torch.float64).unsqueeze(-1)
    flat[4:half] = flat[4:half] / rms[4:half] * scale[4:half]
    flat[0] = 0.0
    flat[1] = -0.0
    flat[2] = 0.0
    flat[2, int(torch.randint(0, d, (), generator=gen))] = 1e-3
    if subnormal:
        flat[3] = torch.where(flat[3] < 0, -SUBNORMAL, SUBNORMAL)
    else:
        flat[3] = flat[3] / rms[3] * NEAR_ZERO_RMS[0]
    return flat.to(x.dtype).reshape(x.shape)


def rmsnorm_zero_rows_case(axes: dict, gen: torch.Generator, device) -> Case:
    """rmsnorm's case (spec.cases.norms.rmsnorm_case) with plant_small_vectors on x's rows."""
    case = rmsnorm_case(axes, gen, torch.device("cpu"))
    case.inputs["x"] = plant_small_vectors(case.inputs["x"], gen)
    case.inputs = {k: v.to(device) for k, v in case.inputs.items()}
    return case


def gated_norm_zero_heads_case(axes: dict, gen: torch.Generator, device) -> Case:
    """gated_rmsnorm's case (spec.cases.gdn.gated_norm_case) with plant_small_vectors on o's head
    vectors (the norm's unit: one head of one row)."""
    case = gated_norm_case(axes, gen, torch.device("cpu"))
    case.inputs["o"] = plant_small_vectors(case.inputs["o"], gen)
    case.inputs = {k: v.to(device) for k, v in case.inputs.items()}
    return case


def qk_norm_rope_zero_heads_case(axes: dict, gen: torch.Generator, device) -> Case:
    """qk_norm_rope's case (spec.cases.rope.qk_norm_rope_case) with plant_small_vectors, without
    subnormals, on q's and k's head vectors (the norm's unit). Subnormal bf16 inputs are left to
    rmsnorm's zero_rows_3072, since Triton's interpreter widens them wrongly."""
    case = qk_norm_rope_case(axes, gen, torch.device("cpu"))
    for name in ("q", "k"):
        case.inputs[name] = plant_small_vectors(case.inputs[name], gen, subnormal=False)
    case.inputs = {k: v.to(device) for k, v in case.inputs.items()}
    return case


def ple_apply_zero_updates_case(axes: dict, gen: torch.Generator, device) -> Case:
    """ple_apply's case (spec.cases.ple.apply_case) with plant_small_vectors, without subnormals, on
    e_l's rows: the vector the update's rmsnorm normalises, W_out (gelu(W_gate x) * e_l), is linear
    in e_l, so a zero e_l row gives a zero vector into the norm and a near-zero one a near-zero
    vector."""
    case = apply_case(axes, gen, torch.device("cpu"))
    case.inputs["e_l"] = plant_small_vectors(case.inputs["e_l"], gen, subnormal=False)
    case.inputs = {k: v.to(device) for k, v in case.inputs.items()}
    return case
