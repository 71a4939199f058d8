"""Edge-case builders of the GDN ops: zero and near-zero q and k heads into the recurrence's l2
norms, which the seeded random builders never draw. Seeded from (op, cell) like every builder."""

from __future__ import annotations

import torch

from certify.harness.target import Case
from spec.cases.gdn import decode_case
from spec.cases.norms_edges import plant_small_vectors


def decode_zero_qk_case(axes: dict, gen: torch.Generator, device) -> Case:
    """gdn_decode's case (spec.cases.gdn.decode_case) with plant_small_vectors, without subnormals,
    on q's and k's head vectors: a zero k leaves the state decayed only (S' = exp(g) S) and a zero q
    gives a zero output of its heads; near-zero ones meet l2norm's eps = 1e-6 on the squared norm."""
    case = decode_case(axes, gen, torch.device("cpu"))
    for name in ("q", "k"):
        case.inputs[name] = plant_small_vectors(case.inputs[name], gen, subnormal=False)
    case.inputs = {k: v.to(device) for k, v in case.inputs.items()}
    return case
