"""QSA top-k selection fused with expansion (spec/ops/qsa.py ``qsa_topk_expand``) as a vectorised torch
composition: the CPU path, and on the GPU the path for score tables wider than the Triton kernel's
4096 columns.

Selection ranks candidates by one int64 key, ``score key * 2^32 + block index``
(``topk_keys.score_keys``): distinct per candidate, larger for a higher index among equal scores, so
the k largest keys are exactly the set of docs/spec.md, "QSA" item 4 (ties to the highest block index)
whichever order ``torch.topk`` finds them in. Expansion uses that selected ids come out ascending:
every selected block but the one holding the cut is whole, so slot s of the row covers tokens
``32 * id_s + j`` and a token at or past the cut is -1 (no scatter, no prefix sum).
"""

from __future__ import annotations

import torch

from impl.kernels.qsa.topk_keys import score_keys, window_mask

TPB = 32  # tokens per block
NONE = -(2**63)  # the key of a column that is not a candidate


def select_mask(scores: torch.Tensor, positions: torch.Tensor, k: int, sink: int,
                local: int) -> torch.Tensor:
    """[N, C] bool: the selected blocks of every row (window, plus the k best candidates)."""
    n, c = scores.shape
    cols = torch.arange(c, device=scores.device)[None, :]
    t = positions.long()
    win = window_mask(cols, t, sink, local)
    cand = (cols < ((t + 1) // TPB)[:, None]) & ~win
    key = score_keys(scores).long() * 2**32 + cols
    # Below every candidate's key: the smallest score key is -inf's, -2^31 + 2^23 - 1 (NaN maps to it).
    key = torch.where(cand, key, torch.full_like(key, NONE))
    top = torch.zeros_like(cand)
    take = min(k, c)
    if take > 0:
        vals, idx = torch.topk(key, take, dim=1)
        # With fewer than k candidates topk also returns non-candidates (key NONE): not selected.
        top.scatter_(1, idx, vals > NONE)
    return win | top


def compact(mask: torch.Tensor, width: int) -> torch.Tensor:
    """[N, C] bool -> int64 [N, width]: the True columns ascending, padded with -1."""
    n, c = mask.shape
    cols = torch.arange(c, device=mask.device).expand(n, c)
    rank = mask.long().cumsum(1) - 1
    out = torch.full((n, width + 1), -1, dtype=torch.int64, device=mask.device)
    # Unselected columns all go to the spare last column, which is dropped.
    out.scatter_(1, torch.where(mask, rank, width), torch.where(mask, cols, -1))
    return out[:, :width]


def expand_sorted(ids: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """Ascending distinct block ids [N, W] (-1 padded) -> tokens [N, 32 W] below ``limit`` [N]."""
    tok = ids[:, :, None] * TPB + torch.arange(TPB, device=ids.device)
    keep = (ids[:, :, None] >= 0) & (tok < limit[:, None, None])
    return torch.where(keep, tok, torch.full_like(tok, -1)).reshape(ids.shape[0], -1)


def qsa_topk_expand(scores: torch.Tensor, positions: torch.Tensor,
                    context_lens: torch.Tensor | None = None, *, selected: torch.Tensor,
                    tokens: torch.Tensor, k: int = 64, sink_blocks: int = 1,
                    local_blocks: int = 2) -> None:
    """scores fp32 [N, C]; positions, context_lens integer [N] -> selected int64 [N, W] and tokens
    int64 [N, 32 W] (W = k + sink + local), both written completely.

    Precondition (as the forward builds tables): a row's own block has a column (t < 32 C)."""
    if scores.dtype != torch.float32:
        raise ValueError("selection keys are built from fp32 score bits: scores must be fp32")
    width = k + sink_blocks + local_blocks
    t = positions.long()
    limit = t + 1 if context_lens is None else torch.minimum(t + 1, context_lens.long())
    ids = compact(select_mask(scores, positions, k, sink_blocks, local_blocks), width)
    selected.copy_(ids)
    tokens.copy_(expand_sorted(ids, limit))
