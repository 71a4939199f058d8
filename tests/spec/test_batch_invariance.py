"""The spec path is batch-invariant by construction (docs/spec.md, "Batch invariance"): a row's result
does not depend on how many rows share the launch. Pinned here for the ops whose projections span the
launch's rows."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from spec.numerics import rowwise_matmul
from spec.ops.hc import hc_first_projection
from spec.ops.mtp import mtp_draft_input
from spec.ops.ple import ple_apply


def _rows_alone_equal_launch(fn, n_rows):
    whole = fn(slice(0, n_rows))
    for r in range(n_rows):
        alone = fn(slice(r, r + 1))
        for w, a in zip(whole if isinstance(whole, tuple) else (whole,),
                        alone if isinstance(alone, tuple) else (alone,)):
            assert torch.equal(w[r:r + 1], a), f"row {r} differs between the launch and alone"


@given(seed=st.integers(0, 2 ** 31), rows=st.integers(2, 40))
def test_rowwise_matmul_rows_do_not_depend_on_the_launch(seed, rows):
    gen = torch.Generator().manual_seed(seed)
    a, b = torch.randn(rows, 96, generator=gen), torch.randn(96, 40, generator=gen)
    _rows_alone_equal_launch(lambda s: rowwise_matmul(a[s], b), rows)


@given(seed=st.integers(0, 2 ** 31), rows=st.sampled_from([2, 5, 17]))
def test_hc_mtp_and_ple_projections_are_batch_invariant(seed, rows):
    gen = torch.Generator().manual_seed(seed)
    n, C = 4, 64
    v = torch.randn(rows, n * C, generator=gen)
    r = torch.rand(rows, generator=gen) + 0.5
    phi = torch.randn(n * C, 2 * n + n * n, generator=gen) * 0.05
    bias = torch.randn(2 * n + n * n, generator=gen)
    _rows_alone_equal_launch(lambda s: tuple(hc_first_projection(v[s], r[s], phi, bias)), rows)

    bf = torch.bfloat16
    h_prev = torch.randn(rows, C, generator=gen).to(bf)
    embed = torch.randn(50, C, generator=gen).to(bf)
    tok = torch.randint(0, 50, (rows,), generator=gen)
    nw = torch.randn(C, generator=gen).to(bf) * 0.1
    fc = (torch.randn(C, 2 * C, generator=gen) * 0.05).to(bf)
    _rows_alone_equal_launch(lambda s: mtp_draft_input(tok[s], h_prev[s], embed, nw, nw, fc), rows)

    P = 16
    x = torch.randn(rows, C, generator=gen).to(bf)
    e_l = torch.randn(rows, P, generator=gen).to(bf)
    w_gate = (torch.randn(P, C, generator=gen) * 0.1).to(bf)
    w_out = (torch.randn(C, P, generator=gen) * 0.1).to(bf)
    _rows_alone_equal_launch(lambda s: ple_apply(x[s], e_l[s], w_gate, w_out, nw), rows)
