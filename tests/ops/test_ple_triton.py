"""The Triton PLE kernel (impl/kernels/ple/triton_ple.py) on the CPU through Triton's interpreter,
beyond the cells' geometry: G rows that hold several layers (the target's three), one layer, or
less than one (the tiny model's, a hash per column), with one request's history and a history per
row.

With E and W_ple zero, e is G's gathered row over sqrt(2), one correctly rounded division and one
rounding to bf16 in both the kernel and the spec's fp32 path: equal bits prove the hash (wrapping
64-bit products, XOR, the unsigned remainder at the target's primes) and the gather exact. With
random tables e stays within the cells' band of the float64 spec (1 ulp of the row maximum)."""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import pytest
import torch

from impl.kernels.ple import triton_ple
from impl.model.ops import _hash_constants
from spec.config import largest_primes_below
from spec.ops.ple import NgramHashConfig, ple_embed

V, C = 97, 64


def _hash(gen: torch.Generator, bound: int) -> NgramHashConfig:
    flat = largest_primes_below(bound, 16)
    odd = lambda: int(torch.randint(0, 2 ** 62, (1,), generator=gen)) * 2 + 1  # noqa: E731
    return NgramHashConfig(multipliers=tuple(tuple(tuple(odd() for _ in range(n)) for _ in range(8))
                                             for n in (2, 3)),
                           primes=(flat[:8], flat[8:]), pad_id=V - 1)


def _case(L: int, P: int, T: int, per_row: bool, random_tables: bool, bound: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    hc = _hash(gen, bound)
    width = L * P // 16
    table = torch.randn(V, L * P, generator=gen).to(torch.bfloat16)
    ngram = torch.randn(hc.table_rows, width, generator=gen).to(torch.bfloat16)
    w_ple = (torch.randn(C, L * P, generator=gen) / C ** 0.5).to(torch.bfloat16)
    if not random_tables:
        table.zero_()
        w_ple.zero_()
    ids = torch.randint(0, V, (T,), generator=gen)
    ids[0] = V - 1                                              # the pad id as a token
    history = torch.randint(0, V, (T, 2) if per_row else (2,), generator=gen)
    x = torch.randn(T, C, generator=gen).to(torch.bfloat16)
    norm_w = torch.randn(P, generator=gen) * 0.1
    return hc, (ids, history, x, table, ngram, w_ple, norm_w)


def _kernel(hc, inputs) -> torch.Tensor:
    ids, history, x, table, ngram, w_ple, norm_w = inputs
    m2, m3, primes = _hash_constants(hc, torch.device("cpu"))
    P = norm_w.shape[0]
    e = torch.full((ids.shape[0], table.shape[1] // P, P), float("nan"), dtype=torch.bfloat16)
    triton_ple.ple_embed(ids, history, x, table, ngram, w_ple, norm_w, m2, m3, primes, e=e)
    return e


# (L, P): G rows of 3 layers (the target's 48 x 256 -> 768), of one layer, of half a layer
GEOMETRIES = [(48, 8), (16, 16), (8, 32)]


@pytest.mark.certify_property("ple_embed")
@pytest.mark.parametrize("L,P", GEOMETRIES)
@pytest.mark.parametrize("per_row", [False, True])
def test_the_gathered_rows_are_the_specs_bit_for_bit(L, P, per_row):
    hc, inputs = _case(L, P, 9, per_row, random_tables=False, bound=65536, seed=L + per_row)
    want = ple_embed(*inputs[:6], inputs[6], hc)                 # fp32 spec path, bf16 output
    assert torch.equal(_kernel(hc, inputs).view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("L,P", GEOMETRIES)
@pytest.mark.parametrize("per_row", [False, True])
def test_e_within_one_ulp_of_the_float64_spec(L, P, per_row):
    hc, inputs = _case(L, P, 7, per_row, random_tables=True, bound=4096, seed=100 + L + per_row)
    got = _kernel(hc, inputs).double()
    want = ple_embed(*(t.double() if t.is_floating_point() else t for t in inputs), hc)
    row_max = want.abs().amax(-1, keepdim=True)
    ulp = torch.exp2(torch.floor(torch.log2(row_max)) - 7)
    assert float(((got - want).abs() / ulp).max()) <= 1.0


def test_a_wrong_multiplier_is_caught():
    hc, inputs = _case(48, 8, 9, True, random_tables=False, bound=65536, seed=3)
    want = ple_embed(*inputs[:6], inputs[6], hc)
    m3 = list(hc.multipliers[1])
    m3[5] = (m3[5][0], m3[5][1] ^ (1 << 40), m3[5][2])
    bad = NgramHashConfig(multipliers=(hc.multipliers[0], tuple(m3)), primes=hc.primes,
                          pad_id=hc.pad_id)
    assert not torch.equal(_kernel(bad, inputs).view(torch.int16), want.view(torch.int16))


@pytest.mark.certify_guard("ple_embed")
@pytest.mark.parametrize("rows", [8, 10])
def test_a_per_row_history_of_another_row_count_is_refused(rows):
    hc, (ids, _, x, table, ngram, w_ple, norm_w) = _case(16, 16, 9, True, random_tables=False,
                                                         bound=65536, seed=4)
    history = torch.zeros(rows, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"a per-row history must be \[9, 2\]"):
        _kernel(hc, (ids, history, x, table, ngram, w_ple, norm_w))
