"""The engine on a CUDA device, against spec/model.py run on the same device (skipped without one).

- Batch-invariant mode dispatches every op's reference variant, which runs on sm_90 as on the CPU:
  every pass (context, mixed, decode, verify, commit, draft) must equal the spec's forward on the
  same device bit for bit, with the paged KV in bf16 / fp8 / nvfp4 and the state pool in fp32 / bf16.
- Default mode dispatches the sm_90 kernels (Triton, Gluon, FlashInfer where installed): the logits
  are held to the bound tests/engine/test_engine.py derives on the CPU (engine error against the
  float64 ideal at most 2x the spec's own bf16 error + 2^-9), and the kernels must have run.
"""

from __future__ import annotations

import pytest
import torch

from impl.model.placement import to_device
from tests.engine import test_engine as cpu_tests
from tests.engine.spec_replay import first_mismatch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def gpu_weights(weights):
    return to_device(weights, "cuda")


@pytest.mark.parametrize("kv,state,k", [("bf16", "fp32", None), ("fp8", "bf16", 3),
                                        ("nvfp4", "fp32", 3)])
def test_batch_invariant_matches_spec_bitwise_on_the_gpu(gpu_weights, kv, state, k):
    e = cpu_tests._engine(gpu_weights, kv=kv, state=state, k=k, device="cuda")
    rep = e.generate(cpu_tests._requests(cpu_tests.LENGTHS))
    assert all(vs == ["spec_lowp"] for vs in e.dispatcher.variants_ran().values())
    passes = cpu_tests._replay(e, gpu_weights)
    assert len(passes) >= rep.steps
    assert first_mismatch(passes) is None, first_mismatch(passes)


@pytest.mark.parametrize("kv,state,k", [
    ("bf16", "fp32", None), ("bf16", "fp32", 3), ("nvfp4", "fp32", None), ("fp8", "bf16", 3)])
def test_default_mode_within_derived_tolerance_on_the_gpu(gpu_weights, kv, state, k):
    engine_err, spec_err, where = cpu_tests._default_mode_ratio(gpu_weights, kv, state, k,
                                                                device="cuda")
    assert engine_err <= 2 * spec_err + 2 ** -9, (
        f"pass {where}: engine {engine_err:.3g} vs reference {spec_err:.3g}")
