"""The QSA storage and expansion spec functions against formulations written independently of them
(docs/spec.md, "QSA" items 1, 2, 4 and 5 and its "Layout"), on seeded inputs that cross page
boundaries (positions 31 / 32, a block completed mid-step, pages out of order in the block table).

The spec scatters each new token into its slot; the formulations here go the other way, slot by
slot: for every (page, offset) of the pool they look up, through the block table's inverse, which
token of which sequence lives there, and read that token's row from the step (or keep the old
value). Expansion enumerates positions 0..t and keeps those whose block is selected, where the spec
enumerates blocks. Block keys are a left fold in the planes' accumulation dtype written in numpy
(fp32: bitwise), and ``math.fsum`` in float64.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from spec.ops.qsa import (block_key, empty_planes, qsa_expand, qsa_index_store,
                          qsa_index_store_into, qsa_kv_append, qsa_kv_append_into, qsa_select,
                          qsa_topk_expand, selection_width, slot_of)
from tests.spec.test_second_formulations_storage import selection_by_sorting

pytestmark = pytest.mark.premerge

F64 = torch.float64
TPB = 32                 # tokens a block, a page (docs/spec.md, "Geometry")


def _close(a, b) -> bool:
    # Float64 block keys: a left fold and math.fsum of 32 values differ by at most 32 x 1.1e-16
    # of the largest partial sum (keys up to 2^12 x 4: 2^14 x 32 x 1.1e-16 = 5.8e-11 in the worst
    # case); rtol 1e-12 of each key plus atol 1e-10 covers it, a wrong slot or a missing / 32 is
    # off by far more.
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-12, atol=1e-10)


# ---------------------------------------------------------------- a paged layout with a step


def _layout(seed: int):
    """Three sequences with pages scattered over a pool of 12 (one page unassigned), their prior
    lengths, and one step of new tokens: sequence 0 crosses 31 -> 32, sequence 1 completes block 1
    with its slot-31 token and starts block 2, sequence 2 is a fresh one-token prefill."""
    gen = torch.Generator().manual_seed(seed)
    pages = torch.randperm(12, generator=gen).tolist()
    block_table = torch.full((3, 4), -1, dtype=torch.int32)
    block_table[0, :2] = torch.tensor(pages[0:2])
    block_table[1, :3] = torch.tensor(pages[2:5])
    block_table[2, :1] = torch.tensor(pages[5:6])
    prior = [30, 60, 0]                       # tokens already stored per sequence
    new = [(0, 30), (0, 31), (0, 32), (0, 33),
           (1, 60), (1, 61), (1, 62), (1, 63), (1, 64),
           (2, 0)]
    seq_ids = torch.tensor([s for s, _ in new])
    positions = torch.tensor([p for _, p in new])
    return block_table, prior, seq_ids, positions, gen


def _inverse(block_table: torch.Tensor) -> dict[int, tuple[int, int]]:
    """page -> (sequence, logical block), from the block table."""
    return {int(p): (s, b) for s, row in enumerate(block_table.tolist()) for b, p in enumerate(row)
            if p >= 0}


def _token_rows(seq_ids, positions) -> dict[tuple[int, int], int]:
    return {(int(s), int(p)): i for i, (s, p) in enumerate(zip(seq_ids, positions))}


# ---------------------------------------------------------------- slot_of, selection_width


@pytest.mark.second_formulation("spec.ops.qsa:slot_of")
def test_slot_of_reads_the_block_table_at_position_over_32():
    block_table, _, seq_ids, positions, _ = _layout(1)
    table = block_table.tolist()
    pages, offsets = slot_of(block_table, seq_ids, positions)
    mine = [(table[s][p // TPB], p % TPB) for s, p in zip(seq_ids.tolist(), positions.tolist())]
    assert list(zip(pages.tolist(), offsets.tolist())) == mine
    # wrong: the page read from the sequence's first block, which the step's pages do not all equal.
    assert pages.tolist() != [table[s][0] for s in seq_ids.tolist()]
    for bad_seq, bad_pos in ((2, 32), (0, 128), (0, -1)):   # no page, past the table, negative
        with pytest.raises(ValueError):
            slot_of(block_table, torch.tensor([bad_seq]), torch.tensor([bad_pos]))


@pytest.mark.second_formulation("spec.ops.qsa:selection_width")
def test_selection_width_is_top_k_plus_the_window():
    assert selection_width() == 64 + 1 + 2 == 67      # docs/spec.md, "QSA" item 4: width 67
    assert selection_width(5, 2, 3) == 10
    scores = torch.randn(4, 100, generator=torch.Generator().manual_seed(2), dtype=F64)
    assert qsa_select(scores, torch.tensor([3199, 40, 2000, 3100])).shape == (4, 67)


# ---------------------------------------------------------------- 1. KV append


def kv_append_by_slot(k_cache, v_cache, pos_plane, block_table, seq_ids, positions, k, v):
    """For every (page, offset): the token there is position 32 b + offset of the page's (sequence,
    block b); if the step holds that token its k, v and position are the slot's, else the old."""
    inv, rows = _inverse(block_table), _token_rows(seq_ids, positions)
    K, V, P = k_cache.clone(), v_cache.clone(), pos_plane.clone()
    for page in range(k_cache.shape[0]):
        if page not in inv:
            continue
        s, b = inv[page]
        for off in range(TPB):
            i = rows.get((s, TPB * b + off))
            if i is not None:
                K[page, off], V[page, off], P[page, off] = k[i], v[i], TPB * b + off
    return K, V, P


@pytest.mark.second_formulation("spec.ops.qsa:qsa_kv_append", "spec.ops.qsa:qsa_kv_append_into")
@pytest.mark.parametrize("dtype", (F64, torch.bfloat16))
def test_kv_append_equals_the_slot_by_slot_lookup(dtype):
    block_table, prior, seq_ids, positions, gen = _layout(3)
    planes = empty_planes(12, 2, 16, 8, dtype=dtype)
    old_k = torch.randn(planes.k_cache.shape, generator=gen, dtype=F64).to(dtype)
    old_v = torch.randn(planes.v_cache.shape, generator=gen, dtype=F64).to(dtype)
    old_pos = torch.randint(0, 99, planes.pos_plane.shape, generator=gen, dtype=torch.int32)
    k = torch.randn(len(seq_ids), 2, 16, generator=gen, dtype=F64)
    v = torch.randn(len(seq_ids), 2, 16, generator=gen, dtype=F64)
    got = qsa_kv_append(old_k, old_v, old_pos, block_table, seq_ids, positions, k, v)
    want = kv_append_by_slot(old_k, old_v, old_pos, block_table, seq_ids, positions,
                             k.to(dtype), v.to(dtype))
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    into = (old_k.clone(), old_v.clone(), old_pos.clone())
    qsa_kv_append_into(*into, block_table, seq_ids, positions, k, v)
    for a, b in zip(into, want):
        assert torch.equal(a, b)
    # wrong: positions shifted by one (each token one slot late) does not give the same pools.
    late = kv_append_by_slot(old_k, old_v, old_pos, block_table, seq_ids, positions + 1,
                             k.to(dtype), v.to(dtype))
    assert not torch.equal(late[0], got[0])


# ---------------------------------------------------------------- 2. index store, block keys


def fold(keys: np.ndarray, dtype) -> np.ndarray:
    """Slots 0..31 added one after the other in ``dtype``, then / 32 (exact)."""
    total = np.zeros(keys.shape[-1], dtype=dtype)
    for row in keys:
        total = (total + row.astype(dtype)).astype(dtype)
    return total / dtype(TPB)


def index_store_by_slot(index_plane, block_keys, valid, block_table, seq_ids, positions, k_index):
    """Every slot as in ``kv_append_by_slot``; then every page the step wrote: a block key (the
    mean of its 32 stored keys, math.fsum / 32 in float64, the fp32 left fold otherwise) and a valid
    flag when its slot 31 was written in the step, else invalid; other pages unchanged."""
    inv, rows = _inverse(block_table), _token_rows(seq_ids, positions)
    plane, keys, flags = index_plane.clone(), block_keys.clone(), valid.clone()
    for page in range(index_plane.shape[0]):
        if page not in inv:
            continue
        s, b = inv[page]
        written = [off for off in range(TPB) if (s, TPB * b + off) in rows]
        for off in written:
            plane[page, off] = k_index[rows[(s, TPB * b + off)]].to(plane.dtype)
        if not written:
            continue
        flags[page] = (TPB - 1) in written
        if flags[page]:
            stored = plane[page]
            if stored.dtype == F64:
                col = stored.T.tolist()
                keys[page] = torch.tensor([math.fsum(c) / TPB for c in col], dtype=F64)
            else:
                keys[page] = torch.from_numpy(fold(stored.float().numpy(), np.float32)
                                              ).to(keys.dtype)
    return plane, keys, flags


@pytest.mark.second_formulation("spec.ops.qsa:qsa_index_store", "spec.ops.qsa:qsa_index_store_into",
                                "spec.ops.qsa:block_key")
@pytest.mark.parametrize("dtype", (F64, torch.bfloat16))
def test_index_store_and_block_keys_equal_the_slot_by_slot_lookup(dtype):
    block_table, prior, seq_ids, positions, gen = _layout(4)
    planes = empty_planes(12, 2, 16, 8, dtype=dtype)
    plane = planes.index_plane.clone()
    # The sequences' earlier tokens, as stored, with magnitudes spread over 2^-12 .. 2^12 so that
    # an fp32 sum of 32 bf16 keys rounds, and its order (slot 0 first) shows in the result.
    for s, n in enumerate(prior):
        for j in range(n):
            page = int(block_table[s, j // TPB])
            spread = torch.exp2(torch.randint(-12, 13, (8,), generator=gen)).to(F64)
            plane[page, j % TPB] = (torch.randn(8, generator=gen, dtype=F64) * spread).to(dtype)
    # Block keys held in fp32 beside the bf16 index plane, so the fp32 fold is seen unrounded.
    keys = torch.randn(planes.block_keys.shape, generator=gen, dtype=F64).to(
        F64 if dtype == F64 else torch.float32)
    valid = torch.rand(12, generator=gen) < 0.5
    # fp32 rows with bf16 planes, so the spec accumulates in fp32 (float64 in reference mode).
    k_index = torch.randn(len(seq_ids), 8, generator=gen, dtype=F64).to(
        F64 if dtype == F64 else torch.float32)
    got = qsa_index_store(plane, keys, valid, block_table, seq_ids, positions, k_index)
    want = index_store_by_slot(plane, keys, valid, block_table, seq_ids, positions, k_index)
    completed = [int(block_table[0, 0]), int(block_table[1, 1])]
    assert got[2][completed].all() and not got[2][int(block_table[0, 1])]
    assert torch.equal(got[0].isnan(), want[0].isnan())
    assert torch.equal(got[0].nan_to_num(), want[0].nan_to_num()) and torch.equal(got[2], want[2])
    checked = want[2]                            # block keys are defined where the flag is valid
    if dtype == F64:
        assert _close(got[1][checked], want[1][checked])
    else:
        assert torch.equal(got[1][checked], want[1][checked])
    into = (plane.clone(), keys.clone(), valid.clone())
    qsa_index_store_into(*into, block_table, seq_ids, positions, k_index)
    assert torch.equal(into[1][checked], got[1][checked]) and torch.equal(into[2], got[2])
    for page in completed:                       # block_key alone, on the stored page
        mine = want[1][page].to(F64)
        spec = block_key(got[0][page], want[1].dtype).to(F64)
        assert _close(spec, mine) if dtype == F64 else torch.equal(spec, mine)
        # wrong: the sum without the / 32.
        assert not _close(spec * TPB, mine)


# ---------------------------------------------------------------- 5. expansion, 4 + 5 fused


def expand_by_position(selected, positions, context_lens=None):
    """Per row: positions j = 0 .. min(t, ctx - 1) whose block j // 32 is selected, ascending,
    padded with -1 to 32 x width."""
    width = TPB * selected.shape[1]
    out = torch.full((selected.shape[0], width), -1, dtype=torch.int64)
    for r, (row, t) in enumerate(zip(selected.tolist(), positions.tolist())):
        limit = t + 1 if context_lens is None else min(t + 1, int(context_lens[r]))
        chosen = set(row)
        toks = [j for j in range(limit) if j // TPB in chosen]
        out[r, :len(toks)] = torch.tensor(toks, dtype=torch.int64)
    return out


def _selections(seed: int, n: int = 60, width: int = 6, blocks: int = 20):
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, TPB * blocks, (n,), generator=gen)
    positions[:6] = torch.tensor([0, 31, 32, 63, 64, TPB * blocks - 1])
    # -1 padding, duplicate ids, any order
    sel = torch.randint(-1, blocks, (n, width), generator=gen)
    ctx = positions + 1 - torch.randint(0, 40, (n,), generator=gen).clamp(max=positions)
    return sel, positions, ctx


@pytest.mark.second_formulation("spec.ops.qsa:qsa_expand")
def test_expand_equals_the_positions_whose_block_is_selected():
    sel, positions, ctx = _selections(5)
    assert torch.equal(qsa_expand(sel, positions), expand_by_position(sel, positions))
    got = qsa_expand(sel, positions, ctx)
    assert torch.equal(got, expand_by_position(sel, positions, ctx))
    # wrong: the context length ignored (tokens up to t even past the sequence's end).
    assert not torch.equal(got, expand_by_position(sel, positions))


@pytest.mark.second_formulation("spec.ops.qsa:qsa_topk_expand")
def test_topk_expand_equals_sorted_selection_then_positions():
    gen = torch.Generator().manual_seed(6)
    n, cols, k = 40, 30, 4
    palette = torch.tensor([-1.0, 0.0, -0.0, 0.5, 2.0, math.nan], dtype=F64)
    scores = palette[torch.randint(0, 6, (n, cols), generator=gen)]
    scores = torch.where(torch.rand(n, cols, generator=gen) < 0.4,
                         torch.randn(n, cols, generator=gen, dtype=F64), scores)
    positions = torch.randint(0, TPB * cols, (n,), generator=gen)
    positions[:4] = torch.tensor([31, 32, 96, TPB * cols - 1])
    ctx = positions + 1 - torch.randint(0, 20, (n,), generator=gen).clamp(max=positions)
    selected, tokens = qsa_topk_expand(scores, positions, ctx, k=k)
    width = k + 1 + 2
    mine = torch.full((n, width), -1, dtype=torch.int64)
    for r in range(n):
        ids = sorted(selection_by_sorting(scores[r].tolist(), int(positions[r]), k, 1, 2))
        mine[r, :len(ids)] = torch.tensor(ids)
    assert torch.equal(selected, mine)
    assert torch.equal(tokens, expand_by_position(mine, positions, ctx))
    # wrong: score ties broken towards the lower block index.
    low = [sorted(selection_by_sorting(scores[r].tolist(), int(positions[r]), k, 1, 2, "ties_low"))
           for r in range(n)]
    assert any(a != [b for b in row if b >= 0] for a, row in zip(low, selected.tolist()))
