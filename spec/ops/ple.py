"""Per-layer embeddings (PLE) with hashed n-grams (docs/spec.md, "PLE with hashed n-grams").

Each token gets a small embedding e_l [P] for every layer l, built from three sources:
- a per-layer table E [V, L*P], looked up by token id and scaled by sqrt(P);
- hashed n-grams: for each order n in {2, 3} and each of 8 hash heads, the ids (id_t, ..., id_{t-n+1})
  are hashed to a row of one shared table G; the 16 rows, each L*P/16 wide, are concatenated to L*P;
- a context path from the token's input embedding: ``rmsnorm((x_emb @ W_ple) / sqrt(C))``.
Combined: ``e = (sqrt(P) E[id] + ngram + context) / sqrt(2)``, viewed [L, P]. Layer l then adds
``rmsnorm(W_out_l (gelu_tanh(W_gate_l x) * e_l))`` to its hidden state after the mixer.

Public definitions followed: the table, context path, 1/sqrt(2) combine and the per-layer gate
follow the per-layer embeddings of Gemma 3n (transformers ``Gemma3nTextModel.get_per_layer_inputs`` /
``project_per_layer_inputs`` and the per-layer gate of ``Gemma3nTextDecoderLayer``), with the model's
zero-centred rmsnorm (spec.ops.norms). The hashed n-gram path is this project's; docs/spec.md and this
module define it (multiplicative hashing of each id by an odd 64-bit constant, the products mixed by XOR, the
row taken modulo a per-head prime).

Decisions left to the spec by docs/spec.md (pinned in tests/spec/test_ple.py):
- The context rmsnorm is over P, per layer, with one weight [P] shared by all layers (Gemma 3n's
  per-layer projection norm): the projection is viewed [L, P] first, then normalised.
- The n-gram rows are added *after* the sqrt(P) scale of the table: ``sqrt(P) E[id] + ngram``.
- Head order: order 2's heads 0..7, then order 3's heads 0..7. It fixes both each head's row offset in G
  (offset = sum of the primes of the heads before it) and the position of its row in the [L*P]
  concatenation (head k fills columns k*L*P/16 .. (k+1)*L*P/16 - 1, then the whole is viewed [L, P]).
- Multipliers are per (order, head, position): ``m_{n,j,k}`` multiplies ``id_{t-k}``. A checkpoint that
  shares multipliers across heads repeats them; the distinct primes still separate the heads.
- Rounding: everything in the accumulation dtype (fp32; float64 in reference mode), tables and weights
  widened exactly; one rounding point per op, at its output: ``ple_embed`` casts e to the activation
  dtype, ``ple_apply`` rounds the added term to the activation dtype (the value a layer adds) and
  returns the sum in x's dtype.
- Weight layouts: ``x_emb @ W_ple`` with W_ple [C, L*P] as docs/spec.md writes it; W_gate [P, C] and
  W_out [C, P] act on the left (``W x``), as docs/spec.md writes them (torch Linear layout). No biases.

The 64-bit arithmetic. The hash is defined on unsigned 64-bit integers: products wrap modulo 2^64 and
the row is the *unsigned* value mod p. Torch has no uint64 arithmetic, and its int64 multiply overflows
through C++ signed overflow, which the language leaves undefined. So the spec never overflows: a 64-bit
value is held as four 16-bit limbs (int64 tensors, least significant first); the product is schoolbook
multiplication of the limbs keeping limbs 0..3 with explicit carries (every partial sum < 2^35), XOR
acts limb by limb, and ``h mod p`` is Horner's rule over the limbs, most significant first
(``r = (r * 2^16 + limb) mod p``, every value < 2^47 for p < 2^31). The result is exact for every input
on every platform. ``ngram_hash_values`` returns h as an int64 holding the same 64 bits (two's
complement), the form a kernel with native wrapping uint64 multiplies would store.

History (explicit per-request state): the last 2 ids, oldest first; a new request starts at
``[pad, pad]``, so ids before the sequence start hash as the pad id. ``ple_ngram_ids`` gives the ids a
step needs and ``ple_history_advance`` the history after it; a verify step's per-row records are the
history after each row, which speculation rolls back with the other side state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spec.numerics import acc_dtype, is_reference_mode, out_cast, round_to, rowwise_matmul
from spec.ops.norms import rmsnorm

HISTORY_LEN = 2          # ids kept: the largest order minus one
NGRAM_ORDERS = (2, 3)
HEADS_PER_ORDER = 8

_LIMB_BITS = 16
_LIMB_MASK = (1 << _LIMB_BITS) - 1
_N_LIMBS = 4
_U64_MASK = (1 << 64) - 1
_MAX_PRIME = 1 << 31     # keeps Horner's partial values below 2^47


def is_prime(p: int) -> bool:
    """Trial division; the moduli are below 2^31, so at most ~23,000 odd divisors."""
    if p < 2 or p % 2 == 0:
        return p == 2
    d = 3
    while d * d <= p:
        if p % d == 0:
            return False
        d += 2
    return True


@dataclass(frozen=True)
class NgramHashConfig:
    """The checkpoint's hash constants.

    multipliers[o][j][k]: the odd unsigned 64-bit multiplier of ``id_{t-k}`` for order ``orders[o]``,
    head j (Python ints in [0, 2^64)). primes[o][j]: that head's distinct prime, < 2^31.
    pad_id: the id used for positions before the sequence start.
    """

    multipliers: tuple[tuple[tuple[int, ...], ...], ...]
    primes: tuple[tuple[int, ...], ...]
    pad_id: int
    orders: tuple[int, ...] = NGRAM_ORDERS

    def __post_init__(self) -> None:
        if len(self.multipliers) != len(self.orders) or len(self.primes) != len(self.orders):
            raise ValueError("one multiplier table and one prime list per order")
        if max(self.orders) - 1 > HISTORY_LEN:
            raise ValueError(f"orders above {HISTORY_LEN + 1} need a longer history")
        for n, mults, primes in zip(self.orders, self.multipliers, self.primes):
            if len(mults) != len(primes):
                raise ValueError(f"order {n}: {len(mults)} multiplier rows for {len(primes)} primes")
            for head in mults:
                if len(head) != n or any(not (0 < m <= _U64_MASK and m % 2 == 1) for m in head):
                    raise ValueError(f"order {n}: each head needs {n} odd 64-bit multipliers")
        flat = [p for primes in self.primes for p in primes]
        if len(set(flat)) != len(flat) or any(not (is_prime(p) and p < _MAX_PRIME) for p in flat):
            raise ValueError("hash head moduli must be distinct primes below 2^31")
        if self.pad_id < 0:
            raise ValueError("pad_id must be a token id (non-negative)")

    @property
    def num_heads(self) -> int:
        """All hash heads, all orders (16 for the model)."""
        return sum(len(p) for p in self.primes)

    def heads(self) -> list[tuple[int, tuple[int, ...], int, int]]:
        """(order, multipliers, prime, row offset in G) per head, in the concatenation order."""
        out, offset = [], 0
        for n, mults, primes in zip(self.orders, self.multipliers, self.primes):
            for m, p in zip(mults, primes):
                out.append((n, m, p, offset))
                offset += p
        return out

    @property
    def table_rows(self) -> int:
        """Rows of G: the sum of all heads' primes."""
        return sum(p for primes in self.primes for p in primes)


# ---------------------------------------------------------------- exact unsigned 64-bit arithmetic


def _limbs(x: torch.Tensor) -> torch.Tensor:
    """int64 [...] holding 64 bits (two's complement) -> [..., 4] 16-bit limbs, least significant first.

    The arithmetic right shift sign-extends, the mask then keeps exactly the 16 bits of each limb.
    """
    return torch.stack([(x >> (_LIMB_BITS * k)) & _LIMB_MASK for k in range(_N_LIMBS)], dim=-1)


def _const_limbs(value: int) -> torch.Tensor:
    """An unsigned 64-bit Python int -> its 4 limbs as an int64 tensor [4]."""
    return torch.tensor([(value >> (_LIMB_BITS * k)) & _LIMB_MASK for k in range(_N_LIMBS)],
                        dtype=torch.int64)


def _mul_u64(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a * b) mod 2^64`` on limbs [..., 4]: schoolbook, limbs 0..3 kept, explicit carries."""
    out, carry = [], torch.zeros_like(a[..., 0])
    for k in range(_N_LIMBS):
        column = carry
        for i in range(k + 1):
            column = column + a[..., i] * b[..., k - i]  # each product < 2^32
        out.append(column & _LIMB_MASK)
        carry = column >> _LIMB_BITS
    return torch.stack(out, dim=-1)  # the carry out of limb 3 is the wrap-around: dropped


def _mod_u64(h: torch.Tensor, p: int) -> torch.Tensor:
    """The unsigned value of limbs [..., 4] mod p (Horner's rule, most significant limb first)."""
    r = torch.zeros_like(h[..., 0])
    for k in reversed(range(_N_LIMBS)):
        r = (r * (1 << _LIMB_BITS) + h[..., k]) % p
    return r


def _limbs_to_int64(h: torch.Tensor) -> torch.Tensor:
    """Limbs [..., 4] -> int64 with the same 64 bits (two's complement), without any overflow."""
    top = h[..., 3] - (h[..., 3] >> (_LIMB_BITS - 1)) * (1 << _LIMB_BITS)  # signed top limb
    low = h[..., 0] + h[..., 1] * (1 << 16) + h[..., 2] * (1 << 32)        # < 2^48
    return top * (1 << 48) + low


# ---------------------------------------------------------------- history and hashing


def ple_history_init(pad_id: int) -> torch.Tensor:
    """The history of a new request: ``[pad, pad]`` (int64 [2], oldest first)."""
    return torch.full((HISTORY_LEN,), pad_id, dtype=torch.int64)


def ple_ngram_ids(ids: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    """The ids each row's n-grams read: ``window[t] = (id_t, id_{t-1}, id_{t-2})``.

    ids [T] int64. history int64, one of:
    - [2]: ids are one request's consecutive ids, in order, and history holds the two ids before
      ids[0], oldest first (the pad id before the sequence start);
    - [T, 2]: each row is the next id of its own request (a decode step's rows), and history[t]
      holds that request's two ids before it, oldest first.
    Returns int64 [T, 3], newest first.
    """
    ids, history = ids.to(torch.int64), history.to(torch.int64)
    if history.dim() == 2:
        if history.shape != (ids.shape[0], HISTORY_LEN):
            raise ValueError(f"a per-row history must be [{ids.shape[0]}, {HISTORY_LEN}], "
                             f"got {tuple(history.shape)}")
        return torch.stack([ids, history[:, 1], history[:, 0]], dim=-1)
    seq = torch.cat([history, ids])
    T = ids.shape[0]
    columns = [seq[HISTORY_LEN - k: HISTORY_LEN - k + T] for k in range(HISTORY_LEN + 1)]
    return torch.stack(columns, dim=-1)


def ple_history_advance(history: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The history after ``ids`` [T]: the last 2 ids of ``history ++ ids`` (int64 [2], oldest first)."""
    return torch.cat([history.to(torch.int64), ids.to(torch.int64)])[-HISTORY_LEN:].clone()


def ngram_hash_u64(window: torch.Tensor, multipliers: tuple[int, ...]) -> torch.Tensor:
    """``h = (w_0 * m_0) XOR (w_1 * m_1) XOR ...`` over unsigned 64-bit integers (products wrap).

    window [..., >= n] int64, newest id first (``ple_ngram_ids``); multipliers: n unsigned 64-bit ints.
    Returns the limbs [..., 4] (int64, 16 bits each, least significant first).
    """
    h = None
    for k, m in enumerate(multipliers):
        term = _mul_u64(_limbs(window[..., k]), _const_limbs(m))
        h = term if h is None else h ^ term
    return h


def ngram_hash_values(ids: torch.Tensor, history: torch.Tensor, cfg: NgramHashConfig) -> torch.Tensor:
    """Every head's 64-bit hash, as int64 holding the unsigned value's bits: [T, num_heads]."""
    window = ple_ngram_ids(ids, history)
    values = [_limbs_to_int64(ngram_hash_u64(window, m)) for _, m, _, _ in cfg.heads()]
    return torch.stack(values, dim=-1)


def ple_ngram_hash(ids: torch.Tensor, history: torch.Tensor, cfg: NgramHashConfig) -> torch.Tensor:
    """The rows of G each token gathers: ``row = (h mod p_{n,j}) + offset_{n,j}`` per head.

    ids [T] int64, history [2] or [T, 2] int64 (see ``ple_ngram_ids``). Returns int64
    [T, num_heads]; column k is head k in the concatenation order (order 2's heads, then order
    3's), inside ``[offset_k, offset_k + p_k)``.
    """
    if ids.device.type == "meta":  # meta: shapes only (the reach tracer); the limb arithmetic costs time
        return torch.empty(ids.shape[0], cfg.num_heads, dtype=torch.int64, device=ids.device)
    window = ple_ngram_ids(ids, history)
    rows = [_mod_u64(ngram_hash_u64(window, m), p) + offset for _, m, p, offset in cfg.heads()]
    return torch.stack(rows, dim=-1)


# ---------------------------------------------------------------- embedding and per-layer apply


def ple_embed(ids: torch.Tensor, history: torch.Tensor, x_emb: torch.Tensor, table: torch.Tensor,
              ngram_table: torch.Tensor, w_ple: torch.Tensor, norm_w: torch.Tensor,
              cfg: NgramHashConfig, act_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The per-layer embeddings of one request's step, or of decode rows of several: e [T, L, P].

    ``e = (sqrt(P) E[id] + concat_k G[row_k] + rmsnorm_P((x_emb @ W_ple) / sqrt(C))) / sqrt(2)``.
    ids [T] int64; history [2] or per row [T, 2] int64 (``ple_ngram_ids``); x_emb [T, C] (the token
    embeddings); table E [V, L*P]; ngram_table G [cfg.table_rows, L*P/num_heads]; w_ple [C, L*P];
    norm_w [P] (the context norm's zero-centred weight, shared by the layers). L and P are read
    from ``norm_w`` and ``table``. Computes in the accumulation dtype; one rounding point: e is cast
    to ``act_dtype`` (float64 stays).
    """
    reference = is_reference_mode(x_emb, table, ngram_table, w_ple, norm_w)
    acc = acc_dtype(x_emb, table, ngram_table, w_ple, norm_w)
    T, C = x_emb.shape
    P = norm_w.shape[0]
    L = table.shape[1] // P
    if L * P != table.shape[1] or ngram_table.shape[1] * cfg.num_heads != L * P:
        raise ValueError("table must be [V, L*P] and G [rows, L*P / num_heads]")

    rows = ple_ngram_hash(ids, history, cfg)                         # [T, heads]
    ngram = ngram_table[rows].to(acc).reshape(T, L * P)              # heads concatenated in order
    per_layer = math.sqrt(P) * table[ids].to(acc) + ngram            # scale first, then the n-grams
    context = rowwise_matmul(x_emb.to(acc), w_ple.to(acc)) / math.sqrt(C)
    context = rmsnorm(context.reshape(T, L, P), norm_w.to(acc))      # over P, per layer
    e = (per_layer.reshape(T, L, P) + context) / math.sqrt(2.0)
    return out_cast(e, act_dtype, reference)


def ple_apply(x: torch.Tensor, e_l: torch.Tensor, w_gate: torch.Tensor, w_out: torch.Tensor,
              norm_w: torch.Tensor, act_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Layer l's PLE update after the mixer: ``x + rmsnorm(W_out (gelu_tanh(W_gate x) * e_l))``.

    x [T, C] (the hidden state the model applies PLE to); e_l [T, P] (``ple_embed(...)[:, l]``);
    w_gate [P, C]; w_out [C, P]; norm_w [C] (zero-centred). gelu is the tanh approximation.
    The added term is computed in the accumulation dtype and rounded to ``act_dtype`` once (it is the
    value the layer adds); the sum is returned in x's dtype (float64 in reference mode).
    """
    reference = is_reference_mode(x, e_l, w_gate, w_out, norm_w)
    acc = acc_dtype(x, e_l, w_gate, w_out, norm_w)
    xf = x.to(acc)
    gate = F.gelu(rowwise_matmul(xf, w_gate.to(acc).T), approximate="tanh")
    update = rmsnorm(rowwise_matmul(gate * e_l.to(acc), w_out.to(acc).T), norm_w.to(acc))
    update = round_to(update, act_dtype, reference)
    return out_cast(xf + update, x.dtype, reference)
