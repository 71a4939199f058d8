"""The torch MoE block's routing weights on a router whose probabilities spread over many experts.

The cells' routers concentrate nearly all of p on the top 10 of 16 experts, so the selected p sum to
almost 1 and weights left unrenormalised pass their bands. A router with small logits spreads p
(about 1/16 each): the top 10 then sum to about 0.63, and only renormalised weights sum to 1.
"""

from __future__ import annotations

import pytest
import torch

from impl.kernels.moe.torch_moe import route
from spec.ops.moe import moe_route


@pytest.mark.certify_property("moe")
def test_torch_routing_weights_are_renormalised_on_a_spread_router():
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(6, 64, generator=gen).to(torch.bfloat16)
    w = (torch.randn(16, 64, generator=gen) * 0.01).to(torch.bfloat16)
    ids, weights = route(x, w, 10)
    ref_ids, ref_w = moe_route(x.double(), w.double(), 10)
    assert torch.equal(ids, ref_ids)
    assert torch.allclose(weights.double(), ref_w, rtol=1e-5, atol=0), (weights, ref_w)
    assert torch.allclose(weights.sum(-1).double(), torch.ones(6, dtype=torch.float64), rtol=1e-5)
