"""How the MoE kernels split their work, checked against what each helper promises ("MoE" in
docs/spec.md defines the block; these are the kernels' own bookkeeping).

- The torch composition groups the (token, slot) pairs by expert (``_expert_rows``): every pair once,
  under its expert, in pair order. A cell of one token cannot see a wrong grouping (every pair is
  that token's), so the grouping is checked on its own, on several tokens.
- The Triton grouped GEMM groups the pairs into blocks of BM rows per expert; past the one-launch
  kernel's pair limit a sort and scans do it (``expert_blocks_sorted``), checked here against the
  layout ``expert_blocks`` promises, from the routing alone.
- The Triton grouped GEMM splits K into at most ``want`` parts of whole BK steps (``k_parts``): the
  most that divide K, one where none does. The part count fixes the fp32 summation order the cells'
  bands admit either way, so it is pinned here.
"""

from __future__ import annotations

import pytest
import torch

from impl.kernels.moe.torch_moe import _expert_rows, routed_experts
from impl.kernels.moe.triton_moe import expert_blocks_sorted, k_parts


@pytest.mark.certify_property("moe")
@pytest.mark.certify_property("moe_nvfp4_experts")
def test_torch_groups_every_pair_under_its_expert_in_pair_order():
    ids = torch.tensor([[3, 1], [1, 2], [3, 0]])          # pairs 0..5 = token * 2 + slot
    used, rows = _expert_rows(ids)
    assert used == [0, 1, 2, 3]
    assert rows.tolist() == [[5, -1], [1, 2], [3, -1], [0, 4]]


@pytest.mark.certify_property("moe")
@pytest.mark.certify_property("moe_nvfp4_experts")
def test_torch_grouping_on_random_routes():
    gen = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(9)])
    used, rows = _expert_rows(ids)
    flat = ids.reshape(-1)
    assert used == sorted(set(flat.tolist()))
    for e, r in zip(used, rows.tolist()):
        pairs = [p for p in r if p >= 0]
        assert pairs == sorted(pairs) and pairs == (flat == e).nonzero().flatten().tolist()
        assert all(p == -1 for p in r[len(pairs):])


@pytest.mark.certify_property("moe")
@pytest.mark.certify_property("moe_nvfp4_experts")
@pytest.mark.parametrize("K,BK,want,parts", [
    (3072, 64, 4, 4), (512, 64, 4, 4), (192, 64, 4, 3), (320, 64, 4, 1), (128, 64, 4, 2),
    (3072, 64, 1, 1), (3072, 64, 0, 1), (32, 64, 4, 1)])
def test_triton_splits_k_into_the_most_whole_parts_at_most_asked(K, BK, want, parts):
    assert k_parts(K, BK, want) == parts


@pytest.mark.certify_guard("moe")
@pytest.mark.certify_guard("moe_nvfp4_experts")
@pytest.mark.parametrize("bad", [16, -1])
def test_torch_experts_refuse_an_expert_id_outside_the_table(bad):
    """An id past the 16-expert table, or negative, is refused before any weight is read (the
    weights are left out: a check that read them would fail otherwise)."""
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 3], [bad, 5]])
    table = torch.zeros(16, 8, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"expert ids must lie in 0\.\.15"):
        routed_experts(x, ids, torch.full((2, 2), 0.5), table, *([None] * 10))


@pytest.mark.certify_property("moe")
@pytest.mark.certify_property("moe_nvfp4_experts")
@pytest.mark.parametrize("E,bm,hot", [(16, 16, False), (16, 16, True), (512, 64, False)])
def test_triton_sorted_grouping_lays_out_each_experts_pairs_in_blocks(E, bm, hot):
    gen = torch.Generator().manual_seed(E + bm + hot)
    P = 300                                   # past the one-launch kernel's 128 pairs
    flat = torch.randint(0, 3 if hot else E, (P,), generator=gen)
    rows_of, block_expert = expert_blocks_sorted(flat, E, bm)
    max_blocks = -(-P // bm) + min(P, E)
    assert rows_of.shape == (max_blocks * bm,) and block_expert.shape == (max_blocks,)
    blocks = rows_of.view(max_blocks, bm).tolist()
    experts = block_expert.tolist()
    used = sorted(set(flat.tolist()))
    want_experts = [e for e in used for _ in range(-(-int((flat == e).sum()) // bm))]
    n = len(want_experts)
    assert experts[:n] == want_experts and all(e == E for e in experts[n:]), experts
    for e in used:
        mine = [b for b, x in zip(blocks[:n], experts) if x == e]
        pairs = [p for blk in mine for p in blk if p >= 0]
        assert pairs == (flat == e).nonzero().flatten().tolist()
        padded = [p for blk in mine for p in blk]
        assert padded == pairs + [-1] * (len(padded) - len(pairs))
    assert all(p == -1 for blk in blocks[n:] for p in blk)
