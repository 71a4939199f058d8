"""A published property of the (gated) delta rule (Schlag et al. 2021, "Linear Transformers Are
Secretly Fast Weight Programmers"; Yang et al. 2024/2025, DeltaNet / Gated DeltaNet): with beta = 1
and no decay, writing (k, v) replaces whatever the memory held under the unit key k, so reading with
k returns exactly v; plain linear attention would return the sum of both values."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from spec.ops import gdn


@given(seed=st.integers(0, 2 ** 31), d=st.sampled_from([4, 16, 128]))
def test_delta_rule_overwrites_the_value_stored_under_a_key(seed, d):
    gen = torch.Generator().manual_seed(seed)
    f = torch.float64
    key = torch.randn(d, generator=gen, dtype=f)
    v1, v2 = torch.randn(2, d, generator=gen, dtype=f)
    k = key.expand(1, 2, 1, d).contiguous()                   # the same key written twice
    v = torch.stack([v1, v2])[None, :, None, :]
    g = torch.zeros(1, 2, 1, dtype=f)                         # no decay
    beta = torch.ones(1, 2, 1, dtype=f)                       # full write
    S0 = torch.randn(1, 1, d, d, generator=gen, dtype=f)      # whatever the memory held before
    _, _, S = gdn.gdn_recurrent(k, k, v, g, beta, S0, record=False)
    k_hat = gdn.l2norm(key)
    read = k_hat @ S[0, 0]                                    # S^T k^
    # l2norm keeps its eps inside the sqrt, so |k^|^2 = 1 - e with e ~ 1e-6 / |k|^2: each write
    # leaves e of what was read before (old, then v1) and writes (1 - e) of the new value.
    old = k_hat @ S0[0, 0]
    e = 1e-6 / key.pow(2).sum()
    slack = 4 * e * (v1.abs() + v2.abs() + old.abs()) + 1e-12
    assert ((read - v2).abs() <= slack).all()
    # Linear attention (no delta) would have returned v1 + v2 + old: the delta rule is not that.
    assert not torch.allclose(read, v1 + v2 + old)
