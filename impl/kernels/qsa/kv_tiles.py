"""Reading K/V tiles of the paged QSA cache in Triton: bf16, fp8 (e4m3) and nvfp4 pools, dequantised
in-kernel to exactly the bf16 values spec/ops/kv_storage.py's loads produce.

Formats (spec/ops/kv_storage.py, MATH.md "KV storage"):
- bf16: one pool [P, 32, n_kv, D] bf16, read as is.
- fp8: one pool [P, 32, n_kv, D] e4m3, passed as its uint8 bytes; e4m3 -> bf16 is exact.
- nvfp4: pools (uint8 codes [P, 32, n_kv, D/2], even element in the low nibble; e4m3 scales
  [P, 32, n_kv, D/16]) and the fp32 global scale gs: value = (code * sf) * gs rounded to fp32, then
  to bf16 (``round_to_bf16``: the same rounding on the interpreter and the GPU).

Both decoders build the value from its bits through fp16 (whose subnormals cover e4m3's and e2m1's),
then scale by a power of two: exact integer work, no lookup table, no fp8 conversion instruction (the
interpreter has none), and the same on every stack.
"""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import functools

import torch
import triton
import triton.language as tl

from impl.kernels.triton_support import round_to_bf16
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
def load_kv_tile(pool, pool_sf, gs_ptr, slot, valid, FMT: tl.constexpr, D: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """The bf16 tile [BLOCK_N, D] of slots ``slot`` (int64 [BLOCK_N]: (page * 32 + offset) * n_kv +
    kv head); rows where ``valid`` is False read nothing and hold zeros."""
    if FMT == 0:
        d = tl.arange(0, D)
        t = tl.load(pool + slot[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
        return t.to(tl.bfloat16)
    elif FMT == 1:
        d = tl.arange(0, D)
        c = tl.load(pool + slot[:, None] * D + d[None, :], mask=valid[:, None], other=0)
        return e4m3_to_f32(c).to(tl.bfloat16)  # exact: e4m3 values are bf16 values
    else:
        j = tl.arange(0, D // 2)
        packed = tl.load(pool + slot[:, None] * (D // 2) + j[None, :], mask=valid[:, None], other=0)
        # element 2j is the low nibble, 2j + 1 the high one: join on a last axis of 2, flatten
        codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_N, D))
        b = tl.arange(0, D // 16)
        sf = tl.load(pool_sf + slot[:, None] * (D // 16) + b[None, :], mask=valid[:, None], other=0)
        sfx = tl.reshape(tl.broadcast_to(e4m3_to_f32(sf)[:, :, None], (BLOCK_N, D // 16, 16)),
                         (BLOCK_N, D))
        # (code * sf) is exact in fp32; the product with gs rounds once in fp32, then to bf16.
        return round_to_bf16((e2m1_to_f32(codes) * sfx) * tl.load(gs_ptr)).to(tl.bfloat16)


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
