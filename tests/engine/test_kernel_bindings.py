"""The engine's bindings of kernel variants (impl/model/ops.py) in their calling convention: a
dispatcher for Triton's interpreter arch chooses the Triton rmsnorm, logits cast and QK norm + RoPE,
the binding runs them into fresh buffers, and the results match the spec within the cells' bands
(rmsnorm 1 ulp, logits cast bitwise, QK norm + RoPE 2 ulp, each against float64). Shape-only mode
(the reach tracer's) dispatches the same variant and returns buffers of the right shape without
running it."""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import pytest
import torch

from certify.oracles import bitwise, tolerance
from impl.model.dispatch import Dispatcher
from impl.model.engine_config import _project_catalog
from impl.model.ops import Ops
from spec.ops import mtp, norms, rope

F64 = torch.float64
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter arch is the CPU's")


@pytest.fixture()
def ops() -> Ops:
    return Ops(Dispatcher(_project_catalog(), "cpu-interpret"))


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(11)


def test_rmsnorm_binding_runs_the_triton_variant(ops: Ops):
    x = (torch.randn(6, 256, generator=_gen()) * 3).to(torch.bfloat16)
    w = (torch.randn(256, generator=_gen()) * 0.2).to(torch.bfloat16)
    out = ops.rmsnorm(x, w, 1e-6)
    assert ops.d.variants_ran()["rmsnorm"] == ["triton"]
    v = tolerance("out", out, norms.rmsnorm(x.to(F64), w.to(F64), 1e-6), 1, 0.5)
    assert v.passed, v.problems


def test_logits_cast_binding_runs_the_triton_variant(ops: Ops):
    logits = (torch.randn(3, 1000, generator=_gen()) * 8).to(torch.bfloat16)
    out = ops.logits_cast(logits)
    assert ops.d.variants_ran()["logits_cast"] == ["triton"]
    assert bitwise("logits_fp32", out, mtp.logits_cast(logits)).passed


def test_qk_norm_rope_binding_runs_the_triton_variant(ops: Ops):
    g = _gen()
    q = (torch.randn(5, 24, 256, generator=g) * 2).to(torch.bfloat16)
    k = (torch.randn(5, 2, 256, generator=g) * 2).to(torch.bfloat16)
    wq = (torch.randn(256, generator=g) * 0.2).to(torch.bfloat16)
    wk = (torch.randn(256, generator=g) * 0.2).to(torch.bfloat16)
    pos = torch.tensor([0, 31, 32, 4095, 131071])
    q_out, k_out = ops.qk_norm_rope(q, k, wq, wk, pos, 64, 1e7, 1e-6, step="prefill",
                                    context=131072)
    assert ops.d.variants_ran()["qk_norm_rope"] == ["triton"]
    rq, rk = rope.qk_norm_rope(q.to(F64), k.to(F64), wq.to(F64), wk.to(F64), pos, 64, 1e7, 1e-6)
    for name, got, ref in (("q_out", q_out, rq), ("k_out", k_out, rk)):
        v = tolerance(name, got, ref, 2, 1)
        assert v.passed, v.problems


def test_shape_only_mode_dispatches_the_kernel_and_runs_nothing():
    ops = Ops(Dispatcher(_project_catalog(), "cpu-interpret"), shape_only=True)
    x = torch.empty(7, 3072, dtype=torch.bfloat16, device="meta")
    out = ops.rmsnorm(x, torch.empty(3072, dtype=torch.bfloat16, device="meta"), 1e-6)
    assert out.shape == x.shape and out.device.type == "meta"
    assert ops.d.variants_ran()["rmsnorm"] == ["triton"]
