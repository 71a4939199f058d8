"""KV storage formats: fp8 (e4m3) and nvfp4 quantisers (docs/spec.md, "KV storage").

Ops defined here:
- ``kv_fp8``   : ``fp8_quantize`` / ``fp8_dequantize`` (unit scales).
- ``kv_nvfp4`` : ``nvfp4_quantize`` / ``nvfp4_dequantize`` (16-element blocks along the last dim).
bf16 storage is the identity and needs no function.

Public definitions followed:
- FP8 E4M3 ("fn" flavour: no infinities, one NaN pattern per sign, max finite 448), from the OCP 8-bit
  Floating Point Specification (OFP8) and Micikevicius et al., "FP8 Formats for Deep Learning" (2022).
  Bias 7, 3 mantissa bits, subnormals down to 2^-9.
- FP4 E2M1 (OCP Microscaling Formats (MX) v1.0 element type): sign bit (bit 3), 2 exponent bits, 1
  mantissa bit; the magnitudes of codes 0..7 are {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
- NVFP4 (NVIDIA, Blackwell): E2M1 elements in blocks of 16 sharing an E4M3 block scale, plus one fp32
  global (per-tensor) scale. Here the global scale ``gs`` is on the dequant side: ``x ~ code * sf * gs``.

Numerics (see spec/numerics.py): quantisers always round, in float64 mode too, because the rounding is
the op. What float64 mode changes is only the arithmetic *before* the rounding:
- ``fp8_quantize`` rounds the exact input value once, in every mode. e4m3 rounding is written out
  explicitly (``_round_e4m3``) rather than left to ``Tensor.to(float8_e4m3fn)``: torch casts a float64
  tensor to fp8 through fp32, which rounds twice (1.0625 + 2^-40 would become 1.0 instead of 1.125).
  For fp32 / bf16 / fp16 inputs the explicit rounding equals torch's cast; a test pins that.
- ``nvfp4_quantize`` computes ``amax / (6 * gs)`` and ``x / (sf * gs)`` in fp32 for non-float64 inputs
  (each of ``6 * gs``, the quotient, ``sf * gs`` and ``x / (...)`` rounds once in fp32, the order an fp32
  kernel evaluates them in) and in float64 when x is float64. The two modes can therefore choose a
  different block scale or code only when a quotient lies within an fp32 rounding of an e4m3 / e2m1
  rounding boundary; the tolerance oracle absorbs that.

Special values (decided here, restated in docs/spec.md, "KV storage"; pinned by
tests/spec/test_kv_storage.py):
- Signed zero. fp8 keeps the sign: -0.0 (and any negative that rounds to zero) is 0x80. nvfp4 keeps
  it likewise inside a block with a nonzero scale: -0.0 and negatives that round to zero get code 0x8
  (decoding to -0.0). A block whose scale is 0 (all its elements are +-0 or underflow the scale) is
  all code 0x0, the literal "a block with sf == 0 is all code 0" of docs/spec.md, whatever the signs.
- Infinity: saturates. fp8 gives +-448 (clamp before the cast); in nvfp4 an infinite element makes the
  block scale saturate to 448 and the element's code +-6.
- NaN: propagates, with one canonical pattern. fp8 maps any NaN to 0x7F (the sign of a NaN carries
  nothing). In nvfp4, e2m1 has no NaN, so a NaN element makes its *block scale* NaN (0x7F) and every
  code of that block 0x0: the whole block dequantizes to NaN (0 * NaN), so the poison stays visible
  and is confined to its block. ``e2m1_encode`` on its own maps NaN to code 0x0.
"""

from __future__ import annotations

from typing import Literal

import torch

from spec.numerics import acc_dtype

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn magnitude (OCP OFP8): 1.75 * 2^8
FP8_NAN_BYTE = 0x7F  # canonical NaN pattern of e4m3fn (S.1111.111 with S = 0)
_E4M3_MANTISSA_BITS = 3
_E4M3_MIN_EXP = -6  # exponent of the smallest normal, 2^-6; subnormals share its quantum 2^-9

NVFP4_BLOCK = 16  # elements sharing one block scale
E2M1_MAX = 6.0
E2M1_SIGN_BIT = 0x8
# Magnitude of e2m1 codes 0..7 (sign bit clear); codes 8..15 are the same values negated.
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between consecutive grid values: the rounding thresholds of e2m1.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)

KvDtype = Literal["bf16", "fp8", "nvfp4"]


# ---------------------------------------------------------------- fp8 (e4m3fn)


def _round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Round v (already within [-448, 448], any float dtype) to the e4m3 grid, nearest-even.

    Returns v's dtype holding e4m3 values exactly. The quantum of a value with exponent e
    (2^e <= |v| < 2^(e+1)) is 2^(e-3); below the smallest normal 2^-6 the quantum stays 2^-9
    (subnormals). Scaling by a power of two is exact, so ``round(v / quantum)`` is the only rounding
    and ``torch.round`` rounds halves to even. Signs (including -0.0) and NaN pass through.
    """
    _, exp = torch.frexp(v.abs())  # |v| = m * 2^exp with m in [0.5, 1): floor(log2|v|) = exp - 1
    e = torch.clamp(exp - 1, min=_E4M3_MIN_EXP)
    quantum = _pow2(e - _E4M3_MANTISSA_BITS, v.dtype)
    return torch.round(v / quantum) * quantum


def _pow2(e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """2^e exactly, for integer e in the normal range of fp32, as a ``dtype`` tensor, built from the
    exponent bits so that the spec is one function on every device: with ``torch.ldexp`` (x times
    ``pow(2, e)``) the e4m3 codes of 24 of the 65536 bf16 values differed between CUDA and the CPU
    (kv_fp8's all_bf16_values cell on sm_90); built from bits they agree (tools/probe_e4m3.py)."""
    bits = (e.to(torch.int32) + 127) << 23
    return bits.view(torch.float32).to(dtype)


def _to_e4m3_saturating(v: torch.Tensor) -> torch.Tensor:
    """e4m3fn(clamp(v, -448, 448)) round-to-nearest-even, NaN -> 0x7F. v: any float dtype."""
    rounded = _round_e4m3(torch.clamp(v, -FP8_MAX, FP8_MAX))
    codes = rounded.to(FP8_DTYPE)  # exact: every value is on the e4m3 grid
    nan_byte = torch.full_like(codes.view(torch.uint8), FP8_NAN_BYTE)
    return torch.where(torch.isnan(v), nan_byte, codes.view(torch.uint8)).view(FP8_DTYPE)


def fp8_quantize(x: torch.Tensor) -> torch.Tensor:
    """KV fp8 storage (op ``kv_fp8``): ``e4m3(clamp(x, -448, 448))``, round to nearest even.

    x: any shape, any float dtype. Returns float8_e4m3fn of x's shape. The value is rounded once from
    its exact value (bf16/fp16/fp32 widen exactly into the acc dtype; float64 is rounded directly,
    never through fp32). Clamping first makes the op saturating whatever torch's cast does out of
    range: +-inf -> +-448. -0.0 -> 0x80; NaN -> 0x7F.
    """
    return _to_e4m3_saturating(x.to(acc_dtype(x)))


def fp8_dequantize(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The cast back: float8_e4m3fn -> ``dtype``. Exact for bf16, fp16, fp32 and float64.

    (e4m3 needs 4 significant bits and exponents 2^-9 .. 2^8, which all of them hold.)
    """
    if codes.dtype != FP8_DTYPE:
        raise TypeError(f"fp8 codes must be {FP8_DTYPE}, got {codes.dtype}")
    return codes.to(dtype)


# ---------------------------------------------------------------- e2m1 codes and nibbles


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """Round v to the e2m1 grid, nearest, ties to even; return 4-bit codes as uint8 (0..15).

    v: any shape, any float dtype (already divided by its block scale). Magnitudes above 6 saturate to
    6 (code 7). The rounding is written as threshold counting: the magnitude code is the number of
    midpoints of ``E2M1_GRID`` that |v| passes, where |v| exactly *on* a midpoint passes it only if
    that lands on the even code (even mantissa bit). Hence 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0,
    1.75 -> 2.0, 2.5 -> 2, 3.5 -> 4, 5 -> 4. The sign bit (bit 3) is v's sign bit, so -0.0 and
    negatives rounding to zero encode as 0x8. NaN encodes as 0x0.
    """
    mag = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for i, mid in enumerate(_E2M1_MIDPOINTS):
        upper_is_even = (i + 1) % 2 == 0  # a tie at this midpoint goes up iff code i+1 is even
        passes = (mag > mid) | ((mag == mid) & upper_is_even)
        code += passes.to(torch.uint8)
    code = torch.where(torch.signbit(v), code | E2M1_SIGN_BIT, code)
    return torch.where(torch.isnan(v), torch.zeros_like(code), code)


def e2m1_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """4-bit e2m1 codes (integer tensor, values 0..15) -> values in ``dtype`` (exact in any float).

    Bit 3 is the sign, bits 0..2 index ``E2M1_GRID``. Code 0x8 decodes to -0.0.
    """
    c = codes.to(torch.int64)
    if bool(((c < 0) | (c > 15)).any()):
        raise ValueError("e2m1 codes must lie in 0..15")
    grid = torch.tensor(E2M1_GRID, dtype=dtype, device=codes.device)
    mag = grid[c & 0x7]
    return torch.where((c & E2M1_SIGN_BIT) != 0, -mag, mag)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes two a byte along the last dim: element 2i in the low nibble, 2i+1 high.

    codes: uint8 [..., D] with D even and values 0..15. Returns uint8 [..., D // 2].
    """
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    if codes.shape[-1] % 2:
        raise ValueError(f"the last dim must be even to pack nibbles, got {codes.shape[-1]}")
    if bool((codes > 15).any()):
        raise ValueError("codes must be 4-bit (0..15)")
    low, high = codes[..., 0::2], codes[..., 1::2]
    return low | (high << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_nibbles``: uint8 [..., N] -> uint8 codes [..., 2N], low nibble first."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed codes must be uint8, got {packed.dtype}")
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


# ---------------------------------------------------------------- nvfp4


def _check_global_scale(gs: torch.Tensor) -> None:
    if gs.numel() != 1:
        raise ValueError(f"the nvfp4 global scale is one number, got shape {tuple(gs.shape)}")
    if not bool(torch.isfinite(gs).all() & (gs > 0).all()):
        raise ValueError(f"the nvfp4 global scale must be finite and > 0, got {gs.item()}")


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., D // 16, 16]; D must be a multiple of 16."""
    d = x.shape[-1]
    if d % NVFP4_BLOCK:
        raise ValueError(f"nvfp4 needs the last dim to be a multiple of {NVFP4_BLOCK}, got {d}")
    return x.unflatten(-1, (d // NVFP4_BLOCK, NVFP4_BLOCK))


def nvfp4_global_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """A conventional global scale for a tensor with largest magnitude ``amax``: ``amax / (6 * 448)``.

    With it the largest block scale is exactly 448, the top of e4m3's range. Not part of the op
    (gs is an input); used to build weights and test inputs. Returns fp32 [] (amax must be > 0).
    """
    a = torch.as_tensor(amax, dtype=torch.float64)
    if not bool(a > 0):
        raise ValueError("amax must be > 0")
    return (a / (E2M1_MAX * FP8_MAX)).to(torch.float32)


def nvfp4_quantize(x: torch.Tensor, gs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 quantisation along the last dim (op ``kv_nvfp4``), blocks of 16.

    x: [..., D] any float dtype, D a multiple of 16. gs: the global scale, one positive finite number
    (fp32 by convention), dequant side: ``x ~ code * sf * gs``.
    Per block: ``sf = e4m3(amax_block / (6 * gs))`` (nearest even, saturating at 448); per element:
    ``code = e2m1(x / (sf * gs))`` (nearest even, clamped to +-6); a block with ``sf == 0`` is all
    code 0x0. Arithmetic in acc_dtype(x, gs): fp32, or float64 for float64 x (module docstring).
    Returns (packed uint8 [..., D // 2], element 2i in the low nibble; sf float8_e4m3fn [..., D // 16]).
    """
    _check_global_scale(gs)
    acc = acc_dtype(x, gs)
    xb = _blocks(x.to(acc))
    g = gs.to(acc).reshape(())
    amax = xb.abs().amax(dim=-1)  # NaN propagates, so a NaN element gives a NaN (0x7F) scale
    sf = _to_e4m3_saturating(amax / (E2M1_MAX * g))
    sf_val = sf.to(acc)
    codes = e2m1_encode(xb / (sf_val * g)[..., None])
    # sf == 0 would divide by zero; a NaN scale poisons the block through the scale, not the codes.
    dead = ((sf_val == 0) | torch.isnan(sf_val))[..., None]
    codes = torch.where(dead, torch.zeros_like(codes), codes)
    return pack_nibbles(codes.flatten(-2)), sf


def nvfp4_dequantize(packed: torch.Tensor, sf: torch.Tensor, gs: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """``code * sf * gs`` evaluated as ``(code * sf) * gs``, then cast to ``dtype``.

    packed: uint8 [..., D // 2]; sf: float8_e4m3fn [..., D // 16]; gs: one number. Returns [..., D] in
    ``dtype``. ``code * sf`` is exact; the product with gs is exact in float64 (dtype float64) and
    rounds once in fp32 otherwise, followed by the cast to ``dtype`` (a second rounding for bf16).
    """
    _check_global_scale(gs)
    if sf.dtype != FP8_DTYPE:
        raise TypeError(f"block scales must be {FP8_DTYPE}, got {sf.dtype}")
    acc = torch.float64 if dtype == torch.float64 else acc_dtype(gs)
    codes = unpack_nibbles(packed)
    if codes.shape[-1] != sf.shape[-1] * NVFP4_BLOCK or codes.shape[:-1] != sf.shape[:-1]:
        raise ValueError(f"packed {tuple(packed.shape)} and scales {tuple(sf.shape)} disagree")
    values = _blocks(e2m1_decode(codes, acc)) * sf.to(acc)[..., None]
    return (values * gs.to(acc).reshape(())).flatten(-2).to(dtype)


# ---------------------------------------------------------------- footprint


def kv_bytes_per_token(n_kv_heads: int, head_dim: int, kv_dtype: KvDtype) -> int:
    """Bytes one token occupies in one layer's KV cache (K and V together), for the report.

    bf16: 2 bytes an element; fp8: 1; nvfp4: half a byte an element plus one e4m3 scale byte per 16
    elements. Per-layer global scales (a few bytes a layer, not a token) and the QSA side planes
    (index keys, positions, block keys) are not counted. Target geometry (2 KV heads x 256):
    bf16 2048, fp8 1024, nvfp4 576.
    """
    if n_kv_heads <= 0 or head_dim <= 0:
        raise ValueError("n_kv_heads and head_dim must be positive")
    elements = n_kv_heads * head_dim
    if kv_dtype == "bf16":
        per_tensor = 2 * elements
    elif kv_dtype == "fp8":
        per_tensor = elements
    elif kv_dtype == "nvfp4":
        if head_dim % NVFP4_BLOCK:
            raise ValueError(f"nvfp4 needs head_dim to be a multiple of {NVFP4_BLOCK}")
        per_tensor = elements // 2 + elements // NVFP4_BLOCK
    else:
        raise ValueError(f"unknown KV dtype {kv_dtype!r}; expected 'bf16', 'fp8' or 'nvfp4'")
    return 2 * per_tensor  # K and V


# ---------------------------------------------------------------- the load seam of qsa_sparse_gqa


def fp8_load(parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
    """The fp8 format as a ``load`` of spec/ops/qsa.py: one e4m3 pool, read back with the cast.

    A named function (not a lambda) so that a kernel can recognise the format it stands for.
    """
    return fp8_dequantize(parts[0], dtype)


def nvfp4_load(parts: tuple[torch.Tensor, ...], dtype: torch.dtype, *, gs: torch.Tensor
               ) -> torch.Tensor:
    """The nvfp4 format as a ``load``: pools (uint8 codes, e4m3 block scales), read back as
    ``nvfp4_dequantize``. Bind the layer's global scale with ``functools.partial(nvfp4_load, gs=gs)``:
    the seam's way to carry a format's parameter, which a kernel reads from ``partial.keywords``."""
    return nvfp4_dequantize(parts[0], parts[1], gs, dtype)
