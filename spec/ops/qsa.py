"""QSA: sparse attention with a block index (docs/spec.md, "QSA: sparse attention with a block index").

QSA is this project's own op; docs/spec.md is its definition and this module is its executable form.
The pipeline of one QSA layer, one function per item of docs/spec.md, "QSA":

1. ``qsa_kv_append``      k (after QK norm + RoPE) and v of new tokens -> paged KV cache, position plane
2. ``qsa_index_store``    index keys kI -> index plane; full blocks -> block key ``kbar`` (block-key plane)
3. ``qsa_index_scores``   ``s[t, b] = sum_h wI[t,h] * relu(qI[t,h] . kbar_b)`` over complete blocks
4. ``qsa_select``         canonical top-k block selection plus the always-selected window
5. ``qsa_expand``         selected blocks -> token positions
   ``qsa_topk_expand``    items 4 and 5 composed (the fused fast paths' definition)
6. ``qsa_sparse_gqa``     gated grouped-query attention over the selected tokens

``dense_causal_gqa`` is the dense causal attention docs/spec.md names as the oracle of item 6 when
every block is selected.

Layout (block == page: ``TOKENS_PER_BLOCK = 32`` tokens a page; P pages in the pool, B sequences)
-------------------------------------------------------------------------------------------------
- ``block_table``     int32 [B, max_pages]: ``block_table[s, b]`` is the page holding logical block b
  (tokens 32b .. 32b+31) of sequence s; -1 marks an unassigned entry.
- Addressing: token position j of sequence s lives at page ``block_table[s, j // 32]``, offset
  ``j % 32`` (``slot_of``). Every plane below is indexed by that same (page, offset) or page.
- KV cache: a tuple of *pools* per K and per V, each ``[P, 32, n_kv_heads, ...]``. bf16 storage is one
  pool ``[P, 32, n_kv_heads, head_dim]`` in bf16; a plain tensor is accepted as a one-pool cache.
  A quantised format (spec/ops/kv_storage.py) may use several pools sharing the page index (e.g. nvfp4:
  uint8 codes ``[P, 32, n_kv, head_dim/2]`` plus an e4m3 scale pool ``[P, 32, n_kv, head_dim/16]``).
- ``pos_plane``       int32 [P, 32]: absolute position of each slot; -1 = empty.
- ``index_plane``     [P, 32, index_dim] (bf16): the index key kI of each slot.
- ``block_keys``      [P, index_dim] (bf16): the block key kbar of the block stored in that page.
- ``block_key_valid`` bool [P]: True iff ``block_keys[p]`` holds the key of a complete block. This is how
  "a partial block has no block key" is represented; the value of ``block_keys`` at an invalid page is
  unspecified (this spec leaves it as it was) and is never read.

``empty_planes`` builds all of them, with unwritten floating slots set to NaN so that a read of a slot
that was never written poisons the result instead of passing silently.

Storage seam
------------
``qsa_kv_append`` takes ``store: x [N, n_kv, D] -> tuple of per-pool slot values [N, n_kv, ...]`` and
``qsa_sparse_gqa`` takes ``load: (tuple of gathered per-pool values [M, n_kv, ...], dtype) -> [M, n_kv, D]``.
Both default to a plain cast into / out of a single pool (bf16 storage, or float64 pools for the
reference). A quantised format binds its parameters (e.g. nvfp4's global scale) into the callables with a
closure or ``functools.partial``. Planes other than K and V are stored with a plain cast to their dtype.

Numerics: computations run in ``acc_dtype`` of the floating inputs (fp32, float64 in reference mode).
Storage casts are rounding points of the *storage* (the dtype of the plane the caller passes), so a
reference run passes float64 planes. Rounding points of the attention are in ``qsa_sparse_gqa``.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from spec.numerics import acc_dtype, is_reference_mode, out_cast, round_to

TOKENS_PER_BLOCK = 32
TOP_K = 64
SINK_BLOCKS = 1
LOCAL_BLOCKS = 2

Pools = tuple[torch.Tensor, ...]
Store = Callable[[torch.Tensor], Pools]
Load = Callable[[Pools, torch.dtype], torch.Tensor]


# ---------------------------------------------------------------------------------------------------
# Layout helpers
# ---------------------------------------------------------------------------------------------------

class QsaPlanes(NamedTuple):
    """Every per-layer QSA plane of one page pool (see the module docstring for shapes)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    pos_plane: torch.Tensor
    index_plane: torch.Tensor
    block_keys: torch.Tensor
    block_key_valid: torch.Tensor


def empty_planes(num_pages: int, n_kv_heads: int, head_dim: int, index_dim: int,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None
                 ) -> QsaPlanes:
    """Empty planes for ``num_pages`` pages: floating slots NaN, positions -1, no valid block key."""
    tpb = TOKENS_PER_BLOCK
    nan = float("nan")
    return QsaPlanes(
        k_cache=torch.full((num_pages, tpb, n_kv_heads, head_dim), nan, dtype=dtype, device=device),
        v_cache=torch.full((num_pages, tpb, n_kv_heads, head_dim), nan, dtype=dtype,
                           device=device),
        pos_plane=torch.full((num_pages, tpb), -1, dtype=torch.int32, device=device),
        index_plane=torch.full((num_pages, tpb, index_dim), nan, dtype=dtype, device=device),
        block_keys=torch.full((num_pages, index_dim), nan, dtype=dtype, device=device),
        block_key_valid=torch.zeros(num_pages, dtype=torch.bool, device=device),
    )


def slot_of(block_table: torch.Tensor, seq_ids: torch.Tensor,
            positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(page, offset) of token ``positions[i]`` of sequence ``seq_ids[i]``; both int64 [N].

    Raises if a token's logical block has no page in the block table. Both are on the block table's
    device, wherever the ids and positions live.
    """
    seq = seq_ids.long().to(block_table.device)
    pos = positions.long().to(block_table.device)
    if (pos < 0).any():
        raise ValueError("token positions must be >= 0")
    blocks = pos // TOKENS_PER_BLOCK
    if (blocks >= block_table.shape[1]).any():
        raise ValueError("a token lies beyond its sequence's block table")
    pages = block_table[seq, blocks].long()
    if (pages < 0).any():
        raise ValueError("a token's block has no page assigned in the block table")
    return pages, pos % TOKENS_PER_BLOCK


def _as_pools(cache: torch.Tensor | Pools) -> Pools:
    return (cache,) if isinstance(cache, torch.Tensor) else tuple(cache)


def _like_input(cache: torch.Tensor | Pools, pools: Pools) -> torch.Tensor | Pools:
    return pools[0] if isinstance(cache, torch.Tensor) else pools


def _store_rows(pools: Pools, x: torch.Tensor, store: Store | None) -> Pools:
    """The per-pool slot values of rows x (the storage seam, see the module docstring)."""
    if store is None:
        if len(pools) != 1:
            raise ValueError("a multi-pool cache needs an explicit store callable")
        return (x.to(pools[0].dtype),)
    parts = tuple(store(x))
    if len(parts) != len(pools):
        raise ValueError(f"store returned {len(parts)} parts for {len(pools)} pools")
    for part, pool in zip(parts, pools):
        if part.shape[1:] != pool.shape[2:] or part.dtype != pool.dtype:
            raise ValueError("store output does not fit its pool's slot shape / dtype")
    return parts


def _load_rows(pools: Pools, pages: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype,
               load: Load | None) -> torch.Tensor:
    """Gather slots (pages[i], offsets[i]) of every pool and dequantise them to ``dtype``."""
    parts = tuple(pool[pages, offsets] for pool in pools)
    if load is None:
        if len(parts) != 1:
            raise ValueError("a multi-pool cache needs an explicit load callable")
        return parts[0].to(dtype)
    return load(parts, dtype).to(dtype)


def _check_unique_slots(pages: torch.Tensor, offsets: torch.Tensor) -> None:
    flat = pages * TOKENS_PER_BLOCK + offsets
    if flat.unique().numel() != flat.numel():
        raise ValueError("two new tokens map to the same slot")


# ---------------------------------------------------------------------------------------------------
# 1. KV append
# ---------------------------------------------------------------------------------------------------

def qsa_kv_append(k_cache: torch.Tensor | Pools, v_cache: torch.Tensor | Pools,
                  pos_plane: torch.Tensor, block_table: torch.Tensor, seq_ids: torch.Tensor,
                  positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  store: Store | None = None, store_v: Store | None = None,
                  ) -> tuple[torch.Tensor | Pools, torch.Tensor | Pools, torch.Tensor]:
    """Write k and v of N new tokens into their slots; record their positions (docs/spec.md, "QSA"
    item 1).

    k, v: [N, n_kv_heads, head_dim] (k after QK norm + RoPE); seq_ids, positions: integer [N].
    ``store`` maps k rows to the K pools' slot values (default: cast to the single pool's dtype);
    ``store_v`` does the same for V and defaults to ``store``. Slots not addressed are unchanged.
    Returns new (k_cache, v_cache, pos_plane), each of the same kind as its input: copies of the
    inputs with the writes of ``qsa_kv_append_into`` applied.
    """
    k_new = _like_input(k_cache, tuple(p.clone() for p in _as_pools(k_cache)))
    v_new = _like_input(v_cache, tuple(p.clone() for p in _as_pools(v_cache)))
    pos_new = pos_plane.clone()
    qsa_kv_append_into(k_new, v_new, pos_new, block_table, seq_ids, positions, k, v, store, store_v)
    return k_new, v_new, pos_new


def qsa_kv_append_into(k_cache: torch.Tensor | Pools, v_cache: torch.Tensor | Pools,
                       pos_plane: torch.Tensor, block_table: torch.Tensor, seq_ids: torch.Tensor,
                       positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       store: Store | None = None, store_v: Store | None = None) -> None:
    """``qsa_kv_append`` written into the given pools and position plane: only the N addressed slots
    change, so its cost is the step's rows, not the pools' size.
    Two new tokens addressing the same slot are an error (the result would depend on write order).
    """
    pages, offsets = slot_of(block_table, seq_ids, positions)
    _check_unique_slots(pages, offsets)
    store_v = store if store_v is None else store_v

    def write(cache: torch.Tensor | Pools, x: torch.Tensor, fn: Store | None) -> None:
        pools = _as_pools(cache)
        for pool, part in zip(pools, _store_rows(pools, x, fn)):
            pool[pages.to(pool.device), offsets.to(pool.device)] = part

    write(k_cache, k, store)
    write(v_cache, v, store_v)
    pos_plane[pages.to(pos_plane.device), offsets.to(pos_plane.device)] = \
        positions.to(device=pos_plane.device, dtype=pos_plane.dtype)


# ---------------------------------------------------------------------------------------------------
# 2. Index store and block compression
# ---------------------------------------------------------------------------------------------------

def block_key(index_keys: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``kbar = (sum of the 32 index keys) / 32``, summed in ``acc`` in ascending slot order.

    index_keys: [32, index_dim] as stored. The sum is an explicit left fold over slots 0..31 so that
    the result is one fixed function (a tree reduction rounds differently in fp32). Division by 32 is
    exact. Returns [index_dim] in ``acc``; the caller casts it to the block-key plane's dtype.
    """
    total = torch.zeros(index_keys.shape[-1], dtype=acc, device=index_keys.device)
    for slot in range(index_keys.shape[0]):
        total = total + index_keys[slot].to(acc)
    return total / index_keys.shape[0]


def qsa_index_store(index_plane: torch.Tensor, block_keys: torch.Tensor,
                    block_key_valid: torch.Tensor, block_table: torch.Tensor,
                    seq_ids: torch.Tensor, positions: torch.Tensor, k_index: torch.Tensor,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Write the index keys of N new tokens; compress every block whose 32nd token arrived.

    k_index: [N, index_dim] (rmsnorm'd, no RoPE); seq_ids, positions: integer [N].
    Index keys are stored with a cast to ``index_plane``'s dtype. For every page that received its
    slot-31 token in this call, ``block_keys[page] = block_key(index_plane[page])`` (computed from the
    keys *as stored*, fp32 sum / 32, cast to ``block_keys``' dtype) and ``block_key_valid[page] = True``.
    Every other page written in this call becomes invalid: it now holds a partial block.

    Precondition (docs/spec.md, "QSA" item 2): each sequence's tokens are stored in
    position order without gaps, so a page whose slot 31 is written holds 32 tokens after the call.
    Returns new (index_plane, block_keys, block_key_valid): copies of the inputs with the writes of
    ``qsa_index_store_into`` applied.
    """
    new_index, new_keys, new_valid = index_plane.clone(), block_keys.clone(), block_key_valid.clone()
    qsa_index_store_into(new_index, new_keys, new_valid, block_table, seq_ids, positions, k_index)
    return new_index, new_keys, new_valid


def qsa_index_store_into(index_plane: torch.Tensor, block_keys: torch.Tensor,
                         block_key_valid: torch.Tensor, block_table: torch.Tensor,
                         seq_ids: torch.Tensor, positions: torch.Tensor, k_index: torch.Tensor
                         ) -> None:
    """``qsa_index_store`` written into the given planes: the N addressed slots and the pages they
    touch change, nothing else, so its cost is the step's rows, not the planes' size."""
    pages, offsets = slot_of(block_table, seq_ids, positions)
    _check_unique_slots(pages, offsets)
    acc = acc_dtype(index_plane, k_index, block_keys)
    dev = index_plane.device
    index_plane[pages.to(dev), offsets.to(dev)] = k_index.to(index_plane.dtype)

    if dev.type == "meta":
        # meta: shapes only (the reach tracer); the flags are host-side and kept exact, the keys of
        # completed pages have no values to sum.
        block_key_valid[pages] = False
        block_key_valid[pages[offsets == TOKENS_PER_BLOCK - 1]] = True
        return
    touched = sorted(set(pages.tolist()))
    completed = set(pages[offsets == TOKENS_PER_BLOCK - 1].tolist())
    for page in touched:
        if page in completed:
            block_keys[page] = block_key(index_plane[page], acc).to(block_keys.dtype)
            block_key_valid[page] = True
        else:
            block_key_valid[page] = False


# ---------------------------------------------------------------------------------------------------
# 3. Index scores
# ---------------------------------------------------------------------------------------------------

def num_complete_blocks(t: int) -> int:
    """Number of blocks b with ``32(b+1) - 1 <= t``: the blocks wholly at or before position t."""
    return (t + 1) // TOKENS_PER_BLOCK


def qsa_index_scores(q_index: torch.Tensor, w_index: torch.Tensor, seq_ids: torch.Tensor,
                     positions: torch.Tensor, block_table: torch.Tensor, block_keys: torch.Tensor,
                     block_key_valid: torch.Tensor) -> torch.Tensor:
    """Block scores ``s[t, b] = sum_h wI[t,h] * relu(qI[t,h] . kbar_b)`` (docs/spec.md, "QSA" item 3).

    q_index: [N, n_index_heads, index_dim]; w_index: [N, n_index_heads]; seq_ids, positions: integer
    [N] (the query row's sequence and absolute position t). Columns are the logical blocks of the row's
    sequence, ``block_table.shape[1]`` of them. Complete blocks (``32(b+1) - 1 <= t``) get their score;
    every other column is -inf. Computed in acc dtype (fp32 / float64) and returned in it, unrounded:
    docs/spec.md names no rounding point, and selection compares these values exactly.
    Errors: a complete block whose block key is absent (scores asked before the index store), and a
    position whose complete blocks do not fit the block table.
    """
    acc = acc_dtype(q_index, w_index, block_keys)
    n_rows, n_cols = q_index.shape[0], block_table.shape[1]
    scores = torch.full((n_rows, n_cols), float("-inf"), dtype=acc, device=q_index.device)
    if q_index.device.type == "meta":
        _check_block_keys_shape_only(seq_ids, positions, block_table, block_key_valid)
        return scores
    for row in range(n_rows):
        t = int(positions[row])
        n_done = num_complete_blocks(t)
        if n_done > n_cols:
            raise ValueError(f"row {row}: position {t} lies beyond its sequence's block table")
        if n_done == 0:
            continue
        pages = block_table[int(seq_ids[row]), :n_done].long()
        if (pages < 0).any() or not bool(block_key_valid[pages].all()):
            raise ValueError(f"row {row}: a complete block at or before t={t} has no block key")
        kbar = block_keys[pages].to(acc)                      # [n_done, index_dim]
        dots = q_index[row].to(acc) @ kbar.T                   # [n_index_heads, n_done]
        weighted = w_index[row].to(acc)[:, None] * torch.relu(dots)
        scores[row, :n_done] = weighted.sum(dim=0)
    return scores


def _check_block_keys_shape_only(seq_ids: torch.Tensor, positions: torch.Tensor,
                                 block_table: torch.Tensor, block_key_valid: torch.Tensor) -> None:
    """meta: ``qsa_index_scores``' checks without its row loop (the reach tracer). The block table and
    the flags are host-side integers, so the checks stay exact: per sequence, its furthest row's
    complete blocks must fit the table and hold a block key."""
    seq, done = seq_ids.long(), (positions.long() + 1) // TOKENS_PER_BLOCK
    for s in seq.unique().tolist():
        n_done = int(done[seq == s].max())
        if n_done > block_table.shape[1]:
            raise ValueError(f"sequence {s}: {n_done} complete blocks lie beyond its block table")
        pages = block_table[s, :n_done].long()
        if (pages < 0).any() or not bool(block_key_valid[pages.clamp(min=0)].all()):
            raise ValueError(f"sequence {s}: a complete block has no block key")


# ---------------------------------------------------------------------------------------------------
# 4. Canonical selection
# ---------------------------------------------------------------------------------------------------

def window_blocks(t: int, sink_blocks: int = SINK_BLOCKS, local_blocks: int = LOCAL_BLOCKS) -> list[int]:
    """The always-selected blocks of position t, ascending: the sink blocks 0 .. sink_blocks-1 and the
    last ``local_blocks`` blocks up to and including t's own (possibly partial) block."""
    own = t // TOKENS_PER_BLOCK
    sink = set(range(min(sink_blocks, own + 1)))
    local = set(range(max(0, own - local_blocks + 1), own + 1))
    return sorted(sink | local)


def select_row(scores: torch.Tensor, t: int, k: int = TOP_K, sink_blocks: int = SINK_BLOCKS,
               local_blocks: int = LOCAL_BLOCKS) -> list[int]:
    """The selected block ids of one query row at position t, ascending (docs/spec.md, "QSA" item 4).

    scores: [n_cols] (one row of ``qsa_index_scores``). Candidates are the complete blocks
    (``32(b+1) - 1 <= t``) outside the window. With at most k candidates, all are selected. Otherwise
    tau = the k-th largest candidate score; every candidate with score > tau is selected, and the
    remaining slots go to candidates with score == tau, highest block index first. NaN counts as -inf
    and -0.0 equals +0.0 (ordinary float comparison). Window blocks are always selected and take no slot.
    Equivalently: the k candidates that are largest in the order (score, block index), both descending.
    """
    if k < 0:
        raise ValueError("k must be >= 0")
    window = window_blocks(t, sink_blocks, local_blocks)
    n_done = num_complete_blocks(t)
    if n_done > scores.shape[0]:
        raise ValueError(f"position {t} has {n_done} complete blocks but only {scores.shape[0]} columns")
    in_window = set(window)
    candidates = [b for b in range(n_done) if b not in in_window]

    row = scores.tolist()
    # NaN counts as -inf; Python float comparison already treats -0.0 == +0.0.
    score = {b: float("-inf") if math.isnan(row[b]) else row[b] for b in candidates}

    if len(candidates) <= k:
        chosen = candidates
    elif k == 0:
        chosen = []
    else:
        tau = sorted(score.values(), reverse=True)[k - 1]
        above = [b for b in candidates if score[b] > tau]
        ties_high_first = sorted((b for b in candidates if score[b] == tau), reverse=True)
        chosen = above + ties_high_first[: k - len(above)]
    return sorted(in_window | set(chosen))


def selection_width(k: int = TOP_K, sink_blocks: int = SINK_BLOCKS, local_blocks: int = LOCAL_BLOCKS) -> int:
    """The fixed width of a selection row: at most k top-k blocks plus the window."""
    return k + sink_blocks + local_blocks


def qsa_select(scores: torch.Tensor, positions: torch.Tensor, k: int = TOP_K,
               sink_blocks: int = SINK_BLOCKS, local_blocks: int = LOCAL_BLOCKS) -> torch.Tensor:
    """Canonical block selection of every query row: ``select_row`` applied row by row.

    scores: [N, n_cols]; positions: integer [N]. Returns int64 [N, k + sink_blocks + local_blocks]:
    each row the ascending selected block ids, padded with -1. Each row depends only on its own
    (scores row, t, window, k), so the result is invariant to row order and batch composition.
    """
    width = selection_width(k, sink_blocks, local_blocks)
    out = torch.full((scores.shape[0], width), -1, dtype=torch.int64, device=scores.device)
    for row in range(scores.shape[0]):
        ids = select_row(scores[row], int(positions[row]), k, sink_blocks, local_blocks)
        out[row, : len(ids)] = torch.tensor(ids, dtype=torch.int64, device=scores.device)
    return out


# ---------------------------------------------------------------------------------------------------
# 5. Expansion
# ---------------------------------------------------------------------------------------------------

def qsa_expand(selected: torch.Tensor, positions: torch.Tensor,
               context_lens: torch.Tensor | None = None) -> torch.Tensor:
    """Selected blocks -> the token positions they cover (docs/spec.md, "QSA" item 5).

    selected: int [N, W] block ids (-1 = padding, any order); positions: integer [N] (t);
    context_lens: integer [N], the sequence's token count (default t + 1). Block b gives tokens
    32b .. 32b+31 that are <= t and < context length. Returns int64 [N, 32 * W]: each row the tokens in
    ascending order, padded with -1. Duplicate block ids contribute their tokens once.
    """
    tpb = TOKENS_PER_BLOCK
    width = tpb * selected.shape[1]
    out = torch.full((selected.shape[0], width), -1, dtype=torch.int64, device=selected.device)
    for row in range(selected.shape[0]):
        t = int(positions[row])
        limit = t + 1 if context_lens is None else min(t + 1, int(context_lens[row]))
        blocks = sorted({int(b) for b in selected[row] if int(b) >= 0})
        tokens = [j for b in blocks for j in range(tpb * b, tpb * (b + 1)) if j < limit]
        out[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64, device=selected.device)
    return out


# ---------------------------------------------------------------------------------------------------
# 4 + 5. Selection fused with expansion
# ---------------------------------------------------------------------------------------------------

def qsa_topk_expand(scores: torch.Tensor, positions: torch.Tensor,
                    context_lens: torch.Tensor | None = None, k: int = TOP_K,
                    sink_blocks: int = SINK_BLOCKS, local_blocks: int = LOCAL_BLOCKS,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``qsa_select`` followed by ``qsa_expand`` (docs/spec.md, "QSA" items 4 and 5), by definition.

    scores: [N, n_cols]; positions: integer [N]; context_lens: integer [N] or None (t + 1).
    Returns (selected int64 [N, k + sink + local], tokens int64 [N, 32 * (k + sink + local)]). Both
    are returned so that IndexShare (item 7) can reuse the block ids of the selection.
    """
    selected = qsa_select(scores, positions, k, sink_blocks, local_blocks)
    return selected, qsa_expand(selected, positions, context_lens)


# ---------------------------------------------------------------------------------------------------
# 6. Sparse GQA
# ---------------------------------------------------------------------------------------------------

def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
            acc: torch.dtype) -> torch.Tensor:
    """Softmax attention of one row's q heads over M tokens, in ``acc``; zero when M == 0.

    q: [n_q, D]; keys, values: [M, n_kv, D] in the activation dtype. Returns [n_q, D] in ``acc``.
    """
    n_q, n_kv = q.shape[0], keys.shape[1]
    if n_q % n_kv:
        raise ValueError(f"n_q_heads {n_q} is not a multiple of n_kv_heads {n_kv}")
    if keys.shape[0] == 0:
        return torch.zeros(q.shape, dtype=acc, device=q.device)
    kv_head = torch.arange(n_q, device=q.device) // (n_q // n_kv)             # q head h reads KV head h // group
    k_h = keys.to(acc)[:, kv_head, :].transpose(0, 1)        # [n_q, M, D]
    v_h = values.to(acc)[:, kv_head, :].transpose(0, 1)
    logits = torch.einsum("hd,hmd->hm", q.to(acc), k_h) * scale
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    e = torch.exp(shifted)
    p = e / e.sum(dim=-1, keepdim=True)
    return torch.einsum("hm,hmd->hd", p, v_h)


def _gate(o: torch.Tensor, gate: torch.Tensor, act: torch.dtype, acc: torch.dtype,
          reference: bool) -> torch.Tensor:
    """``o *= sigmoid(gate)``: o rounded to the activation dtype, gate math in acc, one final cast."""
    o = round_to(o, act, reference)
    return out_cast(o * torch.sigmoid(gate.to(acc)), act, reference)


def qsa_sparse_gqa(q: torch.Tensor, gate: torch.Tensor, tokens: torch.Tensor, seq_ids: torch.Tensor,
                   block_table: torch.Tensor, k_cache: torch.Tensor | Pools,
                   v_cache: torch.Tensor | Pools, load: Load | None = None,
                   load_v: Load | None = None, scale: float | None = None) -> torch.Tensor:
    """Gated sparse GQA over each row's selected tokens (docs/spec.md, "QSA" item 6), before out_proj.

    q, gate: [N, n_q_heads, head_dim] activation dtype (bf16 in the model); tokens: int [N, W] token
    positions per row (``qsa_expand`` output, -1 = padding); seq_ids: integer [N].
    K and V of each token are read from its slot (``slot_of``) and dequantised to the activation dtype
    with ``load`` / ``load_v`` (default: cast of the single pool; ``load_v`` defaults to ``load``).
    q head h reads KV head ``h // (n_q_heads / n_kv_heads)``;
    ``p = softmax(q . k_j * scale)`` with scale = 1/sqrt(head_dim) (1/16 at head_dim 256);
    ``o = sum_j p_j v_j``; ``o *= sigmoid(gate)``. Returns [N, n_q_heads, head_dim] in q's dtype
    (float64 in reference mode).

    Decisions left to the spec by docs/spec.md (pinned in tests/spec/test_qsa.py):
    - The softmax is exact in acc dtype: max-subtracted exp, normalised, with p kept in acc dtype (no
      bf16 rounding of p before the PV product; a kernel that rounds p is certified by tolerance).
    - Rounding points: o is cast to the activation dtype (the attention output), then the gate product
      is computed in acc dtype with sigmoid in acc dtype, and cast to the activation dtype once.
    - A row with no selected token (all -1; cannot happen for a real query, whose own token is in the
      window) outputs exact zeros, as an empty sum.
    - A token listed twice in a row is attended twice (rows from ``qsa_expand`` have no duplicates).
    """
    act = q.dtype
    reference = is_reference_mode(q, gate)
    acc = acc_dtype(q, gate)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    load_v = load if load_v is None else load_v
    k_pools, v_pools = _as_pools(k_cache), _as_pools(v_cache)
    load_dtype = acc if reference else act

    out = torch.empty(q.shape, dtype=acc if reference else act, device=q.device)
    if q.device.type == "meta":  # meta: shapes only (the reach tracer); no token values to gather
        return out
    for row in range(q.shape[0]):
        row_tokens = tokens[row][tokens[row] >= 0]
        seq = torch.full_like(row_tokens, int(seq_ids[row]))
        pages, offsets = slot_of(block_table, seq, row_tokens)
        # Dequantise to the activation dtype first (docs/spec.md; float64 in reference mode), then
        # compute in acc.
        keys = _load_rows(k_pools, pages, offsets, load_dtype, load)
        values = _load_rows(v_pools, pages, offsets, load_dtype, load_v)
        o = _attend(q[row], keys, values, scale, acc)
        out[row] = _gate(o, gate[row], act, acc, reference)
    return out


def dense_causal_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """Dense causal gated GQA over one contiguous sequence: the oracle of ``qsa_sparse_gqa`` when every
    block is selected (docs/spec.md, "QSA" item 6).

    q, gate: [T, n_q_heads, D]; k, v: [T, n_kv_heads, D]; token i sits at position i and attends to
    positions 0..i. Same dtype policy and rounding points as ``qsa_sparse_gqa``, but written as one
    masked matrix softmax so that it is an independent formulation.
    """
    act = q.dtype
    reference = is_reference_mode(q, k, v, gate)
    acc = acc_dtype(q, k, v, gate)
    n_t, n_q, head_dim = q.shape
    group = n_q // k.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    k_h = k.to(acc).repeat_interleave(group, dim=1)           # [T, n_q, D]
    v_h = v.to(acc).repeat_interleave(group, dim=1)
    logits = torch.einsum("ihd,jhd->hij", q.to(acc), k_h) * scale
    causal = torch.ones(n_t, n_t, dtype=torch.bool, device=q.device).tril()
    logits = logits.masked_fill(~causal, float("-inf"))
    p = torch.softmax(logits, dim=-1)
    o = torch.einsum("hij,jhd->ihd", p, v_h)
    return _gate(o, gate, act, acc, reference)
