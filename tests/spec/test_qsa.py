"""Property tests and guards of the QSA spec (spec/ops/qsa.py; docs/spec.md, "QSA: sparse attention
with a block index").

Every random input is seeded from a hypothesis-drawn integer; floating inputs are shifted away from 0.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from spec.ops.qsa import (
    TOKENS_PER_BLOCK,
    block_key,
    dense_causal_gqa,
    empty_planes,
    num_complete_blocks,
    qsa_expand,
    qsa_index_scores,
    qsa_index_store,
    qsa_kv_append,
    qsa_select,
    qsa_sparse_gqa,
    select_row,
    window_blocks,
)

TPB = TOKENS_PER_BLOCK
NAN = float("nan")
INF = float("inf")


# ---------------------------------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------------------------------

def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) + 0.1).to(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN slots of empty planes compare equal to themselves)."""
    if not a.dtype.is_floating_point:
        return torch.equal(a, b)
    as_bytes = lambda x: x.contiguous().view(torch.uint8)  # noqa: E731
    return a.dtype == b.dtype and torch.equal(as_bytes(a), as_bytes(b))


def make_block_table(lengths: list[int], gen: torch.Generator, spare_pages: int = 2
                     ) -> tuple[torch.Tensor, int]:
    """A block table giving each sequence distinct, shuffled pages; unused entries -1."""
    need = [math.ceil(n / TPB) for n in lengths]
    max_pages = max(need) + 1
    num_pages = sum(need) + spare_pages
    perm = torch.randperm(num_pages, generator=gen).tolist()
    table = torch.full((len(lengths), max_pages), -1, dtype=torch.int32)
    for s, n in enumerate(need):
        for b in range(n):
            table[s, b] = perm.pop()
    return table, num_pages


def chunk_rounds(lengths: list[int], chunk: int,
                 gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rounds of a mixed batch: in round r every unfinished sequence contributes its next `chunk`
    positions; rows of a round are shuffled. Returns [(seq_ids, positions)] per round."""
    rounds = []
    for r in range(max(math.ceil(n / chunk) for n in lengths)):
        seqs, poss = [], []
        for s, n in enumerate(lengths):
            for j in range(r * chunk, min(n, (r + 1) * chunk)):
                seqs.append(s)
                poss.append(j)
        order = torch.randperm(len(seqs), generator=gen)
        rounds.append((torch.tensor(seqs)[order], torch.tensor(poss)[order]))
    return rounds


class Batch:
    """B sequences of per-token k, v, index keys (indexed [s][j]) stored into paged planes by rounds."""

    def __init__(self, seed: int, lengths: list[int], n_kv: int, head_dim: int, index_dim: int,
                 chunk: int, dtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.lengths = lengths
        self.dtype = dtype
        self.table, num_pages = make_block_table(lengths, gen)
        self.k = [_randn(gen, n, n_kv, head_dim, dtype=dtype) for n in lengths]
        self.v = [_randn(gen, n, n_kv, head_dim, dtype=dtype) for n in lengths]
        self.ki = [_randn(gen, n, index_dim, dtype=dtype) for n in lengths]
        self.planes = empty_planes(num_pages, n_kv, head_dim, index_dim, dtype)
        self.rounds = chunk_rounds(lengths, chunk, gen)
        self.gen = gen

    def rows(self, data: list[torch.Tensor], seq_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return torch.stack([data[int(s)][int(j)] for s, j in zip(seq_ids, positions)])

    def store_all(self, one_shot: bool = False):
        """Run kv append and index store over every round (or all tokens in one call)."""
        p = self.planes
        kc, vc, pos, ip, bk, bv = p
        rounds = self.rounds
        if one_shot:
            rounds = [(torch.cat([r[0] for r in rounds]), torch.cat([r[1] for r in rounds]))]
        for seq_ids, positions in rounds:
            kc, vc, pos = qsa_kv_append(kc, vc, pos, self.table, seq_ids, positions,
                                        self.rows(self.k, seq_ids, positions),
                                        self.rows(self.v, seq_ids, positions))
            ip, bk, bv = qsa_index_store(ip, bk, bv, self.table, seq_ids, positions,
                                         self.rows(self.ki, seq_ids, positions))
        return kc, vc, pos, ip, bk, bv


batch_params = st.fixed_dictionaries(dict(
    seed=st.integers(0, 2**31 - 1),
    lengths=st.lists(st.integers(1, 5 * TPB + 3), min_size=1, max_size=3),
    n_kv=st.integers(1, 2),
    head_dim=st.sampled_from([4, 8]),
    index_dim=st.sampled_from([4, 8]),
    chunk=st.sampled_from([1, 7, 32, 45, 1000]),
))

# Longer contexts (up to 10 blocks) so that a small k leaves candidates out; coarser chunks keep it cheap.
long_batch_params = st.fixed_dictionaries(dict(
    seed=st.integers(0, 2**31 - 1),
    lengths=st.lists(st.integers(1, 10 * TPB), min_size=1, max_size=3),
    n_kv=st.integers(1, 2),
    head_dim=st.sampled_from([4, 8]),
    index_dim=st.sampled_from([4, 8]),
    chunk=st.sampled_from([32, 45, 1000]),
))


# ---------------------------------------------------------------------------------------------------
# qsa_kv_append
# ---------------------------------------------------------------------------------------------------

@pytest.mark.certify_property("qsa_kv_append")
@given(batch_params, st.sampled_from([torch.bfloat16, torch.float64]))
def test_qsa_kv_append_properties(params: dict, dtype: torch.dtype) -> None:
    """Every token lands in its (page, offset) slot in the storage dtype; the position plane records
    its position; unwritten slots stay empty; chunking and row order of the appends do not matter."""
    batch = Batch(dtype=dtype, **params)
    before = [t.clone() for t in batch.planes[:3]]
    kc, vc, pos, *_ = batch.store_all()
    kc1, vc1, pos1, *_ = batch.store_all(one_shot=True)
    assert _same_bits(kc, kc1) and _same_bits(vc, vc1) and _same_bits(pos, pos1)

    written = torch.zeros(pos.shape, dtype=torch.bool)
    for s, n in enumerate(batch.lengths):
        for j in range(n):
            page, off = int(batch.table[s, j // TPB]), j % TPB
            assert torch.equal(kc[page, off], batch.k[s][j].to(kc.dtype))
            assert torch.equal(vc[page, off], batch.v[s][j].to(vc.dtype))
            assert int(pos[page, off]) == j
            written[page, off] = True
    assert bool((pos[~written] == -1).all())
    assert bool(kc[~written].isnan().all()) and bool(vc[~written].isnan().all())
    for t, b in zip(batch.planes[:3], before):  # inputs are never modified
        assert _same_bits(t, b)


@pytest.mark.certify_guard("qsa_kv_append")
def test_qsa_kv_append_guard() -> None:
    """Sequence 0 maps logical block 0 -> page 1 and block 1 -> page 0. Token position 33 is block 1,
    offset 1: it must land at page 0, slot 1, with position 33; nothing else changes."""
    planes = empty_planes(num_pages=2, n_kv_heads=1, head_dim=2, index_dim=2)
    table = torch.tensor([[1, 0]], dtype=torch.int32)
    k = torch.tensor([[[1.5, -2.0]]], dtype=torch.bfloat16)
    v = torch.tensor([[[3.0, 0.25]]], dtype=torch.bfloat16)
    kc, vc, pos = qsa_kv_append(planes.k_cache, planes.v_cache, planes.pos_plane, table,
                                torch.tensor([0]), torch.tensor([33]), k, v)
    assert kc[0, 1, 0].tolist() == [1.5, -2.0]
    assert vc[0, 1, 0].tolist() == [3.0, 0.25]
    assert pos[0, 1].item() == 33
    assert (pos == -1).sum().item() == 63  # the other 63 slots of the 2 pages are still empty
    assert kc.isnan().sum().item() == 63 * 2 and vc.isnan().sum().item() == 63 * 2


def test_qsa_kv_append_storage_seam() -> None:
    """A multi-pool format plugs in through store / load: here a toy two-pool format that keeps the
    high half of head_dim in a second pool. What load reads back is what store wrote."""
    planes = empty_planes(num_pages=2, n_kv_heads=1, head_dim=4, index_dim=2)
    lo = planes.k_cache[..., :2].clone()
    hi = planes.k_cache[..., 2:].clone()

    def store(x: torch.Tensor):
        return x[..., :2].to(torch.bfloat16), x[..., 2:].to(torch.bfloat16)

    def load(parts, dtype):
        return torch.cat(parts, dim=-1).to(dtype)

    table = torch.tensor([[0, 1]], dtype=torch.int32)
    k = torch.tensor([[[1.0, 2.0, 3.0, 4.0]], [[-1.0, -2.0, -3.0, -4.0]]], dtype=torch.bfloat16)
    (klo, khi), (vlo, vhi), _ = qsa_kv_append((lo, hi), (lo, hi), planes.pos_plane, table,
                                              torch.tensor([0, 0]), torch.tensor([0, 1]), k, k, store=store)
    assert klo[0, 1, 0].tolist() == [-1.0, -2.0] and khi[0, 1, 0].tolist() == [-3.0, -4.0]
    # Attention through the seam equals attention over the plain single-pool cache.
    kc, vc, _ = qsa_kv_append(planes.k_cache, planes.v_cache, planes.pos_plane, table,
                              torch.tensor([0, 0]), torch.tensor([0, 1]), k, k)
    q = torch.tensor([[[0.5, 1.0, -1.0, 2.0]]], dtype=torch.bfloat16)
    tokens = torch.tensor([[0, 1]])
    a = qsa_sparse_gqa(q, q, tokens, torch.tensor([0]), table, (klo, khi), (vlo, vhi), load=load)
    b = qsa_sparse_gqa(q, q, tokens, torch.tensor([0]), table, kc, vc)
    assert torch.equal(a, b)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_qsa_kv_storage_formats_plug_into_the_seam(fmt: str) -> None:
    """The fp8 and nvfp4 quantisers of spec/ops/kv_storage.py plug in as store / load: attention over
    the quantised pools equals attention over a bf16 cache holding the dequantised values."""
    from spec.ops import kv_storage as kvs

    gen = torch.Generator().manual_seed(3)
    n, n_kv, d = 40, 2, 32
    table = torch.tensor([[1, 0]], dtype=torch.int32)
    k = _randn(gen, n, n_kv, d, dtype=torch.bfloat16)
    v = _randn(gen, n, n_kv, d, dtype=torch.bfloat16)
    if fmt == "fp8":
        pools = lambda: (torch.zeros(2, TPB, n_kv, d, dtype=kvs.FP8_DTYPE),)
        store = lambda x: (kvs.fp8_quantize(x),)
        load = lambda parts, dtype: kvs.fp8_dequantize(parts[0], dtype)
    else:
        gs = kvs.nvfp4_global_scale(4.0)
        pools = lambda: (torch.zeros(2, TPB, n_kv, d // 2, dtype=torch.uint8),
                         torch.zeros(2, TPB, n_kv, d // kvs.NVFP4_BLOCK, dtype=kvs.FP8_DTYPE))
        store = lambda x: kvs.nvfp4_quantize(x, gs)
        load = lambda parts, dtype: kvs.nvfp4_dequantize(parts[0], parts[1], gs, dtype)
    seq, positions = torch.zeros(n, dtype=torch.int64), torch.arange(n)
    pos_plane = torch.full((2, TPB), -1, dtype=torch.int32)
    kq, vq, _ = qsa_kv_append(pools(), pools(), pos_plane, table, seq, positions, k, v, store=store)
    plain = empty_planes(2, n_kv, d, 2)
    kc, vc, _ = qsa_kv_append(plain.k_cache, plain.v_cache, pos_plane, table, seq, positions,
                              load(store(k), torch.bfloat16), load(store(v), torch.bfloat16))
    q = _randn(gen, 3, 4, d, dtype=torch.bfloat16)
    tokens = qsa_expand(torch.tensor([[0, 1]] * 3), torch.tensor([5, 33, 39]))
    a = qsa_sparse_gqa(q, q, tokens, torch.zeros(3, dtype=torch.int64), table, kq, vq, load=load)
    b = qsa_sparse_gqa(q, q, tokens, torch.zeros(3, dtype=torch.int64), table, kc, vc)
    assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------
# qsa_index_store
# ---------------------------------------------------------------------------------------------------

@pytest.mark.certify_property("qsa_index_store")
@given(batch_params, st.sampled_from([torch.bfloat16, torch.float64]))
def test_qsa_index_store_properties(params: dict, dtype: torch.dtype) -> None:
    """Index keys land in their slots; exactly the complete blocks have a block key; the block key is
    the mean of the block's stored keys (fp32 left fold / 32, cast to the plane); chunking and row order
    of the stores do not change a bit."""
    batch = Batch(dtype=dtype, **params)
    *_, ip, bk, bv = batch.store_all()
    *_, ip1, bk1, bv1 = batch.store_all(one_shot=True)
    assert _same_bits(ip, ip1) and torch.equal(bv, bv1)
    assert _same_bits(bk[bv], bk1[bv1])

    valid_pages = set()
    for s, n in enumerate(batch.lengths):
        for j in range(n):
            assert torch.equal(ip[int(batch.table[s, j // TPB]), j % TPB], batch.ki[s][j].to(ip.dtype))
        for b in range(math.ceil(n / TPB)):
            page = int(batch.table[s, b])
            complete = TPB * (b + 1) <= n
            assert bool(bv[page]) == complete
            if complete:
                valid_pages.add(page)
                stored = batch.ki[s][TPB * b: TPB * (b + 1)]
                mean64 = stored.double().mean(dim=0)
                if dtype == torch.float64:
                    torch.testing.assert_close(bk[page], mean64, rtol=1e-13, atol=1e-13)
                else:
                    assert torch.equal(bk[page], block_key(stored, torch.float32).to(torch.bfloat16))
                    torch.testing.assert_close(bk[page].double(), mean64, rtol=2**-8, atol=1e-6)
    assert set(torch.nonzero(bv).flatten().tolist()) == valid_pages


@pytest.mark.certify_guard("qsa_index_store")
def test_qsa_index_store_guard() -> None:
    """Index keys [i, 1] for positions i = 0..31 of one page. After 31 keys the block is partial (no
    block key); the 32nd completes it: kbar = [mean(0..31), 1] = [15.5, 1]."""
    planes = empty_planes(num_pages=1, n_kv_heads=1, head_dim=2, index_dim=2)
    table = torch.tensor([[0]], dtype=torch.int32)
    keys = torch.tensor([[float(i), 1.0] for i in range(32)], dtype=torch.bfloat16)
    seq = torch.zeros(31, dtype=torch.int64)
    ip, bk, bv = qsa_index_store(planes.index_plane, planes.block_keys, planes.block_key_valid, table,
                                 seq, torch.arange(31), keys[:31])
    assert bv.tolist() == [False]
    assert ip[0, 30].tolist() == [30.0, 1.0] and bool(ip[0, 31].isnan().all())
    ip, bk, bv = qsa_index_store(ip, bk, bv, table, torch.tensor([0]), torch.tensor([31]), keys[31:])
    assert bv.tolist() == [True]
    assert bk[0].tolist() == [15.5, 1.0]


def test_qsa_index_store_partial_write_invalidates() -> None:
    """Decision pin: a page written below slot 31 holds a partial block, so its key becomes absent."""
    planes = empty_planes(num_pages=1, n_kv_heads=1, head_dim=2, index_dim=2)
    table = torch.tensor([[0]], dtype=torch.int32)
    keys = torch.ones(32, 2, dtype=torch.bfloat16)
    ip, bk, bv = qsa_index_store(planes.index_plane, planes.block_keys, planes.block_key_valid, table,
                                 torch.zeros(32, dtype=torch.int64), torch.arange(32), keys)
    assert bv.tolist() == [True]
    _, _, bv = qsa_index_store(ip, bk, bv, table, torch.tensor([0]), torch.tensor([3]), keys[:1])
    assert bv.tolist() == [False]


# ---------------------------------------------------------------------------------------------------
# qsa_index_scores
# ---------------------------------------------------------------------------------------------------

def _scores_oracle(qi: torch.Tensor, wi: torch.Tensor, t: int, kbars: list[torch.Tensor],
                   n_cols: int) -> list[float]:
    """docs/spec.md, "QSA" item 3 written element by element in Python floats."""
    row = []
    for b in range(n_cols):
        if TPB * (b + 1) - 1 <= t:
            total = 0.0
            for h in range(qi.shape[0]):
                dot = sum(float(x) * float(y) for x, y in zip(qi[h], kbars[b]))
                total += float(wi[h]) * max(0.0, dot)
            row.append(total)
        else:
            row.append(-INF)
    return row


@pytest.mark.certify_property("qsa_index_scores")
@given(batch_params, st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_qsa_index_scores_properties(params: dict, n_heads: int, seed: int) -> None:
    """Scores equal the formula of docs/spec.md, "QSA" item 3 (float64); columns of incomplete or
    future blocks are exactly -inf; each row depends only on itself (row order and batch composition
    invariance)."""
    batch = Batch(dtype=torch.float64, **params)
    *_, ip, bk, bv = batch.store_all()
    gen = torch.Generator().manual_seed(seed)
    seq_ids = torch.tensor([s for s, n in enumerate(batch.lengths) for _ in range(n)])
    positions = torch.tensor([j for n in batch.lengths for j in range(n)])
    pick = torch.randperm(len(seq_ids), generator=gen)[:12]
    seq_ids, positions = seq_ids[pick], positions[pick]
    qi = _randn(gen, len(pick), n_heads, bk.shape[1])
    wi = _randn(gen, len(pick), n_heads)
    scores = qsa_index_scores(qi, wi, seq_ids, positions, batch.table, bk, bv)
    n_cols = batch.table.shape[1]
    assert scores.shape == (len(pick), n_cols) and scores.dtype == torch.float64
    for r in range(len(pick)):
        s, t = int(seq_ids[r]), int(positions[r])
        n_done = num_complete_blocks(t)
        kbars = [bk[int(batch.table[s, b])] for b in range(n_done)]
        expected = torch.tensor(_scores_oracle(qi[r], wi[r], t, kbars, n_cols), dtype=torch.float64)
        assert bool(scores[r, n_done:].eq(-INF).all())
        torch.testing.assert_close(scores[r], expected, rtol=1e-12, atol=1e-12)
    order = torch.randperm(len(pick), generator=gen)
    permuted = qsa_index_scores(qi[order], wi[order], seq_ids[order], positions[order], batch.table, bk, bv)
    assert torch.equal(permuted, scores[order])
    alone = qsa_index_scores(qi[:1], wi[:1], seq_ids[:1], positions[:1], batch.table, bk, bv)
    assert torch.equal(alone, scores[:1])


@pytest.mark.certify_guard("qsa_index_scores")
def test_qsa_index_scores_guard() -> None:
    """t = 64: blocks 0 (tokens 0..31) and 1 (32..63) are complete, block 2 is not (-inf).
    kbar_0 = [1, 0], kbar_1 = [0, 2]; qI heads [1, 1] and [-1, 1]; wI = [1, 0.5].
    s_0 = 1 * relu(1) + 0.5 * relu(-1) = 1;  s_1 = 1 * relu(2) + 0.5 * relu(2) = 3."""
    table = torch.tensor([[2, 0, 1]], dtype=torch.int32)
    block_keys = torch.tensor([[0.0, 2.0], [7.0, 7.0], [1.0, 0.0]], dtype=torch.bfloat16)  # pages 0, 1, 2
    valid = torch.tensor([True, False, True])
    qi = torch.tensor([[[1.0, 1.0], [-1.0, 1.0]]], dtype=torch.bfloat16)
    wi = torch.tensor([[1.0, 0.5]], dtype=torch.bfloat16)
    scores = qsa_index_scores(qi, wi, torch.tensor([0]), torch.tensor([64]), table, block_keys, valid)
    assert scores.dtype == torch.float32
    assert scores.tolist() == [[1.0, 3.0, -INF]]


def test_qsa_index_scores_missing_key_is_an_error() -> None:
    """Decision pin: scoring a complete block whose key was never stored is a usage error."""
    table = torch.tensor([[0]], dtype=torch.int32)
    with pytest.raises(ValueError, match="no block key"):
        qsa_index_scores(torch.ones(1, 1, 2), torch.ones(1, 1), torch.tensor([0]), torch.tensor([31]),
                         table, torch.ones(1, 2), torch.tensor([False]))


# ---------------------------------------------------------------------------------------------------
# qsa_select
# ---------------------------------------------------------------------------------------------------

def _select_oracle(scores: list[float], t: int, k: int, sink: int, local: int) -> list[int]:
    """An independent statement of docs/spec.md, "QSA" item 4: the window, plus the k candidates largest
    in the order (score with NaN as -inf, block index), both descending."""
    window = set(window_blocks(t, sink, local))
    cands = [b for b in range((t + 1) // TPB) if b not in window]
    key = {b: (-INF if math.isnan(scores[b]) else scores[b], b) for b in cands}
    top = sorted(cands, key=lambda b: key[b], reverse=True)[:k]
    return sorted(window | set(top))


score_values = st.sampled_from([-1.0, -0.0, 0.0, 1.0, 2.5, NAN, -INF, INF, 0.5])


@st.composite
def select_cases(draw: st.DrawFn) -> dict:
    n_cols = draw(st.integers(1, 24))
    n_rows = draw(st.integers(1, 5))
    return dict(
        scores=torch.tensor(draw(st.lists(st.lists(score_values, min_size=n_cols, max_size=n_cols),
                                          min_size=n_rows, max_size=n_rows)), dtype=torch.float32),
        # the latest position whose complete blocks all have a column: (t + 1) // 32 <= n_cols
        positions=torch.tensor(draw(st.lists(st.integers(0, TPB * n_cols + TPB - 2),
                                             min_size=n_rows, max_size=n_rows))),
        k=draw(st.integers(0, 10)),
        sink=draw(st.integers(1, 2)),
        local=draw(st.integers(1, 3)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@pytest.mark.certify_property("qsa_select")
def test_complete_blocks_by_hand_and_the_columns_a_row_needs() -> None:
    """Block b is complete at t when 32(b+1) - 1 <= t (docs/spec.md, "QSA" item 4): none before
    t = 31, one from 31 to 62, two at 63. A row needs a column for each complete block."""
    assert [num_complete_blocks(t) for t in (0, 30, 31, 32, 62, 63, 64)] == [0, 0, 1, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="position 31 has 1 complete blocks but only 0 columns"):
        select_row(torch.zeros(0), 31)
    with pytest.raises(ValueError, match="position 64 has 2 complete blocks but only 1 columns"):
        select_row(torch.zeros(1), 64)
    assert select_row(torch.zeros(2), 64) == [0, 1, 2]


@pytest.mark.certify_property("qsa_select")
@given(select_cases())
def test_qsa_select_properties(case: dict) -> None:
    """Matches the (score, index)-descending top-k statement; ties go to the highest block index;
    k >= candidates selects all; window blocks are always present; rows are ascending, padded with -1
    to k + window; NaN == -inf and -0.0 == +0.0; invariant to row order and batch composition."""
    scores, positions, k, sink, local = (case[n] for n in ("scores", "positions", "k", "sink", "local"))
    width = k + sink + local
    out = qsa_select(scores, positions, k, sink, local)
    assert out.shape == (scores.shape[0], width) and out.dtype == torch.int64
    for r in range(scores.shape[0]):
        t = int(positions[r])
        row = out[r][out[r] >= 0].tolist()
        assert out[r, len(row):].eq(-1).all()
        assert row == sorted(set(row))
        assert row == _select_oracle(scores[r].tolist(), t, k, sink, local)
        window = window_blocks(t, sink, local)
        assert set(window) <= set(row)  # window always selected
        cands = [b for b in range(num_complete_blocks(t)) if b not in window]
        chosen = [b for b in row if b not in window]
        assert len(chosen) == min(k, len(cands))  # k >= candidates selects all
        score = [(-INF if math.isnan(x) else x) for x in scores[r].tolist()]
        for b in chosen:  # ties go to the highest block index; nothing better is left out
            for c in set(cands) - set(chosen):
                assert score[b] > score[c] or (score[b] == score[c] and b > c)

    # NaN is -inf; -0.0 is +0.0.
    normalised = torch.where(scores.isnan(), torch.full_like(scores, -INF), scores)
    normalised = torch.where(normalised == 0, torch.zeros_like(scores), normalised)
    flipped = torch.where(normalised == 0, torch.full_like(scores, -0.0), normalised)
    assert torch.equal(qsa_select(normalised, positions, k, sink, local), out)
    assert torch.equal(qsa_select(flipped, positions, k, sink, local), out)

    # Row order and batch composition.
    gen = torch.Generator().manual_seed(case["seed"])
    order = torch.randperm(scores.shape[0], generator=gen)
    assert torch.equal(qsa_select(scores[order], positions[order], k, sink, local), out[order])
    other = torch.randn(3, scores.shape[1], generator=gen)
    other_pos = torch.randint(0, TPB * scores.shape[1], (3,), generator=gen)
    mixed = qsa_select(torch.cat([other, scores[:1]]), torch.cat([other_pos, positions[:1]]), k, sink, local)
    assert torch.equal(mixed[-1], out[0])


@pytest.mark.certify_guard("qsa_select")
def test_qsa_select_guard() -> None:
    """t = 261: own block 8 (partial, 256..261), window = {0, 7, 8}; complete blocks 0..7, so the
    candidates are 1..6 with scores 5, 3, 5, NaN, 5, 8. k = 3: sorted 8, 5, 5, 5, 3, -inf -> tau = 5.
    Above tau: block 6. Two slots remain for the three ties at 5 (blocks 1, 3, 5): highest first -> 5, 3.
    Result: {0, 3, 5, 6, 7, 8}, width k + 3 = 6 (no padding needed)."""
    scores = torch.tensor([[9.0, 5.0, 3.0, 5.0, NAN, 5.0, 8.0, 1.0, 4.0]])
    assert qsa_select(scores, torch.tensor([261]), k=3).tolist() == [[0, 3, 5, 6, 7, 8]]
    # Same row with k = 6: every candidate fits, and a padded row of width 9.
    assert qsa_select(scores, torch.tensor([261]), k=6).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 8]]
    assert qsa_select(scores, torch.tensor([261]), k=7).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 8, -1]]


def test_select_row_small_contexts() -> None:
    """Window edge cases: t in block 0 selects only block 0; t in block 1 selects {0, 1}."""
    row = torch.zeros(4)
    assert select_row(row, 0) == [0] and select_row(row, 31) == [0]
    assert select_row(row, 32) == [0, 1] and select_row(row, 95) == [0, 1, 2]


# ---------------------------------------------------------------------------------------------------
# qsa_expand
# ---------------------------------------------------------------------------------------------------

@st.composite
def expand_cases(draw: st.DrawFn) -> dict:
    n_rows = draw(st.integers(1, 4))
    width = draw(st.integers(1, 6))
    rows, positions, lens = [], [], []
    for _ in range(n_rows):
        t = draw(st.integers(0, 8 * TPB))
        ids = draw(st.lists(st.integers(0, t // TPB), max_size=width, unique=True))
        rows.append(ids + [-1] * (width - len(ids)))
        positions.append(t)
        lens.append(draw(st.integers(1, 9 * TPB)))
    return dict(selected=torch.tensor(rows), positions=torch.tensor(positions), lens=torch.tensor(lens),
                seed=draw(st.integers(0, 2**31 - 1)))


@pytest.mark.certify_property("qsa_expand")
@given(expand_cases())
def test_qsa_expand_properties(case: dict) -> None:
    """Each row is exactly the tokens of its selected blocks that are <= t and < context length,
    ascending, padded with -1 to 32 * width; the order of block ids in a row does not matter."""
    sel, pos, lens = case["selected"], case["positions"], case["lens"]
    out = qsa_expand(sel, pos, lens)
    assert out.shape == (sel.shape[0], TPB * sel.shape[1]) and out.dtype == torch.int64
    for r in range(sel.shape[0]):
        t, n = int(pos[r]), int(lens[r])
        expected = sorted(j for b in sel[r].tolist() if b >= 0 for j in range(TPB * b, TPB * b + TPB)
                          if j <= t and j < n)
        assert out[r, : len(expected)].tolist() == expected
        assert bool(out[r, len(expected):].eq(-1).all())
    gen = torch.Generator().manual_seed(case["seed"])
    shuffled = sel[:, torch.randperm(sel.shape[1], generator=gen)]
    assert torch.equal(qsa_expand(shuffled, pos, lens), out)
    # Default context length is t + 1: the same as passing it.
    assert torch.equal(qsa_expand(sel, pos), qsa_expand(sel, pos, pos + 1))


@pytest.mark.certify_guard("qsa_expand")
def test_qsa_expand_guard() -> None:
    """Blocks {2, 0} at t = 70, context length 71: block 0 -> 0..31, block 2 -> 64..70 (stops at t);
    39 tokens, padded with -1 to 32 * 3 = 96. A second row with context length 66 stops at 65."""
    out = qsa_expand(torch.tensor([[2, 0, -1], [2, 0, -1]]), torch.tensor([70, 70]), torch.tensor([71, 66]))
    assert out[0].tolist() == list(range(0, 32)) + list(range(64, 71)) + [-1] * 57
    assert out[1].tolist() == list(range(0, 32)) + [64, 65] + [-1] * 62


# ---------------------------------------------------------------------------------------------------
# qsa_sparse_gqa
# ---------------------------------------------------------------------------------------------------

def _masked_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor:
    """Float64 gated GQA with an explicit [rows, T] attention mask over k, v [T, ...] (True = attend)."""
    group = q.shape[1] // k.shape[1]
    kh, vh = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    logits = torch.einsum("ihd,jhd->hij", q, kh) / math.sqrt(q.shape[-1])
    p = torch.softmax(logits.masked_fill(~mask, -INF), dim=-1)
    return torch.einsum("hij,jhd->ihd", p, vh) * torch.sigmoid(gate)


@pytest.mark.certify_property("qsa_sparse_gqa")
@given(long_batch_params, st.integers(1, 3), st.integers(0, 4), st.integers(0, 2**31 - 1))
def test_qsa_sparse_gqa_properties(params: dict, group: int, k_top: int, seed: int) -> None:
    """The whole pipeline in float64 (append, index store, scores, select, expand, sparse GQA) on up to
    12 query rows drawn from every sequence: when every block is selected (k >= candidates) it equals
    dense causal attention; with a small k it equals dense attention masked to the selected tokens;
    each row is independent of the others (row order, batch composition)."""
    batch = Batch(dtype=torch.float64, **params)
    kc, vc, pos, ip, bk, bv = batch.store_all()
    gen = torch.Generator().manual_seed(seed)
    n_kv, head_dim, index_dim = batch.k[0].shape[1], batch.k[0].shape[2], batch.ki[0].shape[1]
    n_q = n_kv * group
    # q and gate of every token of every sequence, so the dense oracle has a full causal sequence.
    q_all = [_randn(gen, n, n_q, head_dim) for n in batch.lengths]
    gate_all = [_randn(gen, n, n_q, head_dim) for n in batch.lengths]
    dense = [dense_causal_gqa(q_all[s], batch.k[s], batch.v[s], gate_all[s]) for s in range(len(q_all))]

    seq_all = torch.tensor([s for s, n in enumerate(batch.lengths) for _ in range(n)])
    pos_all = torch.tensor([j for n in batch.lengths for j in range(n)])
    pick = torch.randperm(len(seq_all), generator=gen)[:12]
    seq_ids, positions = seq_all[pick], pos_all[pick]
    n_rows = len(pick)
    q = torch.stack([q_all[int(s)][int(t)] for s, t in zip(seq_ids, positions)])
    gate = torch.stack([gate_all[int(s)][int(t)] for s, t in zip(seq_ids, positions)])
    qi, wi = _randn(gen, n_rows, 2, index_dim), _randn(gen, n_rows, 2)
    scores = qsa_index_scores(qi, wi, seq_ids, positions, batch.table, bk, bv)

    k_all = batch.table.shape[1]  # >= every candidate count
    for k in (k_all, k_top):
        tokens = qsa_expand(qsa_select(scores, positions, k), positions)
        out = qsa_sparse_gqa(q, gate, tokens, seq_ids, batch.table, kc, vc)
        assert out.dtype == torch.float64 and not out.isnan().any()
        for r in range(n_rows):
            s, t = int(seq_ids[r]), int(positions[r])
            if k == k_all:
                assert tokens[r][tokens[r] >= 0].tolist() == list(range(t + 1))
                expected = dense[s][t]
            else:
                mask = torch.zeros(1, t + 1, dtype=torch.bool)
                mask[0, tokens[r][tokens[r] >= 0]] = True
                expected = _masked_dense(q[r: r + 1], batch.k[s][: t + 1], batch.v[s][: t + 1],
                                         gate[r: r + 1], mask)[0]
            torch.testing.assert_close(out[r], expected, rtol=1e-12, atol=1e-12)
        order = torch.randperm(n_rows, generator=gen)[: max(1, n_rows // 2)]
        part = qsa_sparse_gqa(q[order], gate[order], tokens[order], seq_ids[order], batch.table, kc, vc)
        assert torch.equal(part, out[order])


@pytest.mark.certify_guard("qsa_sparse_gqa")
def test_qsa_sparse_gqa_guard() -> None:
    """4 q heads over 2 KV heads (q heads 0, 1 read KV head 0; 2, 3 read KV head 1); head_dim 4, so
    scale = 1/2. Three tokens are stored; the row selects tokens 0 and 2 (token 1's huge v must not
    leak in). Every q head has q . k_j = 2 for both selected tokens -> logits 1 and 1 -> p = 1/2 each.
    KV head 0: v0 = [1, 2, 3, 4], v2 = [3, 2, 1, 0] -> o = [2, 2, 2, 2].
    KV head 1: v0 = [0, 4, 0, 4], v2 = [2, 0, 2, 0] -> o = [1, 2, 1, 2].
    gate = 0 -> sigmoid = 1/2, so heads 0, 1 give [1, 1, 1, 1] and heads 2, 3 give [0.5, 1, 0.5, 1]."""
    planes = empty_planes(num_pages=1, n_kv_heads=2, head_dim=4, index_dim=2)
    table = torch.tensor([[0]], dtype=torch.int32)
    ones = [1.0, 1.0, 1.0, 1.0]
    k = torch.tensor([[ones, ones], [ones, ones], [ones, ones]], dtype=torch.bfloat16)
    v = torch.tensor([[[1.0, 2, 3, 4], [0.0, 4, 0, 4]],
                      [[100.0, 100, 100, 100], [100.0, 100, 100, 100]],
                      [[3.0, 2, 1, 0], [2.0, 0, 2, 0]]], dtype=torch.bfloat16)
    kc, vc, _ = qsa_kv_append(planes.k_cache, planes.v_cache, planes.pos_plane, table,
                              torch.zeros(3, dtype=torch.int64), torch.arange(3), k, v)
    q = torch.full((1, 4, 4), 0.5, dtype=torch.bfloat16)  # q . k_j = 4 * 0.5 = 2
    gate = torch.zeros(1, 4, 4, dtype=torch.bfloat16)
    out = qsa_sparse_gqa(q, gate, torch.tensor([[0, 2, -1]]), torch.tensor([0]), table, kc, vc)
    assert out.dtype == torch.bfloat16
    assert out[0].tolist() == [[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0],
                               [0.5, 1.0, 0.5, 1.0], [0.5, 1.0, 0.5, 1.0]]


def test_qsa_sparse_gqa_empty_row_is_zero() -> None:
    """Decision pin: a row with no selected token (all -1) outputs exact zeros (an empty sum)."""
    planes = empty_planes(num_pages=1, n_kv_heads=1, head_dim=4, index_dim=2)
    table = torch.tensor([[0]], dtype=torch.int32)
    q = torch.ones(1, 2, 4, dtype=torch.bfloat16)
    out = qsa_sparse_gqa(q, q, torch.tensor([[-1, -1]]), torch.tensor([0]), table,
                         planes.k_cache, planes.v_cache)
    assert out.tolist() == [[[0.0] * 4] * 2]


def test_qsa_sparse_gqa_bf16_rounding_points() -> None:
    """Decision pin for bf16 activations: K and V dequantised to bf16, fp32 softmax with p kept fp32,
    o rounded to bf16, then o * sigmoid(gate) in fp32, cast to bf16 once. Also close to float64."""
    gen = torch.Generator().manual_seed(11)
    t, n_q, n_kv, d = 40, 4, 2, 16
    planes = empty_planes(num_pages=2, n_kv_heads=n_kv, head_dim=d, index_dim=2)
    table = torch.tensor([[1, 0]], dtype=torch.int32)
    k = _randn(gen, t, n_kv, d, dtype=torch.bfloat16)
    v = _randn(gen, t, n_kv, d, dtype=torch.bfloat16)
    kc, vc, _ = qsa_kv_append(planes.k_cache, planes.v_cache, planes.pos_plane, table,
                              torch.zeros(t, dtype=torch.int64), torch.arange(t), k, v)
    q = _randn(gen, 1, n_q, d, dtype=torch.bfloat16)
    gate = _randn(gen, 1, n_q, d, dtype=torch.bfloat16)
    tokens = torch.arange(t)[None]
    out = qsa_sparse_gqa(q, gate, tokens, torch.tensor([0]), table, kc, vc)
    kh = k.float().repeat_interleave(2, 1).transpose(0, 1)  # [n_q, t, d]
    vh = v.float().repeat_interleave(2, 1).transpose(0, 1)
    p = torch.softmax(torch.einsum("hd,htd->ht", q[0].float(), kh) / 4.0, dim=-1)
    o = torch.einsum("ht,htd->hd", p, vh).to(torch.bfloat16).float()
    manual = (o * torch.sigmoid(gate[0].float())).to(torch.bfloat16)
    torch.testing.assert_close(out[0], manual, rtol=2**-7, atol=0)  # within 1 bf16 ulp
    ref = dense_causal_gqa(q.double().expand(t, -1, -1), k.double(), v.double(),
                           gate.double().expand(t, -1, -1))
    torch.testing.assert_close(out[0].double(), ref[-1], rtol=2**-7, atol=1e-3)
