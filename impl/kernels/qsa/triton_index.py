"""Triton QSA index store + block compression and index scores (spec/ops/qsa.py; docs/spec.md, "QSA"
items 2, 3).

``index_store`` runs two launches, stream-ordered so no program ever reads a slot another program of
the same launch writes:
1. per tile of new tokens: the bf16 bits of kI go to their slot of the index plane (a copy: the spec's
   store is a bf16 -> bf16 cast), and the token's page is marked invalid (it holds a partial block);
2. per tile of new tokens: a token at offset 31 completes its page's block. The block key is the spec's
   ``block_key``: an fp32 left fold over slots 0..31 of the keys *as stored* (the same additions in the
   same order, so the same bits), divided by 32 (exact), rounded to bf16 on the bits
   (``round_to_bf16``, the interpreter's cast truncates); the page is marked valid. A page completed in
   this call is marked valid after launch 1 marked it invalid, the spec's "completed wins".

``index_scores``: one program per (query row, tile of ``BLOCK_B`` block columns). The row's complete
blocks are ``b < (t + 1) // 32``; their pages come from the row's block table and their keys from the
block-key plane. ``dots = qI @ kbar^T`` is one ``tl.dot`` with fp32 accumulation of exact products (bf16 x bf16 fits
fp32): bf16 tensor-core operands when compiled, fp32 operands with ``input_precision="ieee"`` in the
interpreter (whose bf16 dot returns garbage); either way only the additions round, in the dot's order
(the cells' band covers any order), then
``relu``, the ``wI`` product and a sum over the index heads in fp32; other columns are -inf.
"""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import torch
import triton
import triton.language as tl

from impl.kernels.triton_support import INTERPRETING, round_to_bf16

TPB = 32  # tokens per block == page size (spec/ops/qsa.py:TOKENS_PER_BLOCK)


@triton.jit
def _token_slots(block_table, seq_ids, positions, tok, tmask, table_w):
    """(page int64, offset int64) of tokens ``tok``."""
    seq = tl.load(seq_ids + tok, mask=tmask, other=0).to(tl.int64)
    pos = tl.load(positions + tok, mask=tmask, other=0)
    page = tl.load(block_table + seq * table_w + (pos // 32).to(tl.int64), mask=tmask, other=0)
    return page.to(tl.int64), (pos % 32).to(tl.int64)


@triton.jit
def _store_keys_kernel(k_index, index_plane, valid, block_table, seq_ids, positions, n_tokens,
                       table_w, DIM: tl.constexpr, BLOCK_T: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = tok < n_tokens
    page, off = _token_slots(block_table, seq_ids, positions, tok, tmask, table_w)
    d = tl.arange(0, DIM)
    m = tmask[:, None]
    bits = tl.load(k_index + tok[:, None] * DIM + d[None, :], mask=m, other=0)
    tl.store(index_plane + (page * 32 + off)[:, None] * DIM + d[None, :], bits, mask=m)
    tl.store(valid + page, tl.zeros_like(page).to(tl.int8), mask=tmask)


@triton.jit
def _compress_kernel(index_plane, block_keys, valid, block_table, seq_ids, positions, n_tokens,
                     table_w, DIM: tl.constexpr, BLOCK_T: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = tok < n_tokens
    page, off = _token_slots(block_table, seq_ids, positions, tok, tmask, table_w)
    done = tmask & (off == 31)
    d = tl.arange(0, DIM)
    m = done[:, None]
    base = page[:, None] * (32 * DIM) + d[None, :]
    total = tl.zeros((BLOCK_T, DIM), dtype=tl.float32)
    for slot in range(32):  # the spec's left fold, slot 0 first
        bits = tl.load(index_plane + base + slot * DIM, mask=m, other=0).to(tl.int32) & 0xFFFF
        total += (bits << 16).to(tl.float32, bitcast=True)  # bf16 -> fp32 on the bits: exact
    kbar = round_to_bf16(total * 0.03125)  # / 32 is exact (a power of two)
    kbar_bits = (kbar.to(tl.int32, bitcast=True) >> 16).to(tl.int16)
    tl.store(block_keys + page[:, None] * DIM + d[None, :], kbar_bits, mask=m)
    tl.store(valid + page, tl.full(page.shape, 1, tl.int8), mask=done)


def index_store(index_plane: torch.Tensor, block_keys: torch.Tensor, block_key_valid: torch.Tensor,
                block_table: torch.Tensor, seq_ids: torch.Tensor, positions: torch.Tensor,
                k_index: torch.Tensor, block_t: int | None = None) -> None:
    """In place: kI [N, dim] bf16 -> index_plane [P, 32, dim] bf16; completed pages -> block_keys
    [P, dim] bf16 and block_key_valid [P] bool (spec/ops/qsa.py:qsa_index_store's preconditions)."""
    n, dim = k_index.shape
    if k_index.dtype != torch.bfloat16 or index_plane.dtype != torch.bfloat16 \
            or block_keys.dtype != torch.bfloat16:
        raise ValueError("the Triton index store takes bf16 keys and bf16 planes")
    if dim & (dim - 1):
        raise ValueError(f"index_dim must be a power of two, got {dim}")
    if n == 0:
        return
    block_t = block_t or (128 if INTERPRETING else 16)  # the interpreter pays per op: large tiles
    valid = block_key_valid.view(torch.int8)  # bool is one byte: 0 / 1
    args = (block_table.contiguous(), seq_ids.contiguous(), positions.contiguous(), n,
            block_table.shape[1])
    grid = (triton.cdiv(n, block_t),)
    _store_keys_kernel[grid](k_index.contiguous().view(torch.int16), index_plane.view(torch.int16),
                             valid, *args, DIM=dim, BLOCK_T=block_t, num_warps=4)
    _compress_kernel[grid](index_plane.view(torch.int16), block_keys.view(torch.int16), valid,
                           *args, DIM=dim, BLOCK_T=block_t, num_warps=4)


def qsa_index_store(index_plane, block_keys, block_key_valid, block_table, seq_ids, positions,
                    k_index, *, new_index_plane: torch.Tensor, new_block_keys: torch.Tensor,
                    new_block_key_valid: torch.Tensor) -> None:
    """Certification convention: whole-plane outputs, copies of the inputs updated in place."""
    new_index_plane.copy_(index_plane)
    new_block_keys.copy_(block_keys)
    new_block_key_valid.copy_(block_key_valid)
    index_store(new_index_plane, new_block_keys, new_block_key_valid, block_table, seq_ids,
                positions, k_index)


@triton.jit
def _scores_kernel(q_index, w_index, seq_ids, positions, block_table, block_keys, scores, table_w,
                   H: tl.constexpr, DIM: tl.constexpr, BLOCK_B: tl.constexpr,
                   MMA_BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    seq = tl.load(seq_ids + row).to(tl.int64)
    t = tl.load(positions + row)
    n_done = (t + 1) // 32
    live = b < n_done
    col_ok = b < table_w
    out = tl.full((BLOCK_B,), float("-inf"), tl.float32)
    if tl.program_id(1) * BLOCK_B < n_done:  # a tile with no complete block is all -inf
        page = tl.load(block_table + seq * table_w + b, mask=live, other=0).to(tl.int64)
        h = tl.arange(0, H)
        d = tl.arange(0, DIM)
        q = tl.load(q_index + (row * H + h)[:, None] * DIM + d[None, :])            # [H, DIM] bf16
        kbar = tl.load(block_keys + page[None, :] * DIM + d[:, None], mask=live[None, :],
                       other=0.0)                                                   # [DIM, B] bf16
        if MMA_BF16:  # compiled: bf16 tensor-core MMA, fp32 accumulation
            dots = tl.dot(q, kbar, out_dtype=tl.float32)                            # [H, B] fp32
        else:  # interpreter: its bf16 dot is wrong (garbage magnitudes); fp32 operands are exact
            dots = tl.dot(q.to(tl.float32), kbar.to(tl.float32), input_precision="ieee")
        w = tl.load(w_index + row * H + h).to(tl.float32)
        s = tl.sum(w[:, None] * tl.maximum(dots, 0.0), axis=0)
        out = tl.where(live, s, out)
    tl.store(scores + row * table_w + b, out, mask=col_ok)


def index_scores(q_index: torch.Tensor, w_index: torch.Tensor, seq_ids: torch.Tensor,
                 positions: torch.Tensor, block_table: torch.Tensor, block_keys: torch.Tensor,
                 scores: torch.Tensor, block_b: int | None = None) -> None:
    """q_index [N, H, dim] bf16, w_index [N, H] bf16, block_keys [P, dim] bf16 -> scores [N, width]
    fp32 (width = block_table.shape[1]). Precondition (the spec checks it): every complete block of a
    row has a valid block key."""
    n, heads, dim = q_index.shape
    if q_index.dtype != torch.bfloat16 or block_keys.dtype != torch.bfloat16:
        raise ValueError("the Triton index scores take bf16 qI and block keys")
    if heads & (heads - 1) or dim < 16 or dim & (dim - 1):
        raise ValueError("index heads and index dim must be powers of two, dim >= 16 (tl.dot tiles)")
    width = block_table.shape[1]
    if n == 0 or width == 0:
        return
    if heads < 16:  # the dot's M is at least 16: zero heads add an exact 0 to each head sum
        q_index = torch.cat([q_index, q_index.new_zeros(n, 16 - heads, dim)], dim=1)
        w_index = torch.cat([w_index, w_index.new_zeros(n, 16 - heads)], dim=1)
        heads = 16
    # 64 columns a program on the GPU; the interpreter pays per op, so it takes up to 512
    block_b = block_b or (min(512, max(16, triton.next_power_of_2(width))) if INTERPRETING else 64)
    grid = (n, triton.cdiv(width, block_b))
    _scores_kernel[grid](q_index.contiguous(), w_index.contiguous(), seq_ids.contiguous(),
                         positions.contiguous(), block_table.contiguous(), block_keys.contiguous(),
                         scores, width, H=heads, DIM=dim, BLOCK_B=block_b,
                         MMA_BF16=not INTERPRETING, num_warps=4)


def qsa_index_scores(q_index, w_index, seq_ids, positions, block_table, block_keys,
                     block_key_valid, *, scores: torch.Tensor) -> None:
    """Certification convention (block_key_valid is the spec's check, not read by the kernel)."""
    index_scores(q_index, w_index, seq_ids, positions, block_table, block_keys, scores)
