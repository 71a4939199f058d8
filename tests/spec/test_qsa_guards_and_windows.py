"""QSA guards, meta paths and windows the cells' seeded inputs never reach (docs/spec.md, "QSA:
sparse attention with a block index" items 1 to 5).

- A token whose position is negative or whose block has no page is refused by the KV append and the
  index store (an unassigned page is -1, which would index the last page).
- The index scores refuse a complete block whose key is not valid, on the row loop and on the meta
  path the reach tracer runs; page 0 is a page like any other there.
- On meta the index store keeps the valid flags exact: the block whose 32nd token arrives is valid.
- With one local block the candidates end at the last complete block, ``(t + 1) // 32`` blocks: at
  t = 160 block 4 is complete and outside the window, so with k large enough it is selected.
"""

from __future__ import annotations

import pytest
import torch

from impl.kernels.qsa.torch_topk_expand import qsa_topk_expand as torch_topk_expand
from spec.ops.qsa import empty_planes, qsa_index_scores, qsa_index_store, qsa_kv_append, qsa_topk_expand

pytestmark = pytest.mark.premerge

META = torch.device("meta")


def _planes(pages: int = 4, device=None):
    return empty_planes(pages, 1, 16, 16, device=device)


@pytest.mark.certify_guard("qsa_kv_append")
@pytest.mark.certify_guard("qsa_index_store")
@pytest.mark.parametrize("position,page", [(-1, 1), (5, -1)], ids=["negative-position", "no-page"])
def test_a_token_without_a_place_is_refused(position, page):
    p = _planes()
    table = torch.tensor([[page, 2]], dtype=torch.int32)
    seq, pos = torch.tensor([0]), torch.tensor([position])
    k = torch.zeros(1, 1, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        qsa_kv_append(p.k_cache, p.v_cache, p.pos_plane, table, seq, pos, k, k)
    with pytest.raises(ValueError):
        qsa_index_store(p.index_plane, p.block_keys, p.block_key_valid, table, seq, pos,
                        torch.zeros(1, 16, dtype=torch.bfloat16))


def _scores_inputs(device=None, valid=True):
    """A row at t = 40 whose one complete block lives in page 0; the table and the valid flags are
    host tensors (on meta too: the tracer keeps them on the host)."""
    p = _planes(device=device)
    flags = torch.zeros(4, dtype=torch.bool)
    flags[0] = valid
    if device is None:
        p.block_keys.zero_()
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    q = torch.zeros(1, 16, 16, dtype=torch.bfloat16, device=device)
    w = torch.zeros(1, 16, dtype=torch.bfloat16, device=device)
    return q, w, torch.tensor([0]), torch.tensor([40]), table, p.block_keys, flags


@pytest.mark.certify_guard("qsa_index_scores")
@pytest.mark.parametrize("device", [None, META], ids=["rows", "meta"])
def test_index_scores_read_page_zero_and_refuse_a_block_without_a_key(device):
    scores = qsa_index_scores(*_scores_inputs(device))
    assert scores.shape == (1, 2)
    with pytest.raises(ValueError, match="no block key"):
        qsa_index_scores(*_scores_inputs(device, valid=False))


@pytest.mark.certify_guard("qsa_index_store")
def test_the_meta_index_store_marks_the_block_its_32nd_token_completes():
    p = _planes(device=META)
    valid = torch.zeros(4, dtype=torch.bool)           # the flags are host-side on meta too
    table = torch.tensor([[3, 1]], dtype=torch.int32)
    positions = torch.tensor([30, 31, 32])             # block 0 (page 3) completes, block 1 starts
    _, _, valid = qsa_index_store(p.index_plane, p.block_keys, valid, table,
                                  torch.zeros(3, dtype=torch.long), positions,
                                  torch.zeros(3, 16, dtype=torch.bfloat16, device=META))
    assert valid.tolist() == [False, False, False, True]


@pytest.mark.certify_property("qsa_topk_expand")
@pytest.mark.parametrize("impl", ["spec", "torch"])
def test_one_local_block_leaves_the_last_complete_block_a_candidate(impl):
    t = 160                                           # first token of block 5: blocks 0..4 complete
    scores = torch.zeros(1, 8)
    positions, lens = torch.tensor([t]), torch.tensor([t + 1])
    if impl == "spec":
        selected, _ = qsa_topk_expand(scores, positions, lens, k=4, sink_blocks=1, local_blocks=1)
    else:
        selected = torch.empty(1, 6, dtype=torch.int64)
        torch_topk_expand(scores, positions, lens, selected=selected,
                          tokens=torch.empty(1, 32 * 6, dtype=torch.int64), k=4, sink_blocks=1,
                          local_blocks=1)
    got = sorted(b for b in selected[0].tolist() if b >= 0)
    assert got == [0, 1, 2, 3, 4, 5], got    # window {0, 5}; candidates 1..4, all within k = 4
