"""Oracles: bitwise, and tolerance against float64 in ulp of the output dtype.

Rules every oracle applies:
- NaN never passes, and neither does inf (unless a band allows an inf that equals the reference's).
- An output element still holding the poison after the call was not written: a failure of its own.
- Bitwise compares bytes, so -0.0 differs from +0.0 unless the op's oracle says ``signed_zero_equal``.
- Tolerance metrics, both in units of the *output* dtype:
  ``ulp``: per element, |out - ref| / ulp(max |ref| over the element's row) (the last dim is the row);
  ``rel_rms``: rms(out - ref) / rms(ref) / eps(dtype).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

INT_POISON = {torch.int8: -128, torch.int16: -(2 ** 15), torch.int32: -(2 ** 31),
              torch.int64: -(2 ** 63), torch.uint8: 0xA5}


@dataclass
class Verdict:
    passed: bool
    metrics: dict[str, float] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer so that an element the variant never writes cannot pass."""
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t.fill_(True)
    return t.fill_(INT_POISON.get(t.dtype, -1))


def unwritten_mask(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Elements still holding the poison where the reference holds something else."""
    if out.dtype.is_floating_point:
        out, ref = _as_float(out), _as_float(ref)
        return torch.isnan(out) & ~torch.isnan(ref.to(torch.float64))
    if out.dtype == torch.bool:
        return torch.zeros_like(out)
    p = INT_POISON.get(out.dtype, -1)
    return (out == p) & (ref.to(out.dtype) != p)


def round_once(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round a float64 tensor to ``dtype`` once, to nearest even.

    torch's float64 -> bf16 / fp16 / fp8 casts go through fp32 and so round twice (1 + 2^-8 + 2^-24
    becomes 1.0 in bf16, not 1.0078125). Rounding to fp32 *to odd* first and then to the narrow type
    to nearest even gives the correctly rounded result, since fp32 keeps at least two more bits than
    every narrower format here.
    """
    if x.dtype != torch.float64 or dtype in (torch.float64, torch.float32):
        return x.to(dtype)
    y = x.to(torch.float32)
    y64 = y.to(torch.float64)
    inexact = (y64 != x) & torch.isfinite(x) & torch.isfinite(y64)
    # toward zero: step back one fp32 ulp where round-to-nearest went away from zero
    away = inexact & (y64.abs() > x.abs())
    bits = y.view(torch.int32)
    bits = torch.where(away, bits - 1, bits)
    bits = torch.where(inexact, bits | 1, bits)  # then make the last bit odd: "sticky"
    return bits.view(torch.float32).to(dtype)


def _as_float(t: torch.Tensor) -> torch.Tensor:
    """float8 types lack isnan / isinf / arithmetic on the CPU: widen them (exactly) to fp32."""
    return t.float() if t.dtype.is_floating_point and t.element_size() == 1 else t


def eps_of(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def ulp_of(mag: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at magnitudes ``mag`` (float64 tensor), subnormals included.

    For a normal x, ulp(x) = 2^floor(log2 |x|) * eps; below the smallest normal the spacing is constant
    (the subnormal step, tiny * eps); zero gets that same smallest step.
    """
    fi = torch.finfo(dtype)
    m = mag.abs().clamp_min(fi.tiny)
    return torch.exp2(torch.floor(torch.log2(m))) * fi.eps


def _nonfinite_problems(name: str, out: torch.Tensor, ref: torch.Tensor, allow_matching_inf: bool
                        ) -> list[str]:
    if not out.dtype.is_floating_point:
        return []
    out, ref = _as_float(out), _as_float(ref)
    problems = []
    nan = torch.isnan(out)
    if nan.any():
        problems.append(f"{name}: {int(nan.sum())} NaN element(s), first at {_first(nan)}")
    inf = torch.isinf(out)
    if allow_matching_inf:
        inf = inf & ~(out.to(torch.float64) == ref.to(torch.float64))
    if inf.any():
        problems.append(f"{name}: {int(inf.sum())} inf element(s), first at {_first(inf)}")
    return problems


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


def bitwise(name: str, out: torch.Tensor, ref: torch.Tensor, signed_zero_equal: bool = False
            ) -> Verdict:
    """Identical bytes (same dtype and shape required). NaN never passes, even against NaN."""
    v = Verdict(True)
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return Verdict(False, problems=[f"{name}: got {tuple(out.shape)} {out.dtype}, expected "
                                        f"{tuple(ref.shape)} {ref.dtype}"])
    unwritten = unwritten_mask(out, ref)
    if unwritten.any():
        v.problems.append(f"{name}: {int(unwritten.sum())} element(s) not written, first at "
                          f"{_first(unwritten)}")
    v.problems += _nonfinite_problems(name, out, ref, allow_matching_inf=True)
    a, b = out, ref
    if signed_zero_equal and out.dtype.is_floating_point and out.element_size() > 1:
        a, b = out + 0.0, ref + 0.0  # x + 0.0 turns -0.0 into +0.0 and leaves every other value alone
    diff = bit_pattern(a) != bit_pattern(b)
    v.metrics[f"{name}.mismatches"] = float(diff.sum())
    if diff.any():
        idx = _first(diff)
        v.problems.append(f"{name}: {int(diff.sum())} of {diff.numel()} element(s) differ, first at "
                          f"{idx}: got {_as_float(a)[idx].item()!r}, expected "
                          f"{_as_float(b)[idx].item()!r}")
    v.passed = not v.problems
    return v


def bit_pattern(t: torch.Tensor) -> torch.Tensor:
    """t's bytes as integers of its element size, so that equality is equality of bits (NaN
    payloads and signed zeros included)."""
    t = t.contiguous()
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    if t.element_size() == 1:
        return t.view(torch.uint8)
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def tolerance(name: str, out: torch.Tensor, ref64: torch.Tensor, max_ulp: float, max_rel_rms: float,
              allow_matching_inf: bool = False) -> Verdict:
    """Compare against the float64 reference in ulp of out's dtype (see the module docstring)."""
    v = Verdict(True)
    if out.shape != ref64.shape:
        return Verdict(False, problems=[f"{name}: shape {tuple(out.shape)}, expected "
                                        f"{tuple(ref64.shape)}"])
    if not out.dtype.is_floating_point:
        return Verdict(False, problems=[f"{name}: a tolerance oracle needs a floating output, "
                                        f"got {out.dtype}; use bitwise"])
    unwritten = unwritten_mask(out, ref64)
    if unwritten.any():
        v.problems.append(f"{name}: {int(unwritten.sum())} element(s) not written, first at "
                          f"{_first(unwritten)}")
    v.problems += _nonfinite_problems(name, out, ref64, allow_matching_inf)
    o = out.to(torch.float64)
    r = ref64.to(torch.float64)
    finite = torch.isfinite(o) & torch.isfinite(r)
    o = torch.where(finite, o, 0.0)
    r = torch.where(finite, r, 0.0)
    err = (o - r).abs()
    row_max = r.abs().amax(dim=-1, keepdim=True) if r.dim() else r.abs()
    ulps = err / ulp_of(row_max, out.dtype)
    worst = float(ulps.max()) if ulps.numel() else 0.0
    ref_rms = float(r.pow(2).mean().sqrt()) if r.numel() else 0.0
    err_rms = float((o - r).pow(2).mean().sqrt()) if r.numel() else 0.0
    rel_rms = (err_rms / ref_rms / eps_of(out.dtype)) if ref_rms > 0 else (
        0.0 if err_rms == 0 else math.inf)
    v.metrics[f"{name}.ulp"] = worst
    v.metrics[f"{name}.rel_rms"] = rel_rms
    if worst > max_ulp:
        idx = _first(ulps == ulps.max())
        v.problems.append(f"{name}: {worst:.3g} ulp > band {max_ulp} at {idx}: got "
                          f"{o[idx].item():.9g}, float64 {r[idx].item():.9g}")
    if rel_rms > max_rel_rms:
        v.problems.append(f"{name}: relative RMS {rel_rms:.3g} eps > band {max_rel_rms}")
    v.passed = not v.problems
    return v


def closer_to_float64(a: torch.Tensor, b: torch.Tensor, ref64: torch.Tensor) -> tuple[str, float, float]:
    """Which of two results is closer to the float64 reference (by RMS error): 'a', 'b' or 'tie'.

    The rule when two implementations disagree: the one closer to float64 wins, and only then is the
    other changed.
    """
    r = ref64.to(torch.float64)
    ea = float((a.to(torch.float64) - r).pow(2).mean().sqrt())
    eb = float((b.to(torch.float64) - r).pow(2).mean().sqrt())
    return ("a" if ea < eb else "b" if eb < ea else "tie"), ea, eb
