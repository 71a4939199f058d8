"""QSA top-k selection fused with expansion (spec/ops/qsa.py ``qsa_topk_expand``): one Triton kernel,
one program per query row, for score tables of at most 4096 columns (131072-token contexts).

Per row, in registers (columns padded to a power-of-two bucket ``BLOCK_C``):
1. every column gets the key ``u = score key + 2^31`` in [0, 2^32) (``topk_keys``: NaN -> -inf,
   -0.0 -> +0.0, ordered like the floats); columns that are not candidates get -1;
2. tau's key (the k-th largest candidate key) by a bitwise binary search: 32 passes, each counting the
   candidates >= a trial value; no sort, so nothing depends on a sort's tie order;
3. candidates above tau are selected, and of the r = k - (number above) tied at tau, those with at
   most r ties at or above their index (a prefix sum of the tie flags): ties to the highest index;
4. the selected columns (window | chosen) are written ascending at their prefix-sum rank, the rest
   of the row -1;
5. expansion reads those ids back (after a CTA barrier) and writes slot s, token j as
   ``32 * id_s + j`` when below ``min(t + 1, length)``, else -1: ids are ascending, so only the block
   holding the cut can be partial and the tokens come out packed and ascending, with coalesced stores.
A row's result is a pure function of its own scores, t and length: identical in any launch order or
batch. The row count is the grid size only, so one compiled kernel serves every row count.
"""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import torch
import triton
import triton.language as tl

from impl.kernels.layout import require_contiguous
from impl.kernels.qsa.topk_keys import MAX_TRITON_COLS

TPB = 32          # tokens per block
TOKEN_CHUNK = 1024  # tokens written per pass of the expansion loop


@triton.jit
def _topk_expand_kernel(scores, positions, lens, selected, tokens, C, k, sink, local, W,
                        HAS_LENS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr,
                        CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row * C and row * 32 W exceed 2^31 at 16384-row launches
    cols = tl.arange(0, BLOCK_C)
    t = tl.load(positions + row).to(tl.int32)
    if HAS_LENS:
        limit = tl.minimum(t + 1, tl.load(lens + row).to(tl.int32))
    else:
        limit = t + 1
    own = t // 32
    n_done = (t + 1) // 32
    win = ((cols < sink) & (cols <= own)) | ((cols > own - local) & (cols <= own))
    cand = (cols < n_done) & (cols < C) & (win == 0)

    # 1. Keys: NaN -> -inf, -0.0 -> +0.0, then the order-preserving integer map of the fp32 bits.
    x = tl.load(scores + row * C + cols, mask=cols < C, other=float("-inf"))
    x = tl.where(x != x, float("-inf"), x)
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # topk_keys.FLIP (a jit body reads no globals)
    u = tl.where(cand, key.to(tl.int64) + 2147483648, -1)

    # 2. tau: the largest value v with count(u >= v) >= k, built bit by bit from the top.
    n_cand = tl.sum(cand.to(tl.int32), axis=0)
    thr = tl.full([], 0, tl.int64)
    step = tl.full([], 2147483648, tl.int64)
    for _ in range(32):
        trial = thr + step
        count = tl.sum((u >= trial).to(tl.int32), axis=0)
        thr = tl.where(count >= k, trial, thr)
        step = step // 2

    # 3. Above tau, then the ties with the highest indices; all candidates when at most k exist.
    above = cand & (u > thr)
    tie = cand & (u == thr)
    r = k - tl.sum(above.to(tl.int32), axis=0)
    ties_upto = tl.cumsum(tie.to(tl.int32), axis=0)            # ties at index <= col
    ties_from = tl.sum(tie.to(tl.int32), axis=0) - ties_upto + 1  # ties at index >= col (on a tie)
    chosen = tl.where(n_cand <= k, cand, above | (tie & (ties_from <= r)))

    # 4. Selected ids ascending: each selected column at its rank; the rest of the row -1.
    sel = win | chosen
    rank = tl.cumsum(sel.to(tl.int32), axis=0) - 1
    count_sel = tl.sum(sel.to(tl.int32), axis=0)
    sel_row = selected + row * W
    tl.store(sel_row + rank, cols.to(tl.int64), mask=sel & (cols < C))
    slots = tl.arange(0, BLOCK_W)
    tl.store(sel_row + slots, tl.full([BLOCK_W], -1, tl.int64), mask=(slots >= count_sel) & (slots < W))

    # 5. Expansion from the ids just written: the barrier makes every thread's stores above
    # visible to the whole program before they are read back.
    tl.debug_barrier()
    tok_row = tokens + row * W * 32
    for start in range(0, W * 32, CHUNK):
        p = start + tl.arange(0, CHUNK)
        inside = p < W * 32
        ids = tl.load(sel_row + p // 32, mask=inside, other=-1).to(tl.int32)
        tok = ids * 32 + p % 32
        tok = tl.where((ids >= 0) & (tok < limit), tok, -1)
        tl.store(tok_row + p, tok.to(tl.int64), mask=inside)


def qsa_topk_expand(scores: torch.Tensor, positions: torch.Tensor,
                    context_lens: torch.Tensor | None = None, *, selected: torch.Tensor,
                    tokens: torch.Tensor, k: int = 64, sink_blocks: int = 1,
                    local_blocks: int = 2) -> None:
    """scores fp32 [N, C <= 4096]; positions, context_lens integer [N] -> selected int64 [N, W] and
    tokens int64 [N, 32 W] (W = k + sink + local), both written completely.

    Precondition (as the forward builds tables): a row's own block has a column (t < 32 C)."""
    if scores.dtype != torch.float32:
        raise ValueError("selection keys are built from fp32 score bits: scores must be fp32")
    n, c = scores.shape
    if c > MAX_TRITON_COLS:
        raise ValueError(f"{c} score columns: the fused kernel holds at most {MAX_TRITON_COLS} "
                         "a row (the torch path takes wider tables)")
    width = k + sink_blocks + local_blocks
    if selected.shape != (n, width) or tokens.shape != (n, TPB * width):
        raise ValueError("selected must be [N, k + sink + local] and tokens [N, 32 * that]")
    require_contiguous("the fused top-k expansion", scores=scores, positions=positions,
                       context_lens=context_lens, selected=selected, tokens=tokens)
    if n == 0:
        return
    block_c = max(triton.next_power_of_2(c), 16)
    lens = context_lens if context_lens is not None else positions  # unread without lengths
    _topk_expand_kernel[(n,)](
        scores, positions, lens, selected, tokens, c, k, sink_blocks, local_blocks, width,
        HAS_LENS=context_lens is not None, BLOCK_C=block_c,
        BLOCK_W=triton.next_power_of_2(width), CHUNK=TOKEN_CHUNK,
        num_warps=4 if block_c <= 512 else 8)
