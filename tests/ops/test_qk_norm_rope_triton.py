"""The Triton QK norm + RoPE (impl/kernels/norms/triton_qk_norm_rope.py) against the spec on the CPU
through Triton's interpreter, with the cell file's band (certify/cells/qk_norm_rope.yaml: 2 ulp of the
row maximum, 1 eps relative RMS, each against the float64 spec).

Two planted bugs that the same band must reject: the mRoPE sections wrong (every frequency reads the
t row, as plain RoPE would) and every position one too far."""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import pytest
import torch

from certify.harness.oracles import tolerance
from impl.kernels.norms import triton_qk_norm_rope as kernel
from spec.cases.rope import qk_norm_rope_case
from spec.ops import rope
from spec.ops.norms import rmsnorm

F64 = torch.float64


def _case(rows: int, context: int, mode: str, step: str = "prefill", heads=(4, 1), head_dim=128):
    axes = {"step": step, "rows": rows, "context": context, "rope": mode, "act_dtype": "bfloat16",
            "q_heads": heads[0], "kv_heads": heads[1], "head_dim": head_dim}
    return qk_norm_rope_case(axes, torch.Generator().manual_seed(rows * 7 + context), "cpu").inputs


def _run(inputs, **kw):
    q_out = torch.full_like(inputs["q"], float("nan"))
    k_out = torch.full_like(inputs["k"], float("nan"))
    kernel.qk_norm_rope(**inputs, q_out=q_out, k_out=k_out, **kw)
    return q_out, k_out


def _verdicts(inputs, got):
    ref = rope.qk_norm_rope(*(inputs[n].to(F64) if inputs[n].is_floating_point() else inputs[n]
                              for n in ("q", "k", "w_q", "w_k", "positions")))
    return [tolerance(n, g, r, max_ulp=2, max_rel_rms=1) for n, g, r in zip(("q_out", "k_out"), got, ref)]


@pytest.mark.premerge
@pytest.mark.parametrize("rows,context,mode,step", [(16, 131072, "plain", "decode"),
                                                     (24, 4096, "mrope", "prefill"),
                                                     (5, 300, "plain", "prefill")])
def test_within_the_cell_band(rows, context, mode, step):
    inputs = _case(rows, context, mode, step)
    got = _run(inputs)
    for v in _verdicts(inputs, got):
        assert v.passed, v.problems
    # pass-through dims are the rounded norm: the spec's bf16 rmsnorm but for its summation order
    passed = got[0][..., 64:].float()
    normed = rmsnorm(inputs["q"], inputs["w_q"])[..., 64:].float()
    assert (passed != normed).float().mean() < 0.01


@pytest.mark.premerge
def test_a_heads_count_that_is_no_power_of_two_is_masked():
    inputs = _case(6, 1000, "plain", heads=(3, 1), head_dim=64)
    for v in _verdicts(inputs, _run(inputs)):
        assert v.passed, v.problems


@pytest.mark.premerge
def test_planted_bug_wrong_mrope_sections_is_rejected():
    inputs = _case(24, 4096, "mrope")
    got = _run(inputs, sections=(32, 0, 0))
    assert not all(v.passed for v in _verdicts(inputs, got))


@pytest.mark.premerge
def test_planted_bug_position_off_by_one_is_rejected():
    """The rotation at the position after the token's (a position counted after the append)."""
    inputs = _case(16, 8192, "plain", "decode")
    got = _run({**inputs, "positions": inputs["positions"] + 1})
    assert not all(v.passed for v in _verdicts(inputs, got))


@pytest.mark.premerge
def test_bad_input_is_refused():
    inputs = _case(4, 300, "plain")
    with pytest.raises(ValueError, match="must lie in"):
        _run({**inputs, "positions": inputs["positions"] - 1000})
    with pytest.raises(ValueError, match="must lie in"):
        _run({**inputs, "positions": inputs["positions"] + 131072})
    with pytest.raises(ValueError, match="bf16"):
        _run({**inputs, "q": inputs["q"].float()})
