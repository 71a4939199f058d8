"""Input builders and op adapters of the KV storage formats (docs/spec.md, "KV storage").

The ops' outputs are what a KV page holds and what attention reads back:
- ``kv_fp8``:   the e4m3 byte of every element (``codes``, uint8) and its dequantized value in the
                activation dtype (``deq``).
- ``kv_nvfp4``: the packed e2m1 nibbles (``packed``, uint8), the e4m3 block-scale bytes (``sf``,
                uint8) and the dequantized values in the activation dtype (``deq``).
Codes and scales are returned as their bytes (uint8): a page stores bytes, and the oracles compare
bytes (float8 tensors lack the ``isinf`` the oracles apply to floating outputs).

Rows are K or V of new tokens after QK norm and RoPE: [tokens, 2 KV heads, head_dim 256], bf16.
"""

from __future__ import annotations

import math

import torch

from certify.harness.target import Case, OutSpec
from spec.cases.common import DTYPES, randn
from spec.ops.kv_storage import (
    E2M1_GRID,
    NVFP4_BLOCK,
    fp8_dequantize,
    fp8_quantize,
    nvfp4_dequantize,
    nvfp4_global_scale,
    nvfp4_quantize,
)

ACT = torch.bfloat16


# -------------------------------------------------------- adapters (the ops' spec functions)


def kv_fp8_op(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Op ``kv_fp8``: ``fp8_quantize`` and the read-back ``fp8_dequantize`` to x's dtype.

    Returns ``codes`` (the e4m3 bytes as uint8) and ``deq`` (x's dtype; the cast back is exact).
    In float64 mode x is float64 and so is ``deq``; the bytes are rounded once from the exact value.
    """
    codes = fp8_quantize(x)
    return {"codes": codes.view(torch.uint8), "deq": fp8_dequantize(codes, x.dtype)}


def kv_nvfp4_op(x: torch.Tensor, gs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Op ``kv_nvfp4``: ``nvfp4_quantize`` and the read-back ``nvfp4_dequantize`` to x's dtype.

    Returns ``packed`` (uint8, two e2m1 codes a byte), ``sf`` (the e4m3 block-scale bytes, uint8)
    and ``deq`` (x's dtype: ``(code * sf) * gs`` in fp32, then the cast to bf16; float64 in
    float64 mode).
    """
    packed, sf = nvfp4_quantize(x, gs)
    return {"packed": packed, "sf": sf.view(torch.uint8),
            "deq": nvfp4_dequantize(packed, sf, gs, x.dtype)}


# ---------------------------------------------------------------- K / V rows


def _kv_rows(gen: torch.Generator, tokens: int, heads: int, head_dim: int) -> torch.Tensor:
    """K/V-like rows in fp32: unit normals times a per-channel scale (QK-norm weights and projection
    channels differ: log-normal spread), plus a few outlier channels per head."""
    chan = torch.exp(randn(gen, heads, head_dim, scale=0.7))
    outliers = torch.randperm(head_dim, generator=gen)[:4]
    chan[:, outliers] *= 12.0
    return randn(gen, tokens, heads, head_dim) * chan


def _all_bf16_values(gen: torch.Generator, n: int) -> torch.Tensor:
    """Every bf16 bit pattern once (NaN patterns replaced by +-inf and the largest finite values),
    shuffled; ``n`` must be 65536."""
    bits = torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32).to(torch.int16)
    v = bits.view(torch.bfloat16).float()
    nan = torch.isnan(v)
    fill = torch.tensor([float("inf"), float("-inf"), 3.3895e38, -3.3895e38]).repeat(
        math.ceil(int(nan.sum()) / 4))[: int(nan.sum())]
    v[nan] = fill
    if v.numel() != n:
        raise ValueError(f"the all-bf16 input holds 65536 elements, the cell asks for {n}")
    return v[torch.randperm(n, generator=gen)]


def fp8_case(axes: dict, gen: torch.Generator, device) -> Case:
    """kv_fp8. ``data``: ``kv`` (K/V-like rows whose tails reach e4m3's subnormals, flush to zero
    and saturate) or ``all_bf16`` (every bf16 value once: every e4m3 tie, subnormal and overflow;
    tokens must make exactly 65536 elements)."""
    T, H, D = axes["tokens"], axes["kv_heads"], axes["head_dim"]
    act = DTYPES[axes["act_dtype"]]
    if axes["data"] == "all_bf16":
        x = _all_bf16_values(gen, T * H * D).reshape(T, H, D)
    else:
        x = _kv_rows(gen, T, H, D)
        # A tiny channel per head (values around e4m3's subnormals 2^-9 .. 2^-6 and below) and a
        # huge one (values past 448 saturate).
        x[:, :, 3] *= 2.0 ** -9
        x[:, :, 5] = x[:, :, 5].sign() * (440.0 + x[:, :, 5].abs() * 40.0)
    x = x.to(act).to(device)
    return Case(inputs={"x": x},
                outputs={"codes": OutSpec((T, H, D), torch.uint8), "deq": OutSpec((T, H, D), act)})


# ---------------------------------------------------------------- nvfp4


def _nvfp4_blocks(gen: torch.Generator, T: int, H: int, D: int) -> torch.Tensor:
    """K/V-like rows whose 16-element blocks span e4m3's scale range: per-block magnitudes from
    2^-12 to 2 (subnormal and zero block scales included), sign changes inside every block, and
    outliers."""
    x = _kv_rows(gen, T, H, D)
    nb = D // NVFP4_BLOCK
    mag = torch.exp2(torch.randint(-12, 2, (T, H, nb, 1), generator=gen).float())
    x = (x.unflatten(-1, (nb, NVFP4_BLOCK)) * mag).flatten(-2)
    # A block of signed zeros only: scale 0, every code 0x0 (the signs are dropped).
    x[0, 0, :NVFP4_BLOCK] = torch.tensor([0.0, -0.0] * (NVFP4_BLOCK // 2))
    return x


def nvfp4_case(axes: dict, gen: torch.Generator, device) -> Case:
    """kv_nvfp4. ``gs``: how the layer's global scale was calibrated:
    - ``fp32_stat``: ``amax / 2688`` of an fp32 calibration statistic (a running max times a
      margin): a global scale with a full 24-bit mantissa;
    - ``bf16_amax``: ``amax / 2688`` of a bf16 amax (the max |x| of the calibration data, a bf16
      value): the conventional choice, which puts exact quotients on e2m1/e4m3 ties (see the cell
      file);
    - ``pow2``: a power of two, with rows built on the ties of both roundings and past saturation.
    ``checked``: ``all`` (bytes and dequantized values, bitwise) or ``dequantized`` (values only).
    """
    T, H, D = axes["tokens"], axes["kv_heads"], axes["head_dim"]
    act = DTYPES[axes["act_dtype"]]
    if axes["gs"] == "pow2":
        x, gs = _nvfp4_ties(gen, T, H, D)
    else:
        x = _nvfp4_blocks(gen, T, H, D).to(act)
        amax = x.float().abs().max()
        if axes["gs"] == "bf16_amax":
            gs = nvfp4_global_scale(amax.double())  # amax is a bf16 value: 8 significant bits
        else:
            margin = 1.0 + float(torch.rand((), generator=gen))  # calibration saw up to 2x larger
            gs = nvfp4_global_scale(amax.double() * margin)
    x = x.to(act).to(device)
    outputs = {"packed": OutSpec((T, H, D // 2), torch.uint8),
               "sf": OutSpec((T, H, D // NVFP4_BLOCK), torch.uint8),
               "deq": OutSpec((T, H, D), act)}
    if axes["checked"] == "dequantized":
        outputs = {"deq": outputs["deq"]}
    return Case(inputs={"x": x, "gs": gs.to(device)}, outputs=outputs)


def _nvfp4_ties(gen: torch.Generator, T: int, H: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows on the ties of both roundings, with gs = 2^-6 so every fp32 step is exact.

    Each block has amax / (6 gs) equal to an e4m3 value or a midpoint between two (ties to even),
    or past 448 (saturation); its other elements are e2m1 midpoints or grid values times the block's
    scale (ties to even in the code), with random signs. Returns (x fp32, gs)."""
    gs = torch.tensor(2.0 ** -6)
    nb = D // NVFP4_BLOCK
    grid = torch.tensor(E2M1_GRID)
    mids = (grid[1:] + grid[:-1]) / 2
    # Block-scale targets: e4m3 midpoints (normal and subnormal), e4m3 values, and saturating ones.
    targets = torch.tensor([1.0625, 1.1875, 2.125, 2.375, 13.0, 3 * 2.0 ** -10, 2.0 ** -10,
                            5 * 2.0 ** -10, 1.0, 0.5, 448.0, 464.0, 600.0, 2.0 ** 12])
    pick = torch.randint(0, targets.numel(), (T, H, nb), generator=gen)
    s_target = targets[pick]                           # amax / (6 gs)
    amax = s_target * 6 * gs
    # The scale the quantizer will choose (RNE to e4m3, saturating): its quotients are then exact.
    sf = fp8_quantize(s_target.double()).to(torch.float64)
    unit = (sf * gs.double()).float()
    q = torch.cat([mids, grid[1:]])[torch.randint(0, 14, (T, H, nb, NVFP4_BLOCK), generator=gen)]
    sign = torch.where(torch.rand(T, H, nb, NVFP4_BLOCK, generator=gen) < 0.5, -1.0, 1.0)
    x = sign * q * unit[..., None]
    # The block's largest element fixes amax: place it at a random position with a random sign.
    pos = torch.randint(0, NVFP4_BLOCK, (T, H, nb, 1), generator=gen)
    big = torch.where(torch.rand(T, H, nb, 1, generator=gen) < 0.5, -1.0, 1.0) * amax[..., None]
    x = x.clamp(-amax[..., None], amax[..., None]).scatter(-1, pos, big)
    return x.flatten(-2), gs
