"""The MoE block's routing kernels (impl/kernels/moe/triton_moe.py) on the CPU through Triton's
interpreter: ``_topk_kernel`` against spec.ops.moe.moe_route's ranking rule (ids exactly, weights to
the rounding of one renormalising sum), and ``_blocks_kernel`` against the sort-and-scan grouping
bit for bit, on random routings, ties, NaN rows and every pair count up to the kernel's limit."""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import pytest
import torch

from impl.kernels.moe import triton_moe
from spec.ops.moe import moe_route


def _spec_topk(p: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    rank_key = torch.where(torch.isnan(p), torch.full_like(p, float("-inf")), p)
    ids = torch.sort(rank_key, dim=-1, descending=True, stable=True).indices[:, :k]
    sel = torch.gather(p, -1, ids)
    return ids, sel / sel.sum(dim=-1, keepdim=True)


def _sum_order_rtol(k: int) -> float:
    """Two fp32 sums of the same k positive terms in other orders each lie within (k - 1) u of the
    exact sum (u = 2^-24), so within 2 (k - 1) u of each other; the quotient's own rounding adds one
    more u."""
    return (2 * (k - 1) + 1) * 2 ** -24


def _rows_with_ties(E: int, gen: torch.Generator) -> torch.Tensor:
    p = torch.softmax(torch.randn(24, E, generator=gen) * 2, dim=-1)
    p[1, :] = 1.0 / E                                  # every expert tied
    p[2, 5:40] = p[2, 3]                               # a run of ties across the k-th place
    p[3, E - 1] = p[3].max()                           # the last expert ties the best
    p[4, 7] = float("nan")                             # a NaN ranks last
    p[5, :] = float("nan")                             # an all-NaN row: index order
    p[6, ::2] = 0.0                                    # exact zeros below the k-th place
    return p


@pytest.mark.parametrize("E,k", [(512, 10), (16, 10), (24, 3), (8, 8)])
def test_topk_ranks_as_the_spec(E, k):
    gen = torch.Generator().manual_seed(E * 31 + k)
    p = _rows_with_ties(E, gen)
    ids = torch.empty(p.shape[0], k, dtype=torch.int64)
    w = torch.empty(p.shape[0], k)
    triton_moe._topk_kernel[(p.shape[0],)](p, ids, w, E, TOP_K=k,
                                           BE=triton_moe.triton.next_power_of_2(E))
    want_ids, want_w = _spec_topk(p, k)
    assert torch.equal(ids, want_ids)
    finite = ~torch.isnan(want_w).any(dim=1)
    assert torch.allclose(w[finite], want_w[finite], rtol=_sum_order_rtol(k), atol=0)
    assert torch.equal(torch.isnan(w), torch.isnan(want_w))


def test_route_ranks_its_logits_as_the_spec():
    """route's GEMM is not the spec's row-wise one (the moe cells certify that to a band); on the
    same softmax the selection is the spec's rule."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 64, generator=gen).bfloat16()
    w_router = torch.randn(32, 64, generator=gen).bfloat16()
    ids, w = triton_moe.route(x, w_router, 4)
    p = torch.softmax(triton_moe.widened_matmul(x, w_router.T), dim=-1)
    want_ids, want_w = _spec_topk(p, 4)
    assert torch.equal(ids, want_ids)
    assert torch.allclose(w, want_w, rtol=_sum_order_rtol(4), atol=0)
    spec_ids, _ = moe_route(x, w_router, 4)
    assert torch.equal(ids, spec_ids)   # no near-tie in these rows: the spec's own GEMM agrees


def _routing(P: int, E: int, gen: torch.Generator, hot: bool) -> torch.Tensor:
    if hot:   # many pairs on a few experts: blocks that fill and spill over
        return torch.randint(0, min(E, 3), (P,), generator=gen)
    return torch.randint(0, E, (P,), generator=gen)


@pytest.mark.parametrize("bm", [16, 64])
@pytest.mark.parametrize("E", [8, 512])
def test_the_one_launch_grouping_equals_the_sorted_one(bm, E):
    gen = torch.Generator().manual_seed(bm + E)
    for P in list(range(1, 20)) + [31, 32, 33, 64, 80, 127, 128]:
        for hot in (False, True):
            ids = _routing(P, E, gen, hot)
            got = triton_moe.expert_blocks(ids, E, bm)
            want = triton_moe.expert_blocks_sorted(ids, E, bm)
            assert torch.equal(got[0], want[0]), (P, hot)
            assert torch.equal(got[1], want[1]), (P, hot)


def test_past_the_kernels_limit_the_sorted_grouping_runs():
    ids = torch.randint(0, 512, (triton_moe.BLOCKS_KERNEL_MAX_PAIRS + 1,))
    got = triton_moe.expert_blocks(ids, 512, 16)
    want = triton_moe.expert_blocks_sorted(ids, 512, 16)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
