"""The canonical order of QSA selection as integers, shared by the torch and Triton paths.

docs/spec.md, "QSA" item 4 ranks candidates by (score, block index), both descending, with NaN as -inf and
-0.0 == +0.0. Mapping each fp32 score to a signed 32-bit key that orders like the float makes that rank
an integer comparison: no float compare in a kernel can then differ from another (NaN, signed zeros),
and appending the block index makes every candidate's key distinct, so "the k largest keys" is one set
whatever algorithm finds it.
"""

from __future__ import annotations

import torch

FLIP = 0x7FFFFFFF  # negative floats: flipping the magnitude bits reverses their order
MAX_TRITON_COLS = 4096  # 131072-token contexts / 32: the fused kernel's widest table


def score_keys(scores: torch.Tensor) -> torch.Tensor:
    """fp32 scores -> int32 keys with ``a < b  <=>  key(a) < key(b)`` (NaN -> -inf, -0.0 -> +0.0)."""
    x = torch.where(scores.isnan(), torch.full_like(scores, float("-inf")), scores)
    x = torch.where(x == 0, torch.zeros_like(x), x)  # -0.0 == 0 too: both become +0.0
    bits = x.contiguous().view(torch.int32)
    return torch.where(bits < 0, bits ^ FLIP, bits)


def window_mask(cols: torch.Tensor, t: torch.Tensor, sink: int, local: int) -> torch.Tensor:
    """[N, C] bool: block ``cols`` is in the window of row position t (spec ``window_blocks``)."""
    own = (t // 32)[:, None]
    return (((cols < sink) & (cols <= own)) | ((cols > own - local) & (cols <= own)))
