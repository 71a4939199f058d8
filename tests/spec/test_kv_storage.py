"""Tests of the KV storage quantisers: spec.ops.kv_storage (ops ``kv_fp8`` and ``kv_nvfp4``).

Published facts checked here: FP8 E4M3 ("fn") has max finite 448, no infinities and NaN at S.1111.111
(OCP 8-bit Floating Point Specification; Micikevicius et al. 2022). NVFP4 stores E2M1 elements whose
magnitudes are {0, 0.5, 1, 1.5, 2, 3, 4, 6} with bit 3 the sign (OCP MX v1.0 element type), in blocks of
16 elements sharing one E4M3 scale (NVIDIA's NVFP4 format).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from spec.ops.kv_storage import (
    E2M1_GRID,
    FP8_DTYPE,
    e2m1_decode,
    e2m1_encode,
    fp8_dequantize,
    fp8_quantize,
    kv_bytes_per_token,
    nvfp4_dequantize,
    nvfp4_global_scale,
    nvfp4_quantize,
    pack_nibbles,
    unpack_nibbles,
)

SEEDS = st.integers(min_value=0, max_value=2**31 - 1)
FLOAT_DTYPES = st.sampled_from([torch.bfloat16, torch.float16, torch.float32, torch.float64])
INF, NAN = float("inf"), float("nan")


def _bytes(codes: torch.Tensor) -> list[int]:
    return codes.view(torch.uint8).flatten().tolist()


def _e4m3_table() -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite e4m3fn value (float64) and its byte: an independent enumeration of the format."""
    all_bytes = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    values = all_bytes.view(FP8_DTYPE).to(torch.float64)
    finite = ~torch.isnan(values)
    return values[finite], all_bytes[finite].to(torch.int64)


def _nearest_even_byte(target: torch.Tensor, values: torch.Tensor, codes: torch.Tensor,
                       lsb_is_even: torch.Tensor) -> torch.Tensor:
    """Brute force: the code of the value nearest to each target, ties to the even mantissa.

    target [N] float64; values/codes/lsb_is_even [M]. Among equally near values of the same sign the
    one with the even mantissa wins; +0 and -0 tie only with each other and are resolved by the sign.
    """
    dist = (target[:, None] - values[None, :]).abs()
    best = dist.min(dim=1, keepdim=True).values
    tied = dist == best
    same_sign = torch.signbit(values)[None, :] == torch.signbit(target)[:, None]
    candidates = tied & same_sign & lsb_is_even[None, :]
    fallback = tied & same_sign
    pick = torch.where(candidates.any(dim=1, keepdim=True), candidates, fallback)
    return codes[pick.to(torch.int64).argmax(dim=1)]


# ---------------------------------------------------------------- kv_fp8


@pytest.mark.certify_guard("kv_fp8")
def test_kv_fp8_guard_bytes():
    # value -> byte, each checkable against the e4m3fn layout S.EEEE.MMM (bias 7):
    cases = [
        (1.0, 0x38),          # 0.0111.000
        (448.0, 0x7E),        # max finite: 1.75 * 2^8 = 0.1111.110
        (500.0, 0x7E),        # saturates
        (-1e4, 0xFE),         # saturates to -448
        (INF, 0x7E),          # clamp before the cast: +inf saturates too
        (-INF, 0xFE),
        (1.0625, 0x38),       # tie between 1.0 (mantissa 000) and 1.125 (001): to even, 1.0
        (1.1875, 0x3A),       # tie between 1.125 (001) and 1.25 (010): to even, 1.25
        (-0.0, 0x80),         # the sign of zero is kept
        (2.0**-9, 0x01),      # smallest subnormal
        (2.0**-10, 0x00),     # tie between 0 and 2^-9: to even, 0
        (3 * 2.0**-10, 0x02), # tie between 2^-9 (001) and 2^-8 (010): to even, 2^-8
        (NAN, 0x7F),          # canonical NaN
        (-NAN, 0x7F),
    ]
    x = torch.tensor([v for v, _ in cases], dtype=torch.float32)
    q = fp8_quantize(x)
    assert q.dtype == FP8_DTYPE
    assert _bytes(q) == [b for _, b in cases]
    back = fp8_dequantize(q, torch.float32)
    assert back[:3].tolist() == [1.0, 448.0, 448.0] and math.copysign(1.0, back[8].item()) == -1.0


@pytest.mark.certify_property("kv_fp8")
@given(seed=SEEDS, n=st.integers(1, 300), log2_scale=st.integers(-12, 10), dtype=FLOAT_DTYPES)
def test_kv_fp8_property(seed, n, log2_scale, dtype):
    g = torch.Generator().manual_seed(seed)
    values, codes = _e4m3_table()
    # Random magnitudes across e4m3's range, exact midpoints of adjacent e4m3 values (the ties) and
    # values past the saturation bound.
    noise = torch.randn(n, generator=g, dtype=torch.float64) * 2.0**log2_scale
    order = torch.sort(values).values
    pick = torch.randint(0, order.numel() - 1, (n,), generator=g)
    ties = (order[pick] + order[pick + 1]) / 2
    beyond = torch.sign(torch.randn(n, generator=g, dtype=torch.float64)) * (448 + noise.abs() * 64)
    x = torch.cat([noise, ties, beyond]).to(dtype)
    q = fp8_quantize(x)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape
    got = torch.tensor(_bytes(q), dtype=torch.int64)

    # 1. Nearest e4m3 value to clamp(x, -448, 448) from the exact input, ties to the even mantissa.
    target = x.to(torch.float64).clamp(-448.0, 448.0)
    expect = _nearest_even_byte(target, values, codes, (codes & 1) == 0)
    assert torch.equal(got, expect)
    # 2. Saturation: nothing beyond +-448, and everything at or beyond it is exactly +-448.
    deq = fp8_dequantize(q, torch.float64)
    assert bool((deq.abs() <= 448).all())
    big = x.to(torch.float64).abs() >= 448
    assert bool((deq[big].abs() == 448).all())
    # 3. Idempotent: the dequantized values are their own quantisation.
    assert _bytes(fp8_quantize(fp8_dequantize(q, dtype))) == _bytes(q)
    # 4. For fp32 and narrower inputs this is torch's own (RNE) cast of the clamped value.
    if dtype != torch.float64:
        assert _bytes(q) == _bytes(x.float().clamp(-448, 448).to(FP8_DTYPE))


def test_fp8_published_e4m3_facts():
    """OCP OFP8 E4M3: max finite 448 = 0x7E, 0x7F is NaN, min subnormal 2^-9, no infinity."""
    assert torch.finfo(FP8_DTYPE).max == 448.0
    as_fp8 = torch.tensor([0x7E, 0x7F, 0x01, 0x08], dtype=torch.uint8).view(FP8_DTYPE)
    v = as_fp8.to(torch.float64)
    assert v[0].item() == 448.0 and math.isnan(v[1].item())
    assert v[2].item() == 2.0**-9 and v[3].item() == 2.0**-6  # subnormal min, normal min
    assert _bytes(fp8_quantize(torch.tensor([1e30, -1e30]))) == [0x7E, 0xFE]


def test_fp8_float64_is_rounded_once():
    # Just above the 1.0 / 1.125 tie: correctly rounded it is 1.125. Through fp32 (torch's float64
    # cast) the 2^-40 is lost first and the tie rounds to 1.0: the spec must not do that.
    x = torch.tensor([1.0625 + 2.0**-40, 1.0625 - 2.0**-40], dtype=torch.float64)
    assert fp8_dequantize(fp8_quantize(x), torch.float64).tolist() == [1.125, 1.0]


# ---------------------------------------------------------------- e2m1 and nibbles


def test_e2m1_codes_decode_to_published_grid():
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert list(E2M1_GRID) == grid
    decoded = e2m1_decode(torch.arange(16, dtype=torch.uint8), torch.float64)
    assert decoded.tolist() == grid + [-v for v in grid]
    assert torch.signbit(decoded[8]) and not torch.signbit(decoded[0])  # 0x8 is -0.0
    # Every code is its own encoding (0x8 included: -0.0 keeps its sign bit).
    assert e2m1_encode(decoded).tolist() == list(range(16))


def test_e2m1_rounding_ties_to_even_and_saturation():
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 5.01, 7.0, INF, -5.0, -0.1, NAN])
    expect = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 6.0, 6.0, 6.0, -4.0, -0.0, 0.0]
    codes = e2m1_encode(v)
    assert e2m1_decode(codes, torch.float64).tolist() == expect
    assert codes[-2].item() == 0x8 and codes[-1].item() == 0x0  # -0.1 -> -0; NaN -> code 0


@given(seed=SEEDS, rows=st.integers(1, 4), pairs=st.integers(1, 16))
def test_pack_unpack_nibbles_round_trip(seed, rows, pairs):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, 2 * pairs), generator=g).to(torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (rows, pairs)
    assert torch.equal(packed & 0x0F, codes[:, 0::2]) and torch.equal(packed >> 4, codes[:, 1::2])
    assert torch.equal(unpack_nibbles(packed), codes)


# ---------------------------------------------------------------- kv_nvfp4


@pytest.mark.certify_guard("kv_nvfp4")
def test_kv_nvfp4_guard_bytes():
    # Block 0: amax 6 and gs = 1 make sf = e4m3(6 / 6) = 1.0 (byte 0x38), so codes are the values.
    # Byte = low nibble (even element) | high nibble (odd element) << 4; code = sign << 3 | grid index.
    block0 = [1.0, -0.5,   # 2, 8|1 = 9          -> 0x92
              6.0, 0.25,   # 7, tie 0/0.5 -> 0    -> 0x07
              0.75, 1.25,  # tie -> 1.0, tie -> 1.0 (2, 2) -> 0x22
              1.75, 2.5,   # tie -> 2, tie -> 2 (4, 4)     -> 0x44
              3.5, 5.0,    # tie -> 4, tie -> 4 (6, 6)     -> 0x66
              -3.0, 1.5,   # 8|5 = 0xD, 3                  -> 0x3D
              -0.0, 0.5,   # 0x8 (signed zero kept), 1     -> 0x18
              -6.0, 4.0]   # 0xF, 6                        -> 0x6F
    # Block 1: all +-0 -> amax 0 -> sf = 0 (byte 0x00) -> every code 0x0, signs dropped.
    block1 = [-0.0, 0.0] * 8
    # Block 2: amax 3 -> sf = 0.5 (byte 0x30); x / 0.5 = [6, -2, 1, 0.5, ...] -> codes 7, 0xC, 2, 1.
    block2 = [3.0, -1.0, 0.5, 0.25] + [0.25] * 12
    # Block 3: nonzero but tiny: amax / 6 = 1.7e-5 is below half the smallest e4m3 subnormal (2^-10),
    # so sf = 0 and every code is 0x0 (not +-6, which x / 0 would give).
    block3 = [1e-4, -1e-4] * 8
    x = torch.tensor([block0 + block1 + block2 + block3], dtype=torch.float32)
    packed, sf = nvfp4_quantize(x, torch.tensor(1.0))
    assert packed.dtype == torch.uint8 and packed.shape == (1, 32)
    assert sf.dtype == FP8_DTYPE and sf.shape == (1, 4)
    assert packed[0, :8].tolist() == [0x92, 0x07, 0x22, 0x44, 0x66, 0x3D, 0x18, 0x6F]
    assert packed[0, 8:16].tolist() == [0x00] * 8
    assert packed[0, 16:18].tolist() == [0xC7, 0x12] and packed[0, 18:24].tolist() == [0x11] * 6
    assert packed[0, 24:].tolist() == [0x00] * 8
    assert _bytes(sf) == [0x38, 0x00, 0x30, 0x00]
    # [1.0, -1.0] is 0xA2 at unit scale (code 2 low, 8|2 high).
    pair = torch.tensor([[1.0, -1.0] + [6.0] * 14])
    assert nvfp4_quantize(pair, torch.tensor(1.0))[0][0, 0].item() == 0xA2
    deq = nvfp4_dequantize(packed, sf, torch.tensor(1.0), torch.float32)
    assert deq[0, :16].tolist() == [1.0, -0.5, 6.0, 0.0, 1.0, 1.0, 2.0, 2.0,
                                    4.0, 4.0, -3.0, 1.5, -0.0, 0.5, -6.0, 4.0]


def _e2m1_reference_codes(ratio: torch.Tensor) -> torch.Tensor:
    """Brute-force e2m1 nearest-even of ratio (float64) over the 16 codes, saturating at +-6."""
    codes = torch.arange(16, dtype=torch.int64)
    values = e2m1_decode(codes, torch.float64)
    even = (codes & 1) == 0  # the mantissa bit is bit 0
    return _nearest_even_byte(ratio.clamp(-6.0, 6.0), values, codes, even)


@pytest.mark.certify_property("kv_nvfp4")
@given(seed=SEEDS, rows=st.integers(1, 3), n_blocks=st.integers(1, 4),
       dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.float64]),
       gs_mode=st.sampled_from(["amax", "tight", "loose"]), with_nan=st.booleans())
def test_kv_nvfp4_property(seed, rows, n_blocks, dtype, gs_mode, with_nan):
    g = torch.Generator().manual_seed(seed)
    d = 16 * n_blocks
    # Blocks of very different magnitudes, so scales spread over e4m3's range.
    block_mag = torch.exp2(torch.randint(-8, 6, (rows, n_blocks, 1), generator=g).double())
    x64 = (torch.randn(rows, n_blocks, 16, generator=g, dtype=torch.float64) * block_mag).flatten(-2)
    amax = x64.abs().max().item()
    # "amax": the conventional gs (largest scale 448); "tight": scales saturate; "loose": small ones.
    gs = {"amax": nvfp4_global_scale(amax), "tight": nvfp4_global_scale(amax / 8),
          "loose": nvfp4_global_scale(amax * 64)}[gs_mode]
    if with_nan:
        x64[0, 3] = NAN
    x = x64.to(dtype)
    packed, sf = nvfp4_quantize(x, gs)
    assert packed.shape == (rows, d // 2) and packed.dtype == torch.uint8
    assert sf.shape == (rows, n_blocks) and sf.dtype == FP8_DTYPE  # one e4m3 scale per 16 elements

    acc = torch.float64 if dtype == torch.float64 else torch.float32
    xb = x.to(acc).unflatten(-1, (n_blocks, 16))
    gsa = gs.to(acc)
    # Block scale: e4m3 RNE (saturating) of amax / (6 gs), computed in the acc dtype.
    scale_in = (xb.abs().amax(-1) / (6 * gsa)).to(torch.float64).clamp(max=448.0)
    values, codes = _e4m3_table()
    sf_bytes = torch.tensor(_bytes(sf), dtype=torch.int64).reshape(rows, n_blocks)
    finite_blocks = ~torch.isnan(scale_in)
    expect_sf = _nearest_even_byte(scale_in[finite_blocks], values, codes, (codes & 1) == 0)
    assert torch.equal(sf_bytes[finite_blocks], expect_sf)
    assert bool((sf_bytes[~finite_blocks] == 0x7F).all())

    # Codes: brute-force nearest-even of x / (sf * gs); the even element in the low nibble.
    sf_val = sf.to(acc)
    ratio = (xb / (sf_val * gsa)[..., None]).to(torch.float64)
    expect = _e2m1_reference_codes(ratio.flatten()).reshape(rows, n_blocks, 16)
    dead = (sf_val == 0) | torch.isnan(sf_val)
    expect = torch.where(dead[..., None], torch.zeros_like(expect), expect).flatten(-2)
    assert torch.equal((packed & 0x0F).to(torch.int64), expect[:, 0::2])
    assert torch.equal((packed >> 4).to(torch.int64), expect[:, 1::2])
    # Swapping each (even, odd) pair swaps the nibbles of each byte (blocks are unchanged by it).
    swapped = x.unflatten(-1, (d // 2, 2)).flip(-1).flatten(-2)
    assert torch.equal(nvfp4_quantize(swapped, gs)[0], (packed >> 4) | (packed << 4))

    # Dequantize: a NaN stays inside its block; elsewhere values are code * sf * gs.
    deq = nvfp4_dequantize(packed, sf, gs, torch.float64)
    nan_blocks = torch.isnan(deq).unflatten(-1, (n_blocks, 16))
    assert torch.equal(nan_blocks, (~finite_blocks)[..., None].expand_as(nan_blocks))
    # Idempotent on its own grid: a block whose largest code is 6 (always so when its scale is a
    # normal e4m3 number) or which is all zero requantizes to the same bytes and scale. A block with
    # a subnormal scale need not (module docstring of spec.ops.kv_storage); NaN blocks also hold.
    max_code = (unpack_nibbles(packed) & 0x7).unflatten(-1, (n_blocks, 16)).amax(-1)
    normal = sf_val.abs() >= 2.0**-6
    assert bool((max_code[normal] == 7).all())
    fixed = (max_code == 7) | (max_code == 0) | ~finite_blocks
    for out_dtype in (torch.float32, torch.float64):
        p2, s2 = nvfp4_quantize(nvfp4_dequantize(packed, sf, gs, out_dtype), gs)
        sf2 = torch.tensor(_bytes(s2), dtype=torch.int64).reshape(rows, n_blocks)
        assert torch.equal(sf2[fixed], sf_bytes[fixed])
        same = unpack_nibbles(p2).unflatten(-1, (n_blocks, 16)) == \
            unpack_nibbles(packed).unflatten(-1, (n_blocks, 16))
        assert bool(same.all(-1)[fixed].all())


def test_nvfp4_subnormal_scale_is_not_a_fixed_point():
    # The documented exception: amax / (6 gs) = 1.5 * 2^-9 rounds (tie, to even) to sf = 2^-8; then
    # x / sf = 4.5 -> code 4 (tie at 5 is not reached), so the block dequantizes to 4 * 2^-8 = 2^-6,
    # whose own scale is e4m3(2^-6 / 6) = 2^-9: a different block.
    x = torch.tensor([[6 * 1.5 * 2.0**-9] + [0.0] * 15])
    one = torch.tensor(1.0)
    packed, sf = nvfp4_quantize(x, one)
    assert sf.float().item() == 2.0**-8 and packed[0, 0].item() == 0x06
    p2, s2 = nvfp4_quantize(nvfp4_dequantize(packed, sf, one, torch.float32), one)
    assert s2.float().item() == 2.0**-9 and p2[0, 0].item() == 0x07


def test_nvfp4_float64_block_scale_is_rounded_once():
    # amax / (6 gs) = 1.0625 + 2^-40 exactly in float64: just above the 1.0 / 1.125 tie, so sf = 1.125.
    # (Through fp32 it would be the tie itself and round to 1.0.)
    x = torch.tensor([[6 * (1.0625 + 2.0**-40)] + [1.0] * 15], dtype=torch.float64)
    _, sf = nvfp4_quantize(x, torch.tensor(1.0))
    assert sf.to(torch.float64).item() == 1.125


def test_nvfp4_specials():
    one = torch.tensor(1.0)
    # +inf saturates: scale 448, code +6; the finite neighbours of the block round to 0.
    x = torch.tensor([[INF, -1.0] + [0.5] * 14])
    packed, sf = nvfp4_quantize(x, one)
    assert sf.float().item() == 448.0 and packed[0, 0].item() == 0x87  # -1/448 rounds to -0
    with pytest.raises(ValueError):
        nvfp4_quantize(torch.ones(1, 16), torch.tensor(0.0))
    with pytest.raises(ValueError):
        nvfp4_quantize(torch.ones(1, 15), one)


def test_kv_bytes_per_token():
    # Target geometry, 2 KV heads x head_dim 256, K and V: 2 * 512 elements.
    assert kv_bytes_per_token(2, 256, "bf16") == 2048
    assert kv_bytes_per_token(2, 256, "fp8") == 1024
    assert kv_bytes_per_token(2, 256, "nvfp4") == 2 * (256 + 32)  # 4-bit codes + a scale per 16
    with pytest.raises(ValueError):
        kv_bytes_per_token(2, 256, "int8")  # type: ignore[arg-type]
