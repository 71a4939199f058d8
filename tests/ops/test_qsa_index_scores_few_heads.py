"""The Triton index scores with fewer than 16 index heads (the tiny model's 4): the wrapper pads
the heads with zero heads to the dot's M of 16, which adds an exact 0 to each block's head sum, so
the scores stay the spec's (docs/spec.md, "QSA: sparse attention with a block index" item 3). The
cells run the target's 16 heads only, where no padding happens.
"""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import pytest
import torch

from impl.kernels.qsa.triton_index import index_scores
from spec.ops.qsa import qsa_index_scores

pytestmark = pytest.mark.premerge


@pytest.mark.certify_property("qsa_index_scores")
def test_four_index_heads_give_the_specs_scores():
    gen = torch.Generator().manual_seed(4)
    heads, dim, pages = 4, 16, 6
    q = torch.randn(3, heads, dim, generator=gen).to(torch.bfloat16)
    w = torch.randn(3, heads, generator=gen).to(torch.bfloat16)
    keys = torch.randn(pages, dim, generator=gen).to(torch.bfloat16)
    valid = torch.ones(pages, dtype=torch.bool)
    table = torch.tensor([[2, 0, 5, 1]], dtype=torch.int32)
    seq, pos = torch.zeros(3, dtype=torch.long), torch.tensor([31, 70, 127])
    got = torch.full((3, 4), float("nan"))
    index_scores(q, w, seq, pos, table, keys, got)
    want = qsa_index_scores(q.double(), w.double(), seq, pos, table, keys.double(), valid)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got)), (got, want)
    scale = want[finite].abs().max()
    assert ((got[finite].double() - want[finite]).abs() / scale).max() <= 2 ** -10, (got, want)
