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

from certify.harness.oracles import bitwise, tolerance
from impl.model.dispatch import Dispatcher
from impl.model.engine_config import _project_catalog
from impl.model.ops import Ops
from spec.ops import gdn, mtp, norms, rope

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


class InterpreterFirst(Dispatcher):
    """Triton's interpreter arch where an op has a variant there, the CPU's otherwise: the whole
    engine runs its GPU kernels' bindings on the CPU, as an sm_90 engine would call them."""

    def candidates(self, name):
        self.arch = "cpu-interpret"
        kernels = super().candidates(name)
        self.arch = "cpu"
        return kernels + super().candidates(name)


@pytest.mark.parametrize("kv,k", [
    ("bf16", None),
    # Open: one draft pass measures 0.191 against the spec's own 0.047. Dropping one torch variant at
    # a time, only hc_first_projection's clears it (worst pass then 0.041 vs 0.029), yet that variant
    # is no less accurate per call: over the run's 106 calls its largest distance to float64 is at
    # most 1.35x the spec path's (H_res 1.8e-7). With the spec path another draft pass shows 0.223
    # vs 0.225: some draft passes are ill-conditioned (a routing or nvfp4 step flip), and one pass's
    # reference error is a single draw there. The per-pass 2x bound needs a statistic that knows a
    # pass's conditioning before this can pass for the right reason.
    pytest.param("nvfp4", 3, marks=pytest.mark.xfail(
        reason="an ill-conditioned draft pass: the spec's own error there is one draw"))])
def test_the_engine_runs_its_kernel_bindings_through_the_interpreter(weights, kv, k):
    """Every binding of a Triton variant (the HC inject norm, pre-mix and up projection, QK norm +
    RoPE, KV append, index store, top-k + expand,
    sparse GQA, the GDN kernels, rmsnorm, the logits cast, the MoE block) in one engine, with the logits held to
    tests/engine/test_engine.py's bound against the float64 ideal (engine error at most 2x the
    spec's own bf16 error + 2^-9). Measured on the tiny model: 1.03x (bf16 KV), 1.40x (nvfp4, K 3)."""
    from tests.engine import test_engine as engine_tests
    from tests.engine.spec_replay import replay, widen

    e = engine_tests._engine(weights, kv=kv, k=k, invariant=False)
    e.dispatcher = e.model.ops.d = InterpreterFirst(e.dispatcher.catalog, "cpu")
    e.generate(engine_tests._requests(engine_tests.LENGTHS))
    ran = e.dispatcher.variants_ran()
    for op in ("hc_inject_norm", "hc_pre", "hc_up_projection", "qk_norm_rope", "qsa_kv_append",
               "qsa_index_store", "qsa_topk_expand", "gdn_prefill", "logits_cast", "moe"):
        assert "spec_lowp" not in ran[op], (op, ran[op])
    assert set(ran["qsa_sparse_gqa"]) == {"triton_decode", "triton_rows"}
    lowp = engine_tests._replay(e, weights)
    ideal = replay(e.calls, widen(weights), engine_tests.TINY, kv_dtype=kv,
                   state_dtype=torch.float32, max_len=engine_tests.MAX_LEN + 8)
    err = engine_tests._errors_vs(ideal, [type(p)(p.what, p.engine_logits, p.engine_logits)
                                          for p in lowp])
    ref = engine_tests._errors_vs(ideal, [type(p)(p.what, p.spec_logits, p.spec_logits)
                                          for p in lowp])
    worst = max(range(len(err)), key=lambda i: err[i] - 2 * ref[i])
    assert err[worst] <= 2 * ref[worst] + 2 ** -9, (lowp[worst].what, err[worst], ref[worst])


def test_gdn_verify_binding_takes_the_verify_steps_strided_slots(ops: Ops):
    """A verify-only step hands the GDN verify its slots as a strided view of the rows' seq_ids
    (one per request of T rows); the Triton kernels read row-major offsets, so the binding passes a
    contiguous copy. Results within the r2_b8_fp32 cell's bands (out 2 ulp, states 64 ulp), against
    the spec in float64 on the same slots."""
    g = _gen()
    B, T, HK, HV, D = 2, 4, 2, 4, 128

    def draw(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    q, k = draw(B, T, HK, D, scale=0.1), draw(B, T, HK, D, scale=0.1)
    v, z = draw(B, T, HV, D), draw(B, T, HV, D)
    a, b = draw(B, T, HV), draw(B, T, HV)
    A_log, dt_bias = draw(HV, dtype=torch.float32), draw(HV, dtype=torch.float32)
    norm_w = draw(D)
    pool = draw(5, HV, D, D, dtype=torch.float32, scale=0.1)
    slots = torch.tensor([3, 3, 3, 3, 1, 1, 1, 1]).view(B, T)[:, 0]
    assert not slots.is_contiguous()
    out, states = ops.gdn_verify(q, k, v, a, b, A_log, dt_bias, z, norm_w, pool, slots)
    assert ops.d.variants_ran()["gdn_verify"] == ["triton_split"]
    ref = gdn.gdn_verify(*(t.to(F64) for t in (q, k, v, a, b, A_log, dt_bias, z, norm_w, pool)),
                         slots)
    for name, got, want, ulp, rms in (("out", out, ref["out"], 2, 0.5),
                                      ("states", states, ref["states"], 64, 8)):
        verdict = tolerance(name, got, want, ulp, rms)
        assert verdict.passed, verdict.problems
