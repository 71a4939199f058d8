"""linear: the dense projection y = x @ W^T, one rounding to the activation dtype."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spec.ops.linear import linear


@pytest.mark.certify_property("linear")
@settings(deadline=None, max_examples=20)
@given(seed=st.integers(0, 2 ** 31), rows=st.integers(1, 9), k=st.sampled_from([16, 96, 256]))
def test_linear_rows_are_independent_and_round_once(seed, rows, k):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    w = (torch.randn(24, k, generator=gen) / k ** 0.5).to(torch.bfloat16)
    y = linear(x, w)
    # a row's result does not depend on the rows sharing the call (bitwise)
    for t in range(rows):
        assert torch.equal(linear(x[t:t + 1].clone(), w)[0], y[t])
    # one rounding of the fp32 sum: within one bf16 ulp of the float64 value, rounded once
    ideal = linear(x.double(), w.double())
    assert torch.equal(ideal, x.double() @ w.double().T)
    assert ((y.double() - ideal).abs() <= ideal.abs() * 2 ** -8 + 1e-6).all()


@pytest.mark.certify_guard("linear")
def test_linear_guard():
    """x = (1, 2), W = [[3, 4], [-1, 0.5]]: y = (11, 0); mismatched shapes and dtypes are refused."""
    x = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    w = torch.tensor([[3.0, 4.0], [-1.0, 0.5]], dtype=torch.float64)
    assert linear(x, w).tolist() == [[11.0, 0.0]]
    with pytest.raises(ValueError):
        linear(x, w[:, :1])
    with pytest.raises(TypeError):
        linear(x.float(), w)
