"""The per-layer embeddings in one launch after the context GEMM (spec/ops/ple.py; docs/spec.md, "PLE
with hashed n-grams").

``ple_embed(ids, history, x_emb, table, ngram_table, w_ple, norm_w, mult2, mult3, primes, *, e)``:

1. the context projection ``x_emb @ W_ple`` as one bf16 GEMM with an fp32 result
   (``impl.kernels.gemm.widened_matmul``: exact products, fp32 sums);
2. ``_embed_kernel``, one program per (row, layer): the row's n-gram window (from its request's
   history or its own), the hash of the head whose G row holds this layer's P columns (the unsigned
   64-bit products wrap, as the spec defines them, and are mixed by XOR; the row is the unsigned
   value mod the head's prime plus the head's offset in G; a geometry whose G rows are narrower
   than P hashes per column), the gathers of E[id] and of the G row, the context's rmsnorm over P, and ``(sqrt(P) E[id] + G[row] + context) / sqrt(2)`` in
   fp32, in the spec's order (no fused multiply-adds, correctly rounded divisions), rounded once to
   bf16.

The kernel reads E and G through plain pointers, so the tables may live in host memory mapped into
the device's address space (the engine's host-resident tables): each program reads its P values of
E and of G, 2 x 512 bytes, contiguous.

The rows are independent in the kernel; the GEMM's library kernel follows the row count, so a row's
last bits may depend on the rows sharing the call: not batch-invariant.
"""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import math

import torch
import triton
import triton.language as tl

from impl.kernels.gemm import widened_matmul
from impl.kernels.layout import require_contiguous
from impl.kernels.triton_support import round_to_bf16

EPS = 1e-6   # spec.ops.norms.EPS


@triton.jit
def _embed_kernel(ids, history, context, table, ngram, norm_w, mult, primes, offsets, e,
                  PER_ROW: tl.constexpr, ONE_HEAD: tl.constexpr, L: tl.constexpr,
                  P: tl.constexpr, HEAD_W: tl.constexpr,
                  SQRT_P: tl.constexpr, SQRT_C: tl.constexpr, SQRT_2: tl.constexpr,
                  EPS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1)
    # the window (id_t, id_{t-1}, id_{t-2}): a row's own history, or its request's ids before it
    id0 = tl.load(ids + t)
    if PER_ROW:
        id1 = tl.load(history + 2 * t + 1)
        id2 = tl.load(history + 2 * t)
    else:
        id1 = tl.where(t >= 1, tl.load(ids + t - 1, mask=t >= 1, other=0),
                       tl.load(history + 1))
        id2 = tl.where(t >= 2, tl.load(ids + t - 2, mask=t >= 2, other=0),
                       tl.load(history + tl.minimum(t, 1)))
    c = tl.arange(0, P)
    if ONE_HEAD:
        # one head's G row holds this layer's columns: one hash, one contiguous read of G
        head = (layer * P) // HEAD_W
        m0 = tl.load(mult + head * 3).to(tl.uint64, bitcast=True)
        m1 = tl.load(mult + head * 3 + 1).to(tl.uint64, bitcast=True)
        m2 = tl.load(mult + head * 3 + 2).to(tl.uint64, bitcast=True)
        h = ((id0.to(tl.uint64) * m0) ^ (id1.to(tl.uint64) * m1)) ^ (id2.to(tl.uint64) * m2)
        row = (h % tl.load(primes + head).to(tl.uint64)).to(tl.int64) + tl.load(offsets + head)
        gv = tl.load(ngram + row * HEAD_W + (layer * P) % HEAD_W + c).to(tl.float32)
    else:
        # the layer spans several heads' rows (a narrow G): a hash per column
        cols = layer * P + c
        head = cols // HEAD_W
        m0 = tl.load(mult + head * 3).to(tl.uint64, bitcast=True)
        m1 = tl.load(mult + head * 3 + 1).to(tl.uint64, bitcast=True)
        m2 = tl.load(mult + head * 3 + 2).to(tl.uint64, bitcast=True)
        h = ((id0.to(tl.uint64) * m0) ^ (id1.to(tl.uint64) * m1)) ^ (id2.to(tl.uint64) * m2)
        row = (h % tl.load(primes + head).to(tl.uint64)).to(tl.int64) + tl.load(offsets + head)
        gv = tl.load(ngram + row * HEAD_W + cols % HEAD_W).to(tl.float32)
    ev = tl.load(table + id0 * (L * P) + layer * P + c).to(tl.float32)
    ctx = tl.div_rn(tl.load(context + t * (L * P) + layer * P + c), SQRT_C)
    r = 1.0 / tl.sqrt_rn(tl.sum(ctx * ctx, axis=0) / P + EPS)
    ctx = ctx * r * (1.0 + tl.load(norm_w + c).to(tl.float32))
    out = tl.div_rn((SQRT_P * ev + gv) + ctx, SQRT_2)
    tl.store(e + (t * L + layer) * P + c, round_to_bf16(out).to(tl.bfloat16))


def _heads(mult2: torch.Tensor, mult3: torch.Tensor, primes: torch.Tensor):
    """Every head's three multipliers [H, 3] (an order-2 head's third 0: its product is 0, and XOR
    with 0 changes nothing), its prime [H] and its first row in G [H], in the concatenation order
    (order 2's heads, then order 3's). Device tensors, no host reads."""
    pad = torch.zeros(mult2.shape[0], 1, dtype=torch.int64, device=mult2.device)
    mult = torch.cat([torch.cat([mult2.to(torch.int64), pad], 1), mult3.to(torch.int64)])
    p = primes.reshape(-1).to(torch.int64)
    return mult.contiguous(), p.contiguous(), (torch.cumsum(p, 0) - p).contiguous()


def ple_embed(ids: torch.Tensor, history: torch.Tensor, x_emb: torch.Tensor, table: torch.Tensor,
              ngram_table: torch.Tensor, w_ple: torch.Tensor, norm_w: torch.Tensor,
              mult2: torch.Tensor, mult3: torch.Tensor, primes: torch.Tensor, *,
              e: torch.Tensor) -> None:
    """ids [T], history [2] (one request) or [T, 2] (a history per row), x_emb [T, C], table
    [V, L*P], ngram_table [rows, L*P/16], w_ple [C, L*P], norm_w [P] -> e [T, L, P] bf16 (written
    completely)."""
    T, C = x_emb.shape
    P = norm_w.shape[0]
    L = table.shape[1] // P
    heads = primes.numel()
    head_w = ngram_table.shape[1]
    if L * P != table.shape[1] or head_w * heads != L * P:
        raise ValueError("table must be [V, L*P] and G [rows, L*P / num_heads]")
    if P & (P - 1):
        raise ValueError(f"the kernel reads a layer's P = {P} columns as one power-of-two block")
    if e.dtype != torch.bfloat16 or tuple(e.shape) != (T, L, P) or not e.is_contiguous():
        raise ValueError(f"e must be a contiguous bf16 [{T}, {L}, {P}]")
    if history.dim() == 2 and tuple(history.shape) != (T, 2):
        raise ValueError(f"a per-row history must be [{T}, 2], got {tuple(history.shape)}")
    require_contiguous("the Triton PLE embedding", table=table, ngram_table=ngram_table,
                       norm_w=norm_w)
    if T == 0:
        return
    context = widened_matmul(x_emb, w_ple).contiguous()
    mult, p, offsets = _heads(mult2, mult3, primes)
    _embed_kernel[(T, L)](
        ids.to(torch.int64).contiguous(), history.to(torch.int64).contiguous(), context, table,
        ngram_table, norm_w, mult, p, offsets, e, PER_ROW=history.dim() == 2,
        ONE_HEAD=head_w % P == 0, L=L, P=P,
        HEAD_W=head_w, SQRT_P=math.sqrt(P), SQRT_C=math.sqrt(C), SQRT_2=math.sqrt(2.0), EPS=EPS,
        num_warps=2, enable_fp_fusion=False)
