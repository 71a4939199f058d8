"""The GDN spec functions against formulations written independently of them (docs/spec.md,
"GDN layer"), in float64 on seeded inputs at the edge shapes the ops admit
(T = 1, one row short of a chunk, a whole chunk, one row past it, two chunks and one row).

- The exact tier's recurrence (``gdn_recurrent``, ``gdn_chunked``, and the layer steps
  ``gdn_prefill``, ``gdn_verify``, ``gdn_decode``) against the chunked (WY) form written as row
  loops in numpy: per (sequence, value head) and chunk, the updates ``u_t`` by forward substitution
  of ``(I + A) U = beta (V - e^G K^ S0)`` one row at a time, then each row's output and the chunk's
  final state as the sums the prose writes.
  The recurrent spec against the chunked loop is the check the prose asks for ("each certifies the
  other"); the per-row states of a verify step are the loop's final states of each prefix.
- The same recurrence against transformers' Qwen3-Next functions
  (``torch_recurrent_gated_delta_rule`` and ``torch_chunk_gated_delta_rule``): q and k
  l2-normalised inside (``use_qk_l2norm_in_kernel``, eps 1e-6 inside the root), q scaled by
  ``d_k^-1/2``, the state decayed by ``exp(g)`` (g <= 0), beta on the delta, the state laid out
  ``[d_k, d_v]``, value heads reading key heads expanded by ``repeat_interleave`` as Qwen3-Next's
  layer does. Those functions compute in fp32 whatever their input dtype, so the comparison is at
  an fp32 bound derived below.

The bf16_operands tier is checked in test_gdn_bf16_operands_independent.py.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from spec.ops.gdn import gdn_chunked, gdn_decode, gdn_prefill, gdn_recurrent, gdn_verify

pytestmark = pytest.mark.premerge

F64 = torch.float64
EPS = 1e-6          # l2norm and gated RMSNorm (docs/spec.md, "Notation and numerics")
CHUNK = 64
EDGE_T = (1, 63, 64, 65, 129)
# Float64 agreement: every output is O(1) (unit keys, beta in (0, 1), exp(g) <= 1: each row's update
# is non-expansive, so rounding errors add up linearly, not geometrically). An output or state
# element takes at most T (K + V) ~ 129 x 16 multiply-adds per form, so the two forms differ by at
# most ~2 x 2064 x 1.1e-16 = 4.6e-13 of the values' scale, plus the forward substitution of the
# chunk's unit lower system (entries |A| < 1). Measured: at most 2.0e-15 on outputs and states up
# to 2.1 in magnitude. RTOL 1e-12 (with ATOL 1e-12 against values of order 1) sits above the bound;
# each wrong variant below is off by 1e-2 or more.
RTOL = ATOL = 1e-12


def _close(a, b, rtol: float = RTOL, atol: float = ATOL) -> bool:
    a, b = torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64)
    return a.shape == b.shape and torch.allclose(a, b, rtol=rtol, atol=atol)


# ---------------------------------------------------------------- the formulation, in numpy


def _softplus(x: float) -> float:
    return x if x > 20.0 else math.log1p(math.exp(x))


def np_gates(a, b, A_log, dt_bias):
    """Per element: ``beta = 1 / (1 + e^-b)``, ``g = -e^{A_log} softplus(a + dt_bias)``."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    hv = a.shape[-1]
    g, beta = np.empty_like(a), np.empty_like(b)
    for idx in np.ndindex(a.shape):
        h = idx[-1] % hv
        g[idx] = -math.exp(float(A_log[h])) * _softplus(float(a[idx]) + float(dt_bias[h]))
        beta[idx] = 1.0 / (1.0 + math.exp(-float(b[idx])))
    return g, beta


def _unit(x: np.ndarray) -> np.ndarray:
    return x / math.sqrt(float(np.dot(x, x)) + EPS)


def wy_head(q, k, v, g, beta, S0, chunk: int = CHUNK, decay_sign: float = 1.0):
    """One (sequence, value head): q, k [T, K] raw, v [T, V], g, beta [T], S0 [K, V].

    Per chunk from its start state S0, with G_t the running sum of g inside the chunk:
    ``u_t = beta_t (v_t - e^{G_t} S0^T k^_t) - sum_{i<t} beta_t e^{G_t - G_i} (k^_t . k^_i) u_i``,
    ``o_t = e^{G_t} S0^T q^_t + sum_{i<=t} e^{G_t - G_i} (q^_t . k^_i) u_i``,
    ``S = e^{G_C} S0 + sum_i e^{G_C - G_i} k^_i u_i^T``. Returns (o [T, V], final state [K, V]).
    ``decay_sign`` -1 is a wrong variant (the gate's sign flipped).
    """
    T, K = q.shape
    qh = np.stack([_unit(q[t]) / math.sqrt(K) for t in range(T)])
    kh = np.stack([_unit(k[t]) for t in range(T)])
    S = np.array(S0, dtype=np.float64)
    out = np.empty((T, v.shape[1]))
    for c0 in range(0, T, chunk):
        C = min(chunk, T - c0)
        G, run = [], 0.0
        for t in range(C):
            run += decay_sign * float(g[c0 + t])
            G.append(run)
        G = np.array(G)
        kc, qc = kh[c0:c0 + C], qh[c0:c0 + C]
        U = np.empty((C, v.shape[1]))
        for t in range(C):          # forward substitution, one row at a time
            a_t = float(beta[c0 + t]) * np.exp(G[t] - G[:t]) * (kc[:t] @ kc[t])
            U[t] = float(beta[c0 + t]) * (v[c0 + t] - math.exp(G[t]) * (kc[t] @ S)) - a_t @ U[:t]
        for t in range(C):
            w = np.exp(G[t] - G[:t + 1]) * (kc[:t + 1] @ qc[t])
            out[c0 + t] = math.exp(G[t]) * (qc[t] @ S) + w @ U[:t + 1]
        S = math.exp(G[-1]) * S + (kc * np.exp(G[-1] - G)[:, None]).T @ U
    return out, S


def wy(q, k, v, g, beta, state=None, chunk: int = CHUNK, key_head=None, decay_sign: float = 1.0):
    """All sequences and value heads: q, k [B, T, HK, K]; v [B, T, HV, V]; g, beta [B, T, HV];
    value head h reads key head ``key_head(h)`` (h // (HV / HK))."""
    q, k, v, g, beta = (np.asarray(t, np.float64) for t in (q, k, v, g, beta))
    B, T, HK, K = q.shape
    HV, V = v.shape[2:]
    key_head = key_head or (lambda h: h // (HV // HK))
    o = np.empty((B, T, HV, V))
    final = np.empty((B, HV, K, V))
    for bi in range(B):
        for h in range(HV):
            S0 = np.zeros((K, V)) if state is None else np.asarray(state[bi, h], np.float64)
            kh = key_head(h)
            o[bi, :, h], final[bi, h] = wy_head(q[bi, :, kh], k[bi, :, kh], v[bi, :, h],
                                                g[bi, :, h], beta[bi, :, h], S0, chunk, decay_sign)
    return torch.from_numpy(o), torch.from_numpy(final)


def np_gated_rmsnorm(o, z, w):
    """Per value-head vector: ``w o / sqrt(mean(o^2) + eps)`` times ``z / (1 + e^-z)``."""
    o, z, w = (np.asarray(t, np.float64) for t in (o, z, w))
    out = np.empty_like(o)
    for idx in np.ndindex(o.shape[:-1]):
        ov, zv = o[idx], z[idx]
        n = w * ov / math.sqrt(math.fsum(x * x for x in ov) / ov.size + EPS)
        out[idx] = n * np.array([x / (1.0 + math.exp(-x)) for x in zv])
    return torch.from_numpy(out)


# ---------------------------------------------------------------- inputs


def _layer(seed: int, lead: tuple[int, ...], HK: int = 2, HV: int = 6, K: int = 8, V: int = 8):
    """Raw layer inputs (float64): q, k, v, z, gate pre-activations a, b and the parameters in
    Qwen3-Next's ranges (A = e^A_log in [1, 16], softplus(dt_bias) in [1e-3, 0.1])."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    dt = torch.exp(torch.empty(HV, dtype=F64).uniform_(math.log(1e-3), math.log(0.1),
                                                       generator=gen))
    return {"q": r(*lead, HK, K), "k": r(*lead, HK, K), "v": r(*lead, HV, V),
            "a": r(*lead, HV), "b": r(*lead, HV),
            "A_log": torch.empty(HV, dtype=F64).uniform_(0.0, math.log(16.0), generator=gen),
            "dt_bias": dt + torch.log(-torch.expm1(-dt)), "z": r(*lead, HV, V),
            "norm_w": 1.0 + 0.1 * r(V)}


def _state(seed: int, B: int, HV: int = 6, K: int = 8, V: int = 8) -> torch.Tensor:
    return 0.5 * torch.randn(B, HV, K, V, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _raw(seed: int, B: int, T: int, HK: int = 2, HV: int = 6, K: int = 8, V: int = 8):
    """q, k, v, g, beta: decays strong enough that e^G spans several orders in a chunk."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, HK, K, generator=gen, dtype=F64)
    k = torch.randn(B, T, HK, K, generator=gen, dtype=F64)
    v = torch.randn(B, T, HV, V, generator=gen, dtype=F64)
    g = -0.2 * torch.rand(B, T, HV, generator=gen, dtype=F64)
    beta = torch.rand(B, T, HV, generator=gen, dtype=F64)
    return q, k, v, g, beta


# ---------------------------------------------------------------- exact tier, float64


@pytest.mark.second_formulation("spec.ops.gdn:gdn_recurrent", "spec.ops.gdn:gdn_chunked")
@pytest.mark.parametrize("T", EDGE_T)
def test_recurrent_and_chunked_spec_equal_the_chunked_loop_at_chunk_edges(T):
    q, k, v, g, beta = _raw(800 + T, 1, T)
    for S0 in (None, _state(900 + T, 1)):
        o_loop, final_loop = wy(q, k, v, g, beta, S0)
        o_rec, states, final_rec = gdn_recurrent(q, k, v, g, beta, S0)
        o_chk, final_chk = gdn_chunked(q, k, v, g, beta, S0)
        assert _close(o_rec, o_loop) and _close(final_rec, final_loop)
        assert _close(o_chk, o_loop) and _close(final_chk, final_loop)
        assert torch.equal(states[:, -1], final_rec)


def test_the_chunked_loop_tells_wrong_conventions_apart():
    q, k, v, g, beta = _raw(860, 2, 65)
    S0 = _state(861, 2)
    o, _, final = gdn_recurrent(q, k, v, g, beta, S0)
    assert _close(wy(q, k, v, g, beta, S0)[0], o)
    # wrong: the gate's sign flipped; value head h on key head h % HK; no initial state.
    assert not _close(wy(q, k, v, g, beta, S0, decay_sign=-1.0)[0], o)
    assert not _close(wy(q, k, v, g, beta, S0, key_head=lambda h: h % 2)[0], o)
    assert not _close(wy(q, k, v, g, beta, None)[1], final)


def test_the_chunked_loop_does_not_depend_on_its_chunk():
    # The loop's own consistency: chunk 1 is the plain recurrence, chunk 64 the WY form.
    q, k, v, g, beta = _raw(850, 1, 70)
    S0 = _state(851, 1)
    o1, f1 = wy(q, k, v, g, beta, S0, chunk=1)
    o64, f64 = wy(q, k, v, g, beta, S0, chunk=64)
    assert _close(o1, o64) and _close(f1, f64)


@pytest.mark.second_formulation("spec.ops.gdn:gdn_recurrent", "spec.ops.gdn:gdn_chunked")
def test_strong_decays_down_to_exp_minus_200_a_row():
    # g = -A softplus(a + dt_bias) reaches -16 x 20 and beyond: e^G underflows to 0 inside a chunk
    # and e^{G_t - G_i} overflows above the diagonal, where the chunked form masks it. Measured
    # worst difference 6.8e-14 (recurrent) and 3.3e-16 (chunked), inside the 1e-12 tolerance.
    q, k, v, g, beta = _raw(5, 1, 129)
    g = g * 1000.0                                               # g in (-200, 0)
    S0 = _state(6, 1)
    o_loop, final_loop = wy(q, k, v, g, beta, S0)
    o_rec, _, final_rec = gdn_recurrent(q, k, v, g, beta, S0)
    o_chk, final_chk = gdn_chunked(q, k, v, g, beta, S0)
    assert _close(o_rec, o_loop) and _close(final_rec, final_loop)
    assert _close(o_chk, o_loop) and _close(final_chk, final_loop)


@pytest.mark.second_formulation("spec.ops.gdn:gdn_prefill")
@pytest.mark.parametrize("T", (1, 64, 65))
def test_prefill_equals_gates_chunked_loop_and_gated_norm(T):
    x = _layer(700 + T, (2, T))
    S0 = _state(710 + T, 2)
    g, beta = np_gates(x["a"], x["b"], x["A_log"], x["dt_bias"])
    for state in (None, S0):
        o, final = wy(x["q"], x["k"], x["v"], g, beta, state)
        res = gdn_prefill(x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"], x["z"],
                          x["norm_w"], state)
        assert res["out"].dtype == res["final_state"].dtype == F64
        assert _close(res["final_state"], final)
        assert _close(res["out"], np_gated_rmsnorm(o, x["z"], x["norm_w"]))
    # wrong: the norm weight zero-centred (1 + w) as rmsnorm's, instead of the plain weight.
    assert not _close(res["out"], np_gated_rmsnorm(o, x["z"], 1.0 + x["norm_w"]))


@pytest.mark.second_formulation("spec.ops.gdn:gdn_verify")
def test_verify_records_the_state_of_every_prefix():
    B, T, P = 3, 8, 5
    x = _layer(720, (B, T))
    pool = _state(721, P)
    slots = torch.tensor([4, 0, 2])
    res = gdn_verify(x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"], x["z"],
                     x["norm_w"], pool, slots)
    g, beta = np_gates(x["a"], x["b"], x["A_log"], x["dt_bias"])
    o, _ = wy(x["q"], x["k"], x["v"], g, beta, pool[slots])
    assert _close(res["out"], np_gated_rmsnorm(o, x["z"], x["norm_w"]))
    for t in range(T):
        _, prefix_final = wy(x["q"][:, :t + 1], x["k"][:, :t + 1], x["v"][:, :t + 1],
                             g[:, :t + 1], beta[:, :t + 1], pool[slots])
        assert _close(res["states"][:, t], prefix_final), t
    # wrong: the pool read in batch order instead of through the slots.
    _, bad = wy(x["q"][:, :1], x["k"][:, :1], x["v"][:, :1], g[:, :1], beta[:, :1], pool[:B])
    assert not _close(res["states"][:, 0], bad)


@pytest.mark.second_formulation("spec.ops.gdn:gdn_decode")
def test_decode_writes_the_one_step_state_to_its_slots_only():
    B, P = 3, 6
    x = _layer(730, (B,))
    pool = _state(731, P)
    slots = torch.tensor([5, 1, 3])
    res = gdn_decode(x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"], x["z"],
                     x["norm_w"], pool, slots)
    g, beta = np_gates(x["a"], x["b"], x["A_log"], x["dt_bias"])
    o, final = wy(x["q"][:, None], x["k"][:, None], x["v"][:, None], g[:, None], beta[:, None],
                  pool[slots])
    assert _close(res["out"], np_gated_rmsnorm(o[:, 0], x["z"], x["norm_w"]))
    assert _close(res["state_pool"][slots], final)
    others = [p for p in range(P) if p not in slots.tolist()]
    assert torch.equal(res["state_pool"][others], pool[others])
    assert torch.equal(pool, _state(731, P))                      # the input pool is not written


# ---------------------------------------------------------------- transformers' Qwen3-Next


def _qwen3_next():
    """transformers' pure-torch gated delta rule functions (``__wrapped__``: never a hub or fla
    kernel substituted for them). Skipped where transformers is absent, except on CI."""
    if os.environ.get("CI") != "true":
        pytest.importorskip("transformers")
    from transformers.models.qwen3_next import modeling_qwen3_next as m
    unwrap = lambda f: getattr(f, "__wrapped__", f)  # noqa: E731
    return unwrap(m.torch_recurrent_gated_delta_rule), unwrap(m.torch_chunk_gated_delta_rule)


def _fp32_bound(T: int, K: int, V: int) -> float:
    """An fp32 computation of the recurrence, against float64: each row's update is non-expansive,
    so the fp32 roundings add up linearly, about 2 u32 per multiply-add over T (K + V) of them; the
    chunked form's triangular solve on |A| < 1 stays inside it. Measured on these inputs: at most
    3.5e-7 of the largest output or state element (both functions, every T), against the bound's
    2 x 129 x 32 x 6e-8 = 4.9e-4 at T = 129; every wrong convention below is off by 0.9 or more."""
    return 2.0 * T * (K + V) * 2.0 ** -24


@pytest.mark.second_formulation("spec.ops.gdn:gdn_recurrent", "spec.ops.gdn:gdn_chunked")
@pytest.mark.parametrize("T", EDGE_T)
def test_recurrence_equals_transformers_qwen3_next_functions(T):
    recurrent, chunked = _qwen3_next()
    B, HK, HV, K, V = 2, 2, 6, 16, 16
    q, k, v, g, beta = (t.float() for t in _raw(1000 + T, B, T, HK, HV, K, V))
    S0 = _state(1100 + T, B, HV, K, V).float()
    ratio = HV // HK
    qe, ke = q.repeat_interleave(ratio, dim=2), k.repeat_interleave(ratio, dim=2)
    o_ref, _, final_ref = gdn_recurrent(*(t.double() for t in (q, k, v, g, beta, S0)))
    o_chk, final_chk = gdn_chunked(*(t.double() for t in (q, k, v, g, beta, S0)))
    tol = _fp32_bound(T, K, V)
    scale_o, scale_s = float(o_ref.abs().max()), float(final_ref.abs().max())
    for fn, extra in ((recurrent, {}), (chunked, {"chunk_size": CHUNK})):
        o, final = fn(qe, ke, v, g, beta, initial_state=S0.clone(), output_final_state=True,
                      use_qk_l2norm_in_kernel=True, **extra)
        assert o.dtype == torch.float32
        for mine in ((o_ref, final_ref), (o_chk, final_chk)):
            assert float((o.double() - mine[0]).abs().max()) <= tol * scale_o, fn.__name__
            assert float((final.double() - mine[1]).abs().max()) <= tol * scale_s, fn.__name__
        if T != 65:
            continue
        # wrong: keys not normalised inside, or the key heads tiled (h % HK) instead of repeated.
        o_bad, _ = fn(qe, ke, v, g, beta, initial_state=S0.clone(), use_qk_l2norm_in_kernel=False,
                      **extra)
        assert float((o_bad.double() - o_ref).abs().max()) > 100 * tol * scale_o
        tiled = (q.repeat(1, 1, ratio, 1), k.repeat(1, 1, ratio, 1))
        o_bad, _ = fn(*tiled, v, g, beta, initial_state=S0.clone(), use_qk_l2norm_in_kernel=True,
                      **extra)
        assert float((o_bad.double() - o_ref).abs().max()) > 100 * tol * scale_o
