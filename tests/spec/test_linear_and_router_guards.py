"""Shape guards of ``linear`` and ``moe_route`` the cells' well-formed inputs never reach
(docs/spec.md, "Norms and embeddings", its dense projections item, and "MoE"): each bad argument
alone is refused, whatever the others are, including a shape whose second dimension matches.
"""

from __future__ import annotations

import pytest
import torch

from spec.ops.linear import linear
from spec.ops.moe import moe_route

pytestmark = pytest.mark.premerge

BF16 = torch.bfloat16


@pytest.mark.certify_guard("linear")
@pytest.mark.parametrize("x_shape,w_shape", [((2, 8, 8), (4, 8)), ((2, 8), (4, 8, 1)),
                                             ((2, 8), (4, 6))],
                         ids=["x-3d", "w-3d", "in-mismatch"])
def test_linear_refuses_each_bad_shape_alone(x_shape, w_shape):
    with pytest.raises(ValueError, match="expected x"):
        linear(torch.zeros(x_shape, dtype=BF16), torch.zeros(w_shape, dtype=BF16))


@pytest.mark.certify_guard("moe_route")
@pytest.mark.parametrize("w_shape,top_k,match", [((4, 8, 1), 2, "expected x"),
                                                 ((4, 6), 2, "expected x"),
                                                 ((4, 8), 0, "top_k"), ((4, 8), 5, "top_k")],
                         ids=["router-3d", "hidden-mismatch", "top-k-0", "top-k-past-e"])
def test_moe_route_refuses_each_bad_argument_alone(w_shape, top_k, match):
    with pytest.raises(ValueError, match=match):
        moe_route(torch.zeros(3, 8, dtype=BF16), torch.zeros(w_shape, dtype=BF16), top_k)
