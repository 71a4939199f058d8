"""gdn_prefill's bf16_operands tier (docs/spec.md, "Numerics tiers"): its spec path is the chunked
form plus its rounding points, each of them real in the float64 path, and its blockwise inverse is
the inverse."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from certify.harness.target import run_spec
from spec.cases.gdn import prefill_case
from spec.numerics import round_operand
from spec.ops import gdn

AXES = {"batch": 2, "seq_len": 100, "key_heads": 2, "value_heads": 6, "head_dim": 128}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def case():
    return prefill_case(AXES, torch.Generator().manual_seed(7), "cpu")


@pytest.mark.certify_property("gdn_prefill")
def test_without_its_rounding_points_the_tier_is_the_exact_function(case):
    none = partial(gdn.gdn_prefill_bf16_operands, skip=frozenset(gdn.BF16_OPERAND_POINTS))
    tier = run_spec(none, case, reference=True)
    exact = run_spec(gdn.gdn_prefill, case, reference=True)
    for name in ("out", "final_state"):
        assert _rel(tier[name], exact[name]) < 1e-8, name   # the decay floor 1e-10 only


@pytest.mark.certify_property("gdn_prefill")
def test_each_rounding_point_changes_the_float64_result(case):
    full = run_spec(gdn.gdn_prefill_bf16_operands, case, reference=True)
    exact = run_spec(gdn.gdn_prefill, case, reference=True)
    assert 1e-4 < _rel(full["final_state"], exact["final_state"]) < 1e-2
    for point in gdn.BF16_OPERAND_POINTS:
        less = run_spec(partial(gdn.gdn_prefill_bf16_operands, skip=frozenset({point})), case,
                        reference=True)
        moved = max(_rel(less[n], full[n]) for n in ("out", "final_state"))
        assert moved > 1e-6, f"leaving {point} out changes nothing"


def test_an_unknown_rounding_point_is_refused(case):
    with pytest.raises(ValueError, match="unknown rounding points"):
        run_spec(partial(gdn.gdn_prefill_bf16_operands, skip=frozenset({"o_fp8"})), case, True)


@pytest.mark.parametrize("size", [64, 37, 1])
def test_the_blockwise_inverse_is_the_inverse(size):
    A = (torch.randn(3, size, size, dtype=torch.float64) * 0.2).tril(-1)
    eye = torch.eye(size, dtype=torch.float64)
    inv = gdn._unit_lower_inverse(A, lambda x: x)
    assert float((inv @ (eye + A) - eye).abs().max()) < 1e-12
    inv16 = gdn._unit_lower_inverse(A, lambda x: round_operand(x, torch.float16))
    assert float((inv16 @ (eye + A) - eye).abs().max()) < 2e-2
    assert torch.equal(inv16, round_operand(inv16, torch.float16))   # stored in fp16


def test_an_operand_is_rounded_once_from_float64():
    x = torch.tensor([1 + 2 ** -8 + 2 ** -24, -(1 + 2 ** -8 + 2 ** -24), 3.0], dtype=torch.float64)
    # through fp32 the tie-breaking bit is lost and the value rounds down to 1.0
    assert x.to(torch.bfloat16).tolist()[0] == 1.0
    assert round_operand(x, torch.bfloat16).tolist() == [1.0078125, -1.0078125, 3.0]
    y = torch.tensor([1.5, 2 ** -3], dtype=torch.float32)
    assert torch.equal(round_operand(y, torch.bfloat16), y)
