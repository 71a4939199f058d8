"""Property tests and hand-checkable guards of the hyper-connection ops (spec/ops/hc.py)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from spec.ops.hc import (
    N_STREAMS,
    hc_first_projection,
    hc_inject_norm,
    hc_pre,
    hc_up_projection,
    sinkhorn,
)

N = N_STREAMS
F64 = torch.float64

# Sinkhorn residual after 20 rounds for M = exp(l), every |l| <= 1, n = 4 (rows are normalised last,
# so the residual is in the column sums).
# Derived (loose): the projective diameter of M is at most 4, so each half-round contracts the Hilbert
# distance to the fixed point by tanh(4/4) = 0.76 (Birkhoff-Hopf); 40 half-rounds give 0.76^40 = 1.9e-5
# times the initial distance (<= 4), i.e. about 7e-5.
# Measured (float64): the worst column-sum error over all 2^16 sign patterns l in {-1, +1}^16 (the
# extreme points) is 7.6e-7, at the pattern of SINKHORN_WORST_LOGITS; 2e5 uniform draws and a gradient
# ascent on the error stay below it. fp32 adds rounding: 8.3e-7 worst measured.
SINKHORN_LOGIT_BOUND = 1.0
SINKHORN_COL_BOUND = {torch.float64: 1.0e-6, torch.float32: 1.5e-6}
SINKHORN_ROW_BOUND = {torch.float64: 1.0e-14, torch.float32: 1.0e-6}
SINKHORN_WORST_LOGITS = [[-1.0, 1.0, 1.0, 1.0]] * 3 + [[1.0, -1.0, -1.0, -1.0]]

seeds = st.integers(min_value=0, max_value=2**31 - 1)
tokens = st.integers(min_value=1, max_value=4)
channels = st.integers(min_value=1, max_value=12)
dtypes = st.sampled_from([torch.float32, torch.float64])


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(g: torch.Generator, *shape: int, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=F64).to(dtype)


def _birkhoff_matrix(g: torch.Generator, T: int, n: int, terms: int = 3) -> torch.Tensor:
    """A convex combination of permutation matrices: doubly stochastic exactly up to float64 rounding."""
    w = torch.rand(T, terms, generator=g, dtype=F64) + 0.1
    w = w / w.sum(dim=-1, keepdim=True)
    eye = torch.eye(n, dtype=F64)
    out = torch.zeros(T, n, n, dtype=F64)
    for t in range(T):
        for k in range(terms):
            out[t] += w[t, k] * eye[torch.randperm(n, generator=g)]
    return out


def _shifted_doubly_stochastic() -> torch.Tensor:
    """The guard matrix: 0.7 at (i, (i + 1) % 4), 0.1 elsewhere (rows and columns sum to 1)."""
    h = torch.full((N, N), 0.1, dtype=F64)
    for i in range(N):
        h[i, (i + 1) % N] = 0.7
    return h


# ---------------------------------------------------------------- hc_inject_norm


@pytest.mark.certify_property("hc_inject_norm")
@given(seed=seeds, T=tokens, C=channels, dtype=dtypes, scale=st.floats(0.01, 100.0))
def test_inject_norm_property(seed: int, T: int, C: int, dtype: torch.dtype, scale: float) -> None:
    X = _randn(_gen(seed), T, N, C, dtype=dtype) * scale
    v, r = hc_inject_norm(X)
    assert v.dtype == dtype and r.dtype == dtype and v.shape == (T, N * C) and r.shape == (T,)
    # v is vec(X), stream 0's C values first, exactly.
    assert torch.equal(v, X.reshape(T, N * C))
    assert torch.equal(v[:, C:2 * C], X[:, 1])
    ref = 1.0 / torch.sqrt(X.to(F64).pow(2).mean(dim=(1, 2)) + 1e-6)
    tol = 1e-14 if dtype == F64 else 4e-7
    torch.testing.assert_close(r.to(F64), ref, rtol=tol, atol=0.0)
    # The normalised vector has RMS sqrt(ms / (ms + eps)) <= 1, ms = mean(v^2): 1 up to the eps term.
    ms = X.to(F64).pow(2).mean(dim=(1, 2))
    rms = (v.to(F64) * r.to(F64)[:, None]).pow(2).mean(dim=-1).sqrt()
    torch.testing.assert_close(rms, torch.sqrt(ms / (ms + 1e-6)), rtol=10 * tol, atol=0.0)


@pytest.mark.certify_guard("hc_inject_norm")
def test_inject_norm_guard() -> None:
    # v = [1, 1, 1, 1, 1, 1, 1, 5]: mean(v^2) = (7 + 25) / 8 = 4, so r = 1/2 (eps = 0).
    X = torch.tensor([[[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 5.0]]], dtype=F64)
    v, r = hc_inject_norm(X, eps=0.0)
    assert v.tolist() == [[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 5.0]]
    assert r.tolist() == [0.5]
    # With the default eps = 1e-6: r = 1/sqrt(4.000001).
    _, r_eps = hc_inject_norm(X)
    assert r_eps.item() == pytest.approx(0.49999993750001, rel=1e-12)


# ---------------------------------------------------------------- sinkhorn


@pytest.mark.certify_property("sinkhorn")
@given(seed=seeds, T=tokens, dtype=dtypes, scale=st.floats(0.01, 1000.0))
def test_sinkhorn_property(seed: int, T: int, dtype: torch.dtype, scale: float) -> None:
    g = _gen(seed)
    logits = (2.0 * torch.rand(T, N, N, generator=g, dtype=F64) - 1.0) * SINKHORN_LOGIT_BOUND
    worst = torch.tensor(SINKHORN_WORST_LOGITS, dtype=F64)[None]
    logits = torch.cat([logits, worst], dim=0)
    H = sinkhorn(torch.exp(logits).to(dtype))
    assert H.dtype == dtype and torch.all(H > 0)
    col_err = (H.to(F64).sum(dim=-2) - 1.0).abs().max().item()
    row_err = (H.to(F64).sum(dim=-1) - 1.0).abs().max().item()
    assert col_err <= SINKHORN_COL_BOUND[dtype], col_err
    assert row_err <= SINKHORN_ROW_BOUND[dtype], row_err
    # Scale invariance: a positive factor common to the matrix is divided out by the first round.
    H_scaled = sinkhorn(torch.exp(logits) * scale)
    torch.testing.assert_close(H_scaled, sinkhorn(torch.exp(logits)), rtol=1e-12, atol=1e-14)
    # Permutation equivariance: relabelling rows and columns relabels the result.
    pr, pc = torch.randperm(N, generator=g), torch.randperm(N, generator=g)
    M = torch.exp(logits)
    torch.testing.assert_close(sinkhorn(M[:, pr][:, :, pc]), sinkhorn(M)[:, pr][:, :, pc],
                               rtol=1e-12, atol=1e-14)


@pytest.mark.certify_guard("sinkhorn")
def test_sinkhorn_guard() -> None:
    # One round on [[1, 2], [3, 4]]: columns (sums 4, 6) -> [[1/4, 1/3], [3/4, 2/3]];
    # rows (sums 7/12, 17/12) -> [[3/7, 4/7], [9/17, 8/17]].
    H = sinkhorn(torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=F64), iters=1)
    torch.testing.assert_close(H, torch.tensor([[3 / 7, 4 / 7], [9 / 17, 8 / 17]], dtype=F64),
                               rtol=1e-15, atol=0.0)
    # A constant 4 x 4 matrix goes to 1/4 everywhere; a scaled doubly stochastic matrix to itself.
    assert torch.equal(sinkhorn(torch.full((N, N), 5.0, dtype=F64)), torch.full((N, N), 0.25, dtype=F64))
    target = _shifted_doubly_stochastic()
    torch.testing.assert_close(sinkhorn(10.0 * target), target, rtol=1e-15, atol=1e-15)


# ---------------------------------------------------------------- hc_first_projection


@pytest.mark.certify_property("hc_first_projection")
@given(seed=seeds, T=tokens, C=channels, dtype=dtypes)
def test_first_projection_property(seed: int, T: int, C: int, dtype: torch.dtype) -> None:
    g = _gen(seed)
    X = _randn(g, T, N, C, dtype=dtype)
    width = 2 * N + N * N
    # Columns of Phi scaled so |l| stays below ~15 (H_post strictly inside (0, 2) in fp32).
    phi = _randn(g, N * C, width, dtype=dtype) / math.sqrt(N * C)
    bias = _randn(g, width, dtype=dtype)
    v, r = hc_inject_norm(X)
    h = hc_first_projection(v, r, phi, bias)
    assert h.h_pre.shape == (T, N) and h.h_post.shape == (T, N) and h.h_res.shape == (T, N, N)
    assert h.h_pre.dtype == h.h_post.dtype == h.h_res.dtype == dtype
    assert torch.all((h.h_pre > 0) & (h.h_pre < 1))
    assert torch.all((h.h_post > 0) & (h.h_post < 2))
    assert torch.all(h.h_res > 0)
    assert (h.h_res.to(F64).sum(dim=-1) - 1).abs().max() <= SINKHORN_ROW_BOUND[dtype]
    # Float64 reference with the literal exp(l_res) (no shift): the shift changes nothing.
    l = (v.to(F64) * r.to(F64)[:, None]) @ phi.to(F64) + bias.to(F64)
    ref_res = sinkhorn(torch.exp(l[:, 2 * N:].reshape(T, N, N)))
    tol = 1e-12 if dtype == F64 else 2e-5
    torch.testing.assert_close(h.h_pre.to(F64), torch.sigmoid(l[:, :N]), rtol=tol, atol=tol)
    torch.testing.assert_close(h.h_post.to(F64), 2 * torch.sigmoid(l[:, N:2 * N]), rtol=tol, atol=tol)
    torch.testing.assert_close(h.h_res.to(F64), ref_res, rtol=tol, atol=tol)


def test_first_projection_extreme_logits_stay_finite() -> None:
    # l_res up to 1000: exp would overflow without the per-matrix shift; the result is still finite
    # and equals the literal float64 definition on the shifted-down logits.
    v = torch.tensor([[1.0, -1.0, 1.0, -1.0]], dtype=torch.float32)
    phi = torch.full((N, 2 * N + N * N), 0.5)
    bias = torch.cat([torch.zeros(2 * N), 1000.0 + torch.arange(N * N, dtype=torch.float32) / 8])
    h = hc_first_projection(v, torch.ones(1), phi, bias)
    assert torch.isfinite(h.h_res).all()
    ref = sinkhorn(torch.exp(torch.arange(N * N, dtype=F64).reshape(1, N, N) / 8))
    torch.testing.assert_close(h.h_res.to(F64), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.certify_guard("hc_first_projection")
def test_first_projection_guard() -> None:
    # v = [1, -1, 1, -1], r = 1, Phi = 0.5 everywhere: (v * r) @ Phi = 0, so l = bias.
    v = torch.tensor([[1.0, -1.0, 1.0, -1.0]], dtype=F64)
    phi = torch.full((N, 2 * N + N * N), 0.5, dtype=F64)
    ln3, ln7 = math.log(3.0), math.log(7.0)
    l_pre = [0.0, ln3, -ln3, 0.0]    # sigmoid: 1/2, 3/4, 1/4, 1/2
    l_post = [0.0, 0.0, -ln3, ln3]   # 2 sigmoid: 1, 1, 1/2, 3/2
    # l_res row-major: ln 7 at (i, i+1 mod 4) -> exp has columns summing to 10, rows to 10:
    # H_res = 0.7 at (i, i+1 mod 4), 0.1 elsewhere.
    l_res = [[ln7 if j == (i + 1) % N else 0.0 for j in range(N)] for i in range(N)]
    bias = torch.tensor(l_pre + l_post + sum(l_res, []), dtype=F64)
    h = hc_first_projection(v, torch.ones(1, dtype=F64), phi, bias)
    torch.testing.assert_close(h.h_pre, torch.tensor([[0.5, 0.75, 0.25, 0.5]], dtype=F64))
    torch.testing.assert_close(h.h_post, torch.tensor([[1.0, 1.0, 0.5, 1.5]], dtype=F64))
    torch.testing.assert_close(h.h_res[0], _shifted_doubly_stochastic(), rtol=1e-14, atol=1e-14)


# ---------------------------------------------------------------- hc_pre


@pytest.mark.certify_property("hc_pre")
@given(seed=seeds, T=tokens, C=channels, act=st.sampled_from([torch.bfloat16, torch.float16]))
def test_hc_pre_property(seed: int, T: int, C: int, act: torch.dtype) -> None:
    g = _gen(seed)
    X = _randn(g, T, N, C, dtype=torch.float32)
    h_pre = torch.sigmoid(_randn(g, T, N, dtype=torch.float32))
    x_in = hc_pre(X, h_pre, act_dtype=act)
    # The one rounding point: the fp32 sum (stream 0 first) cast to the activation dtype once.
    fp32_sum = h_pre[:, 0, None] * X[:, 0]
    for j in range(1, N):
        fp32_sum = fp32_sum + h_pre[:, j, None] * X[:, j]
    assert x_in.dtype == act and torch.equal(x_in, fp32_sum.to(act))
    # Reference mode: float64 in, float64 out, no rounding, equal to the einsum.
    x64 = hc_pre(X.to(F64), h_pre.to(F64), act_dtype=act)
    assert x64.dtype == F64
    torch.testing.assert_close(x64, torch.einsum("tn,tnc->tc", h_pre.to(F64), X.to(F64)),
                               rtol=1e-14, atol=1e-14)
    # A one-hot H_pre selects its stream exactly.
    k = seed % N
    onehot = torch.zeros(T, N)
    onehot[:, k] = 1.0
    assert torch.equal(hc_pre(X, onehot, act_dtype=torch.float32), X[:, k])


@pytest.mark.certify_guard("hc_pre")
def test_hc_pre_guard() -> None:
    # x_in = 0.5*[1, 2] + 0.25*[4, 8] + 0.125*[8, 16] + 0.125*[16, 32] = [0.5+1+1+2, 1+2+2+4] = [4.5, 9].
    X = torch.tensor([[[1.0, 2.0], [4.0, 8.0], [8.0, 16.0], [16.0, 32.0]]])
    h_pre = torch.tensor([[0.5, 0.25, 0.125, 0.125]])
    x_in = hc_pre(X, h_pre)
    assert x_in.dtype == torch.bfloat16 and x_in.float().tolist() == [[4.5, 9.0]]
    # bf16 rounding point: 1 + 2^-9 is not a bf16 value (8 significand bits) and rounds to 1.
    X2 = torch.tensor([[[1.0 + 2.0**-9], [1.0 + 2.0**-9], [1.0 + 2.0**-9], [1.0 + 2.0**-9]]])
    assert hc_pre(X2, torch.full((1, N), 0.25)).float().item() == 1.0
    assert hc_pre(X2, torch.full((1, N), 0.25), act_dtype=torch.float32).item() == 1.0 + 2.0**-9


# ---------------------------------------------------------------- hc_up_projection


@pytest.mark.certify_property("hc_up_projection")
def test_up_projection_on_meta_tensors_has_the_real_shapes_and_dtypes() -> None:
    """The reach tracer runs the spec on meta tensors (shapes only): that path must give what the
    real one gives, shape and dtype."""
    g = _gen(3)
    real = (_randn(g, 5, N, 64, dtype=torch.float32), _randn(g, 5, 64, dtype=torch.bfloat16),
            _birkhoff_matrix(g, 5, N).float(), torch.sigmoid(_randn(g, 5, N, dtype=torch.float32)))
    want = hc_up_projection(*real)
    got = hc_up_projection(*(t.to("meta") for t in real))
    assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in want]


@pytest.mark.certify_property("hc_up_projection")
@given(seed=seeds, T=tokens, C=channels, dtype=dtypes)
def test_up_projection_property(seed: int, T: int, C: int, dtype: torch.dtype) -> None:
    g = _gen(seed)
    X = _randn(g, T, N, C, dtype=dtype)
    y = _randn(g, T, C, dtype=torch.bfloat16 if dtype == torch.float32 else F64)
    h_res = _birkhoff_matrix(g, T, N).to(dtype)
    h_post = 2.0 * torch.sigmoid(_randn(g, T, N, dtype=dtype))
    Xn, m = hc_up_projection(X, y, h_res, h_post)
    # Streams stay in the accumulation dtype (fp32 with a bf16 y): no activation rounding.
    assert Xn.dtype == dtype and m.dtype == dtype and Xn.shape == (T, N, C) and m.shape == (T, C)
    # m is the stream mean of X': bitwise the fixed-order sum / n, and equal to torch.mean.
    fixed = ((Xn[:, 0] + Xn[:, 1]) + Xn[:, 2]) + Xn[:, 3]
    assert torch.equal(m, fixed / N)
    tol = 1e-14 if dtype == F64 else 1e-5
    torch.testing.assert_close(m, Xn.mean(dim=1), rtol=tol, atol=tol)
    # Definition, against a float64 einsum.
    ref = torch.einsum("tij,tjc->tic", h_res.to(F64), X.to(F64))
    ref = ref + h_post.to(F64)[..., None] * y.to(F64)[:, None]
    torch.testing.assert_close(Xn.to(F64), ref, rtol=tol, atol=tol)
    # A column-stochastic H_res preserves the stream mean: m = mean(X) + mean(H_post) * y.
    ref_m = X.to(F64).mean(dim=1) + h_post.to(F64).mean(dim=1, keepdim=True) * y.to(F64)
    torch.testing.assert_close(m.to(F64), ref_m, rtol=10 * tol, atol=10 * tol)


@pytest.mark.certify_guard("hc_up_projection")
def test_up_projection_guard() -> None:
    # X = [1, 2, 3, 4] (C = 1), H_res = 0.7 at (i, i+1 mod 4) else 0.1, H_post = 0.5, y = 2:
    # X'[i] = 0.7 X[i+1] + 0.1 (10 - X[i+1]) + 1 = 0.6 X[i+1] + 2 -> [3.2, 3.8, 4.4, 2.6];
    # m = 14 / 4 = 3.5 = mean(X) + 0.5 * 2.
    X = torch.tensor([[[1.0], [2.0], [3.0], [4.0]]], dtype=F64)
    y = torch.tensor([[2.0]], dtype=F64)
    h_post = torch.full((1, N), 0.5, dtype=F64)
    Xn, m = hc_up_projection(X, y, _shifted_doubly_stochastic()[None], h_post)
    torch.testing.assert_close(Xn[0, :, 0], torch.tensor([3.2, 3.8, 4.4, 2.6], dtype=F64),
                               rtol=1e-15, atol=1e-15)
    torch.testing.assert_close(m, torch.tensor([[3.5]], dtype=F64), rtol=1e-15, atol=1e-15)
