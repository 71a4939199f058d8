"""Triton QSA KV append (spec/ops/qsa.py:qsa_kv_append; docs/spec.md, "QSA" item 1) in bf16, fp8 and
nvfp4.

One program per (tile of ``BLOCK_T`` new tokens, KV head) writes K and V of its tokens into their paged
slots: page = ``block_table[seq, pos // 32]``, offset = ``pos % 32``, read in the kernel so the host
never synchronises. The head-0 program also writes the token's position into the position plane.

Storage (spec/ops/kv_storage.py), every rounding done with integer arithmetic on fp32 bits so the
compiled kernel and Triton's interpreter produce the same bytes as the spec's quantisers:
- bf16: the bf16 bits are copied (the spec's store is a cast bf16 -> bf16, the identity).
- fp8: ``e4m3(clamp(x, -448, 448))`` nearest-even from the exact value (``_e4m3_code``); NaN -> 0x7F.
- nvfp4: per 16-element block ``sf = e4m3(amax / (6 gs))`` and ``code = e2m1(x / (sf gs))``, with the
  spec's fp32 rounding points (``6 * gs``, the quotient, ``sf * gs``, ``x / (sf gs)``, each rounded once:
  IEEE ``div_rn``, never Triton's approximate ``/``); a NaN element makes the scale 0x7F and the block's
  codes 0; ``sf == 0`` gives code 0. Two codes a byte, the even element in the low nibble.

``kv_append`` is the engine-shaped entry point (pools updated in place, explicit format and global
scales); ``qsa_kv_append`` is the certification convention (poisoned whole-pool outputs) and reads the
format from the storage seam the spec takes (``store`` / ``store_v``, see ``seam_format``).
"""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import functools
from typing import Literal

import torch
import triton
import triton.language as tl

from impl.kernels.triton_support import INTERPRETING
from spec.ops.kv_storage import FP8_DTYPE, NVFP4_BLOCK, nvfp4_quantize

TPB = 32  # tokens per block == page size (spec/ops/qsa.py:TOKENS_PER_BLOCK)
KIND_BF16, KIND_FP8, KIND_NVFP4 = 0, 1, 2
KvFormat = Literal["bf16", "fp8", "nvfp4"]
_KINDS = {"bf16": KIND_BF16, "fp8": KIND_FP8, "nvfp4": KIND_NVFP4}


@triton.jit
def _e4m3_code(a):
    """|value| given as non-negative fp32 bits (int32) -> its e4m3fn byte magnitude (int32 0..0x7F).

    Saturating (anything above 448, inf included, is 448 = 0x7E), nearest-even, NaN -> 0x7F.
    Normals (exponent >= -6): round the 23-bit mantissa to 3 bits on the bits (a carry moves into the
    exponent, as it should) and rebias 127 -> 7. Subnormals: the quantum is 2^-9, so the code is the
    24-bit significand shifted right by (14 - exponent), rounded half to even on the shifted-out bits.
    """
    exp = (a >> 23) - 127
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    sig = (a & 0x7FFFFF) | 0x800000
    shift = tl.minimum(14 - exp, 30)  # >= 21 on this branch; past 25 everything rounds to 0
    shift = tl.maximum(shift, 1)       # keeps the (unused) normal lanes' shifts in range
    q = sig >> shift
    rem = sig & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    sub = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    code = tl.where(exp >= -6, normal, sub)
    code = tl.where(a > 0x43E00000, 0x7E, code)  # 0x43E00000 = 448.0; inf saturates too
    return tl.where(a > 0x7F800000, 0x7F, code)  # NaN


@triton.jit
def _e4m3_value(code):
    """e4m3fn byte magnitude (int32, not NaN) -> its exact fp32 value."""
    e = (code >> 3) & 0xF
    m = code & 0x7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    return tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2^-9


@triton.jit
def _e2m1_code(mag):
    """|y| (fp32) -> e2m1 magnitude code 0..7, nearest with ties to the even code (the spec's
    threshold counting over the grid's midpoints; above 6 saturates, NaN gives 0)."""
    c = (mag > 0.25).to(tl.int32)
    c += ((mag > 0.75) | (mag == 0.75)).to(tl.int32)
    c += (mag > 1.25).to(tl.int32)
    c += ((mag > 1.75) | (mag == 1.75)).to(tl.int32)
    c += (mag > 2.5).to(tl.int32)
    c += ((mag > 3.5) | (mag == 3.5)).to(tl.int32)
    c += (mag > 5.0).to(tl.int32)
    return c


@triton.jit
def _slots(block_table, seq_ids, positions, tok, tmask, table_w):
    """(slot index page * 32 + offset as int64, position) of tokens ``tok``."""
    seq = tl.load(seq_ids + tok, mask=tmask, other=0).to(tl.int64)
    pos = tl.load(positions + tok, mask=tmask, other=0)
    page = tl.load(block_table + seq * table_w + (pos // 32).to(tl.int64), mask=tmask, other=0)
    return page.to(tl.int64) * 32 + (pos % 32).to(tl.int64), pos


@triton.jit
def _store_rows(x, pool, scale_pool, slot, tmask, gs, h, NKV: tl.constexpr, D: tl.constexpr,
                KIND: tl.constexpr, BLOCK_T: tl.constexpr):
    """Rows x (bf16 bits as int16, [N, NKV, D]) of tokens in ``slot`` -> pool(s), head h."""
    t = tl.arange(0, BLOCK_T)
    src_row = (tl.program_id(0).to(tl.int64) * BLOCK_T + t) * NKV + h   # [T] int64
    dst_row = slot * NKV + h                                           # [T] int64
    if KIND == 0:  # bf16: copy the bits
        d = tl.arange(0, D)
        m = tmask[:, None]
        v = tl.load(x + src_row[:, None] * D + d[None, :], mask=m, other=0)
        tl.store(pool + dst_row[:, None] * D + d[None, :], v, mask=m)
    elif KIND == 1:  # fp8 e4m3, one byte an element
        d = tl.arange(0, D)
        m = tmask[:, None]
        bits = (tl.load(x + src_row[:, None] * D + d[None, :], mask=m, other=0).to(tl.int32)
                & 0xFFFF) << 16
        code = _e4m3_code(bits & 0x7FFFFFFF)
        code = tl.where(code == 0x7F, code, code | ((bits >> 24) & 0x80))  # sign; NaN unsigned
        tl.store(pool + dst_row[:, None] * D + d[None, :], code.to(tl.uint8), mask=m)
    else:  # nvfp4: [T, D/16 blocks, 8 pairs]; even element low nibble, odd element high nibble
        b = tl.arange(0, D // 16)
        j = tl.arange(0, 8)
        m = tmask[:, None, None]
        col = b[None, :, None] * 16 + 2 * j[None, None, :]
        base = src_row[:, None, None] * D + col
        be = (tl.load(x + base, mask=m, other=0).to(tl.int32) & 0xFFFF) << 16
        bo = (tl.load(x + base + 1, mask=m, other=0).to(tl.int32) & 0xFFFF) << 16
        ae, ao = be & 0x7FFFFFFF, bo & 0x7FFFFFFF
        # amax on the bits: for non-negative floats the integer order is the value order, and a
        # NaN's bits exceed inf's, so a NaN element makes the block's amax NaN (the spec's rule).
        amax_bits = tl.max(tl.maximum(ae, ao), axis=2)                  # [T, NB]
        amax = amax_bits.to(tl.float32, bitcast=True)
        sf_code = _e4m3_code(tl.math.div_rn(amax, 6.0 * gs).to(tl.int32, bitcast=True))
        sf_code = tl.where(amax_bits > 0x7F800000, 0x7F, sf_code)
        dead = ((sf_code == 0) | (sf_code == 0x7F))[:, :, None]
        # a dead block's codes are 0 whatever the quotient: divide by 1 there, not by 0 or NaN
        denom = tl.where(dead, 1.0, (_e4m3_value(sf_code) * gs)[:, :, None])
        ce = _e2m1_code(tl.math.div_rn(ae.to(tl.float32, bitcast=True), denom))
        co = _e2m1_code(tl.math.div_rn(ao.to(tl.float32, bitcast=True), denom))
        ce = tl.where(dead, 0, ce | ((be >> 28) & 0x8))   # the sign bit of x is the sign of x / d
        co = tl.where(dead, 0, co | ((bo >> 28) & 0x8))
        packed = (ce | (co << 4)).to(tl.uint8)
        tl.store(pool + dst_row[:, None, None] * (D // 2) + b[None, :, None] * 8 + j[None, None, :],
                 packed, mask=m)
        tl.store(scale_pool + dst_row[:, None] * (D // 16) + b[None, :], sf_code.to(tl.uint8),
                 mask=tmask[:, None])


@triton.jit
def _kv_append_kernel(k, v, k_pool, k_scales, v_pool, v_scales, pos_plane, block_table, seq_ids,
                      positions, k_gs, v_gs, n_tokens, table_w, NKV: tl.constexpr,
                      D: tl.constexpr, KIND: tl.constexpr, BLOCK_T: tl.constexpr):
    h = tl.program_id(1)
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = tok < n_tokens
    slot, pos = _slots(block_table, seq_ids, positions, tok, tmask, table_w)
    _store_rows(k, k_pool, k_scales, slot, tmask, k_gs, h, NKV, D, KIND, BLOCK_T)
    _store_rows(v, v_pool, v_scales, slot, tmask, v_gs, h, NKV, D, KIND, BLOCK_T)
    if h == 0:  # one program per token tile writes the positions
        tl.store(pos_plane + slot, pos, mask=tmask)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A pool's storage as raw integers: Triton writes bytes / bf16 bits, never float conversions."""
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16)


def kv_append(k_pools: tuple[torch.Tensor, ...], v_pools: tuple[torch.Tensor, ...],
              pos_plane: torch.Tensor, block_table: torch.Tensor, seq_ids: torch.Tensor,
              positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_format: KvFormat,
              k_gs: float = 1.0, v_gs: float = 1.0, block_t: int | None = None) -> None:
    """Write k, v [N, n_kv, D] (bf16) of N new tokens into their slots, in place.

    Pools as the spec lays them out: bf16 ``([P, 32, n_kv, D] bf16,)``, fp8 ``([P, 32, n_kv, D] e4m3,)``,
    nvfp4 ``([P, 32, n_kv, D/2] uint8 codes, [P, 32, n_kv, D/16] e4m3 scales)``; k_gs / v_gs are nvfp4's
    global scales (fp32 numbers). Preconditions the engine guarantees (the spec checks them): every
    token's block has a page, and no two tokens share a slot.
    """
    n, nkv, d = k.shape
    if k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16:
        raise ValueError("the Triton append takes bf16 k / v rows")
    if d & (d - 1) or d < 16:
        raise ValueError(f"head_dim must be a power of two >= 16, got {d}")
    kind = _KINDS[kv_format]
    if n == 0:
        return
    # Tokens a program: 16 keeps a GPU program's registers small; the interpreter's cost is per
    # operation, not per element, so it takes large tiles (the bytes written are the same).
    block_t = block_t or (256 if INTERPRETING else 16)
    kc, vc = k.contiguous().view(torch.int16), v.contiguous().view(torch.int16)
    kp, vp = _bytes(k_pools[0]), _bytes(v_pools[0])
    ks = _bytes(k_pools[1]) if kind == KIND_NVFP4 else kp
    vs = _bytes(v_pools[1]) if kind == KIND_NVFP4 else vp
    grid = (triton.cdiv(n, block_t), nkv)
    _kv_append_kernel[grid](kc, vc, kp, ks, vp, vs, pos_plane, block_table.contiguous(),
                            seq_ids.contiguous(), positions.contiguous(), float(k_gs), float(v_gs),
                            n, block_table.shape[1], NKV=nkv, D=d, KIND=kind, BLOCK_T=block_t,
                            num_warps=4)


def seam_format(pools: tuple[torch.Tensor, ...], store) -> tuple[KvFormat, float]:
    """The storage format (and nvfp4 global scale) that the spec's storage seam describes.

    bf16: one bf16 pool and the default store (a cast). fp8: one e4m3 pool (the only format of
    spec/ops/kv_storage.py with that layout). nvfp4: (uint8 codes, e4m3 scales) and a store that is
    ``functools.partial(nvfp4_quantize, gs=...)``: the global scale is read from the partial, the one
    form of the seam that exposes it (a closure would hide it, so it is refused, not guessed).
    """
    if len(pools) == 1 and pools[0].dtype == torch.bfloat16 and store is None:
        return "bf16", 1.0
    if len(pools) == 1 and pools[0].dtype == FP8_DTYPE:
        return "fp8", 1.0
    if len(pools) == 2 and pools[0].dtype == torch.uint8 and pools[1].dtype == FP8_DTYPE:
        if isinstance(store, functools.partial) and store.func is nvfp4_quantize \
                and "gs" in store.keywords and not store.args:
            return "nvfp4", float(store.keywords["gs"])
        raise ValueError("nvfp4 pools need store = functools.partial(nvfp4_quantize, gs=...)")
    raise ValueError(f"no Triton append for pools {[p.dtype for p in pools]} with store {store!r}")


def qsa_kv_append(k_cache, v_cache, pos_plane, block_table, seq_ids, positions, k, v,
                  store=None, store_v=None, **outs: torch.Tensor) -> None:
    """Certification convention: the spec's inputs, then the poisoned whole-pool outputs.

    Outputs, in the spec's result order flattened: ``new_k_cache`` / ``new_v_cache`` (one pool) or
    ``new_k_codes, new_k_scales`` / ``new_v_codes, new_v_scales`` (nvfp4), and ``new_pos_plane``.
    Each output starts as a copy of its input pool (untouched slots keep their content), then the new
    tokens are written in place.
    """
    k_pools = (k_cache,) if isinstance(k_cache, torch.Tensor) else tuple(k_cache)
    v_pools = (v_cache,) if isinstance(v_cache, torch.Tensor) else tuple(v_cache)
    fmt, k_gs = seam_format(k_pools, store)
    fmt_v, v_gs = seam_format(v_pools, store if store_v is None else store_v)
    if fmt_v != fmt:
        raise ValueError("K and V must share one storage format")
    names = (("new_k_cache",), ("new_v_cache",)) if fmt != "nvfp4" else \
        (("new_k_codes", "new_k_scales"), ("new_v_codes", "new_v_scales"))
    new_k = tuple(outs[n_].copy_(p) for n_, p in zip(names[0], k_pools))
    new_v = tuple(outs[n_].copy_(p) for n_, p in zip(names[1], v_pools))
    new_pos = outs["new_pos_plane"].copy_(pos_plane)
    kv_append(new_k, new_v, new_pos, block_table, seq_ids, positions, k, v, fmt, k_gs, v_gs)


def nvfp4_store(gs: torch.Tensor):
    """The nvfp4 storage seam in the form ``seam_format`` reads: the spec's quantiser, gs bound."""
    return functools.partial(nvfp4_quantize, gs=gs)


assert NVFP4_BLOCK == 16  # the kernel's block of 16 (two 8-pair halves) is written for it
