"""The Triton rmsnorm, logits_cast and GDN conv update (impl/kernels/norms/triton_rmsnorm.py,
impl/kernels/mtp/triton_logits_cast.py, impl/kernels/gdn/triton_conv.py) against the spec, on the CPU
through Triton's interpreter at small shapes, with the cells' oracles and bands (certify/cells/rmsnorm.yaml:
1 ulp / 0.5 eps; logits_cast.yaml: bitwise; gdn_conv_update.yaml: y 1 ulp / 0.5 eps, state exact).

Each kernel also has a planted bug (a copy of the kernel with one realistic mistake) that the same
oracle must reject, so a band too loose to notice the mistake fails here."""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import pytest
import torch
import triton
import triton.language as tl

from certify.harness.oracles import bitwise, tolerance
from impl.kernels.gdn import triton_conv
from impl.kernels.mtp import triton_logits_cast
from impl.kernels.norms import triton_rmsnorm
from impl.kernels.triton_support import round_to_bf16
from spec.cases.gdn import conv_update_case
from spec.cases.mtp import logits_cast_case
from spec.cases.norms import rmsnorm_case
from spec.ops import gdn, mtp, norms

F64 = torch.float64
BF = torch.bfloat16


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- rmsnorm


@triton.jit
def _rmsnorm_padded_mean(x, w, out, eps, D: tl.constexpr, BLOCK: tl.constexpr):
    """Planted bug: the mean square divides by the padded block, not by D."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    xv = tl.load(x + row * D + offs, mask=mask, other=0.0).to(tl.float32)
    wv = tl.load(w + offs, mask=mask, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt_rn(tl.sum(xv * xv, axis=0) / BLOCK + eps)
    tl.store(out + row * D + offs, round_to_bf16(xv * r * (1.0 + wv)).to(tl.bfloat16), mask=mask)


def _rmsnorm_inputs(rows: int, hidden: int):
    case = rmsnorm_case({"rows": rows, "hidden": hidden, "act_dtype": "bfloat16"}, _gen(hidden), "cpu")
    x, w = case.inputs["x"], case.inputs["w"]
    return x, w, norms.rmsnorm(x.to(F64), w.to(F64))


@pytest.mark.premerge
@pytest.mark.parametrize("rows,hidden", [(3, 128), (5, 96), (2, 3072)])
def test_triton_rmsnorm_within_the_cell_band(rows, hidden):
    x, w, ref = _rmsnorm_inputs(rows, hidden)
    out = torch.full_like(x, float("nan"))
    triton_rmsnorm.rmsnorm(x, w, out=out)
    v = tolerance("out", out, ref, 1, 0.5)
    assert v.passed, v.problems
    # the spec's own bf16 path rounds at the same point: equal on these rows
    assert torch.equal(out, norms.rmsnorm(x, w))


@pytest.mark.premerge
def test_planted_rmsnorm_bug_is_caught():
    x, w, ref = _rmsnorm_inputs(5, 96)  # 96 pads to a block of 128
    out = torch.full_like(x, float("nan"))
    _rmsnorm_padded_mean[(5,)](x, w, out, 1e-6, D=96, BLOCK=128)
    assert not tolerance("out", out, ref, 1, 0.5).passed


# ---------------------------------------------------------------- logits_cast


@triton.jit
def _widen_flushing_subnormals(src, dst, n, BLOCK: tl.constexpr):
    """Planted bug: subnormals flushed to a signed zero (what a flush-to-zero float path does)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    bits = tl.load(src + offs, mask=mask, other=0).to(tl.int32)
    bits = tl.where((bits & 0x7F80) == 0, bits & -32768, bits)
    tl.store(dst + offs, bits * 65536, mask=mask)


def _every_pattern():
    case = logits_cast_case({"rows": 1, "vocab": 65536, "logits_dtype": "bfloat16",
                             "value_set": "every_pattern"}, _gen(0), "cpu")
    return case.inputs["logits"]


@pytest.mark.premerge
@pytest.mark.parametrize("value_set,rows,vocab", [("every_pattern", 1, 65536),
                                                  ("lm_logits", 3, 5000)])
def test_triton_logits_cast_is_bitwise(value_set, rows, vocab):
    case = logits_cast_case({"rows": rows, "vocab": vocab, "logits_dtype": "bfloat16",
                             "value_set": value_set}, _gen(1), "cpu")
    logits = case.inputs["logits"]
    out = torch.full((rows, vocab), float("nan"))
    triton_logits_cast.logits_cast(logits, logits_fp32=out)
    v = bitwise("logits_fp32", out, mtp.logits_cast(logits))
    assert v.passed, v.problems


@pytest.mark.premerge
@pytest.mark.certify_property("logits_cast")
@pytest.mark.parametrize("n", [0, 1, 2])
def test_triton_logits_cast_writes_launches_of_zero_one_and_two_elements(n):
    """The launches no cell makes: an empty one writes nothing and raises nothing, a one- and a
    two-element one write every element (the output is poisoned before)."""
    logits = torch.tensor([-1.5, 3.0e-39], dtype=torch.bfloat16)[:n]
    out = torch.full((n,), float("nan"))
    triton_logits_cast.logits_cast(logits, logits_fp32=out)
    v = bitwise("logits_fp32", out, mtp.logits_cast(logits))
    assert v.passed, v.problems


@pytest.mark.premerge
def test_planted_logits_cast_bug_is_caught():
    logits = _every_pattern()
    out = torch.full(logits.shape, float("nan"))
    _widen_flushing_subnormals[(1,)](logits.view(torch.int16), out.view(torch.int32),
                                     logits.numel(), BLOCK=65536)
    assert not bitwise("logits_fp32", out, mtp.logits_cast(logits)).passed


# ---------------------------------------------------------------- gdn_conv_update

AXES = {"batch": 3, "key_heads": 2, "value_heads": 6, "head_dim": 16}


@triton.jit
def _conv_window_one_early(x, weight, state, y, C, BLOCK: tl.constexpr):
    """Planted bug: an off-by-one window, the taps read the old state and not the new input."""
    i_b = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < C
    srow = state + (i_b * C + offs) * 3
    s0 = tl.load(srow + 0, mask=mask, other=0.0)
    s1 = tl.load(srow + 1, mask=mask, other=0.0)
    s2 = tl.load(srow + 2, mask=mask, other=0.0)
    xv = tl.load(x + i_b * C + offs, mask=mask, other=0.0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    acc = acc + tl.load(weight + offs * 4 + 1, mask=mask, other=0.0) * s0.to(tl.float32)
    acc = acc + tl.load(weight + offs * 4 + 2, mask=mask, other=0.0) * s1.to(tl.float32)
    acc = acc + tl.load(weight + offs * 4 + 3, mask=mask, other=0.0) * s2.to(tl.float32)
    tl.store(y + i_b * C + offs, round_to_bf16(acc / (1.0 + tl.exp(-acc))).to(tl.bfloat16), mask=mask)
    tl.store(srow + 0, s1, mask=mask)
    tl.store(srow + 1, s2, mask=mask)
    tl.store(srow + 2, xv, mask=mask)


def _conv_check(launch, seed: int) -> bool:
    inp = conv_update_case(AXES, _gen(seed), "cpu").inputs
    ref_y, ref_state = gdn.causal_conv1d_update(*(inp[k].to(F64) for k in ("x", "weight", "conv_state")))
    y = torch.full(inp["x"].shape, float("nan"), dtype=BF)
    state = inp["conv_state"].clone()
    launch(inp["x"], inp["weight"], state, y)
    v_y = tolerance("y", y, ref_y, 1, 0.5)
    v_state = tolerance("new_conv_state", state, ref_state, 0.001, 0.001)
    # the stored inputs move, never recomputed: the rolled state is bitwise the spec's bf16 one
    exact = torch.equal(state, gdn.causal_conv1d_update(inp["x"], inp["weight"],
                                                        inp["conv_state"])[1])
    return v_y.passed and v_state.passed and exact


@pytest.mark.premerge
@pytest.mark.parametrize("seed", [0, 1])
def test_triton_conv_update_within_the_cell_band_and_rolls_the_state(seed):
    assert _conv_check(lambda x, w, s, y: triton_conv.gdn_conv_update(x, w, s, y=y), seed)


@pytest.mark.premerge
def test_triton_conv_update_twice_equals_a_two_token_prefill():
    inp = conv_update_case(AXES, _gen(5), "cpu").inputs
    x2 = torch.randn(2, *inp["x"].shape, generator=_gen(6)).to(BF)
    state = inp["conv_state"].clone()
    ys = []
    for t in range(2):
        y = torch.full(inp["x"].shape, float("nan"), dtype=BF)
        triton_conv.gdn_conv_update(x2[t].contiguous(), inp["weight"], state, y=y)
        ys.append(y)
    ref_y, ref_state = gdn.causal_conv1d(x2.transpose(0, 1).to(F64), inp["weight"].to(F64),
                                         inp["conv_state"].to(F64))
    assert tolerance("y", torch.stack(ys, 1), ref_y, 1, 0.5).passed
    assert torch.equal(state.to(F64), ref_state)


@pytest.mark.premerge
def test_planted_conv_update_bug_is_caught():
    C = triton_conv.BLOCK_C

    def buggy(x, w, s, y):
        _conv_window_one_early[(x.shape[0], triton.cdiv(x.shape[1], C))](x, w, s, y, x.shape[1],
                                                                           BLOCK=C)
    assert not _conv_check(buggy, 0)
