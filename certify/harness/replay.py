"""Rollback replay: the state a commit leaves must equal, bit for bit, the state a shorter run leaves.

A speculative engine verifies K+1 rows a request and then commits the first a+1 of them. The oracle
(DESIGN.md, "Replay test") compares what the commit left with what a verify of only those a+1 rows
leaves, piece by piece. A target describes its per-request state as a ``StateView``: state name ->
request -> ``Piece`` (a tensor whose dim 0 is named by ``row``: a position, a block, a head). This
module compares two views byte for byte (NaN payloads and -0.0 included: a commit copies bytes, it
computes nothing) and names the first row that differs in every piece that differs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch


@dataclass(frozen=True)
class Piece:
    """One piece of one request's state: ``tensor`` with dim 0 indexed by ``row`` (e.g. 'position')."""

    tensor: torch.Tensor
    row: str


StateView = Mapping[str, Mapping[str, Piece]]


@dataclass(frozen=True)
class ReplayMismatch:
    state: str
    request: str
    row: str
    detail: str

    def __str__(self) -> str:
        return f"{self.state}, request {self.request}, {self.row}: {self.detail}"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, one row per dim-0 index (bool and 0-dim tensors included)."""
    t = t.detach().cpu().contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.reshape(t.shape[0], -1).view(torch.uint8) if t.numel() else t.reshape(t.shape[0], 0)


def compare_piece(state: str, request: str, got: Piece, want: Piece) -> ReplayMismatch | None:
    """None when the two pieces hold the same bytes; else the first row that differs."""
    g, w = got.tensor, want.tensor
    if g.dtype != w.dtype:
        return ReplayMismatch(state, request, got.row, f"dtype {g.dtype} vs {w.dtype}")
    if tuple(g.shape) != tuple(w.shape):
        n = min(g.shape[0] if g.dim() else 1, w.shape[0] if w.dim() else 1)
        return ReplayMismatch(state, request, f"{got.row} {n}",
                              f"shape {tuple(g.shape)} after the commit vs {tuple(w.shape)} replayed")
    gb, wb = _bytes(g), _bytes(w)
    differs = (gb != wb).any(dim=1)
    if not bool(differs.any()):
        return None
    rows = differs.nonzero().flatten().tolist()
    first = rows[0]
    return ReplayMismatch(state, request, f"{got.row} {first}",
                          f"{len(rows)} {got.row}(s) differ (first {first}: "
                          f"{_show(g, first)} after the commit vs {_show(w, first)} replayed)")


def _show(t: torch.Tensor, row: int) -> str:
    x = t.reshape(1) if t.dim() == 0 else t[row]
    flat = x.reshape(-1)
    vals = flat[:4].tolist() if flat.dtype not in (torch.float8_e4m3fn,) else \
        flat[:4].float().tolist()
    more = ", ..." if flat.numel() > 4 else ""
    return "[" + ", ".join(f"{v:.6g}" if isinstance(v, float) else str(v) for v in vals) + more + "]"


def compare_states(committed: StateView, replayed: StateView) -> list[ReplayMismatch]:
    """Every piece that differs (or exists on one side only), in state then request order."""
    out: list[ReplayMismatch] = []
    for state in sorted(set(committed) | set(replayed)):
        a, b = committed.get(state, {}), replayed.get(state, {})
        for request in sorted(set(a) | set(b)):
            if request not in a or request not in b:
                side = "the commit" if request not in a else "the replay"
                out.append(ReplayMismatch(state, request, "-", f"missing after {side}"))
                continue
            m = compare_piece(state, request, a[request], b[request])
            if m is not None:
                out.append(m)
    return out


def assert_replay_equal(committed: StateView, replayed: StateView, context: str = "") -> None:
    """Raise AssertionError listing every mismatch (state, request, row) when the views differ."""
    mismatches = compare_states(committed, replayed)
    if mismatches:
        head = f"rollback replay differs{': ' + context if context else ''}"
        raise AssertionError(head + "\n" + "\n".join(f"  {m}" for m in mismatches))
