"""The PLE ops with batched fp32 GEMMs (spec/ops/ple.py, docs/spec.md, "PLE with hashed n-grams").

- ``ple_embed(ids, history, x_emb, table, ngram_table, w_ple, norm_w, mult2, mult3, primes, *, e)``:
  the context projection ``x_emb @ W_ple`` is one [T, C] @ [C, L*P] fp32 matmul over the step's rows,
  where the spec runs one product per row (``spec.numerics.rowwise_matmul``, a launch per row). The
  n-gram rows are the spec's ``ple_ngram_hash`` computed for all heads at once (``ngram_rows``: the
  same exact 64-bit limb arithmetic; the hash constants arrive as tensors and become the spec's
  ``NgramHashConfig``), and the gathers, the sqrt(P) scale, the rmsnorm over P and the 1/sqrt(2) combine are the spec's steps in
  fp32, with one cast of e to its buffer's dtype (bf16).
- ``ple_apply(x, e_l, w_gate, w_out, norm_w, *, out)``: ``W_gate x`` and ``W_out (gelu_tanh(.) * e_l)``
  as two batched fp32 matmuls in place of the spec's row loops; gelu (tanh form), the zero-centred
  rmsnorm, the rounding of the added term to bf16 and the sum in x's dtype are the spec's.

The bf16 operands (x_emb, x and the weights) enter their GEMMs widened exactly (``impl.kernels.gemm``:
a bf16 GEMM with an fp32 result on cuda), so the products are exact and only the summation order
differs from the spec's; W_out's fp32 operand (gelu * e_l, not a bf16 value) runs a full fp32 GEMM
(no TF32).

The library picks its GEMM kernel and summation order from the launch's shape, so a row's last bits
may depend on how many rows share the launch: these variants are not batch-invariant, and
batch-invariant mode runs the spec's path.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from impl.kernels.gemm import fp32_matmul, widened_matmul

from spec.ops.norms import rmsnorm
from spec.ops.ple import HISTORY_LEN, NgramHashConfig, ple_ngram_ids

ACT = torch.bfloat16  # the rounding dtype of ple_apply's added term (the spec's default act_dtype)
_U64 = (1 << 64) - 1


def _config(mult2: torch.Tensor, mult3: torch.Tensor, primes: torch.Tensor) -> NgramHashConfig:
    """The spec's hash config from the constants as tensors: multipliers int64 [8, 2] and [8, 3] (the
    unsigned 64-bit values' bits), primes int64 [2, 8]. The history carries the pad id, so the
    config's own pad_id (only used to start a history) is 0."""
    def u64(t: torch.Tensor) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(int(m) & _U64 for m in row) for row in t.tolist())
    return NgramHashConfig(multipliers=(u64(mult2), u64(mult3)),
                           primes=tuple(tuple(int(p) for p in row) for row in primes.tolist()),
                           pad_id=0)


_LIMB_BITS, _LIMBS = 16, 4
_HEADS: dict[tuple[NgramHashConfig, str], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _u64_limbs(x: torch.Tensor) -> torch.Tensor:
    """int64 holding 64 bits -> [..., 4] 16-bit limbs, least significant first (the spec's form)."""
    return torch.stack([(x >> (_LIMB_BITS * k)) & 0xFFFF for k in range(_LIMBS)], dim=-1)


def _head_constants(cfg: NgramHashConfig, device: torch.device):
    """Every head's multipliers as limbs [H, 3, 4] (an order-2 head's third multiplier 0: its
    product is 0, and XOR with 0 changes nothing), primes [H] and row offsets [H], once a device."""
    key = (cfg, str(device))
    if key not in _HEADS:
        heads = cfg.heads()
        mult = torch.zeros(len(heads), HISTORY_LEN + 1, _LIMBS, dtype=torch.int64)
        for h, (_, multipliers, _, _) in enumerate(heads):
            for k, m in enumerate(multipliers):
                mult[h, k] = torch.tensor([(m >> (_LIMB_BITS * j)) & 0xFFFF for j in range(_LIMBS)])
        primes = torch.tensor([p for _, _, p, _ in heads], dtype=torch.int64)
        offsets = torch.tensor([o for _, _, _, o in heads], dtype=torch.int64)
        _HEADS[key] = (mult.to(device), primes.to(device), offsets.to(device))
    return _HEADS[key]


def ngram_rows(ids: torch.Tensor, history: torch.Tensor, cfg: NgramHashConfig) -> torch.Tensor:
    """``spec.ops.ple.ple_ngram_hash`` for all heads at once: the same limb arithmetic (exact
    unsigned 64-bit products and XOR, Horner's rule mod each head's prime) over [T, heads, ...]
    tensors, about 60 launches where the spec's head loop takes about 2000. Returns int64
    [T, heads], equal to the spec's (tests/ops/test_ple_torch.py)."""
    mult, primes, offsets = _head_constants(cfg, ids.device)
    a = _u64_limbs(ple_ngram_ids(ids, history))[:, None]             # [T, 1, 3, 4]
    b = mult[None]                                                    # [1, H, 3, 4]
    limbs, carry = [], None
    for k in range(_LIMBS):                                           # schoolbook, limbs 0..3
        column = a[..., 0] * b[..., k]
        for i in range(1, k + 1):
            column = column + a[..., i] * b[..., k - i]               # each product < 2^32
        if carry is not None:
            column = column + carry
        limbs.append(column & 0xFFFF)
        carry = column >> _LIMB_BITS
    h = torch.stack(limbs, dim=-1)                                    # [T, H, 3, 4]
    h = h[:, :, 0] ^ h[:, :, 1] ^ h[:, :, 2]                          # [T, H, 4]
    r = torch.zeros_like(h[..., 0])
    for k in reversed(range(_LIMBS)):
        r = (r * (1 << _LIMB_BITS) + h[..., k]) % primes
    return r + offsets


def ple_embed(ids: torch.Tensor, history: torch.Tensor, x_emb: torch.Tensor, table: torch.Tensor,
              ngram_table: torch.Tensor, w_ple: torch.Tensor, norm_w: torch.Tensor,
              mult2: torch.Tensor, mult3: torch.Tensor, primes: torch.Tensor, *,
              e: torch.Tensor) -> None:
    """ids [T], history [2] (one request) or [T, 2] (a history per row), x_emb [T, C], table
    [V, L*P], ngram_table [rows, L*P/16], w_ple [C, L*P], norm_w [P] -> e [T, L, P] (written
    completely, in its buffer's dtype)."""
    f32 = torch.float32
    T, C = x_emb.shape
    P = norm_w.shape[0]
    L = table.shape[1] // P
    cfg = _config(mult2, mult3, primes)
    if L * P != table.shape[1] or ngram_table.shape[1] * cfg.num_heads != L * P:
        raise ValueError("table must be [V, L*P] and G [rows, L*P / num_heads]")
    rows = ngram_rows(ids, history, cfg)                               # [T, heads]
    ngram = ngram_table[rows].to(f32).reshape(T, L * P)                # heads concatenated in order
    per_layer = math.sqrt(P) * table[ids].to(f32) + ngram              # scale first, then the n-grams
    context = widened_matmul(x_emb, w_ple) / math.sqrt(C)
    context = rmsnorm(context.reshape(T, L, P), norm_w.to(f32))        # over P, per layer
    e.copy_((per_layer.reshape(T, L, P) + context) / math.sqrt(2.0))


def ple_apply(x: torch.Tensor, e_l: torch.Tensor, w_gate: torch.Tensor, w_out: torch.Tensor,
              norm_w: torch.Tensor, *, out: torch.Tensor) -> None:
    """x [T, C], e_l [T, P], w_gate [P, C], w_out [C, P], norm_w [C] -> out [T, C] (x's dtype,
    written completely)."""
    f32 = torch.float32
    xf = x.to(f32)
    gate = F.gelu(widened_matmul(x, w_gate.T), approximate="tanh")
    update = rmsnorm(fp32_matmul(gate * e_l.to(f32), w_out.T), norm_w.to(f32))
    update = update.to(ACT).to(f32)  # the value the layer adds, rounded once
    out.copy_(xf + update)
