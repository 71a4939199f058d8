"""Input builders and op adapters of the PLE ops (docs/spec.md, "PLE with hashed n-grams").

The spec's n-gram functions take the checkpoint's hash constants as an ``NgramHashConfig``; the
adapters here build it from tensors, the form a kernel receives them in: ``mult2`` int64 [8, 2] and
``mult3`` int64 [8, 3] (the odd unsigned 64-bit multipliers of orders 2 and 3, stored as the int64
with the same bits) and ``primes`` int64 [2, 8] (each head's modulus). The history input carries the
pad id where a request starts, so the config's own ``pad_id`` (used only to initialise a history) is
set to 0.

Geometry: L = 48 layers, P = 256, L * P = 12288, hidden C = 3072, 16 hash heads of 768 columns.
Reduced where a CPU cell cannot hold the target's tables (see the cell files): the vocabulary of the
per-layer table E and the primes (hence the rows) of the n-gram table G in ``ple_embed``.
"""

from __future__ import annotations

import math

import torch

from certify.harness.target import Case, OutSpec
from spec.cases.common import DTYPES, randn
from spec.config import ModelConfig
from spec.ops.ple import NgramHashConfig, is_prime, ple_embed, ple_ngram_hash

ACT = torch.bfloat16
_TARGET = ModelConfig.target()
VOCAB = _TARGET.vocab_size  # 151936, Qwen3-Next's (spec/config.py; docs/spec.md, "Geometry")
PAD = _TARGET.pad_id        # 151643
_U64 = (1 << 64) - 1


# -------------------------------------------------------- adapters (the ops' spec functions)


def _config(mult2: torch.Tensor, mult3: torch.Tensor, primes: torch.Tensor) -> NgramHashConfig:
    def u64(t: torch.Tensor) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(int(m) & _U64 for m in row) for row in t.tolist())
    return NgramHashConfig(multipliers=(u64(mult2), u64(mult3)),
                           primes=tuple(tuple(int(p) for p in row) for row in primes.tolist()),
                           pad_id=0)


def ple_ngram_hash_op(ids: torch.Tensor, history: torch.Tensor, mult2: torch.Tensor,
                      mult3: torch.Tensor, primes: torch.Tensor) -> torch.Tensor:
    """Op ``ple_ngram_hash``: the G rows [T, 16] each token gathers."""
    return ple_ngram_hash(ids, history, _config(mult2, mult3, primes))


def ple_embed_op(ids: torch.Tensor, history: torch.Tensor, x_emb: torch.Tensor, table: torch.Tensor,
                 ngram_table: torch.Tensor, w_ple: torch.Tensor, norm_w: torch.Tensor,
                 mult2: torch.Tensor, mult3: torch.Tensor, primes: torch.Tensor) -> torch.Tensor:
    """Op ``ple_embed``: e [T, L, P] in bf16 (the spec's default activation dtype)."""
    return ple_embed(ids, history, x_emb, table, ngram_table, w_ple, norm_w,
                     _config(mult2, mult3, primes))


# ---------------------------------------------------------------- hash constants and ids


def _signed(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def _multipliers(gen: torch.Generator, heads: int, order: int) -> torch.Tensor:
    """Odd unsigned 64-bit multipliers as int64 bits; about half have the top bit set, so the
    products wrap and the hashes exceed 2^63."""
    limbs = torch.randint(0, 1 << 16, (heads, order, 4), generator=gen).tolist()
    vals = [[_signed((l0 | 1) | (l1 << 16) | (l2 << 32) | (l3 << 48)) for l0, l1, l2, l3 in row]
            for row in limbs]
    return torch.tensor(vals, dtype=torch.int64)


def _primes(gen: torch.Generator, n: int, lo: int, hi: int) -> torch.Tensor:
    """n distinct primes drawn in [lo, hi) (the next prime after a uniform draw)."""
    out: list[int] = []
    while len(out) < n:
        p = int(torch.randint(lo, hi, (), generator=gen))
        while not is_prime(p):
            p += 1
        if p < hi and p not in out:
            out.append(p)
    return torch.tensor(out, dtype=torch.int64).reshape(2, n // 2)


def _ids(gen: torch.Generator, T: int, vocab: int) -> torch.Tensor:
    """Token ids with repeats (frequent tokens recur, so n-grams repeat) and the vocabulary's
    ends."""
    ids = torch.randint(0, vocab, (T,), generator=gen)
    frequent = torch.randint(0, vocab, (8,), generator=gen)
    repeat = torch.rand(T, generator=gen) < 0.3
    ids = torch.where(repeat, frequent[torch.randint(0, 8, (T,), generator=gen)], ids)
    if T >= 4:
        ids[1], ids[2] = 0, vocab - 1
    return ids


def _history(gen: torch.Generator, start: str, vocab: int, pad: int, rows: int = 1) -> torch.Tensor:
    """``new_request``: [pad, pad]; ``continuing``: two drawn ids; ``decode_rows``: one history per
    row [rows, 2], drawn ids except row 0 (a new request's first id: [pad, pad]) and row 1 (its
    second: [pad, id])."""
    if start == "new_request":
        return torch.tensor([pad, pad], dtype=torch.int64)
    if start == "decode_rows":
        history = torch.randint(0, vocab, (rows, 2), generator=gen)
        history[0, :] = pad
        history[1:2, 0] = pad
        return history
    return torch.randint(0, vocab, (2,), generator=gen)


# ---------------------------------------------------------------- builders


def ngram_hash_case(axes: dict, gen: torch.Generator, device) -> Case:
    """One request's step: ``start`` ``new_request`` (history [pad, pad]) or ``continuing`` (the two
    previous ids). ``moduli``: ``target`` (the target config's primes, the 16 largest below 65536)
    or ``wide`` (16 primes drawn up to 2^31, the spec's bound: a larger table)."""
    T = axes["tokens"]
    if axes["moduli"] == "target":
        primes = torch.tensor(_TARGET.ple_hash_primes(), dtype=torch.int64)
    else:
        primes = _primes(gen, 16, 1 << 20, 1 << 31)
    inputs = {"ids": _ids(gen, T, VOCAB), "history": _history(gen, axes["start"], VOCAB, PAD),
              "mult2": _multipliers(gen, 8, 2), "mult3": _multipliers(gen, 8, 3),
              "primes": primes}
    return Case(inputs={n: v.to(device) for n, v in inputs.items()},
                outputs={"rows": OutSpec((T, 16), torch.int64)})


def embed_case(axes: dict, gen: torch.Generator, device) -> Case:
    """ple_embed at the target's L, P and C, with a reduced vocabulary table E (``vocab`` rows) and
    n-gram table G (16 primes in [1000, 3000)); ids are drawn below the reduced vocabulary."""
    T, L, P, C, V = axes["tokens"], axes["layers"], axes["ple_dim"], axes["hidden"], axes["vocab"]
    ids = _ids(gen, T, V)
    history = _history(gen, axes["start"], V, pad=PAD, rows=T)  # hashed, never looked up
    primes = _primes(gen, 16, 1000, 3000)
    rows = int(primes.sum())
    inputs = {
        "ids": ids, "history": history,
        # The token embedding (gain ~0.05, a few larger channels), the per-layer table E (scaled by
        # sqrt(P) in the op, so entries of std 1/sqrt(P)), the n-gram table G, the projection W_ple
        # and the zero-centred norm weight: bf16 checkpoint tensors.
        "x_emb": (randn(gen, T, C, scale=0.05) * torch.exp(randn(gen, C, scale=0.5))).to(ACT),
        "table": randn(gen, V, L * P, scale=1.0 / math.sqrt(P), dtype=ACT),
        "ngram_table": randn(gen, rows, L * P // 16, scale=0.5, dtype=ACT),
        "w_ple": randn(gen, C, L * P, dtype=ACT),
        "norm_w": randn(gen, P, scale=0.1, dtype=ACT),
        "mult2": _multipliers(gen, 8, 2), "mult3": _multipliers(gen, 8, 3), "primes": primes,
    }
    return Case(inputs={n: v.to(device) for n, v in inputs.items()},
                outputs={"e": OutSpec((T, L, P), ACT)})


def apply_case(axes: dict, gen: torch.Generator, device) -> Case:
    """Layer l's PLE update on a hidden state of dtype ``x_dtype``: x of RMS ~2 with massive
    channels, e_l a bf16 row of ple_embed's output scale, bf16 weights (W_gate [P, C],
    W_out [C, P])."""
    T, C, P = axes["tokens"], axes["hidden"], axes["ple_dim"]
    x_dtype = DTYPES[axes["x_dtype"]]
    gain = torch.exp(randn(gen, C, scale=0.5))
    gain[torch.randperm(C, generator=gen)[:4]] *= 20.0
    inputs = {
        "x": (2.0 * randn(gen, T, C) * gain).to(x_dtype),
        "e_l": randn(gen, T, P, scale=1.2, dtype=ACT),
        "w_gate": randn(gen, P, C, scale=1.0 / math.sqrt(C), dtype=ACT),
        "w_out": randn(gen, C, P, scale=1.0 / math.sqrt(P), dtype=ACT),
        "norm_w": randn(gen, C, scale=0.1, dtype=ACT),
    }
    return Case(inputs={n: v.to(device) for n, v in inputs.items()},
                outputs={"out": OutSpec((T, C), x_dtype)})
