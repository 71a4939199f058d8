"""Second, independent formulations of the storage, selection, routing and hashing spec functions.

The spec under spec/ops/ is the definition every implementation is certified against, so it must be
checked, not only trusted. Each test below restates one spec function from its prose (the function's
docstring and docs/spec.md) in a deliberately different form, and compares the two on seeded
random inputs plus hand-picked edge values:

- fp8 (e4m3fn): a 256-entry value table decoded from the bit layout, a brute-force nearest-value search
  over it (ties to the even code), and torch's own ``float8_e4m3fn`` cast of fp32 (after the clamp).
- e2m1: brute-force nearest value of {0, 0.5, 1, 1.5, 2, 3, 4, 6} with a sign bit, ties to the even code.
- nibbles: per-element integer arithmetic (``low + 16 * high``, ``% 16``, ``// 16``).
- nvfp4: one Python loop per 16-element block, with Python floats (float64) and, for fp32 inputs, an
  explicit fp32 rounding after each operation (``struct``), applying the scale rule of docs/spec.md.
- QSA selection: the window built by enumeration, top-k by sorting every candidate block by
  (score, block index) descending; the selected block SETS are compared.
- MoE routing: per-row softmax in float64 with ``math.exp`` / ``math.fsum``, a full sort, renormalised.
- Shared expert: the SwiGLU formula written out per row in float64.
- PLE n-gram hash: Python integers with explicit ``mod 2^64`` arithmetic, per window.

Exact quantities (codes, ids, selections, hash bits) are compared bitwise; floating results in float64
with a tolerance justified where it is used. Every test also checks that a plausible wrong variant of
its formulation (round half up instead of to even, no saturation, sink block dropped, no
renormalisation, ...) does NOT match the spec on the same inputs, so each comparison has power.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch

from spec.ops.kv_storage import (
    e2m1_decode,
    e2m1_encode,
    fp8_dequantize,
    fp8_quantize,
    nvfp4_dequantize,
    nvfp4_quantize,
    pack_nibbles,
    unpack_nibbles,
)
from spec.ops.moe import moe_route, moe_shared_expert
from spec.ops.ple import ngram_hash_u64
from spec.ops.qsa import num_complete_blocks, qsa_select, select_row, window_blocks

F32, F64 = torch.float32, torch.float64
FP8 = torch.float8_e4m3fn
U64 = (1 << 64) - 1


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _f32(v: float) -> float:
    """v rounded once to fp32 (nearest even), returned as a Python float."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def _bits(x: torch.Tensor) -> list[int]:
    """The raw bit patterns of a float tensor (so -0.0 and +0.0 differ)."""
    view = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
            torch.float16: torch.int16, FP8: torch.uint8}[x.dtype]
    return x.contiguous().view(view).flatten().tolist()


# =====================================================================================================
# fp8 e4m3fn
# =====================================================================================================


def e4m3_value(byte: int) -> float:
    """Value of one e4m3fn byte from its bit layout: S.EEEE.MMM, bias 7, subnormals at E = 0,
    S.1111.111 is NaN, no infinities."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * man * 2.0 ** -9
    return sign * (1.0 + man / 8.0) * 2.0 ** (exp - 7)


E4M3_TABLE = [e4m3_value(b) for b in range(256)]
# Non-negative finite codes 0x00 .. 0x7E, ascending in value.
E4M3_POSITIVE = [(E4M3_TABLE[b], b) for b in range(0x7F)]


def e4m3_nearest_byte(v: float, ties: str = "even", saturate: bool = True) -> int:
    """Brute-force e4m3fn byte of a Python float: the nearest finite table value, NaN -> 0x7F.

    |v| is clamped to 448 first (saturation). Distances |v| - g are exact for the two neighbours of
    |v| (Sterbenz: consecutive nonzero e4m3 values are within a factor 2), so ties are detected exactly.
    ``ties``: "even" (the stated rule: the even code, i.e. even mantissa bit) or "away" (wrong variant).
    """
    if math.isnan(v):
        return 0x7F
    mag = abs(v)
    if saturate:
        mag = min(mag, 448.0)
    elif mag > 464.0:  # what a non-saturating cast does beyond the top rounding boundary: NaN
        return 0x7F
    best = None
    for g, b in E4M3_POSITIVE:
        d = abs(mag - g)
        if best is None or d < best[0]:
            best = (d, b)
        elif d == best[0]:
            pick = b if (b % 2 == 0 if ties == "even" else b > best[1]) else best[1]
            best = (d, pick)
    byte = best[1]
    return byte | 0x80 if math.copysign(1.0, v) < 0 else byte


def _fp8_inputs(seed: int, n: int = 1500) -> list[float]:
    """Random magnitudes over 2^-13 .. 2^11 (subnormals to overflow), both signs, plus every midpoint
    between consecutive e4m3 values (exact ties), values around the top 448, zeros and infinities."""
    g = _gen(seed)
    mag = 2.0 ** (torch.rand(n, generator=g, dtype=F64) * 24 - 13)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).to(F64)
    values = (mag * sign).to(F32).tolist()
    mids = [(a + b) / 2 for (a, _), (b, _) in zip(E4M3_POSITIVE, E4M3_POSITIVE[1:])]
    top = [416.0, 432.0, 440.0, 447.0, 448.0, 449.0, 456.0, 464.0, 465.0, 480.0, 500.0, 1e6, math.inf]
    small = [0.0, 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -11, 1e-5]
    edge = mids + top + small
    return values + edge + [-v for v in edge] + [-0.0]


@pytest.mark.second_formulation("spec.ops.kv_storage:fp8_quantize")
def test_fp8_quantize_matches_torch_e4m3fn_cast_and_brute_force_fp32():
    xs = _fp8_inputs(seed=11)
    x = torch.tensor(xs + [math.nan], dtype=F32)
    spec = _bits(fp8_quantize(x))

    # Public implementation: torch's fp32 -> float8_e4m3fn cast, after the clamp the docstring states
    # (the cast rounds to nearest even); NaN is mapped to the canonical 0x7F by hand.
    torch_cast = torch.clamp(x, -448.0, 448.0).to(FP8).view(torch.uint8)
    torch_cast = torch.where(torch.isnan(x), torch.full_like(torch_cast, 0x7F), torch_cast).tolist()
    brute = [e4m3_nearest_byte(v) for v in x.tolist()]
    assert spec == torch_cast
    assert spec == brute

    # Wrong variants: ties away from zero; no saturation (out-of-range values become NaN).
    assert spec != [e4m3_nearest_byte(v, ties="away") for v in x.tolist()]
    assert spec != [e4m3_nearest_byte(v, saturate=False) for v in x.tolist()]


@pytest.mark.second_formulation("spec.ops.kv_storage:fp8_quantize")
def test_fp8_quantize_float64_rounds_once_like_brute_force():
    g = _gen(12)
    xs = _fp8_inputs(seed=13)
    # float64 values that are not fp32 values, and the docstring's double-rounding example.
    jitter = (torch.rand(len(xs), generator=g, dtype=F64) - 0.5) * 2.0 ** -30
    x = torch.tensor(xs, dtype=F64) * (1 + jitter)
    x = torch.cat([x, torch.tensor([1.0625 + 2.0 ** -40, -(1.0625 + 2.0 ** -40), 448.0 + 2.0 ** -30],
                                   dtype=F64)])
    spec = _bits(fp8_quantize(x))
    assert spec == [e4m3_nearest_byte(v) for v in x.tolist()]
    # Wrong variant: torch's float64 cast goes through fp32 (two roundings).
    through_fp32 = torch.clamp(x, -448.0, 448.0).to(FP8).view(torch.uint8).tolist()
    assert spec != through_fp32


@pytest.mark.second_formulation("spec.ops.kv_storage:fp8_dequantize")
def test_fp8_dequantize_matches_bit_layout_table_for_all_256_codes():
    codes = torch.arange(256, dtype=torch.uint8).view(FP8)
    for dtype in (F64, F32, torch.float16, torch.bfloat16):
        spec = fp8_dequantize(codes, dtype).to(F64).tolist()
        for byte, (s, t) in enumerate(zip(spec, E4M3_TABLE)):
            assert (math.isnan(s) and math.isnan(t)) or (s == t and math.copysign(1, s) ==
                                                         math.copysign(1, t)), (dtype, byte, s, t)
    # Wrong variant: bias 8 instead of 7 halves every normal value.
    spec = fp8_dequantize(codes, F64).tolist()
    wrong = [v / 2 if (b >> 3) & 0xF else v for b, v in enumerate(E4M3_TABLE)]
    assert any(s != w for s, w in zip(spec, wrong) if not math.isnan(s))


# =====================================================================================================
# e2m1 and nibbles
# =====================================================================================================

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_nearest_code(v: float, ties: str = "even") -> int:
    """Brute-force e2m1 code: index of the nearest grid magnitude to min(|v|, 6), ties to the even
    index (the stated rule) or to the larger magnitude (``ties="up"``, wrong variant); bit 3 = v's
    sign bit; NaN -> 0. Neighbour distances are exact (Sterbenz, grid ratios <= 2)."""
    if math.isnan(v):
        return 0
    mag = min(abs(v), 6.0)
    dists = [abs(mag - g) for g in E2M1_VALUES]
    best = min(dists)
    tied = [i for i, d in enumerate(dists) if d == best]
    if ties == "even":
        code = next(i for i in tied if i % 2 == 0) if len(tied) > 1 else tied[0]
    else:
        code = max(tied)
    return code | 0x8 if math.copysign(1.0, v) < 0 else code


def _e2m1_inputs(seed: int, n: int = 2000) -> list[float]:
    g = _gen(seed)
    rand = ((torch.rand(n, generator=g, dtype=F64) - 0.5) * 16).tolist()
    mids = [(a + b) / 2 for a, b in zip(E2M1_VALUES, E2M1_VALUES[1:])]
    edge = list(E2M1_VALUES) + mids + [5.999, 6.001, 7.0, 100.0, math.inf, 0.2499, 0.2501]
    return rand + edge + [-v for v in edge] + [math.nan]


@pytest.mark.second_formulation("spec.ops.kv_storage:e2m1_encode")
def test_e2m1_encode_is_brute_force_nearest_ties_to_even():
    xs = _e2m1_inputs(seed=21)
    for dtype in (F32, F64):
        x = torch.tensor(xs, dtype=dtype)
        spec = e2m1_encode(x).tolist()
        vals = x.tolist()
        assert spec == [e2m1_nearest_code(v) for v in vals], dtype
        # Wrong variant: round half up (ties to the larger magnitude).
        assert spec != [e2m1_nearest_code(v, ties="up") for v in vals], dtype


@pytest.mark.second_formulation("spec.ops.kv_storage:e2m1_decode")
def test_e2m1_decode_is_signed_table_lookup():
    codes = torch.arange(16, dtype=torch.uint8)
    expected = [(-1.0 if c & 8 else 1.0) * E2M1_VALUES[c & 7] for c in range(16)]
    for dtype in (F32, F64, torch.bfloat16):
        spec = e2m1_decode(codes, dtype)
        assert _bits(spec) == _bits(torch.tensor(expected, dtype=dtype)), dtype
    # Wrong variant: sign ignored (code 8 would be +0.0, codes 9..15 positive).
    wrong = [E2M1_VALUES[c & 7] for c in range(16)]
    assert _bits(e2m1_decode(codes, F32)) != _bits(torch.tensor(wrong, dtype=F32))


@pytest.mark.second_formulation(
    "spec.ops.kv_storage:pack_nibbles", "spec.ops.kv_storage:unpack_nibbles")
def test_pack_and_unpack_nibbles_are_per_element_bit_arithmetic():
    g = _gen(31)
    codes = torch.randint(0, 16, (7, 5, 32), generator=g, dtype=torch.uint8)
    packed = pack_nibbles(codes)
    rows = codes.reshape(-1, 32).tolist()
    expected = [[row[2 * i] + 16 * row[2 * i + 1] for i in range(16)] for row in rows]
    assert packed.shape == (7, 5, 16)
    assert packed.reshape(-1, 16).tolist() == expected
    swapped = [[16 * row[2 * i] + row[2 * i + 1] for i in range(16)] for row in rows]
    assert packed.reshape(-1, 16).tolist() != swapped  # wrong variant: even element high

    raw = torch.randint(0, 256, (6, 24), generator=g, dtype=torch.uint8)
    unpacked = unpack_nibbles(raw).tolist()
    assert unpacked == [[f(b) for b in row for f in (lambda b: b % 16, lambda b: b // 16)]
                        for row in raw.tolist()]
    assert unpacked != [[f(b) for b in row for f in (lambda b: b // 16, lambda b: b % 16)]
                        for row in raw.tolist()]
    assert torch.equal(unpack_nibbles(packed), codes)


# =====================================================================================================
# nvfp4
# =====================================================================================================


def _e4m3_ceil_byte(v: float) -> int:
    """Wrong variant of the scale rule: the smallest e4m3 value >= v (round the scale up)."""
    for g, b in E4M3_POSITIVE:
        if g >= v:
            return b
    return 0x7E


def nvfp4_reference(xs: list[float], gs: float, fp32: bool, scale_rule: str = "nearest"
                    ) -> tuple[list[int], list[int]]:
    """Per 16-element block, Python floats: ``sf = e4m3(amax / (6 gs))`` (nearest even, saturating),
    ``code = e2m1(x / (sf gs))``, a block with sf == 0 all code 0. With ``fp32`` each of ``6 gs``,
    the quotient, ``sf gs`` and ``x / (sf gs)`` is rounded to fp32 once (a float64 quotient of two fp32
    values rounded to fp32 is the correctly rounded fp32 quotient, since 53 >= 2 * 24 + 2).
    Returns (codes per element, scale byte per block)."""
    rnd = _f32 if fp32 else (lambda v: v)
    codes, scales = [], []
    for start in range(0, len(xs), 16):
        block = xs[start:start + 16]
        amax = max(abs(v) for v in block)
        q = rnd(amax / rnd(6.0 * gs))
        sf_byte = e4m3_nearest_byte(q) if scale_rule == "nearest" else _e4m3_ceil_byte(q)
        sf = E4M3_TABLE[sf_byte]
        scales.append(sf_byte)
        if sf == 0:
            codes += [0] * 16
            continue
        denom = rnd(sf * gs)
        codes += [e2m1_nearest_code(rnd(v / denom)) for v in block]
    return codes, scales


def _nvfp4_inputs(seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [6, 128]: 48 blocks with per-block magnitudes over 2^-10 .. 2^10, one all-zero block, one
    block of tiny negatives (scale underflows to 0), one saturating block (amax / (6 gs) > 448) and one
    block whose scale is exactly 1 with e2m1 ties (gs = 1/8: amax 6/8 -> sf = 1)."""
    g = _gen(seed)
    x = torch.randn(6, 8, 16, generator=g, dtype=F64)
    x = x * 2.0 ** torch.randint(-10, 11, (6, 8, 1), generator=g).to(F64)
    gs = 2.0 ** -3
    x[0, 0] = 0.0
    x[0, 1] = -1e-9
    x[0, 2] = x[0, 2] * 1e4  # amax / (6 gs) far above 448
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0,
                         -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.1], dtype=F64)
    x[0, 3] = ties * gs
    return x.reshape(6, 128).to(dtype), torch.tensor(gs, dtype=F32)


@pytest.mark.second_formulation("spec.ops.kv_storage:nvfp4_quantize")
def test_nvfp4_quantize_matches_per_block_python_floats():
    for dtype, seed in ((F64, 41), (F32, 42)):
        x, gs = _nvfp4_inputs(seed, dtype)
        packed, sf = nvfp4_quantize(x, gs)
        spec_codes = unpack_nibbles(packed).flatten().tolist()
        spec_scales = sf.view(torch.uint8).flatten().tolist()
        codes, scales = nvfp4_reference(x.flatten().tolist(), gs.item(), fp32=dtype == F32)
        assert spec_scales == scales, dtype
        assert spec_codes == codes, dtype
        assert 0x7E in spec_scales and 0 in spec_scales  # saturated and dead blocks were exercised
        # Wrong variant: the scale rounded up to e4m3 (no element clipped) instead of to nearest.
        _, wrong = nvfp4_reference(x.flatten().tolist(), gs.item(), fp32=dtype == F32,
                                   scale_rule="ceil")
        assert spec_scales != wrong, dtype


@pytest.mark.second_formulation("spec.ops.kv_storage:nvfp4_dequantize")
def test_nvfp4_dequantize_is_code_times_scale_times_global_scale():
    x, gs = _nvfp4_inputs(43, F32)
    packed, sf = nvfp4_quantize(x, gs)
    g = gs.item()
    codes = [b % 16 if k == 0 else b // 16 for b in packed.flatten().tolist() for k in (0, 1)]
    scale_of = [E4M3_TABLE[b] for b in sf.view(torch.uint8).flatten().tolist()]
    exact = [(-1.0 if c & 8 else 1.0) * E2M1_VALUES[c & 7] * scale_of[i // 16] * g
             for i, c in enumerate(codes)]  # exact in float64: 2 + 4 + 24 significant bits
    for dtype in (F64, F32):
        spec = nvfp4_dequantize(packed, sf, gs, dtype)
        expected = torch.tensor(exact if dtype == F64 else [_f32(v) for v in exact], dtype=dtype)
        assert _bits(spec) == _bits(expected.reshape(spec.shape)), dtype
    # Wrong variant: the global scale left out.
    no_gs = torch.tensor([v / g for v in exact], dtype=F64)
    assert _bits(nvfp4_dequantize(packed, sf, gs, F64)) != _bits(no_gs.reshape(6, 128))


# =====================================================================================================
# QSA selection
# =====================================================================================================


def window_by_enumeration(t: int, sink: int, local: int, drop_sink: bool = False) -> set[int]:
    """Blocks 0 .. t // 32 that are a sink block (b < sink) or among the last ``local`` up to t's own."""
    own = t // 32
    return {b for b in range(own + 1) if (b < sink and not drop_sink) or own - b < local}


def complete_blocks_by_enumeration(t: int) -> int:
    """Count of blocks b whose last token 32(b + 1) - 1 is at or before t."""
    return sum(1 for b in range(t // 32 + 2) if 32 * (b + 1) - 1 <= t)


def selection_by_sorting(scores: list[float], t: int, k: int, sink: int, local: int,
                         variant: str = "") -> set[int]:
    """Window plus the first k candidates after sorting all complete non-window blocks by
    (score with NaN as -inf, block index), both descending. Variants (wrong on purpose):
    "drop_sink" leaves the sink block out; "ties_low" breaks score ties by the lower block index."""
    window = window_by_enumeration(t, sink, local, drop_sink=variant == "drop_sink")
    full_window = window_by_enumeration(t, sink, local)
    cands = [b for b in range(complete_blocks_by_enumeration(t)) if b not in full_window]
    key = {b: -math.inf if math.isnan(scores[b]) else scores[b] for b in cands}
    tie = (lambda b: -b) if variant == "ties_low" else (lambda b: b)
    ranked = sorted(cands, key=lambda b: (key[b], tie(b)), reverse=True)
    return window | set(ranked[:k])


def _qsa_cases(seed: int, n_rows: int = 300, n_cols: int = 40):
    """Scores drawn from a few values (many exact ties), with NaN, -inf and both zeros mixed in."""
    g = _gen(seed)
    palette = torch.tensor([-1.0, -0.0, 0.0, 0.5, 1.0, 2.0, math.nan, -math.inf], dtype=F32)
    idx = torch.randint(0, len(palette), (n_rows, n_cols), generator=g)
    scores = palette[idx]
    cont = torch.rand(n_rows, n_cols, generator=g) < 0.3  # some continuous scores too
    scores = torch.where(cont, torch.randn(n_rows, n_cols, generator=g), scores)
    positions = torch.randint(0, 32 * n_cols, (n_rows,), generator=g)
    positions[:8] = torch.tensor([0, 30, 31, 32, 63, 64, 95, 32 * n_cols - 1])
    return scores, positions


@pytest.mark.second_formulation("spec.ops.qsa:select_row")
def test_select_row_equals_selection_by_sorting():
    scores, positions = _qsa_cases(51)
    mismatches = {"drop_sink": 0, "ties_low": 0}
    for sink, local, k in ((1, 2, 4), (1, 2, 0), (2, 3, 7), (1, 2, 64), (0, 1, 3)):
        for row in range(scores.shape[0]):
            t = int(positions[row])
            s = scores[row].tolist()
            spec = select_row(scores[row], t, k, sink, local)
            assert spec == sorted(spec) and len(set(spec)) == len(spec)
            assert set(spec) == selection_by_sorting(s, t, k, sink, local), (row, t, k, sink, local)
            for variant in mismatches:
                mismatches[variant] += set(spec) != selection_by_sorting(s, t, k, sink, local, variant)
    assert all(n > 0 for n in mismatches.values()), mismatches


@pytest.mark.second_formulation("spec.ops.qsa:qsa_select")
def test_qsa_select_rows_are_the_sorted_sets_padded_with_minus_one():
    scores, positions = _qsa_cases(52, n_rows=120)
    k, sink, local = 5, 1, 2
    out = qsa_select(scores, positions, k, sink, local)
    assert out.shape == (120, k + sink + local) and out.dtype == torch.int64
    wrong_rows = 0
    for row, ids in enumerate(out.tolist()):
        chosen = [b for b in ids if b >= 0]
        assert ids == chosen + [-1] * (len(ids) - len(chosen)) and chosen == sorted(chosen)
        s, t = scores[row].tolist(), int(positions[row])
        assert set(chosen) == selection_by_sorting(s, t, k, sink, local), row
        wrong_rows += set(chosen) != selection_by_sorting(s, t, k, sink, local, "drop_sink")
    assert wrong_rows > 0


@pytest.mark.second_formulation("spec.ops.qsa:window_blocks", "spec.ops.qsa:num_complete_blocks")
def test_window_blocks_and_num_complete_blocks_equal_enumeration():
    wrong_window = wrong_count = 0
    for t in range(0, 32 * 12):
        assert num_complete_blocks(t) == complete_blocks_by_enumeration(t), t
        wrong_count += num_complete_blocks(t) != t // 32 + 1  # wrong variant: own block counted
        for sink, local in ((1, 2), (0, 1), (3, 2), (2, 5)):
            spec = window_blocks(t, sink, local)
            assert spec == sorted(window_by_enumeration(t, sink, local)), (t, sink, local)
            wrong_window += set(spec) != window_by_enumeration(t, sink, local, drop_sink=True)
    assert num_complete_blocks(31) == 1 and num_complete_blocks(30) == 0
    assert wrong_window > 0 and wrong_count > 0


# =====================================================================================================
# MoE
# =====================================================================================================


def route_by_sorting(x: list[float], w: list[list[float]], k: int, renormalise: bool = True,
                     ties: str = "low") -> dict[int, float]:
    """softmax(x . w_e) over experts in float64 (math.fsum, math.exp), all experts sorted by
    (-p, expert index), the first k kept, weights p / sum(p_selected). Returns {expert: weight}."""
    logits = [math.fsum(a * b for a, b in zip(x, row)) for row in w]
    top = max(logits)
    e = [math.exp(v - top) for v in logits]
    total = math.fsum(e)
    p = [v / total for v in e]
    order = sorted(range(len(p)), key=lambda i: (-p[i], i if ties == "low" else -i))[:k]
    norm = math.fsum(p[i] for i in order) if renormalise else 1.0
    return {i: p[i] / norm for i in order}


def _route_inputs(seed: int, dtype: torch.dtype):
    g = _gen(seed)
    x = torch.randn(48, 24, generator=g, dtype=F64)
    w = torch.randn(16, 24, generator=g, dtype=F64) * 0.5
    x[:3] = 0.0  # all probabilities equal: the tie rule decides every slot
    return x.to(dtype), w.to(dtype)


def _k_gap(x: list[float], w: list[list[float]], k: int) -> float:
    """Relative gap between the k-th and (k+1)-th largest float64 probability of one row."""
    p = sorted(route_by_sorting(x, w, len(w), renormalise=False).values(), reverse=True)
    return (p[k - 1] - p[k]) / p[k - 1]


@pytest.mark.second_formulation("spec.ops.moe:moe_route")
def test_moe_route_equals_sorted_float64_softmax_renormalised():
    for dtype, seed in ((F64, 61), (F32, 62)):
        x, w = _route_inputs(seed, dtype)
        # float64 mode: the spec and this formulation differ only in summation order (a few ulps of
        # logits of size ~10, amplified by exp to ~1e-14 relative); fp32 mode: the spec's softmax is
        # fp32, relative error ~ 1e-6. The tolerances leave a factor ~100 of headroom.
        rtol = 1e-12 if dtype == F64 else 2e-5
        for k in (1, 3, 8):
            ids, weights = moe_route(x, w, k)
            assert ids.dtype == torch.int64 and weights.dtype == dtype
            wl, unnormalised, ties_high = w.tolist(), 0, 0
            for row, xr in enumerate(x.tolist()):
                expected = route_by_sorting(xr, wl, k)
                spec = dict(zip(ids[row].tolist(), weights[row].tolist()))
                tied_row = row < 3
                # A continuous row whose k-th and (k+1)-th p lie within fp32 rounding could
                # legitimately rank differently in fp32 mode; none occur with these seeds.
                if dtype == F32 and not tied_row:
                    assert _k_gap(xr, wl, k) > 1e-5, (row, k)
                assert set(spec) == set(expected), (dtype, k, row)
                for e, v in expected.items():
                    assert math.isclose(spec[e], v, rel_tol=rtol, abs_tol=0.0), (dtype, k, row, e)
                unnormalised += any(not math.isclose(spec[e], v, rel_tol=rtol)
                                    for e, v in route_by_sorting(xr, wl, k, renormalise=False).items())
                ties_high += set(spec) != set(route_by_sorting(xr, wl, k, ties="high"))
            assert unnormalised > 0 and ties_high > 0, (dtype, k)


def shared_expert_formula(x: list[float], wg: list[list[float]], wu: list[list[float]],
                          wd: list[list[float]], wsg: list[float], swap: bool = False) -> list[float]:
    """``sigmoid(x . w_sg) * W_down (silu(W_gate x) * (W_up x))`` for one row, float64.
    ``swap`` (wrong variant) applies silu to the up projection instead of the gate."""
    def dot(a, b):
        return math.fsum(p * q for p, q in zip(a, b))

    def silu(v):
        return v / (1.0 + math.exp(-v))

    g = [dot(r, x) for r in wg]
    u = [dot(r, x) for r in wu]
    h = [silu(b) * a if swap else silu(a) * b for a, b in zip(g, u)]
    gate = 1.0 / (1.0 + math.exp(-dot(x, wsg)))
    return [gate * dot(r, h) for r in wd]


@pytest.mark.second_formulation("spec.ops.moe:moe_shared_expert")
def test_moe_shared_expert_equals_explicit_swiglu_in_float64():
    g = _gen(71)
    C, I = 32, 48
    x = torch.randn(10, C, generator=g, dtype=F64)
    wg = torch.randn(I, C, generator=g, dtype=F64) / math.sqrt(C)
    wu = torch.randn(I, C, generator=g, dtype=F64) / math.sqrt(C)
    wd = torch.randn(C, I, generator=g, dtype=F64) / math.sqrt(I)
    wsg = torch.randn(C, generator=g, dtype=F64) / math.sqrt(C)
    spec = moe_shared_expert(x, wg, wu, wd, wsg)
    args = (wg.tolist(), wu.tolist(), wd.tolist(), wsg.tolist())
    expected = torch.tensor([shared_expert_formula(r, *args) for r in x.tolist()], dtype=F64)
    wrong = torch.tensor([shared_expert_formula(r, *args, swap=True) for r in x.tolist()], dtype=F64)
    # Reference (float64) mode has no rounding points: the two differ only in summation order over
    # C = 32 / I = 48 terms of size O(1), i.e. ~1e-15 absolute; 1e-12 leaves ample headroom.
    torch.testing.assert_close(spec, expected, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(spec, wrong, rtol=1e-3, atol=1e-3)


# =====================================================================================================
# PLE n-gram hash
# =====================================================================================================


def hash_u64(window: list[int], multipliers: list[int], combine: str = "xor") -> int:
    """``XOR_k ((w_k mod 2^64) * m_k mod 2^64)`` with Python integers; w_k are int64 bit patterns.
    ``combine="add"`` (wrong variant) sums the terms mod 2^64 instead."""
    h = 0
    for w, m in zip(window, multipliers):
        term = ((w & U64) * m) & U64
        h = h ^ term if combine == "xor" else (h + term) & U64
    return h


def _u64_from_limbs(limbs: list[int]) -> int:
    return sum((limb & 0xFFFF) << (16 * k) for k, limb in enumerate(limbs))


@pytest.mark.second_formulation("spec.ops.ple:ngram_hash_u64")
def test_ngram_hash_u64_equals_python_integer_arithmetic():
    g = _gen(81)
    ids = torch.randint(0, 2 ** 31, (200, 3), generator=g, dtype=torch.int64)
    ids[:4] = torch.tensor([[0, 0, 0], [2 ** 62, 2 ** 63 - 1, 1], [-1, -2 ** 63, 7], [1, 2, 3]])
    draws = torch.randint(0, 2 ** 32, (2, 3, 2), generator=g, dtype=torch.int64).tolist()
    for n in (2, 3):
        for head in draws:
            mults = [((hi << 32) | lo) | 1 for hi, lo in head[:n]]  # odd 64-bit multipliers
            spec = ngram_hash_u64(ids, tuple(mults))
            assert spec.shape == (200, 4)
            got = [_u64_from_limbs(r) for r in spec.tolist()]
            assert all(0 <= limb < 2 ** 16 for r in spec.tolist() for limb in r)
            windows = ids.tolist()
            assert got == [hash_u64(w[:n], mults) for w in windows], (n, mults)
            assert got != [hash_u64(w[:n], mults, combine="add") for w in windows]
