"""The engine's per-request state as the replay oracle compares it (certify/harness/replay.py).

Physical pages differ between two runs that allocated different numbers of pages, so the view is
logical: a request's tokens by position (through its block table), its blocks by index. Pieces:

- ``gdn_state[l]`` [HV, d_k, d_v] and ``conv_window[l]`` [channels, 3] of every GDN layer l;
- ``ngram_history`` [2]; ``length`` (tokens stored);
- per QSA layer l (and ``mtp`` for the draft layer when asked): ``k[l]``, ``v[l]`` (the stored
  bytes of each position < length: bf16, fp8, or nvfp4 codes and scales), ``index[l]`` (index keys by
  position), ``positions[l]`` (the position plane over the blocks that hold tokens, including the
  unused tail of the last block, which must read -1), ``block_key_valid[l]`` and ``block_keys[l]``
  (the key bytes of valid blocks, zeros for the others), and ``stale_pages[l]`` (how many pages the
  request holds past its last block that still record a position or a valid key: 0 after a correct
  rollback).
"""

from __future__ import annotations

from typing import Iterable

import torch

from certify.harness.replay import Piece, StateView
from impl.model.cache import PAGE, GDNPool
from impl.model.engine import Engine
from spec.ops.qsa import QsaPlanes


def _as_bytes(pool: torch.Tensor | tuple) -> torch.Tensor:
    """A pool (or an nvfp4 (codes, scales) pair) as uint8 [pages, 32, bytes]."""
    parts = pool if isinstance(pool, tuple) else (pool,)
    flat = [p.contiguous().reshape(p.shape[0], p.shape[1], -1).view(torch.uint8) for p in parts]
    return torch.cat(flat, dim=-1)


def _planes(planes: QsaPlanes, table_row: torch.Tensor, length: int, tag: str
            ) -> dict[str, Piece]:
    nb = -(-length // PAGE)
    pages = [int(p) for p in table_row[:nb]]
    pos = torch.arange(length)
    page_of = torch.tensor(pages, dtype=torch.long)[pos // PAGE] if length else pos
    off = pos % PAGE
    out = {}
    for name, pool in (("k", planes.k_cache), ("v", planes.v_cache)):
        out[f"{name}[{tag}]"] = Piece(_as_bytes(pool)[page_of, off], "position")
    out[f"index[{tag}]"] = Piece(_as_bytes(planes.index_plane)[page_of, off], "position")
    idx = torch.tensor(pages, dtype=torch.long)
    out[f"positions[{tag}]"] = Piece(planes.pos_plane[idx].reshape(-1), "position")
    valid = planes.block_key_valid[idx]
    keys = planes.block_keys[idx.to(planes.block_keys.device)].cpu().contiguous()
    key_bytes = keys.view(torch.uint8).reshape(len(pages), -1).clone()
    key_bytes[~valid] = 0
    out[f"block_key_valid[{tag}]"] = Piece(valid.clone(), "block")
    out[f"block_keys[{tag}]"] = Piece(key_bytes, "block")
    tail = [int(p) for p in table_row[nb:] if p >= 0]
    stale = sum(1 for p in tail if bool((planes.pos_plane[p] >= 0).any())
                or bool(planes.block_key_valid[p]))
    out[f"stale_pages[{tag}]"] = Piece(torch.tensor([stale]), "count")
    return out


def engine_state(engine: Engine, request_ids: Iterable[str], *, draft_layer: bool = False
                 ) -> StateView:
    """state name -> request id -> Piece, for the running requests ``request_ids``."""
    cache = engine.cache
    view: dict[str, dict[str, Piece]] = {}

    def put(name: str, rid: str, piece: Piece) -> None:
        view.setdefault(name, {})[rid] = piece

    for rid in request_ids:
        slot = engine.sequence(rid).slot
        length = cache.lengths[slot]
        table_row = cache.pages.block_table[slot]
        put("length", rid, Piece(torch.tensor([length]), "count"))
        put("ngram_history", rid, Piece(cache.ple_history[slot].clone(), "history entry"))
        for li, layer in enumerate(cache.layers):
            if isinstance(layer, GDNPool):
                put(f"gdn_state[{li}]", rid, Piece(layer.state[slot].cpu().clone(), "value head"))
                put(f"conv_window[{li}]", rid, Piece(layer.conv[slot].cpu().clone(), "channel"))
            else:
                for name, piece in _planes(layer, table_row, length, str(li)).items():
                    put(name, rid, piece)
        if draft_layer and cache.mtp is not None:
            for name, piece in _planes(cache.mtp, table_row, cache.mtp_lengths[slot],
                                       "mtp").items():
                put(name, rid, piece)
    return view
