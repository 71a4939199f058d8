"""Second formulations of the core spec ops, checked against the spec functions.

The spec under spec/ is the definition every implementation is certified against, so it has to be
checked, not only trusted. For each op below this file writes the definition a second time, from the
prose of docs/spec.md and the function's docstring, in a deliberately different computational
form, and compares the two in float64 on seeded random inputs:

- ``rmsnorm``, ``gated_rmsnorm``: a per-row Python loop over the row's elements (``math.fsum``);
  the gated norm also in its low-precision form (bf16 z), rounding at the two points its docstring names;
- ``gdn_gates``: the closed scalar formulas (``math.log1p``/``math.exp``), softplus threshold 20;
- ``l2norm``: per-vector loop, eps inside the sqrt;
- ``causal_conv1d``: an explicit loop over (batch, time, channel) reading the history by index, with
  and without a conv state; ``causal_conv1d_update``: one step on the concatenated window;
- ``gdn_recurrent``: the gated delta rule in the published transition-matrix form
  ``M_t = M_{t-1} alpha_t (I - beta_t k_t k_t^T) + beta_t v_t k_t^T``, ``o_t = M_t q_t`` (Gated
  DeltaNet, state [d_v, d_k]), one (batch, value head, time) at a time, value head h reading key
  head h // (HV / HK);
- ``apply_neox_rope``: complex multiplication ``(x_j + i x_{j+r/2}) * exp(i angle)``;
- ``inv_freq`` / ``rope_angles``: the closed formula ``theta^(-2j/r)`` per (token, frequency), and
  the interleaved mRoPE row rule written out as docs/spec.md states it.

Every comparison is paired with a deliberately wrong variant of the same second formulation (eps
outside the sqrt, the wrong head mapping, the other rotary pairing, ...) that must *not* match the
spec at the same tolerance, so each test shows it can fail.

Tolerances: both sides compute the same real-number function in float64 with O(10) to O(100)
roundings per output on values of order 1, so they agree to a few 1e-15 relative; rtol 1e-12
(atol 1e-13 for values that can be near 0) leaves margin for summation-order differences only,
while every wrong variant is off by 1e-8 or more. Stored values (conv states, pass-through dims,
above-threshold softplus) are compared bitwise.
"""

from __future__ import annotations

import math

import pytest
import torch

from spec.ops.gdn import (causal_conv1d, causal_conv1d_update, gdn_gates, gdn_recurrent,
                          l2norm)
from spec.ops.norms import gated_rmsnorm, rmsnorm
from spec.ops.rope import apply_neox_rope, inv_freq, rope_angles

F64 = torch.float64
RTOL = 1e-12   # float64 rounding differences only (see the module docstring)
ATOL = 1e-13


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = RTOL, atol: float = ATOL) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=rtol, atol=atol)


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def _silu(x: float) -> float:
    return x / (1.0 + math.exp(-x))


# ---------------------------------------------------------------- norms


def second_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float,
                   eps_outside_sqrt: bool = False, plain_weight: bool = False) -> torch.Tensor:
    """Per row: ``y_i = x_i / sqrt(mean_j x_j^2 + eps) * (1 + w_i)``, element by element."""
    rows = x.reshape(-1, x.shape[-1]).tolist()
    ws = w.tolist()
    out = []
    for row in rows:
        ms = math.fsum(v * v for v in row) / len(row)
        denom = math.sqrt(ms) + eps if eps_outside_sqrt else math.sqrt(ms + eps)
        out.append([v / denom * (wi if plain_weight else 1.0 + wi) for v, wi in zip(row, ws)])
    return torch.tensor(out, dtype=F64).reshape(x.shape)


def second_gated_rmsnorm(o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float,
                         act: torch.dtype | None = None, round_normed: bool = True,
                         gate_is_z: bool = False) -> torch.Tensor:
    """Per row: ``n_i = w_i * o_i / sqrt(mean_j o_j^2 + eps)``, then ``n_i * silu(z_i)``, in float64.

    With ``act`` (the activation dtype) the result is rounded at the docstring's two points: the
    weighted norm (unless ``round_normed`` is False), and the end.
    """
    o_rows = o.double().reshape(-1, o.shape[-1]).tolist()
    z_rows = z.double().reshape(-1, z.shape[-1]).tolist()
    ws = w.double().tolist()
    normed, gates = [], []
    for orow, zrow in zip(o_rows, z_rows):
        rms = math.sqrt(math.fsum(v * v for v in orow) / len(orow) + eps)
        normed.append([wi * (v / rms) for v, wi in zip(orow, ws)])
        gates.append([zi if gate_is_z else _silu(zi) for zi in zrow])
    n = torch.tensor(normed, dtype=F64).reshape(o.shape)
    g = torch.tensor(gates, dtype=F64).reshape(z.shape)
    if act is None:
        return n * g
    if round_normed:
        n = n.to(act).double()
    return (n * g).to(act)


@pytest.mark.second_formulation("spec.ops.norms:rmsnorm")
def test_rmsnorm_equals_per_row_loop_and_eps_sits_inside_the_sqrt():
    gen = _gen(101)
    for shape in [(3, 16), (2, 5, 64), (1, 7)]:
        x = torch.randn(*shape, generator=gen, dtype=F64)
        x[0, ..., :] *= 1e-3   # a small-rms row, where eps weighs more
        w = 0.1 * torch.randn(shape[-1], generator=gen, dtype=F64)
        spec = rmsnorm(x, w, eps=1e-6)
        assert spec.dtype == F64
        assert _close(second_rmsnorm(x, w, 1e-6), spec)
        assert not _close(second_rmsnorm(x, w, 1e-6, eps_outside_sqrt=True), spec)
        assert not _close(second_rmsnorm(x, w, 1e-6, plain_weight=True), spec)


@pytest.mark.second_formulation("spec.ops.norms:rmsnorm")
def test_rmsnorm_bf16_is_the_float64_loop_rounded_once():
    # fp32 math then one cast: equal to the float64 result rounded once to bf16, except where fp32's
    # own error (~1e-7 relative) moves a value across a bf16 rounding boundary (rare, one ulp).
    gen = _gen(102)
    x = torch.randn(8, 128, generator=gen, dtype=F64).to(torch.bfloat16)
    w = (0.1 * torch.randn(128, generator=gen)).float()
    spec = rmsnorm(x, w)
    assert spec.dtype == torch.bfloat16
    mine = second_rmsnorm(x.double(), w.double(), 1e-6).to(torch.bfloat16)
    mismatch = (spec != mine).double().mean().item()
    assert mismatch <= 0.005
    assert ((spec.float() - mine.float()).abs() <= mine.float().abs() * 2 ** -7).all()


@pytest.mark.second_formulation("spec.ops.norms:gated_rmsnorm")
def test_gated_rmsnorm_float64_equals_per_row_loop():
    gen = _gen(103)
    o = torch.randn(2, 3, 6, 32, generator=gen, dtype=F64)
    o[0, 0, 0] *= 1e-4
    z = 2.0 * torch.randn(2, 3, 6, 32, generator=gen, dtype=F64)
    w = 1.0 + 0.2 * torch.randn(32, generator=gen, dtype=F64)
    spec = gated_rmsnorm(o, z, w, eps=1e-6)
    assert spec.dtype == F64
    assert _close(second_gated_rmsnorm(o, z, w, 1e-6), spec)
    # wrong: z used as the gate without silu; and the zero-centred (1 + w) weight of rmsnorm.
    assert not _close(second_gated_rmsnorm(o, z, w, 1e-6, gate_is_z=True), spec)
    assert not _close(second_gated_rmsnorm(o, z, 1.0 + w, 1e-6), spec)


@pytest.mark.second_formulation("spec.ops.norms:gated_rmsnorm")
def test_gated_rmsnorm_bf16_rounds_after_the_weighted_norm_and_at_the_end():
    # o fp32, z bf16 (and z fp32 with out_dtype=bf16): the spec computes in fp32 and rounds to bf16
    # twice. The float64 loop rounded at the same two points agrees except where fp32's own error
    # (~1e-7 relative) crosses a bf16 rounding boundary: rare, and then by at most ~2 bf16 ulps.
    # Leaving out the first rounding point changes a large fraction of the outputs.
    gen = _gen(104)
    o = torch.randn(16, 6, 64, generator=gen, dtype=F64).float()
    w = (1.0 + 0.2 * torch.randn(64, generator=gen, dtype=F64)).float()
    z64 = 2.0 * torch.randn(16, 6, 64, generator=gen, dtype=F64)
    for z, out_dtype in [(z64.to(torch.bfloat16), None), (z64.float(), torch.bfloat16)]:
        spec = gated_rmsnorm(o, z, w, out_dtype=out_dtype)
        assert spec.dtype == torch.bfloat16
        mine = second_gated_rmsnorm(o, z, w, 1e-6, act=torch.bfloat16)
        one_rounding = second_gated_rmsnorm(o, z, w, 1e-6, act=torch.bfloat16, round_normed=False)
        assert (spec != mine).double().mean().item() <= 0.005
        assert ((spec.float() - mine.float()).abs() <= mine.float().abs() * 2 ** -6).all()
        assert (spec != one_rounding).double().mean().item() >= 0.05


# ---------------------------------------------------------------- GDN gates, l2norm


def second_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                 threshold: float | None = 20.0, bias_after_softplus: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise: ``g = -e^{A_log_h} * softplus(a + dt_bias_h)``, ``beta = 1 / (1 + e^{-b})``,
    softplus(x) = log(1 + e^x), or x itself above the threshold."""
    def softplus(x: float) -> float:
        return x if threshold is not None and x > threshold else math.log1p(math.exp(x))

    hv = a.shape[-1]
    a_rows, b_rows = a.reshape(-1, hv).tolist(), b.reshape(-1, hv).tolist()
    al, dt = A_log.tolist(), dt_bias.tolist()
    g, beta = [], []
    for ar, br in zip(a_rows, b_rows):
        if bias_after_softplus:
            g.append([-math.exp(al[h]) * (softplus(ar[h]) + dt[h]) for h in range(hv)])
        else:
            g.append([-math.exp(al[h]) * softplus(ar[h] + dt[h]) for h in range(hv)])
        beta.append([1.0 / (1.0 + math.exp(-x)) for x in br])
    return (torch.tensor(g, dtype=F64).reshape(a.shape),
            torch.tensor(beta, dtype=F64).reshape(b.shape))


@pytest.mark.second_formulation("spec.ops.gdn:gdn_gates")
def test_gdn_gates_equal_the_closed_scalar_formulas():
    gen = _gen(201)
    a = 3.0 * torch.randn(2, 5, 6, generator=gen, dtype=F64)
    b = 3.0 * torch.randn(2, 5, 6, generator=gen, dtype=F64)
    A_log = torch.randn(6, generator=gen, dtype=F64)
    dt_bias = torch.randn(6, generator=gen, dtype=F64)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    g2, beta2 = second_gates(a, b, A_log, dt_bias)
    assert g.dtype == beta.dtype == F64
    assert _close(g2, g) and _close(beta2, beta)
    assert not _close(second_gates(a, b, A_log, dt_bias, bias_after_softplus=True)[0], g)
    assert not _close(second_gates(a, -b, A_log, dt_bias)[1], beta)


@pytest.mark.second_formulation("spec.ops.gdn:gdn_gates")
def test_gdn_softplus_threshold_is_20_and_exact_above_it():
    # With A_log = 0 (e^0 = 1 exactly) g is -softplus itself; above the threshold softplus returns its
    # argument, which log(1 + e^x) does not (it adds e^-x > half an ulp of x for x < 36): bitwise.
    gen = _gen(202)
    x = 20.0 + 15.0 * torch.rand(4, 6, generator=gen, dtype=F64)   # a + dt_bias in (20, 35)
    x[0, 0] = 20.0 + 2 ** -40                                        # just above the threshold
    zeros = torch.zeros(6, dtype=F64)
    g, _ = gdn_gates(x, x, zeros, zeros)
    assert _bitwise(g, -x)
    assert _bitwise(second_gates(x, x, zeros, zeros)[0], g)
    assert not _bitwise(second_gates(x, x, zeros, zeros, threshold=None)[0], g)
    # just below the threshold both use log(1 + e^x).
    below = torch.full((1, 6), 19.5, dtype=F64)
    assert _close(second_gates(below, below, zeros, zeros)[0], gdn_gates(below, below, zeros, zeros)[0])


def second_l2norm(x: torch.Tensor, eps: float, eps_outside_sqrt: bool = False) -> torch.Tensor:
    """Per vector: ``x / sqrt(sum x^2 + eps)``."""
    out = []
    for row in x.reshape(-1, x.shape[-1]).tolist():
        s = math.fsum(v * v for v in row)
        d = math.sqrt(s) + eps if eps_outside_sqrt else math.sqrt(s + eps)
        out.append([v / d for v in row])
    return torch.tensor(out, dtype=F64).reshape(x.shape)


@pytest.mark.second_formulation("spec.ops.gdn:l2norm")
def test_l2norm_equals_per_vector_loop_with_eps_inside_the_sqrt():
    gen = _gen(203)
    x = torch.randn(2, 4, 3, 16, generator=gen, dtype=F64)
    x[0, 0] *= 1e-3   # small vectors: eps matters there
    spec = l2norm(x, eps=1e-6)
    assert spec.dtype == F64
    assert _close(second_l2norm(x, 1e-6), spec)
    assert not _close(second_l2norm(x, 1e-6, eps_outside_sqrt=True), spec)


# ---------------------------------------------------------------- causal conv


def second_conv(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None,
                flip_taps: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``y[b, t, c] = silu(sum_j W[c, j] * input(t - 3 + j))`` by explicit loops, where input(s) is
    x[b, s, c] for s >= 0, else the conv state's entry (oldest first) or 0; the new state is the
    last three inputs."""
    B, T, C = x.shape
    y = torch.empty(B, T, C, dtype=F64)
    state = torch.empty(B, C, 3, dtype=x.dtype)
    for bi in range(B):
        def inp(s: int, c: int) -> float:
            if s >= 0:
                return x[bi, s, c].item()
            if conv_state is None:
                return 0.0
            return conv_state[bi, c, 3 + s].item()   # s = -1 is the newest (index 2)
        for c in range(C):
            for t in range(T):
                acc = 0.0
                for j in range(4):
                    wj = weight[c, 3 - j] if flip_taps else weight[c, j]
                    acc += wj.item() * inp(t - 3 + j, c)
                y[bi, t, c] = _silu(acc)
            for i in range(3):
                state[bi, c, i] = inp(T - 3 + i, c)
    return y, state


@pytest.mark.second_formulation("spec.ops.gdn:causal_conv1d")
def test_causal_conv1d_equals_time_loop_with_and_without_state():
    gen = _gen(301)
    C = 5
    weight = torch.randn(C, 4, generator=gen, dtype=F64)
    for T in (1, 2, 3, 7):
        x = torch.randn(2, T, C, generator=gen, dtype=F64)
        state = torch.randn(2, C, 3, generator=gen, dtype=F64)
        for cs in (None, state):
            y, new_state = causal_conv1d(x, weight, cs)
            y2, state2 = second_conv(x, weight, cs)
            assert _close(y2, y)
            assert _bitwise(state2, new_state)   # stored inputs, moved not computed
            assert not _close(second_conv(x, weight, cs, flip_taps=True)[0], y)
        # wrong: a given state ignored (zeros assumed) changes the first three outputs.
        assert not _close(second_conv(x, weight, None)[0], causal_conv1d(x, weight, state)[0])


@pytest.mark.second_formulation("spec.ops.gdn:causal_conv1d_update")
def test_causal_conv1d_update_is_the_last_step_of_the_concatenated_window():
    gen = _gen(302)
    B, C = 3, 6
    weight = torch.randn(C, 4, generator=gen, dtype=F64)
    state = torch.randn(B, C, 3, generator=gen, dtype=F64)
    x = torch.randn(B, C, generator=gen, dtype=F64)
    y, new_state = causal_conv1d_update(x, weight, state)
    window = torch.cat([state.transpose(1, 2), x[:, None, :]], dim=1)   # [B, 4, C], oldest first
    y_full, _ = causal_conv1d(window, weight)
    assert _close(y, y_full[:, -1])
    assert _close(y, second_conv(x[:, None, :], weight, state)[0][:, 0])
    assert _bitwise(new_state, torch.cat([state[:, :, 1:], x[:, :, None]], dim=2))
    # wrong: the first step of the window, or dropping the newest state entry instead of the oldest.
    assert not _close(y, y_full[:, 0])
    assert not _bitwise(new_state, torch.cat([state[:, :, :2], x[:, :, None]], dim=2))


# ---------------------------------------------------------------- gated delta rule


def second_gated_delta_rule(q, k, v, g, beta, state=None, head_map=None):
    """The Gated DeltaNet recurrence in its transition-matrix form, state M [d_v, d_k] per head:

    ``M_t = M_{t-1} (alpha_t (I - beta_t k_t k_t^T)) + beta_t v_t k_t^T``, ``o_t = M_t q_t``, with
    alpha_t = e^{g_t}, k_t = l2norm(k), q_t = l2norm(q) / sqrt(d_k), value head h on key head
    ``head_map(h)`` (default h // (HV / HK)). Returns (o, states after each row, final state) with the
    states in the spec's [d_k, d_v] layout, i.e. M^T.
    """
    B, T, HK, K = q.shape
    HV, V = v.shape[-2], v.shape[-1]
    head_map = head_map or (lambda h: h // (HV // HK))
    qn = second_l2norm(q, 1e-6) / math.sqrt(K)
    kn = second_l2norm(k, 1e-6)
    eye = torch.eye(K, dtype=F64)
    o = torch.empty(B, T, HV, V, dtype=F64)
    states = torch.empty(B, T, HV, K, V, dtype=F64)
    for bi in range(B):
        for h in range(HV):
            kh = head_map(h)
            M = torch.zeros(V, K, dtype=F64) if state is None else state[bi, h].T.clone()
            for t in range(T):
                kt, qt, vt = kn[bi, t, kh], qn[bi, t, kh], v[bi, t, h]
                alpha, bt = math.exp(g[bi, t, h].item()), beta[bi, t, h].item()
                M = M @ (alpha * (eye - bt * torch.outer(kt, kt))) + bt * torch.outer(vt, kt)
                o[bi, t, h] = M @ qt
                states[bi, t, h] = M.T
    return o, states, states[:, -1]


def _gdn_inputs(seed: int, B=2, T=6, HK=2, HV=6, K=8, V=8):
    gen = _gen(seed)
    q = torch.randn(B, T, HK, K, generator=gen, dtype=F64)
    k = torch.randn(B, T, HK, K, generator=gen, dtype=F64)
    v = torch.randn(B, T, HV, V, generator=gen, dtype=F64)
    g = -torch.rand(B, T, HV, generator=gen, dtype=F64)           # log decays in (-1, 0)
    beta = torch.rand(B, T, HV, generator=gen, dtype=F64)
    state = 0.5 * torch.randn(B, HV, K, V, generator=gen, dtype=F64)
    return q, k, v, g, beta, state


@pytest.mark.second_formulation("spec.ops.gdn:gdn_recurrent")
def test_gdn_recurrent_equals_the_transition_matrix_form_per_head():
    # Values stay O(1) (|exp(g)| <= 1, beta in (0, 1), unit keys); six steps of K = 8 dot products
    # keep both forms within ~1e-14 of each other, well inside rtol 1e-12 / atol 1e-13.
    q, k, v, g, beta, state = _gdn_inputs(401)
    for S0 in (None, state):
        o, states, final = gdn_recurrent(q, k, v, g, beta, S0)
        o2, states2, final2 = second_gated_delta_rule(q, k, v, g, beta, S0)
        assert o.dtype == states.dtype == final.dtype == F64
        assert _close(o2, o) and _close(states2, states) and _close(final2, final)
        # wrong: value head h on key head h % HK (interleaved) instead of h // (HV / HK).
        o_bad, _, _ = second_gated_delta_rule(q, k, v, g, beta, S0, head_map=lambda h: h % 2)
        assert not _close(o_bad, o)
        # wrong: the ungated delta rule (alpha = 1, i.e. the gate left out).
        o_bad2, _, _ = second_gated_delta_rule(q, k, v, torch.zeros_like(g), beta, S0)
        assert not _close(o_bad2, o)
    # the initial state is really read: starting from zeros differs.
    assert not _close(gdn_recurrent(q, k, v, g, beta, None)[0],
                      gdn_recurrent(q, k, v, g, beta, state)[0])


@pytest.mark.second_formulation("spec.ops.gdn:gdn_recurrent")
def test_gdn_recurrent_grouping_with_one_key_head_per_three_value_heads():
    # The target's GVA ratio 3 with HK = 3, HV = 9: head map h // 3, against the wrong h % 3.
    q, k, v, g, beta, state = _gdn_inputs(402, B=1, T=5, HK=3, HV=9, K=4, V=6)
    o, _, final = gdn_recurrent(q, k, v, g, beta, state, record=False)
    o2, _, final2 = second_gated_delta_rule(q, k, v, g, beta, state)
    assert _close(o2, o) and _close(final2, final)
    o_bad, _, _ = second_gated_delta_rule(q, k, v, g, beta, state, head_map=lambda h: h % 3)
    assert not _close(o_bad, o)


# ---------------------------------------------------------------- RoPE


def second_neox_rope(x: torch.Tensor, angles: torch.Tensor, pairing: str = "neox",
                     conjugate: bool = False) -> torch.Tensor:
    """Rotary dims as complex numbers z_j = x_j + i x_{j+r/2} (NeoX halves; "gptj" pairs x_{2j},
    x_{2j+1} instead), multiplied by exp(i angle_j); dims >= r unchanged."""
    half = angles.shape[-1]
    rot = 2 * half
    if pairing == "neox":
        re, im = x[..., :half], x[..., half:rot]
    else:
        re, im = x[..., 0:rot:2], x[..., 1:rot:2]
    z = torch.complex(re, im)
    phase = torch.exp(1j * (-angles if conjugate else angles).to(torch.complex128))[:, None, :]
    w = z * phase
    out = x.clone()
    if pairing == "neox":
        out[..., :half], out[..., half:rot] = w.real, w.imag
    else:
        out[..., 0:rot:2], out[..., 1:rot:2] = w.real, w.imag
    return out


@pytest.mark.second_formulation("spec.ops.rope:apply_neox_rope")
def test_apply_neox_rope_equals_complex_multiplication_on_the_halves():
    gen = _gen(501)
    T, H, D, half = 5, 3, 24, 8                 # partial rotary: 16 of 24 dims rotate
    x = torch.randn(T, H, D, generator=gen, dtype=F64)
    angles = 10.0 * torch.randn(T, half, generator=gen, dtype=F64)
    spec = apply_neox_rope(x, torch.cos(angles), torch.sin(angles))
    mine = second_neox_rope(x, angles)
    assert _close(mine, spec)
    assert _bitwise(spec[..., 2 * half:], x[..., 2 * half:])   # pass-through dims untouched
    assert not _close(second_neox_rope(x, angles, pairing="gptj"), spec)
    assert not _close(second_neox_rope(x, angles, conjugate=True), spec)


def second_inv_freq(rotary_dim: int, theta: float) -> list[float]:
    """theta^(-2j/r) = exp(-(2j/r) ln theta), j < r/2."""
    return [math.exp(-(2.0 * j / rotary_dim) * math.log(theta)) for j in range(rotary_dim // 2)]


def second_angles(positions: torch.Tensor, rotary_dim: int, theta: float,
                  mrope_rows: str = "interleaved") -> torch.Tensor:
    """angle[t, j] = position * theta^(-2j/r); for [3, T] positions frequency j reads row h when
    j % 3 == 1 and j < 33, row w when j % 3 == 2 and j < 33, else row t (docs/spec.md); "chunked" is the
    non-interleaved Qwen2-VL layout (11 t, then 11 h, then 10 w frequencies)."""
    freqs = second_inv_freq(rotary_dim, theta)
    n = len(freqs)
    pos = positions.tolist()
    T = len(pos) if positions.dim() == 1 else len(pos[0])
    out = torch.empty(T, n, dtype=F64)
    for t in range(T):
        for j in range(n):
            if positions.dim() == 1:
                p = pos[t]
            elif mrope_rows == "interleaved":
                row = 1 if (j % 3 == 1 and j < 33) else 2 if (j % 3 == 2 and j < 33) else 0
                p = pos[row][t]
            else:
                row = 0 if j < 11 else 1 if j < 22 else 2
                p = pos[row][t]
            out[t, j] = float(p) * freqs[j]
    return out


@pytest.mark.second_formulation("spec.ops.rope:inv_freq")
def test_inv_freq_is_theta_to_the_minus_2j_over_r():
    for r, theta in [(64, 1e7), (16, 1e4), (2, 1e6)]:
        spec = inv_freq(r, theta)
        assert spec.dtype == F64 and spec.shape == (r // 2,)
        assert _close(torch.tensor(second_inv_freq(r, theta), dtype=F64), spec, atol=0.0)
        wrong = torch.tensor([theta ** (-j / r) for j in range(r // 2)], dtype=F64)
        if r > 2:
            assert not _close(wrong, spec, atol=0.0)
        assert spec[0].item() == 1.0


@pytest.mark.second_formulation("spec.ops.rope:rope_angles")
def test_rope_angles_plain_and_interleaved_mrope_equal_the_closed_formula():
    gen = _gen(502)
    # Positions up to 131K: float64 angles keep ~1e-11 rad absolute there, so compare relatively.
    positions = torch.randint(0, 131072, (9,), generator=gen)
    positions[0] = 0
    spec = rope_angles(positions)
    assert spec.dtype == F64 and spec.shape == (9, 32)
    assert _close(second_angles(positions, 64, 1e7), spec, atol=0.0)
    m_pos = torch.randint(0, 4096, (3, 7), generator=gen)
    m_spec = rope_angles(m_pos)
    assert _close(second_angles(m_pos, 64, 1e7), m_spec, atol=0.0)
    assert not _close(second_angles(m_pos, 64, 1e7, mrope_rows="chunked"), m_spec, atol=0.0)
    # wrong: theta^(-j/r) (half the exponent).
    wrong = torch.tensor([[float(p) * 1e7 ** (-j / 64) for j in range(32)] for p in positions.tolist()],
                         dtype=F64)
    assert not _close(wrong, spec, atol=0.0)
