"""The Gluon state pass of the chunked GDN prefill (impl/kernels/gdn/gluon_chunked.py) without a GPU.

Its numerics are certified on sm_90 only (Gluon has no interpreter: reports/receipts/sm_90.jsonl, cells
short_t37, long_t8192, b3_t130, b1_t20, b2_t2048 and b1_t4101 of certify/cells/gdn_prefill.yaml). What
the CPU can check: that the piece products the kernel keeps for the state's products of two fp32
operands are fp32-accurate (a missing pair would cost about 2^-17 relative, which only the GPU receipt
would otherwise notice) and those of the output's within 2^-16, that the kernel
compiles for sm_90 on every cell that names it, that the prologue's PIECES mode (shared with
triton_chunked, run here through Triton's interpreter) writes the planes the state pass reads, and that
the wrapper refuses what it cannot run."""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, strategies as st

from impl.kernels.gdn import gluon_chunked as gc

ROOT = Path(__file__).resolve().parents[2]


def _split3(x: torch.Tensor) -> list[torch.Tensor]:
    """The kernel's ``_split3`` in torch: each piece the nearest bf16 of what the previous ones left."""
    x1 = x.to(torch.bfloat16).float()
    r = x - x1
    x2 = r.to(torch.bfloat16).float()
    return [x1, x2, (r - x2).to(torch.bfloat16).float()]


def test_piece_pairs_are_every_product_down_to_2_16_once_smallest_first() -> None:
    pairs = list(gc.PIECE_PAIRS)
    assert sorted(pairs) == sorted((i, j) for i in range(3) for j in range(3) if i + j <= 2)
    orders = [i + j for i, j in pairs]
    assert orders == sorted(orders, reverse=True), "smallest products first, into the accumulator"
    assert tuple(gc._X_PIECE.value) == tuple(i for i, _ in pairs)
    assert tuple(gc._Y_PIECE.value) == tuple(j for _, j in pairs)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_kept_piece_products_are_fp32_accurate(seed: int) -> None:
    """X Y from the kept piece products, each exact (bf16 x bf16), summed in float64, against the
    float64 product of the same fp32 values. Measured 0.09-0.11 x 2^-24 relative (Frobenius) on these
    inputs; the band is 2^-24. Keeping only the three leading pairs gives about 77 x 2^-24 and the
    leading pair alone about 2^-8.7, so the check fails if a pair of order 2^-16 goes missing. The
    kernel's fp32 accumulation adds its own rounding on top; the cells' bands cover that."""
    g = torch.Generator().manual_seed(seed)
    # rows of different scales, a right operand of decayed magnitudes (like Aib and QKD^T)
    x = torch.randn(64, 64, generator=g) * torch.rand(64, 1, generator=g) * 4
    y = torch.randn(64, 64, generator=g) * torch.exp(-8 * torch.rand(64, 64, generator=g))
    xs, ys = _split3(x), _split3(y)
    ref = x.double() @ y.double()

    def rel(pairs) -> float:
        got = sum(xs[i].double() @ ys[j].double() for i, j in pairs)
        return float((got - ref).norm() / ref.norm())

    assert rel(gc.PIECE_PAIRS) <= 2.0 ** -24
    assert rel(gc.PIECE_PAIRS[3:]) > 16 * 2.0 ** -24


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_outputs_products_keep_2_16(seed: int) -> None:
    """The output's own products (they reach o, never the state): U^T QKD^T from the last three piece
    pairs, qS^T from two pieces of S^T against the exact bf16 q, each within 2^-16 relative (Frobenius)
    of the float64 product; out's bf16 rounding is 2^-8. Measured 2^-17.9 .. 2^-17.7 and 2^-18.7 ..
    2^-18.6 on these inputs; the leading pair or piece alone (about 2^-9) fails."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(64, 64, generator=g) * torch.rand(64, 1, generator=g) * 4
    qkd = torch.randn(64, 64, generator=g) * torch.exp(-8 * torch.rand(64, 64, generator=g))
    us, qs = _split3(u), _split3(qkd)
    ref = u.double() @ qkd.double()
    kept = sum(us[i].double() @ qs[j].double() for i, j in gc.PIECE_PAIRS[3:])
    lead = us[0].double() @ qs[0].double()
    assert float((kept - ref).norm() / ref.norm()) <= 2.0 ** -16
    assert float((lead - ref).norm() / ref.norm()) > 2.0 ** -16
    state_t = torch.randn(64, 128, generator=g) * torch.rand(64, 1, generator=g)
    q = torch.randn(128, 64, generator=g).to(torch.bfloat16).double()
    sp = _split3(state_t)
    ref = state_t.double() @ q
    assert float(((sp[0].double() + sp[1].double()) @ q - ref).norm() / ref.norm()) <= 2.0 ** -16
    assert float((sp[0].double() @ q - ref).norm() / ref.norm()) > 2.0 ** -16


@pytest.mark.skipif(not triton_support.INTERPRETING, reason="runs the prologue in Triton's interpreter")
def test_prologue_pieces_are_the_planes_the_state_pass_reads() -> None:
    """One launch of the prologue as triton_chunked runs it (Aib in fp32) and one with PIECES, on 70 rows
    (a full chunk and a partial one); the state pass reads both sets of planes as [t, i] (transposed
    views). Planes 0-2 must sum to the same Aib to 2^-23 relative, element by element (the split's
    remainder). Planes 3-4 must sum to QKD [t, i] = e^{G_t - G_i} rq_t rk_i q_t . k_i (i <= t), in
    float64 from the prologue's own G, rk, rq, within 2^-17 + 2^-21 relative (Frobenius, a (chunk,
    head) block): two pieces, each the nearest bf16, leave at most half an ulp of the first remainder,
    2^-17 of the element (2^-17.003 at worst over every fp32 in [1, 2)), and the prologue's fp32
    arithmetic was measured at 1.6 x 2^-24 with three pieces (allowed 8 x 2^-24, as before). Measured
    2^-19.2 .. 2^-18.4; the leading plane alone, 2^-10.0 .. 2^-9.1, fails it. Above the diagonal and on
    rows past T every plane must be exactly zero."""
    from impl.kernels.gdn import triton_chunked as tc

    c = _case()
    B, T, HK, K = c["q"].shape
    HV = c["v"].shape[2]
    NT = 2
    gbuf, rbuf = torch.empty(B * HV * NT * 64), torch.empty(2 * B * HV * NT * 64)
    ai_plain, ai_scratch = torch.empty(B * HV * NT * 4096), torch.empty(B * HV * NT * 4096)
    pc = torch.full((B * HV * NT * tc.PIECE_PLANES.value * 4096,), float("nan")).to(torch.bfloat16)
    args = (c["q"], c["k"], c["a"], c["b"], c["A_log"], c["dt_bias"], gbuf, rbuf)
    common = dict(HK=HK, HV=HV, K=K, DOT="f32", TLOAD=True)
    tc._prep_kernel[(NT, B * HK)](*args, ai_plain, ai_plain, T, NT, 0, K ** -0.5, tc.L2_EPS, PIECES=False,
                                  **common)
    tc._prep_kernel[(NT, B * HK)](*args, ai_scratch, pc, T, NT, 0, K ** -0.5, tc.L2_EPS, PIECES=True,
                                  **common)
    planes = pc.double().view(B * HV, NT, tc.PIECE_PLANES.value, 64, 64)
    n_aib = tc.AIB_PLANES.value      # Aib's planes, then QKD's
    aib = ai_plain.double().view(B * HV, NT, 64, 64)
    torch.testing.assert_close(planes[:, :, :n_aib].sum(2), aib, rtol=2.0 ** -23, atol=0.0)
    G = gbuf.double().view(B * HV, NT, 64)
    rk, rq = rbuf.double().view(B * HV, NT, 2, 64).unbind(2)
    q = torch.nn.functional.pad(c["q"].double(), (0, 0, 0, 0, 0, NT * 64 - T))   # rows past T: zeros
    k = torch.nn.functional.pad(c["k"].double(), (0, 0, 0, 0, 0, NT * 64 - T))
    causal = torch.ones(64, 64, dtype=torch.bool).tril()
    for bh in range(B * HV):
        hk = bh // (HV // HK)
        for ch in range(NT):
            rows = slice(ch * 64, ch * 64 + 64)
            qk = q[0, rows, hk] @ k[0, rows, hk].T
            g = G[bh, ch]
            want = torch.where(causal, (g[:, None] - g[None, :]).exp(), 0.0) \
                * rq[bh, ch][:, None] * rk[bh, ch][None, :] * qk
            got = planes[bh, ch, n_aib:].sum(0)
            band = 2.0 ** -17 + 8 * 2.0 ** -24
            assert float((got - want).norm() / want.norm()) <= band
            assert float((planes[bh, ch, n_aib] - want).norm() / want.norm()) > band
            assert (planes[bh, ch, n_aib:][:, ~causal] == 0).all()
    past_t = T - 64     # rows of the partial second chunk past the end
    assert (planes[:, 1, :, past_t:, :] == 0).all()


@pytest.mark.skipif(not triton_support.INTERPRETING, reason="runs the prologue in Triton's interpreter")
def test_prologue_by_ranges_of_chunks_is_bitwise_one_launch() -> None:
    """gluon_chunked launches the prologue once per range of chunks (its first chunk C0): two launches
    of one chunk each must write the same bits as one launch of both (gates, factors, Aib and the
    pieces), from outputs poisoned with NaN. A range that ignored C0 would rewrite chunk 0 and leave
    chunk 1's NaNs."""
    from impl.kernels.gdn import triton_chunked as tc

    c = _case()
    B, T, HK, K = c["q"].shape
    HV = c["v"].shape[2]
    NT = 2
    args = (c["q"], c["k"], c["a"], c["b"], c["A_log"], c["dt_bias"])
    common = dict(HK=HK, HV=HV, K=K, DOT="f32", TLOAD=True, PIECES=True)

    def buffers() -> list[torch.Tensor]:
        return [torch.full((B * HV * NT * 64,), float("nan")), torch.full((2 * B * HV * NT * 64,), float("nan")),
                torch.full((B * HV * NT * 4096,), float("nan")),
                torch.full((B * HV * NT * tc.PIECE_PLANES.value * 4096,), float("nan")).to(torch.bfloat16)]

    whole, ranges = buffers(), buffers()
    tc._prep_kernel[(NT, B * HK)](*args, *whole, T, NT, 0, K ** -0.5, tc.L2_EPS, **common)
    for c0 in range(NT):
        tc._prep_kernel[(1, B * HK)](*args, *ranges, T, NT, c0, K ** -0.5, tc.L2_EPS, **common)
    for name, w, r in zip(("gbuf", "rbuf", "pieces"), (whole[0], whole[1], whole[3]),
                          (ranges[0], ranges[1], ranges[3])):
        assert not w.float().isnan().any(), name
        assert torch.equal(w, r), name


@pytest.mark.skipif(not triton_support.INTERPRETING, reason="runs the norm in Triton's interpreter")
def test_gated_norm_by_row_ranges_of_each_sequence_is_bitwise_one_launch() -> None:
    """The gated norm as gluon_chunked launches it once per range of chunks (rows row0 .. row0 + n - 1
    of each sequence, the sequences seq_rows apart in z and out and o_seq_rows apart in o, which
    gluon_chunked pads to whole chunks) writes the same bits as one launch over all rows of an unpadded
    o. Two sequences of 70 tokens, ranges of 64 and 6 tokens, o padded to 128 tokens a sequence with
    NaN: a range that ignored the sequence axis, row0 or o's stride, or read a padding row, leaves
    NaNs or writes other values."""
    from impl.kernels.gdn import triton_chunked as tc

    B, T, HV, V = 2, 70, 3, 128
    T_PAD = 128
    g = torch.Generator().manual_seed(5)
    o = torch.randn(B, T, HV * V, generator=g)
    o_padded = torch.cat([o, torch.full((B, T_PAD - T, HV * V), float("nan"))], dim=1)
    z = torch.randn(B * T * HV * V, generator=g).to(torch.bfloat16)
    w = torch.rand(V, generator=g) + 0.5
    rows = B * T * HV
    whole = torch.full((rows * V,), float("nan")).to(torch.bfloat16)
    ranges = whole.clone()
    tc._gated_norm_kernel[(-(-rows // 16), 1)](o.reshape(-1), z, w, whole, rows, 0, rows, rows, tc.NORM_EPS,
                                               V=V, R=16)
    for t0, t1 in ((0, 64), (64, T)):
        n = (t1 - t0) * HV
        tc._gated_norm_kernel[(-(-n // 16), B)](o_padded.reshape(-1), z, w, ranges, n, t0 * HV, T * HV,
                                                T_PAD * HV, tc.NORM_EPS, V=V, R=16)
    assert not whole.float().isnan().any()
    assert torch.equal(whole, ranges)


class _Recorder:
    """Stands in for a kernel: ``kernel[grid](*args, **kw)`` appends (name, grid, args) to a log."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def __getitem__(self, grid):
        return lambda *args, **kw: self.log.append((self.name, grid, args))


@pytest.mark.parametrize("B, T, bounds", [(2, 4229, [0, 33, 67]), (1, 4101, [0, 33, 53, 65])])
def test_ranges_launch_every_chunk_and_row_once_and_chain_the_state(monkeypatch, B, T, bounds) -> None:
    """gluon_chunked's schedule with its three kernels replaced by recorders (Gluon does not run here).
    Two sequences of 4229 tokens (67 chunks: two equal ranges by the rule, split at chunk 33) and one of
    4101 (65 chunks: three ranges of falling length, from chunks 33 and 53). The launches come as
    prologue, state pass, norm per range; the prologues cover every chunk once; the first state pass
    starts from ``state`` and each later one from ``final_state`` (where the one before left it); the
    norms cover every row of each sequence exactly once and none past T."""
    from impl.kernels.gdn import triton_chunked as tc

    log: list = []
    monkeypatch.setattr(gc, "INTERPRETING", False)
    monkeypatch.setattr(gc, "_state_pass_wgmma", _Recorder("state_pass", log))
    monkeypatch.setattr(tc, "_prep_kernel", _Recorder("prep", log))
    monkeypatch.setattr(tc, "_gated_norm_kernel", _Recorder("norm", log))
    HK, HV, K = 2, 6, 128
    bf16 = dict(dtype=torch.bfloat16)
    case = dict(q=torch.zeros(B, T, HK, K, **bf16), k=torch.zeros(B, T, HK, K, **bf16),
                v=torch.zeros(B, T, HV, K, **bf16), a=torch.zeros(B, T, HV, **bf16),
                b=torch.zeros(B, T, HV, **bf16), A_log=torch.zeros(HV), dt_bias=torch.zeros(HV),
                z=torch.zeros(B, T, HV, K, **bf16), norm_w=torch.ones(K), state=torch.zeros(B, HV, K, K))
    final_state = torch.empty_like(case["state"])
    gc.gdn_prefill_chunked(**case, out=torch.empty_like(case["z"]), final_state=final_state)

    ranges = list(zip(bounds, bounds[1:]))
    assert [name for name, _, _ in log] == ["prep", "state_pass", "norm"] * len(ranges)
    preps = [(args[12], grid[0]) for name, grid, args in log if name == "prep"]
    assert preps == [(c0, c1 - c0) for c0, c1 in ranges]
    passes = [(args[11], args[12], args[4]) for name, _, args in log if name == "state_pass"]
    assert [(c0, c1) for c0, c1, _ in passes] == ranges
    assert passes[0][2] is case["state"] and all(src is final_state for _, _, src in passes[1:])
    covered = torch.zeros(B, T * HV, dtype=torch.int64)
    for name, grid, args in log:
        if name == "norm":
            n_rows, row0, seq_rows, o_seq_rows = args[4], args[5], args[6], args[7]
            assert seq_rows == T * HV and grid[1] == B and grid[0] * 16 >= n_rows
            assert o_seq_rows == -(-T // 64) * 64 * HV      # o padded to whole chunks a sequence
            assert row0 + n_rows <= T * HV
            covered[:, row0:row0 + n_rows] += 1
    assert (covered == 1).all()


def test_ranges_of_chunks_follow_the_measured_rule() -> None:
    """Three ranges of falling length for one sequence of 64 chunks or more; else two equal ranges from
    64 chunks of work (sequences x chunks) with 16 chunks of every sequence a range, else one (the
    figures are in gluon_chunked's comment)."""
    three = (3, gc.RATIO)
    assert gc.default_schedule(1, 64) == gc.default_schedule(1, 128) == gc.default_schedule(1, 2048) == three
    assert gc.default_schedule(2, 32) == gc.default_schedule(2, 128) == gc.default_schedule(8, 64) == (2, 1.0)
    assert gc.default_schedule(4, 32) == (2, 1.0)
    for batch, n_chunks in ((1, 63), (1, 32), (3, 3), (32, 2), (128, 1), (4, 15), (4, 31), (3, 31)):
        assert gc.default_schedule(batch, n_chunks) == (1, 1.0), (batch, n_chunks)
    for n_chunks in range(1, 300):     # ratio 1: the equal cut, exactly
        for parts in range(1, 6):
            p = min(parts, n_chunks)
            assert gc.range_bounds(n_chunks, parts) == [n_chunks * i // p for i in range(p + 1)]


@given(n_chunks=st.integers(1, 4096), parts=st.integers(1, 6), ratio=st.floats(0.2, 1.0))
def test_range_bounds_cut_every_chunk_once_into_nonempty_ranges(n_chunks, parts, ratio) -> None:
    """Strictly increasing bounds from 0 to n_chunks, min(parts, n_chunks) ranges; with ratio 1 the
    equal cut n * i // parts; no range longer than the one before it by more than the rounding (one
    chunk)."""
    b = gc.range_bounds(n_chunks, parts, ratio)
    assert b[0] == 0 and b[-1] == n_chunks and len(b) == min(parts, n_chunks) + 1
    assert all(x < y for x, y in zip(b, b[1:]))
    if ratio == 1.0:
        assert b == [n_chunks * i // len(b[1:]) for i in range(len(b))]
    lengths = [y - x for x, y in zip(b, b[1:])]
    assert all(later <= earlier + 1 for earlier, later in zip(lengths, lengths[1:]))


def _case(K: int = 128, dtype: torch.dtype = torch.bfloat16) -> dict:
    B, T, HK, HV = 1, 70, 2, 6
    g = torch.Generator().manual_seed(3)
    return dict(q=torch.randn(B, T, HK, K, generator=g).to(dtype),
                k=torch.randn(B, T, HK, K, generator=g).to(dtype),
                v=torch.randn(B, T, HV, K, generator=g).to(torch.bfloat16),
                a=torch.randn(B, T, HV, generator=g).to(torch.bfloat16),
                b=torch.randn(B, T, HV, generator=g).to(torch.bfloat16),
                A_log=torch.zeros(HV), dt_bias=torch.zeros(HV),
                z=torch.randn(B, T, HV, K, generator=g).to(torch.bfloat16), norm_w=torch.ones(K),
                state=torch.zeros(B, HV, K, K))


def _call(case: dict) -> None:
    gc.gdn_prefill_chunked(**case, out=torch.empty_like(case["z"]),
                           final_state=torch.empty_like(case["state"]))


def test_refuses_other_head_dims_and_dtypes_with_a_reason() -> None:
    with pytest.raises(ValueError, match="d_k = d_v = 128"):
        _call(_case(K=64))
    with pytest.raises(ValueError, match="bf16 q, k and v"):
        _call(_case(dtype=torch.float16))


@pytest.mark.skipif(not triton_support.INTERPRETING, reason="the refusal is the interpreter's")
def test_refuses_the_interpreter_with_a_reason() -> None:
    with pytest.raises(ValueError, match="interpreter does not run Gluon"):
        _call(_case())


def test_compiles_for_sm90_on_every_cell_that_names_it(tmp_path) -> None:
    """The state pass (TMA ring, warp-group MMAs on shared-memory operands, 8 warps, about 168 KB of
    shared memory) and the prologue's PIECES mode compile for sm_90 and fit the H200's limits, at each
    cell's specialisation. With the triton installed here (CI's 3.9); the H200 runs 3.6, whose Gluon
    names differ (the module picks them at import): check that one by hand with
    ``tools/sm90_compile_check.py --triton-site`` (docs/gpu.md)."""
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "tools/sm90_compile_check.py", "--op", "gdn_prefill"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    for cell in ("short_t37", "long_t8192", "b3_t130", "b1_t20", "b2_t2048", "b1_t4101"):
        assert re.search(rf"^OK\s+gdn_prefill::gluon_chunked::{cell}", out.stdout, re.M), \
            out.stdout + out.stderr[-3000:]
