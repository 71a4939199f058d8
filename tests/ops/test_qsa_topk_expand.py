"""QSA top-k selection fused with expansion (spec/ops/qsa.py ``qsa_topk_expand``; its variants in
impl/kernels/qsa/): the spec's composition by hand, every variant against it on drawn tables, and the
determinism the fused kernel promises: the same rows selected bitwise whatever order they launch in.

The Triton variant runs through the interpreter here (about 17 ms a row), so its launches on the CPU are
small; the 50 launches of 256 rows at 4096 columns run on sm_90 only.
"""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
from typing import Callable

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from impl.kernels.qsa import torch_topk_expand, triton_topk_expand
from spec.cases.qsa import topk_expand_case
from spec.ops.qsa import TOKENS_PER_BLOCK, qsa_expand, qsa_select, qsa_topk_expand

TPB = TOKENS_PER_BLOCK
NAN, INF = float("nan"), float("inf")
POISON = -7  # no valid output is -7: an element left unwritten shows

Variant = Callable[..., None]
VARIANTS: dict[str, Variant] = {"torch": torch_topk_expand.qsa_topk_expand,
                                "triton": triton_topk_expand.qsa_topk_expand}
HAS_CUDA = torch.cuda.is_available()


def run(variant: Variant, scores: torch.Tensor, positions: torch.Tensor,
        lens: torch.Tensor | None, k: int = 64, sink: int = 1, local: int = 2
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch into poisoned buffers, on the GPU where there is one (a compiled Triton kernel
    cannot read host memory), else on the CPU; returns (selected, tokens) on the CPU."""
    dev = torch.device("cuda" if HAS_CUDA else "cpu")
    scores, positions = scores.to(dev), positions.to(dev)
    lens = None if lens is None else lens.to(dev)
    width = k + sink + local
    sel = torch.full((scores.shape[0], width), POISON, dtype=torch.int64, device=dev)
    tok = torch.full((scores.shape[0], TPB * width), POISON, dtype=torch.int64, device=dev)
    variant(scores, positions, lens, selected=sel, tokens=tok, k=k, sink_blocks=sink,
            local_blocks=local)
    return sel.cpu(), tok.cpu()


# ---------------------------------------------------------------------------------------------------
# Guard
# ---------------------------------------------------------------------------------------------------

GUARD_ROW = [9.0, 5.0, 3.0, 5.0, NAN, 5.0, 8.0, 1.0, 4.0]


@pytest.mark.certify_guard("qsa_topk_expand")
@pytest.mark.parametrize("name", ["spec", *VARIANTS])
def test_qsa_topk_expand_guard(name: str) -> None:
    """t = 261: own block 8 (256..261), window {0, 7, 8}; candidates 1..6 scoring 5, 3, 5, NaN, 5, 8.
    k = 3: tau = 5; block 6 (8) is above it, and the two slots left go to the ties at 5 (blocks 1, 3,
    5), highest first: 5 and 3. Selected {0, 3, 5, 6, 7, 8}. Row 0 has length 300, so the cut is
    t + 1 = 262: blocks 0, 3, 5, 6, 7 whole and 256..261 of block 8, 166 tokens then 26 x -1.
    Row 1 has length 230: block 7 stops at 229 and block 8 gives nothing, 134 tokens."""
    scores = torch.tensor([GUARD_ROW, GUARD_ROW])
    pos, lens = torch.tensor([261, 261]), torch.tensor([300, 230])
    if name == "spec":
        sel, tok = qsa_topk_expand(scores, pos, lens, k=3)
    else:
        sel, tok = run(VARIANTS[name], scores, pos, lens, k=3)
    assert sel.tolist() == [[0, 3, 5, 6, 7, 8]] * 2
    whole = [*range(0, 32), *range(96, 128), *range(160, 192), *range(192, 224)]
    assert tok[0].tolist() == whole + [*range(224, 256), *range(256, 262)] + [-1] * 26
    assert tok[1].tolist() == whole + [*range(224, 230)] + [-1] * 58


# ---------------------------------------------------------------------------------------------------
# Property test
# ---------------------------------------------------------------------------------------------------

score_values = st.sampled_from([-1.0, -0.0, 0.0, 1.0, 2.5, NAN, -INF, INF, 0.5, 1e-30, -2.5])


@st.composite
def tables(draw: st.DrawFn) -> dict:
    """Small tables dense in ties, NaN, +-0.0 and infinities; t inside the table (its own block has a
    column, as the forward builds tables); lengths below, at and past t + 1."""
    n_cols = draw(st.integers(1, 20))
    n_rows = draw(st.integers(1, 6))
    rows = draw(st.lists(st.lists(score_values, min_size=n_cols, max_size=n_cols),
                         min_size=n_rows, max_size=n_rows))
    positions = draw(st.lists(st.integers(0, TPB * n_cols - 1), min_size=n_rows, max_size=n_rows))
    lens = draw(st.one_of(st.none(), st.lists(st.integers(1, TPB * n_cols + TPB), min_size=n_rows,
                                              max_size=n_rows)))
    return dict(scores=torch.tensor(rows, dtype=torch.float32),
                positions=torch.tensor(positions, dtype=torch.int32),
                lens=None if lens is None else torch.tensor(lens, dtype=torch.int32),
                k=draw(st.integers(0, 10)), sink=draw(st.integers(1, 2)),
                local=draw(st.integers(1, 3)), seed=draw(st.integers(0, 2**31 - 1)))


@pytest.mark.certify_property("qsa_topk_expand")
@given(tables())
def test_qsa_topk_expand_properties(case: dict) -> None:
    """The spec is qsa_select then qsa_expand; every variant equals it bitwise (every element
    written), its tokens are ascending, below min(t + 1, length) and inside the selected blocks, and
    each row is the same whatever order the rows launch in."""
    scores, pos, lens = case["scores"], case["positions"], case["lens"]
    k, sink, local = case["k"], case["sink"], case["local"]
    want_sel, want_tok = qsa_topk_expand(scores.double(), pos, lens, k, sink, local)
    ref_sel = qsa_select(scores, pos, k, sink, local)
    assert torch.equal(want_sel, ref_sel) and torch.equal(want_tok, qsa_expand(ref_sel, pos, lens))

    limit = pos.long() + 1 if lens is None else torch.minimum(pos.long() + 1, lens.long())
    for r in range(pos.numel()):
        row = want_tok[r][want_tok[r] >= 0]
        assert bool((row[1:] > row[:-1]).all()) and bool((row < limit[r]).all())
        assert set((row // TPB).tolist()) <= set(want_sel[r].tolist())

    order = torch.randperm(pos.numel(), generator=torch.Generator().manual_seed(case["seed"]))
    for name, variant in VARIANTS.items():
        sel, tok = run(variant, scores, pos, lens, k, sink, local)
        assert torch.equal(sel, want_sel), name
        assert torch.equal(tok, want_tok), name
        lens_p = None if lens is None else lens[order]
        sel_p, tok_p = run(variant, scores[order], pos[order], lens_p, k, sink, local)
        assert torch.equal(sel_p, want_sel[order]) and torch.equal(tok_p, want_tok[order]), name


# ---------------------------------------------------------------------------------------------------
# Determinism: shuffled launches select identical rows
# ---------------------------------------------------------------------------------------------------

def _launch_table(rows: int, context: int, seed: int) -> tuple[torch.Tensor, ...]:
    """A verify launch (2 rows a request) of the cells' score rows: every tie rule of qsa_select."""
    axes = {"step": "verify", "batch": rows // 2, "rows": rows, "context": context,
            "score_pattern": "mixed_ties", "edge_rows": False}
    case = topk_expand_case(axes, torch.Generator().manual_seed(seed), "cpu")
    return case.inputs["scores"], case.inputs["positions"], case.inputs["context_lens"]


def _check_shuffled_launches(variant: Variant, launches: int, rows: int, context: int,
                             device: str) -> None:
    scores, pos, lens = _launch_table(rows, context, seed=rows + context)
    want_sel, want_tok = qsa_topk_expand(scores.double(), pos, lens)
    gen = torch.Generator().manual_seed(launches)
    for i in range(launches):
        order = torch.randperm(rows, generator=gen)
        sel, tok = run(variant, *(x[order].to(device) for x in (scores, pos, lens)))
        assert torch.equal(sel, want_sel[order]), f"launch {i}: a row's selection moved"
        assert torch.equal(tok, want_tok[order]), f"launch {i}: a row's tokens moved"


def test_torch_selects_identical_rows_in_50_shuffled_launches() -> None:
    _check_shuffled_launches(torch_topk_expand.qsa_topk_expand, 50, 256, 8192, "cpu")


def test_triton_selects_identical_rows_in_shuffled_launches_interpreted() -> None:
    """The interpreter's affordable version: 4 launches of 32 rows over 256 columns."""
    _check_shuffled_launches(triton_topk_expand.qsa_topk_expand, 4, 32, 8192, "cpu")


@pytest.mark.postmerge
@pytest.mark.arch("sm_90")
@pytest.mark.skipif(not HAS_CUDA, reason="the 50 x 256-row launches at 4096 columns need a GPU")
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_selects_identical_rows_in_50_shuffled_launches_on_the_gpu(name: str) -> None:
    _check_shuffled_launches(VARIANTS[name], 50, 256, 131072, "cuda")
