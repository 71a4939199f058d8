"""The MoE kernels' nvfp4 quantizer (impl/kernels/moe/triton_moe.py ``nvfp4_values``) against the
spec's (spec.ops.kv_storage.nvfp4_quantize, then ``code * sf`` with the global scale left out): bit
for bit, on the CPU through Triton's interpreter, on random rows and on the rounding's edges (ties of
both roundings, subnormal and saturating block scales, zero, NaN and infinite blocks, signed zeros).

The moe cells certify the kernels that call it to a band; a quantizer one code off inside that band
would still pass them, so its exactness is checked here on its own."""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import pytest
import torch
import triton
import triton.language as tl

from impl.kernels.moe import triton_moe
from spec.ops.kv_storage import nvfp4_dequantize, nvfp4_global_scale, nvfp4_quantize


def _spec_values(x: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    packed, sf = nvfp4_quantize(x, gs)
    return nvfp4_dequantize(packed, sf, torch.ones((), dtype=torch.float32), torch.float32)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.float().view(torch.int32), b.float().view(torch.int32))


def _edge_rows(gs: float) -> torch.Tensor:
    """Blocks of 16 whose scale or codes land on a rounding edge under global scale ``gs``."""
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    blocks = []
    # the block scale exactly 1 (amax 6 gs): every e2m1 midpoint and its neighbours, both signs
    elems = [6.0] + mids + [-m for m in mids] + [-0.0]
    blocks.append([e * gs for e in elems])
    # amax / (6 gs) on an e4m3 tie (1.0625 between 1 and 1.125; 1.1875 between 1.125 and 1.25)
    for v in (1.0625, 1.1875, 3.5 * 2 ** -9, 2.5 * 2 ** -9, 0.5 * 2 ** -9, 2 ** -6 - 2 ** -11):
        blocks.append([6.0 * v * gs] + [(-1) ** i * i * 0.37 * v * gs for i in range(15)])
    blocks.append([0.0] * 15 + [-0.0])                      # a zero block: scale 0, all code 0
    blocks.append([1e30 * gs] + [1.0 * gs] * 15)            # saturating scale (448)
    blocks.append([float("inf")] + [2.0 * gs] * 15)         # infinite element: scale 448, code 6
    blocks.append([float("nan")] + [2.0 * gs] * 15)         # NaN element: NaN scale, the block NaN
    blocks.append([1e-40] * 8 + [-1e-40] * 8)               # fp32 subnormal inputs
    rows = torch.tensor(blocks, dtype=torch.float32).reshape(-1)
    pad = (-rows.numel()) % 64
    return torch.cat([rows, torch.zeros(pad)]).reshape(-1, 64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale", [2.0 ** -12, 0.37, 3.0])
def test_the_quantizer_matches_the_spec_bit_for_bit(dtype, scale):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(37, 96, generator=gen) * scale
    x[3] *= 1e-5   # blocks whose scales are e4m3 subnormals
    x[5] *= 1e4    # blocks that saturate at 448
    x = x.to(dtype)
    gs = nvfp4_global_scale(torch.tensor(4.0 * scale))
    got = triton_moe.quantized_values(x, gs)
    assert got.dtype == torch.float16
    assert _same_bits(got, _spec_values(x, gs).to(torch.float16))


@pytest.mark.parametrize("gs", [1.0, 2.0 ** -10, 0.0123])
def test_the_quantizer_matches_the_spec_on_the_rounding_edges(gs):
    x = _edge_rows(gs)
    g = torch.tensor(gs, dtype=torch.float32)
    got = triton_moe.quantized_values(x, g).float()
    want = _spec_values(x, g)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert _same_bits(got[~nan], want[~nan])


def test_the_edge_rows_tell_a_ties_up_rounding_apart():
    """A quantizer that resolves ties upwards (as ``bits + 0x80000`` would) instead of to even gives
    other bits on these rows: the edge test above can fail."""
    x = _edge_rows(1.0)
    g = torch.tensor(1.0)
    want = _spec_values(x, g)
    nan = torch.isnan(want)
    ties_up = _spec_values(x * (1 + 2 ** -20), g)   # every tie resolved upwards, the rest alike
    got = triton_moe.quantized_values(x, g).float()
    assert _same_bits(got[~nan], want[~nan])
    assert not _same_bits(ties_up[~nan], want[~nan])   # the edges do tell the two apart


def test_widths_off_the_block_are_refused():
    with pytest.raises(ValueError, match="multiple of 16"):
        triton_moe.quantized_values(torch.ones(2, 24), torch.tensor(1.0))


@triton.jit
def _decode_tiles(packed, sf, out, R, K: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    mask = rows < R
    w = triton_moe._weight_tile(packed, sf, rows.to(tl.int64), mask, 0, K, BN, K)
    at = rows[:, None] * K + tl.arange(0, K)[None, :]
    tl.store(out + at, w.to(tl.float32), mask=mask[:, None])


# Triton's mode decides the decoder under test: the interpreter's integer decode on the CPU, the
# byte-permutation decoder and the hardware e4m3 conversion where the kernels compile (the GPU).
DEVICE = "cpu" if triton_moe.INTERPRETING else "cuda"


@pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a GPU")
def test_the_weight_decode_matches_the_spec_for_every_code_byte_and_block_scale():
    """The GEMMs' operand decode (``_weight_tile``) against the spec's dequantization with the global
    scale 1, bit for bit and in K order: every packed byte (both nibbles, both signs, signed zeros)
    under every finite e4m3 block scale."""
    K = 16
    scales = torch.arange(0, 0x7F, dtype=torch.uint8)                # 0x7F is e4m3fn's NaN
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(-1, K // 2)   # 32 rows
    packed = codes.repeat(scales.numel(), 1).contiguous()            # [127 * 32, 8]
    sf = scales.repeat_interleave(codes.shape[0]).reshape(-1, 1).contiguous()
    R = packed.shape[0]
    out = torch.full((R, K), float("nan"), device=DEVICE)
    _decode_tiles[(triton.cdiv(R, 64),)](packed.to(DEVICE), sf.to(DEVICE), out, R, K=K, BN=64)
    want = nvfp4_dequantize(packed, sf.view(torch.float8_e4m3fn), torch.ones(()), torch.float32)
    assert _same_bits(out.cpu(), want)
