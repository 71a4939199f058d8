"""The Triton sparse GQA variants (impl/kernels/qsa/triton_sparse_gqa.py) against the spec
(spec/ops/qsa.py:qsa_sparse_gqa), on the CPU through Triton's interpreter at small shapes, with the
bf16 band of certify/cells/qsa_sparse_gqa.yaml (2 ulp, 1 eps) for every page format: the kernels read
nvfp4 elements as exact code * sf and never round them, so they hold the bf16 band there too (60
hypothesis examples over nvfp4 pages passed it), where the nvfp4 cells keep 6 ulp, 2 eps for the
spec's own rounding of every element.

Inputs come from the cells' own builder (spec/cases/qsa.py:sparse_gqa_case) at a small geometry, then
each row keeps a drawn subset of its tokens (down to one token, padding (-1) left in the middle), so
the kernels see selections the builder alone would not make."""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from certify.harness.target import run_spec
from certify.harness.oracles import tolerance
from impl.kernels.qsa import triton_sparse_gqa as tsg
from spec.cases.qsa import sparse_gqa_case
from spec.ops import qsa
from spec.ops.qsa import empty_planes, qsa_kv_append, qsa_sparse_gqa

BANDS = {"bfloat16": (2, 1), "fp8": (2, 1), "nvfp4": (2, 1)}
VARIANTS = {"decode": tsg.triton_decode, "rows": tsg.triton_rows}


def _case(step: str, batch: int, rows: int, context: int, kv: str, heads: tuple[int, int, int],
          seed: int):
    n_q, n_kv, d = heads
    axes = dict(step=step, batch=batch, rows=rows, context=context, kv_dtype=kv,
                act_dtype="bfloat16", q_heads=n_q, kv_heads=n_kv, head_dim=d)
    return sparse_gqa_case(axes, torch.Generator().manual_seed(seed), "cpu")


def _thin(tokens: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Each row keeps a drawn subset of its tokens (at least one; some rows exactly one): the dropped
    ones become -1 in place, so padding also sits between selected tokens."""
    out = tokens.clone()
    for r in range(out.shape[0]):
        live = (out[r] >= 0).nonzero().flatten()
        mode = int(torch.randint(0, 3, (1,), generator=gen))
        if mode == 0:    # a single token
            keep = live[torch.randint(0, live.numel(), (1,), generator=gen)]
        elif mode == 1:  # a random subset
            keep = live[torch.rand(live.numel(), generator=gen) < 0.5]
            keep = live[:1] if keep.numel() == 0 else keep
        else:            # all
            keep = live
        drop = torch.ones(out.shape[1], dtype=torch.bool)
        drop[keep] = False
        out[r][drop] = -1
    return out


def _run(fn, inputs: dict, **kw) -> torch.Tensor:
    out = torch.full(inputs["q"].shape, float("nan"), dtype=torch.bfloat16)
    fn(**inputs, out=out, **kw)
    return out


@pytest.mark.premerge
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(step=st.sampled_from(["decode", "verify", "prefill", "mixed"]),
       kv=st.sampled_from(["bfloat16", "fp8", "nvfp4"]),
       heads=st.sampled_from([(4, 2, 32), (6, 2, 16), (2, 1, 32)]),
       seed=st.integers(0, 2**31 - 1))
def test_triton_sparse_gqa_properties(step: str, kv: str, heads: tuple, seed: int) -> None:
    """Both variants within the cell band of the float64 spec at every step and KV dtype; every
    element written; rows independent of their neighbours (a shuffled half of the rows gives the
    same rows: bitwise for split-K, whose rows never share a program; within the band for the row
    tiles, whose union, hence tile boundaries, depends on the tile's rows)."""
    layouts = {"decode": (3, 3), "verify": (2, 4), "prefill": (1, 6), "mixed": (4, 6)}
    batch, rows = layouts[step]
    case = _case(step, batch, rows, 200, kv, heads, seed)
    gen = torch.Generator().manual_seed(seed)
    inputs = dict(case.inputs, tokens=_thin(case.inputs["tokens"], gen))
    ref = run_spec(qsa_sparse_gqa, type(case)(inputs, case.outputs), reference=True)["out"]
    max_ulp, max_rms = BANDS[kv]
    order = torch.randperm(rows, generator=gen)[: max(1, rows // 2)]
    part_in = dict(inputs, **{n: inputs[n][order].contiguous() for n in ("q", "gate", "tokens",
                                                                        "seq_ids")})
    for name, fn in VARIANTS.items():
        kw = {"num_splits": 3, "block_n": 16} if name == "decode" else {"block_n": 16}
        out = _run(fn, inputs, **kw)
        assert not out.isnan().any(), f"{name}: an element was not written"
        v = tolerance("out", out, ref, max_ulp, max_rms)
        assert v.passed, (name, kv, v.problems)
        part = _run(fn, part_in, **kw)
        if name == "decode":
            assert torch.equal(part, out[order])
        else:
            assert tolerance("out", part, ref[order], max_ulp, max_rms).passed


def _guard_inputs(tokens: list[int]):
    """spec guard of qsa_sparse_gqa (tests/spec/test_qsa.py) at head_dim 16: 4 q heads over 2 KV
    heads, every q . k_j = 16 * 0.25 * 1 = 4, scale 1/4 -> equal logits 1 for every listed token."""
    planes = empty_planes(num_pages=1, n_kv_heads=2, head_dim=16, index_dim=2)
    table = torch.tensor([[0]], dtype=torch.int32)
    k = torch.ones(3, 2, 16, dtype=torch.bfloat16)
    v = torch.empty(3, 2, 16, dtype=torch.bfloat16)
    v[0, 0], v[0, 1] = 1.0, 0.0
    v[1] = 100.0  # never selected: must not leak in
    v[2, 0], v[2, 1] = 4.0, 3.0
    kc, vc, _ = qsa_kv_append(planes.k_cache, planes.v_cache, planes.pos_plane, table,
                              torch.zeros(3, dtype=torch.int64), torch.arange(3), k, v)
    q = torch.full((1, 4, 16), 0.25, dtype=torch.bfloat16)
    gate = torch.zeros(1, 4, 16, dtype=torch.bfloat16)  # sigmoid(0) = 1/2
    return dict(q=q, gate=gate, tokens=torch.tensor([tokens]), seq_ids=torch.tensor([0]),
                block_table=table, k_cache=kc, v_cache=vc)


@pytest.mark.premerge
@pytest.mark.parametrize("name", list(VARIANTS))
def test_triton_sparse_gqa_guard(name: str) -> None:
    """Tokens 0 and 2 selected (p = 1/2 each): KV head 0 o = (1 + 4) / 2 = 2.5, KV head 1 o = 1.5;
    gated by 1/2: 1.25 and 0.75. Token 2 listed twice (the spec attends it twice: p = 1/3, 2/3):
    o = (1 + 8) / 3 = 3 and (0 + 6) / 3 = 2, gated 1.5 and 1. A row of padding only: zeros."""
    fn = VARIANTS[name]
    out = _run(fn, _guard_inputs([0, -1, 2, -1]))
    assert out[0, :, 0].tolist() == [1.25, 1.25, 0.75, 0.75]
    assert torch.equal(out[0], out[0, :, :1].expand(4, 16))
    dup = _guard_inputs([2, 0, 2, -1])
    out = _run(fn, dup)
    assert out[0, :, 0].tolist() == [1.5, 1.5, 1.0, 1.0]
    assert torch.equal(out, qsa_sparse_gqa(**dup))
    assert _run(fn, _guard_inputs([-1, -1, -1, -1])).eq(0).all()


@pytest.mark.premerge
def test_nvfp4_band_rejects_a_wrong_global_scale() -> None:
    """The nvfp4 band (6 ulp) is tight enough to see V read back under a global scale 6% off (an
    output 6% off, ~15 ulp), and the spec under that scale agrees with the kernel again."""
    case = _case("decode", 3, 3, 200, "nvfp4", (4, 2, 32), 7)
    ref = run_spec(qsa_sparse_gqa, case, reference=True)["out"]
    good = _run(tsg.triton_decode, case.inputs)
    assert tolerance("out", good, ref, 6, 2).passed
    load_v = case.inputs["load_v"]
    off = load_v.keywords["gs"] * (1 + 2**-4)  # a wrong scale for V
    bad_in = dict(case.inputs, load_v=type(load_v)(load_v.func, gs=off))
    bad = _run(tsg.triton_decode, bad_in)
    assert not tolerance("out", bad, ref, 6, 2).passed
    # and the spec agrees with the kernel about what the wrong scale computes
    assert tolerance("out", bad, run_spec(qsa_sparse_gqa, type(case)(bad_in, case.outputs),
                                          reference=True)["out"], 6, 2).passed


@pytest.mark.parametrize("name", list(VARIANTS))
def test_nvfp4_pages_refuse_more_than_32_q_heads_per_kv_head(name: str) -> None:
    """Over nvfp4 pages the dots' M stops at 32 (triton 3.6 cannot compile the prmt reader into a
    larger dot): 40 q heads over one KV head is refused with that reason, 32 runs."""
    with pytest.raises(ValueError, match="at most 32 q heads per KV head"):
        _run(VARIANTS[name], _case("decode", 1, 1, 64, "nvfp4", (40, 1, 16), 5).inputs)
    case = _case("decode", 1, 1, 64, "nvfp4", (32, 1, 16), 5)
    ref = run_spec(qsa_sparse_gqa, case, reference=True)["out"]
    assert tolerance("out", _run(VARIANTS[name], case.inputs), ref, 2, 1).passed


def test_unsupported_load_is_refused() -> None:
    case = _case("decode", 1, 1, 64, "fp8", (2, 1, 16), 3)
    with pytest.raises(ValueError, match="unsupported KV cache"):
        _run(tsg.triton_decode, dict(case.inputs, load=lambda parts, dtype: parts[0].to(dtype)))
    assert qsa.TOKENS_PER_BLOCK == tsg.TPB


@pytest.mark.premerge
@pytest.mark.parametrize("kv", ["fp8", "nvfp4"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_q_far_outside_fp16_range_keeps_the_band(name: str, kv: str) -> None:
    """Over fp8 / nvfp4 pages the dots are fp16, and q (bf16) is scaled per row into fp16's range.
    Rows scaled by 2^-40 (below fp16's subnormals) and 2^40 (past its largest, 65504) stay within
    the band of the float64 spec; without the per-row scaling the first would attend uniformly (all
    logits 0) and the second would overflow to NaN. The scaling is a power of two, so the spec's own
    q is exactly the scaled bf16 q and the reference sharpens with it (2^40 makes each row one-hot)."""
    case = _case("decode", 4, 4, 300, kv, (4, 2, 32), 11)
    q = case.inputs["q"].float()
    factor = torch.tensor([2.0**-40, 2.0**40, 1.0, 2.0**-40])[:, None, None]
    inputs = dict(case.inputs, q=(q * factor).bfloat16())
    assert torch.equal(inputs["q"].float() / factor, q)  # the scaling itself is exact in bf16
    ref = run_spec(qsa_sparse_gqa, type(case)(inputs, case.outputs), reference=True)["out"]
    out = _run(VARIANTS[name], inputs)
    assert not out.isnan().any()
    assert tolerance("out", out, ref, *BANDS[kv]).passed


@pytest.mark.premerge
@pytest.mark.parametrize("name", list(VARIANTS))
def test_tiny_q_over_huge_nvfp4_keys_keeps_the_band(name: str) -> None:
    """The per-row scaling's clamp: q near 2^-116 (its largest below 2^-112, where 2^(14 - e) would
    leave fp32's range) against keys near 2^110 (nvfp4's global scale times 2^110), so the logits
    are of order one. Both factors must stay exact inverses there; a mismatched clamp doubles every
    logit of the row (7.8 ulp)."""
    case = _case("decode", 4, 4, 300, "nvfp4", (4, 2, 32), 13)
    load = case.inputs["load"]
    inputs = dict(case.inputs, q=(case.inputs["q"].float() * 2.0**-116).bfloat16(),
                  load=type(load)(load.func, gs=load.keywords["gs"] * 2.0**110))
    assert float(inputs["q"].float().abs().max()) < 2.0**-112
    ref = run_spec(qsa_sparse_gqa, type(case)(inputs, case.outputs), reference=True)["out"]
    out = _run(VARIANTS[name], inputs)
    assert tolerance("out", out, ref, 2, 1).passed
