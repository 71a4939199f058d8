"""The PLE n-gram spec functions left to check, against formulations written independently of them
(docs/spec.md, "PLE with hashed n-grams" and "Geometry"), on seeded inputs and the catalog cells'
own inputs.

- ``ple_ngram_hash_op`` (the catalog's adapter) and ``ngram_hash_values`` against the hash in Python
  integers (``second_ngram_rows``, which ``ple_ngram_hash`` is checked against): ids before the
  start are the pad id, products wrap modulo 2^64, heads ordered order 2's then order 3's.
- ``ple_embed_op`` against the explicit gather per token and layer (``second_ple_embed``).
- ``is_prime`` against a deterministic Miller-Rabin test; ``ple_history_init`` against
  ``[pad, pad]``.
"""

from __future__ import annotations

import random

import pytest
import torch

from certify.catalog.load import load_catalog
from certify.files.paths import project_paths
from certify.harness.target import build_case
from spec.cases.ple import ple_embed_op, ple_ngram_hash_op
from spec.ops.ple import NgramHashConfig, is_prime, ngram_hash_values, ple_history_init
from tests.spec.test_second_formulations_model import (_close, second_ngram_ids,
                                                       second_ngram_rows, second_ple_embed)

pytestmark = pytest.mark.premerge

CATALOG = load_catalog(project_paths().cells)
U64 = (1 << 64) - 1
F64 = torch.float64


def _cfg_from_tensors(mult2, mult3, primes, pad_id: int = 0) -> NgramHashConfig:
    """The adapters' constants read as unsigned 64-bit integers (int64 bits & (2^64 - 1))."""
    unsigned = lambda t: tuple(tuple(int(m) & U64 for m in row) for row in t.tolist())  # noqa: E731
    return NgramHashConfig(multipliers=(unsigned(mult2), unsigned(mult3)),
                           primes=tuple(tuple(int(p) for p in row) for row in primes.tolist()),
                           pad_id=pad_id)


@pytest.mark.second_formulation("spec.cases.ple:ple_ngram_hash_op")
@pytest.mark.parametrize("cell", ("new_request_t2048", "decode_t1", "verify_t8"))
def test_ngram_hash_op_equals_python_integer_hash_on_the_cells(cell):
    op = CATALOG.ops["ple_ngram_hash"]
    x = build_case(op, op.cell(cell), torch.device("cpu")).inputs
    got = ple_ngram_hash_op(x["ids"], x["history"], x["mult2"], x["mult3"], x["primes"])
    cfg = _cfg_from_tensors(x["mult2"], x["mult3"], x["primes"])
    history = x["history"].tolist()
    window = second_ngram_ids(x["ids"].tolist(), history)
    assert got.tolist() == second_ngram_rows(window, cfg)
    # wrong: the sum of the products instead of their XOR.
    assert got.tolist() != second_ngram_rows(window, cfg, use_xor=False)


def _cfg(seed: int) -> NgramHashConfig:
    rng = random.Random(seed)
    odd = lambda: rng.getrandbits(64) | 1  # noqa: E731
    return NgramHashConfig(multipliers=(((odd(), odd()), (odd(), odd())),
                                        ((odd(), odd(), odd()), (odd(), odd(), odd()))),
                           primes=((5, 7), (11, 13)), pad_id=3)


@pytest.mark.second_formulation("spec.ops.ple:ngram_hash_values")
def test_hash_values_are_the_unsigned_hashes_as_int64_bits():
    cfg = _cfg(61)
    gen = torch.Generator().manual_seed(61)
    ids = torch.randint(0, 2 ** 62, (7,), generator=gen)
    hist = torch.tensor([3, 3])
    got = ngram_hash_values(ids, hist, cfg)
    want = []
    for w in second_ngram_ids(ids.tolist(), hist.tolist()):
        row = []
        for n, mults in zip(cfg.orders, cfg.multipliers):
            for head in mults:
                h = 0
                for k in range(n):
                    h ^= (w[k] * head[k]) & U64
                row.append(h - (1 << 64) if h >> 63 else h)      # two's complement bits
        want.append(row)
    assert got.tolist() == want
    assert any(v < 0 for row in want for v in row)                 # hashes past 2^63 occur


@pytest.mark.second_formulation("spec.cases.ple:ple_embed_op")
def test_ple_embed_op_equals_explicit_gather_per_token_and_layer():
    cfg = _cfg(62)
    gen = torch.Generator().manual_seed(62)
    T, C, L, P, V = 5, 6, 2, 8, 30
    cfg = NgramHashConfig(cfg.multipliers, cfg.primes, pad_id=0)   # the adapter's pad id
    mult2 = torch.tensor([[m - (1 << 64) if m >> 63 else m for m in h] for h in cfg.multipliers[0]])
    mult3 = torch.tensor([[m - (1 << 64) if m >> 63 else m for m in h] for h in cfg.multipliers[1]])
    primes = torch.tensor(cfg.primes)
    ids = torch.randint(0, V, (T,), generator=gen)
    hist = torch.tensor([0, 17])                                   # a continuing request
    x_emb = torch.randn(T, C, generator=gen, dtype=F64)
    table = torch.randn(V, L * P, generator=gen, dtype=F64)
    G = torch.randn(cfg.table_rows, L * P // cfg.num_heads, generator=gen, dtype=F64)
    w_ple = torch.randn(C, L * P, generator=gen, dtype=F64)
    norm_w = 0.2 * torch.randn(P, generator=gen, dtype=F64)
    got = ple_embed_op(ids, hist, x_emb, table, G, w_ple, norm_w, mult2, mult3, primes)
    want = second_ple_embed(ids, hist, x_emb, table, G, w_ple, norm_w, cfg)
    assert got.dtype == F64 and _close(got, want)
    assert not _close(got, second_ple_embed(ids, hist, x_emb, table, G, w_ple, norm_w, cfg,
                                            ngram_before_scale=True))


def miller_rabin(n: int) -> bool:
    """Deterministic for n < 3,215,031,751 with the bases 2, 3, 5, 7."""
    if n < 2:
        return False
    for p in (2, 3, 5, 7):
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in (2, 3, 5, 7):
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


@pytest.mark.second_formulation("spec.ops.ple:is_prime", "spec.ops.ple:ple_history_init")
def test_is_prime_equals_miller_rabin_and_a_new_history_is_two_pads():
    rng = random.Random(63)
    samples = list(range(0, 3000)) + [rng.randrange(2 ** 20, 2 ** 31) for _ in range(300)]
    samples += [2 ** 31 - 1, 65521, 65519, 65537 * 65537, 46337 * 46349]   # primes, squares
    assert [is_prime(n) for n in samples] == [miller_rabin(n) for n in samples]
    hist = ple_history_init(151643)
    assert hist.dtype == torch.int64 and hist.tolist() == [151643, 151643]
