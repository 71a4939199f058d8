"""Input builders and op adapters of the MoE ops (docs/spec.md, "MoE").

The spec functions of the routed experts and of the whole block take weight containers
(``NvFp4Experts``, ``SharedExpert``); the adapters here build them from plain tensors, so a cell's
inputs are what a kernel receives: packed nvfp4 codes (uint8), e4m3 block-scale bytes (uint8), fp32
global scales, bf16 dense weights and activations. In float64 mode the harness widens every floating
input; byte tensors pass through unchanged, so both modes read the same quantized weights.

Geometry: hidden 3072, expert intermediate 512, shared-expert intermediate 512, top-10 of 512
experts. A CPU cell cannot hold 512 nvfp4 experts at this geometry (1.2 GB of codes), so the expert
ops run on a reduced table (``experts`` axis); routing (``moe_route``) runs at the full 512.
"""

from __future__ import annotations

import math

import torch

from certify.harness.target import Case, OutSpec
from spec.cases.common import randn
from spec.ops.kv_storage import FP8_DTYPE, nvfp4_global_scale
from spec.ops.moe import (
    NvFp4Experts,
    NvFp4Weight,
    SharedExpert,
    moe,
    moe_experts,
    moe_route,
)

ACT = torch.bfloat16
_EXPERT_KEYS = ("gate_packed", "gate_sf", "gate_gs", "up_packed", "up_sf", "up_gs",
                "down_packed", "down_sf", "down_gs", "x_gs", "h_gs")


# -------------------------------------------------------- adapters (the ops' spec functions)


def _weight(packed: torch.Tensor, sf: torch.Tensor, gs: torch.Tensor) -> NvFp4Weight:
    """An nvfp4 weight stack from its bytes: ``sf`` holds e4m3 bytes (uint8), ``gs`` fp32 [E]
    (float64 in float64 mode: the same values, widened)."""
    return NvFp4Weight(packed, sf.view(FP8_DTYPE), gs)


def _experts(gate_packed, gate_sf, gate_gs, up_packed, up_sf, up_gs, down_packed, down_sf, down_gs,
             x_gs, h_gs) -> NvFp4Experts:
    return NvFp4Experts(_weight(gate_packed, gate_sf, gate_gs), _weight(up_packed, up_sf, up_gs),
                        _weight(down_packed, down_sf, down_gs), x_gs, h_gs)


def moe_experts_op(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                   gate_packed: torch.Tensor, gate_sf: torch.Tensor, gate_gs: torch.Tensor,
                   up_packed: torch.Tensor, up_sf: torch.Tensor, up_gs: torch.Tensor,
                   down_packed: torch.Tensor, down_sf: torch.Tensor, down_gs: torch.Tensor,
                   x_gs: torch.Tensor, h_gs: torch.Tensor) -> torch.Tensor:
    """Op ``moe_nvfp4_experts``: ``spec.ops.moe.moe_experts`` on experts given as tensors."""
    experts = _experts(gate_packed, gate_sf, gate_gs, up_packed, up_sf, up_gs, down_packed, down_sf,
                       down_gs, x_gs, h_gs)
    return moe_experts(x, expert_ids, weights, experts)


def moe_op(x: torch.Tensor, w_router: torch.Tensor, top_k: int,
           gate_packed: torch.Tensor, gate_sf: torch.Tensor, gate_gs: torch.Tensor,
           up_packed: torch.Tensor, up_sf: torch.Tensor, up_gs: torch.Tensor,
           down_packed: torch.Tensor, down_sf: torch.Tensor, down_gs: torch.Tensor,
           x_gs: torch.Tensor, h_gs: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
           w_down: torch.Tensor, w_sg: torch.Tensor) -> torch.Tensor:
    """Op ``moe``: ``spec.ops.moe.moe`` on experts and a shared expert given as tensors."""
    experts = _experts(gate_packed, gate_sf, gate_gs, up_packed, up_sf, up_gs, down_packed, down_sf,
                       down_gs, x_gs, h_gs)
    return moe(x, w_router, experts, SharedExpert(w_gate, w_up, w_down, w_sg), top_k)


# ---------------------------------------------------------------- data


def _hidden_rows(gen: torch.Generator, T: int, C: int) -> torch.Tensor:
    """The MoE input: an rmsnorm output, rows of RMS ~1 with per-channel gains (1 + w) and a few
    outlier channels; fp32 (the caller casts)."""
    gain = torch.exp(randn(gen, C, scale=0.3))
    gain[torch.randperm(C, generator=gen)[:6]] *= 8.0
    return randn(gen, T, C) * gain


def _router(gen: torch.Generator, E: int, C: int) -> torch.Tensor:
    """Router rows [E, C] in fp32 giving logits of standard deviation ~1.5 on rmsnorm'd inputs."""
    return randn(gen, E, C, scale=1.5 / math.sqrt(C))


def _calibrated_gs(amax: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """An input global scale calibrated on an fp32 statistic: amax times a margin in [1, 1.5],
    over 6 * 448 (a full-mantissa fp32 number)."""
    margin = 1.0 + 0.5 * float(torch.rand((), generator=gen))
    return nvfp4_global_scale(amax.double() * margin)


def _nvfp4_stack(gen: torch.Generator, E: int, out_f: int, in_f: int) -> NvFp4Weight:
    """E nvfp4 matrices [out_f, in_f] of dense N(0, 1/in_f) weights, each with its own global
    scale.

    Quantizing every expert costs seconds on one core, so a base of up to 4 experts is quantized
    (``NvFp4Weight.from_dense``) and the others are derived from it exactly in the nvfp4 domain: an
    independent row permutation and random row sign flips (the sign bit of every code of the row,
    ``^ 0x88``) per expert. Each expert is then itself a quantized N(0, 1/in_f) matrix, and no two
    compute the same function."""
    n_base = min(E, 4)
    base = NvFp4Weight.from_dense(randn(gen, n_base, out_f, in_f, scale=1.0 / math.sqrt(in_f)))
    packed, sf, gs = [base.packed[e] for e in range(n_base)], [base.sf[e] for e in range(n_base)], \
        [base.gs[e] for e in range(n_base)]
    for e in range(n_base, E):
        b = e % n_base
        perm = torch.randperm(out_f, generator=gen)
        flip = (torch.rand(out_f, 1, generator=gen) < 0.5).to(torch.uint8) * 0x88
        packed.append(base.packed[b][perm] ^ flip)
        sf.append(base.sf[b][perm])
        gs.append(base.gs[b])
    return NvFp4Weight(torch.stack(packed), torch.stack(sf), torch.stack(gs))


def _expert_tensors(gen: torch.Generator, E: int, C: int, inter: int, x: torch.Tensor
                    ) -> dict[str, torch.Tensor]:
    """E SwiGLU experts (nvfp4, one global scale per matrix) and the layer's input global scales
    calibrated on the activations they will see."""
    out: dict[str, torch.Tensor] = {}
    for name, (o, i) in (("gate", (inter, C)), ("up", (inter, C)), ("down", (C, inter))):
        w = _nvfp4_stack(gen, E, o, i)
        out[f"{name}_packed"], out[f"{name}_sf"], out[f"{name}_gs"] = \
            w.packed, w.sf.view(torch.uint8), w.gs
    out["x_gs"] = _calibrated_gs(x.float().abs().max(), gen)
    # h = silu(g) u with g, u ~ N(0, 1): its tail reaches ~10 over a calibration set.
    out["h_gs"] = _calibrated_gs(torch.tensor(10.0), gen)
    return out


def _shared_tensors(gen: torch.Generator, C: int, inter: int) -> dict[str, torch.Tensor]:
    """The shared expert's dense bf16 weights and its gate vector (gate logits of std ~2)."""
    return {"w_gate": randn(gen, inter, C, scale=1.0 / math.sqrt(C), dtype=ACT),
            "w_up": randn(gen, inter, C, scale=1.0 / math.sqrt(C), dtype=ACT),
            "w_down": randn(gen, C, inter, scale=1.0 / math.sqrt(inter), dtype=ACT),
            "w_sg": randn(gen, C, scale=2.0 / math.sqrt(C), dtype=ACT)}


def _with_ties(gen: torch.Generator, x: torch.Tensor, w_router: torch.Tensor, top_k: int,
               n_pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plant exact routing ties: for ``n_pairs`` tokens, copy the router row of the token's k-th
    ranked expert onto an expert ranked below it (so the copy ties at the k-th place and the tie
    rule, lower index first, decides membership); in a launch of 4 rows or more one token is all
    zeros (a padding row: all E logits tie at 0, so the lower indices 0..k-1 win with equal
    weights)."""
    T = x.shape[0]
    x = x.clone()
    w = w_router.clone()
    pad = T // 2 if T >= 4 else -1  # a launch of fewer than 4 rows keeps every row real
    if pad >= 0:
        x[pad] = 0.0
    for t in torch.randperm(T, generator=gen)[:n_pairs].tolist():
        if t == pad:
            continue
        logits = x[t].double() @ w.double().T
        order = torch.sort(logits, descending=True, stable=True).indices
        kth = int(order[top_k - 1])
        below = min(20, w.shape[0] - top_k)  # one of the next ranks below the k-th
        victim = int(order[top_k + int(torch.randint(0, below, (), generator=gen))])
        w[victim] = w[kth]
    return x, w


# ---------------------------------------------------------------- builders


def route_case(axes: dict, gen: torch.Generator, device) -> Case:
    """moe_route at the full expert count, with planted exact ties at the k-th place.

    The output is the expert ids only (the first result of ``moe_route``): a cell applies one
    oracle to all its outputs, and the ids need the bitwise one (see the cell file)."""
    T, C, E, k = axes["tokens"], axes["hidden"], axes["experts"], axes["top_k"]
    x = _hidden_rows(gen, T, C).to(ACT).float()
    w = _router(gen, E, C).to(ACT).float()
    x, w = _with_ties(gen, x, w, k, n_pairs=max(1, T // 4))
    return Case(inputs={"x": x.to(ACT).to(device), "w_router": w.to(ACT).to(device), "top_k": k},
                outputs={"expert_ids": OutSpec((T, k), torch.int64)})


def experts_case(axes: dict, gen: torch.Generator, device) -> Case:
    """moe_nvfp4_experts on a reduced table of ``experts`` experts; ids and weights come from the
    spec's router on a random router, so they are distinct per row, best first, and sum to 1."""
    T, C, E, k, inter = (axes["tokens"], axes["hidden"], axes["experts"], axes["top_k"],
                         axes["expert_inter"])
    x = _hidden_rows(gen, T, C).to(ACT)
    ids, weights = moe_route(x, _router(gen, E, C).to(ACT), k)
    inputs = {"x": x, "expert_ids": ids, "weights": weights}
    inputs.update(_expert_tensors(gen, E, C, inter, x))
    return Case(inputs={n: v.to(device) for n, v in inputs.items()},
                outputs={"out": OutSpec((T, C), ACT)})


def shared_case(axes: dict, gen: torch.Generator, device) -> Case:
    T, C, inter = axes["tokens"], axes["hidden"], axes["shared_inter"]
    inputs = {"x": _hidden_rows(gen, T, C).to(ACT)}
    inputs.update(_shared_tensors(gen, C, inter))
    return Case(inputs={n: v.to(device) for n, v in inputs.items()},
                outputs={"out": OutSpec((T, C), ACT)})


def moe_case(axes: dict, gen: torch.Generator, device) -> Case:
    """The whole block on a reduced expert table, with planted routing ties."""
    T, C, E, k = axes["tokens"], axes["hidden"], axes["experts"], axes["top_k"]
    x = _hidden_rows(gen, T, C).to(ACT).float()
    w = _router(gen, E, C).to(ACT).float()
    x, w = _with_ties(gen, x, w, k, n_pairs=max(1, T // 4))
    x = x.to(ACT)
    inputs: dict = {"x": x, "w_router": w.to(ACT), "top_k": k}
    inputs.update(_expert_tensors(gen, E, C, axes["expert_inter"], x))
    inputs.update(_shared_tensors(gen, C, axes["shared_inter"]))
    order = ["x", "w_router", "top_k", *_EXPERT_KEYS, "w_gate", "w_up", "w_down", "w_sg"]
    return Case(inputs={n: (inputs[n].to(device) if isinstance(inputs[n], torch.Tensor)
                            else inputs[n]) for n in order},
                outputs={"out": OutSpec((T, C), ACT)})
