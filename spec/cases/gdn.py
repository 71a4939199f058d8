"""Input builders of the GDN ops at the target geometry (docs/spec.md, "GDN layer")."""

from __future__ import annotations

import math

import torch

from certify.harness.target import Case, OutSpec
from spec.cases.common import DTYPES, distinct_slots, randn, uniform

ACT = torch.bfloat16


def _geometry(axes: dict) -> tuple[int, int, int, int]:
    hk, hv, d = axes["key_heads"], axes["value_heads"], axes["head_dim"]
    return hk, hv, d, d


def _layer_params(gen, hv: int, d_v: int, device) -> dict[str, torch.Tensor]:
    # A = exp(A_log) in [1, 16] and dt = softplus(dt_bias) in [1e-3, 0.1]: Qwen3-Next's init ranges.
    A_log = uniform(gen, hv, lo=0.0, hi=math.log(16.0), device=device)
    dt = uniform(gen, hv, lo=1e-3, hi=0.1)
    dt_bias = (dt + torch.log(-torch.expm1(-dt))).to(device)  # inverse softplus
    norm_w = randn(gen, d_v, scale=0.1, shift=1.0, device=device)
    return {"A_log": A_log, "dt_bias": dt_bias, "norm_w": norm_w}


def _rows(gen, lead: tuple[int, ...], hk: int, hv: int, dk: int, dv: int, device):
    return {
        "q": randn(gen, *lead, hk, dk, dtype=ACT, device=device),
        "k": randn(gen, *lead, hk, dk, dtype=ACT, device=device),
        "v": randn(gen, *lead, hv, dv, dtype=ACT, device=device),
        "a": randn(gen, *lead, hv, dtype=ACT, device=device),
        "b": randn(gen, *lead, hv, dtype=ACT, device=device),
    }


def _pool(gen, batch: int, hv: int, dk: int, dv: int, dtype: torch.dtype, device):
    pool_rows = batch + 3  # spare rows the step must leave alone
    pool = randn(gen, pool_rows, hv, dk, dv, scale=0.5, dtype=dtype, device=device)
    return pool, distinct_slots(gen, batch, pool_rows, device)


def decode_case(axes: dict, gen: torch.Generator, device) -> Case:
    hk, hv, dk, dv = _geometry(axes)
    B = axes["batch"]
    inputs = _rows(gen, (B,), hk, hv, dk, dv, device)
    inputs.update(_layer_params(gen, hv, dv, device))
    inputs["z"] = randn(gen, B, hv, dv, dtype=ACT, device=device)
    pool, slots = _pool(gen, B, hv, dk, dv, DTYPES[axes["state_dtype"]], device)
    inputs.update(state_pool=pool, slots=slots)
    order = ["q", "k", "v", "a", "b", "A_log", "dt_bias", "z", "norm_w", "state_pool", "slots"]
    return Case(inputs={n: inputs[n] for n in order},
                outputs={"out": OutSpec((B, hv, dv), ACT),
                         "state_pool": OutSpec(tuple(pool.shape), pool.dtype)},
                inplace={"state_pool": "state_pool"})


def verify_case(axes: dict, gen: torch.Generator, device) -> Case:
    hk, hv, dk, dv = _geometry(axes)
    B, T = axes["batch"], axes["rows"]
    inputs = _rows(gen, (B, T), hk, hv, dk, dv, device)
    inputs.update(_layer_params(gen, hv, dv, device))
    inputs["z"] = randn(gen, B, T, hv, dv, dtype=ACT, device=device)
    pool, slots = _pool(gen, B, hv, dk, dv, DTYPES[axes["state_dtype"]], device)
    inputs.update(state_pool=pool, slots=slots)
    order = ["q", "k", "v", "a", "b", "A_log", "dt_bias", "z", "norm_w", "state_pool", "slots"]
    return Case(inputs={n: inputs[n] for n in order},
                outputs={"out": OutSpec((B, T, hv, dv), ACT),
                         "states": OutSpec((B, T, hv, dk, dv), pool.dtype)})


def prefill_case(axes: dict, gen: torch.Generator, device) -> Case:
    hk, hv, dk, dv = _geometry(axes)
    B, T = axes["batch"], axes["seq_len"]
    inputs = _rows(gen, (B, T), hk, hv, dk, dv, device)
    inputs.update(_layer_params(gen, hv, dv, device))
    inputs["z"] = randn(gen, B, T, hv, dv, dtype=ACT, device=device)
    # A prefill chunk continues from the state the previous chunk left (chunked prefill).
    inputs["state"] = randn(gen, B, hv, dk, dv, scale=0.5, device=device)
    order = ["q", "k", "v", "a", "b", "A_log", "dt_bias", "z", "norm_w", "state"]
    return Case(inputs={n: inputs[n] for n in order},
                outputs={"out": OutSpec((B, T, hv, dv), ACT),
                         "final_state": OutSpec((B, hv, dk, dv), torch.float32)})


def gates_case(axes: dict, gen: torch.Generator, device) -> Case:
    hv, rows = axes["value_heads"], axes["rows"]
    p = _layer_params(gen, hv, 8, device)
    # Spread a + dt_bias across softplus's threshold (20) so both branches are exercised.
    a = randn(gen, rows, hv, scale=8.0, dtype=ACT, device=device)
    b = randn(gen, rows, hv, scale=4.0, dtype=ACT, device=device)
    return Case(inputs={"a": a, "b": b, "A_log": p["A_log"], "dt_bias": p["dt_bias"]},
                outputs={"g": OutSpec((rows, hv), torch.float32),
                         "beta": OutSpec((rows, hv), torch.float32)})


def _conv_channels(axes: dict) -> int:
    hk, hv, dk, dv = _geometry(axes)
    return 2 * hk * dk + hv * dv  # [all q | all k | all v]


def conv_prefill_case(axes: dict, gen: torch.Generator, device) -> Case:
    C, B, T = _conv_channels(axes), axes["batch"], axes["seq_len"]
    return Case(inputs={"x": randn(gen, B, T, C, dtype=ACT, device=device),
                        "weight": randn(gen, C, 4, scale=0.5, device=device),
                        "conv_state": randn(gen, B, C, 3, dtype=ACT, device=device)},
                outputs={"y": OutSpec((B, T, C), ACT),
                         "new_conv_state": OutSpec((B, C, 3), ACT)})


def conv_update_case(axes: dict, gen: torch.Generator, device) -> Case:
    C, B = _conv_channels(axes), axes["batch"]
    return Case(inputs={"x": randn(gen, B, C, dtype=ACT, device=device),
                        "weight": randn(gen, C, 4, scale=0.5, device=device),
                        "conv_state": randn(gen, B, C, 3, dtype=ACT, device=device)},
                outputs={"y": OutSpec((B, C), ACT), "new_conv_state": OutSpec((B, C, 3), ACT)},
                inplace={"new_conv_state": "conv_state"})


def gated_norm_case(axes: dict, gen: torch.Generator, device) -> Case:
    rows, hv, dv = axes["rows"], axes["value_heads"], axes["head_dim"]
    return Case(inputs={"o": randn(gen, rows, hv, dv, scale=0.3, device=device),
                        "z": randn(gen, rows, hv, dv, dtype=ACT, device=device),
                        "w": randn(gen, dv, scale=0.1, shift=1.0, device=device)},
                outputs={"out": OutSpec((rows, hv, dv), ACT)})
