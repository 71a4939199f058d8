"""The torch PLE variant's all-heads hash (``ngram_rows``) equals the spec's ``ple_ngram_hash``
exactly: the same integers, for one request's history and for a history per row."""

from __future__ import annotations

import pytest
import torch

from impl.kernels.ple.torch_ple import _config, ngram_rows
from spec.cases.ple import PAD, VOCAB, _multipliers, _primes
from spec.ops.ple import ple_ngram_hash


def _cfg(seed: int, lo: int, hi: int):
    gen = torch.Generator().manual_seed(seed)
    return _config(_multipliers(gen, 8, 2), _multipliers(gen, 8, 3), _primes(gen, 16, lo, hi))


@pytest.mark.parametrize("seed,lo,hi", [(0, 1000, 3000), (1, 2**30, 2**31)])
def test_all_heads_hash_equals_the_spec(seed, lo, hi):
    cfg = _cfg(seed, lo, hi)
    gen = torch.Generator().manual_seed(10 + seed)
    ids = torch.randint(0, VOCAB, (257,), generator=gen)
    ids[:4] = torch.tensor([0, VOCAB - 1, PAD, (1 << 62) + 12345])   # extremes, a 63-bit id
    for history in (torch.tensor([PAD, PAD]), torch.randint(0, VOCAB, (2,), generator=gen),
                    torch.randint(0, VOCAB, (257, 2), generator=gen)):
        assert torch.equal(ngram_rows(ids, history, cfg), ple_ngram_hash(ids, history, cfg))


def test_a_wrong_limb_is_caught():
    # The comparison sees one flipped bit of one multiplier: the test can fail.
    cfg = _cfg(0, 1000, 3000)
    bad = _config(*(t.clone() for t in _cfg_tensors(0)))
    ids = torch.arange(64)
    assert not torch.equal(ngram_rows(ids, torch.tensor([PAD, PAD]), bad),
                           ple_ngram_hash(ids, torch.tensor([PAD, PAD]), cfg))


def _cfg_tensors(seed: int):
    gen = torch.Generator().manual_seed(seed)
    m2, m3, p = _multipliers(gen, 8, 2), _multipliers(gen, 8, 3), _primes(gen, 16, 1000, 3000)
    m3[5, 1] ^= 1 << 40
    return m2, m3, p
