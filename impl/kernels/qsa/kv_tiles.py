"""Reading K/V tiles of the paged QSA cache in Triton: bf16, fp8 (e4m3) and nvfp4 pools.

Formats (spec/ops/kv_storage.py; docs/spec.md, "KV storage"):
- bf16: one pool [P, 32, n_kv, D] bf16, read as is (``load_kv_tile_bf16``), for bf16 dots.
- fp8: one pool [P, 32, n_kv, D] e4m3, passed as its uint8 bytes.
- nvfp4: pools (uint8 codes [P, 32, n_kv, D/2], even element in the low nibble; e4m3 scales
  [P, 32, n_kv, D/16]) and the fp32 global scale gs.

The narrow formats are read as exact fp16 values for fp16 dots (``load_kv_tile_f16``): an e4m3 value
is an fp16 value, and so is code * sf of nvfp4 (at most 6 significant bits, between 2^-10 and 2688);
nvfp4's gs is left to the caller, which applies it to the logits and to the output in fp32. So an
nvfp4 element enters the attention as the exact code * sf, without the spec's rounding of each
element (code * sf) * gs to fp32 and bf16: the kernels are closer to the float64 reference than the
spec's own low-precision path (the bands of certify/cells/qsa_sparse_gqa.yaml say what each path is
certified to), and the decode step is faster for it (reports/bench/gpu-notes.md, "Sparse GQA
decode").
fp16 rather than bf16 because each conversion instruction costs several bytes' worth of memory time
on sm_90: e4m3 -> fp16 is one hardware conversion for two elements, while e4m3 ->
bf16 needs three.

On the GPU (``HW``): e4m3 through the hardware conversion (``tl.float8e4nv``); e2m1 through a byte
permutation (``prmt``) that looks the fp16 high byte of each of 4 magnitudes up in an 8-entry table,
sign bits moved by a second permutation, and one packed fp16 multiply by the block scale (exact).
In the interpreter, which has neither, the same values are built from their bits
(``e4m3_to_f32``, ``e2m1_to_f32``): integer work and exact fp32 products, the same on every stack.
"""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import functools

import torch
import triton
import triton.language as tl

from spec.ops.kv_storage import FP8_DTYPE, NVFP4_BLOCK, fp8_load, nvfp4_load

FMT_BF16, FMT_FP8, FMT_NVFP4 = 0, 1, 2


@triton.jit
def e4m3_to_f32(code):
    """e4m3fn bytes (uint8) -> fp32 values, exactly; 0x7F / 0xFF (the NaN patterns) -> NaN.

    Sign to bit 15, exponent and mantissa to bits 7..14 of an fp16: its exponent field then holds
    e4m3's (bias 7 instead of 15) and its subnormals e4m3's subnormals, so a factor 2^8 finishes it.
    """
    x = code.to(tl.uint16)
    h = ((x & 0x80) << 8) | ((x & 0x7F) << 7)
    v = h.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return tl.where((x & 0x7F) == 0x7F, float("nan"), v)


@triton.jit
def e2m1_to_f32(nib):
    """e2m1 codes (0..15, bit 3 the sign) -> fp32 values {0, 0.5, ..., 6} with sign, exactly.

    Same trick as ``e4m3_to_f32``: exponent and mantissa to bits 9..11 of an fp16, times 2^14.
    """
    x = nib.to(tl.uint16)
    h = ((x & 0x8) << 12) | ((x & 0x7) << 9)
    return h.to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def load_kv_tile_bf16(pool, slot, valid, D: tl.constexpr):
    """The bf16 tile [BLOCK_N, D] of a bf16 pool at slots ``slot`` (int64 [BLOCK_N]: (page * 32 +
    offset) * n_kv + kv head); rows where ``valid`` is False read nothing and hold zeros."""
    d = tl.arange(0, D)
    return tl.load(pool + slot[:, None] * D + d[None, :], mask=valid[:, None], other=0.0).to(tl.bfloat16)


# The fp16 bits of the e2m1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 are 0x0000, 0x3800 ... 0x4600,
# each with a zero low byte: their high bytes, in order, are the 8-byte table
# {0x3E3C3800, 0x46444240} that ``prmt`` indexes with a nibble. $4 holds 4 packed bytes (8 codes:
# byte i = hi_i << 4 | lo_i); $5 / $6 the fp16 block scales of bytes 0-1 / 2-3; $0 / $1 the fp16
# values lo_0 lo_1 / lo_2 lo_3 (even elements),
# $2 / $3 hi_0 hi_1 / hi_2 hi_3 (odd elements). Per 2 bytes: mask the sign bits off (the nibbles of
# the low half-word are then the selector), look the 4 high bytes up, spread them into two fp16x2
# words (low bytes zero), take each sign from bit 7 of a byte of (w << 4) (low nibbles) or of w (high
# nibbles) with prmt's sign-replicating mode, merge it (lop3 0xF8: a | (b & c)), multiply by the scale
# (code * sf is exact in fp16).
E2M1_TIMES_SF_ASM = tl.constexpr("""{
.reg .b32 x, s, t, v, g;
shl.b32 x, $4, 4;
and.b32 s, $4, 0x7777;
prmt.b32 t, 0x3E3C3800, 0x46444240, s;
prmt.b32 v, t, 0, 0x2404;
prmt.b32 g, x, $4, 0x9988;
lop3.b32 v, v, g, 0x80008000, 0xF8;
mul.rn.f16x2 $0, v, $5;
prmt.b32 v, t, 0, 0x3414;
prmt.b32 g, x, $4, 0xDDCC;
lop3.b32 v, v, g, 0x80008000, 0xF8;
mul.rn.f16x2 $2, v, $5;
shr.b32 s, $4, 16;
and.b32 s, s, 0x7777;
prmt.b32 t, 0x3E3C3800, 0x46444240, s;
prmt.b32 v, t, 0, 0x2404;
prmt.b32 g, x, $4, 0xBBAA;
lop3.b32 v, v, g, 0x80008000, 0xF8;
mul.rn.f16x2 $1, v, $6;
prmt.b32 v, t, 0, 0x3414;
prmt.b32 g, x, $4, 0xFFEE;
lop3.b32 v, v, g, 0x80008000, 0xF8;
mul.rn.f16x2 $3, v, $6;
}""")


@triton.jit
def load_kv_tile_f16(pool, pool_sf, slot, valid, FMT: tl.constexpr, D: tl.constexpr,
                     BLOCK_N: tl.constexpr, HW: tl.constexpr):
    """The fp16 tile [BLOCK_N, D] of an fp8 (FMT 1) or nvfp4 (FMT 2) pool, exactly: the e4m3 value, or
    code * sf (nvfp4's gs is the caller's). Slots and ``valid`` as ``load_kv_tile_bf16``. ``HW``: the
    GPU's conversion instructions; otherwise the bit decoders (the interpreter)."""
    if FMT == 1:
        d = tl.arange(0, D)
        c = tl.load(pool + slot[:, None] * D + d[None, :], mask=valid[:, None], other=0)
        if HW:
            return c.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        else:
            return e4m3_to_f32(c).to(tl.float16)
    else:
        # [N, D/16, 8] bytes: the 8 bytes of one 16-element scale block on the last axis, so the
        # block's scale broadcasts along it. Loaded as a 2-D [N, D/2] tile and reshaped: a 3-D load
        # puts the lanes along the tokens, and the decoded tile then reaches shared memory one fp16
        # at a time (token-major); the 2-D load's layout is d-major, stored in vectors and read back
        # by ldmatrix (the decode step's times: reports/bench/gpu-notes.md, "Sparse GQA decode")
        gi = tl.arange(0, D // 16)
        b = tl.arange(0, D // 2)
        packed = tl.load(pool + slot[:, None] * (D // 2) + b[None, :], mask=valid[:, None], other=0)
        packed = tl.reshape(packed, (BLOCK_N, D // 16, 8))
        sf = tl.load(pool_sf + slot[:, None] * (D // 16) + gi[None, :], mask=valid[:, None], other=0)
        if HW:
            sf16 = tl.broadcast_to(sf.to(tl.float8e4nv, bitcast=True).to(tl.float16)[:, :, None],
                                   (BLOCK_N, D // 16, 8))
            lo, hi = tl.inline_asm_elementwise(E2M1_TIMES_SF_ASM, "=r,=r,=r,=r,r,r,r", [packed, sf16],
                                               dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
        else:
            sfx = e4m3_to_f32(sf)[:, :, None]
            lo = (e2m1_to_f32(packed & 0xF) * sfx).to(tl.float16)  # exact: <= 6 significant bits
            hi = (e2m1_to_f32(packed >> 4) * sfx).to(tl.float16)
        # element 2j is the low nibble, 2j + 1 the high one: join on a last axis of 2, flatten
        return tl.reshape(tl.join(lo, hi), (BLOCK_N, D))


@triton.jit
def slots_of(tok, seq, block_table, table_w, h, HKV: tl.constexpr, valid):
    """The spec's ``slot_of`` for a tile of token positions of one sequence: page =
    block_table[seq, tok // 32], offset tok % 32, plus the KV head. Returns (slot int64, valid):
    padding (-1), a block beyond the table or an unassigned page read nothing (the spec raises on
    the last two; the engine never builds them)."""
    blk = tl.where(valid, tok // 32, 0)
    valid = valid & (blk < table_w)
    page = tl.load(block_table + seq * table_w + blk, mask=valid, other=-1).to(tl.int64)
    valid = valid & (page >= 0)
    slot = (page * 32 + tok % 32) * HKV + h
    return tl.where(valid, slot, 0), valid


class KvFormat:
    """One cache's pools as kernel arguments: (pool, scale pool, global-scale pointer, FMT)."""

    def __init__(self, cache, load, n_kv: int, head_dim: int):
        pools = (cache,) if isinstance(cache, torch.Tensor) else tuple(cache)
        for p in pools:
            if not p.is_contiguous():
                raise ValueError("KV pools must be contiguous")
        fn = load.func if isinstance(load, functools.partial) else load
        if len(pools) == 1 and pools[0].dtype == torch.bfloat16 and load is None:
            self.fmt, self.pool, self.sf = FMT_BF16, pools[0], pools[0]
            self.gs = torch.ones(1, dtype=torch.float32, device=pools[0].device)
        elif len(pools) == 1 and pools[0].dtype == FP8_DTYPE and (load is None or fn is fp8_load):
            # load None is the spec's default, the cast, which for e4m3 is fp8_dequantize
            self.fmt, self.pool = FMT_FP8, pools[0].view(torch.uint8)
            self.sf = self.pool
            self.gs = torch.ones(1, dtype=torch.float32, device=pools[0].device)
        elif len(pools) == 2 and fn is nvfp4_load and pools[0].dtype == torch.uint8 \
                and pools[1].dtype == FP8_DTYPE:
            gs = load.keywords["gs"]
            if head_dim % NVFP4_BLOCK:
                raise ValueError("nvfp4 needs head_dim to be a multiple of 16")
            self.fmt, self.pool, self.sf = FMT_NVFP4, pools[0], pools[1].view(torch.uint8)
            self.gs = gs.reshape(1).to(device=pools[0].device, dtype=torch.float32)
        else:
            raise ValueError("unsupported KV cache / load: expected a bf16 pool (load None), an e4m3 "
                             "pool (fp8_load) or nvfp4 pools (partial(nvfp4_load, gs=...))")
        width = head_dim // 2 if self.fmt == FMT_NVFP4 else head_dim
        if tuple(self.pool.shape[1:]) != (32, n_kv, width):
            raise ValueError(f"pool shape {tuple(self.pool.shape)} does not fit [P, 32, {n_kv}, "
                             f"{width}]")

    def args(self) -> tuple:
        return self.pool, self.sf, self.gs
