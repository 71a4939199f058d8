"""A cell's ``why`` is true of the inputs its builder makes: each claim about the range the inputs
reach is measured on the built case (CPU, the cell's own seed)."""

from __future__ import annotations

import pytest
import torch

from certify.catalog.cell_extensions import cell_inputs
from certify.catalog.load import load_catalog
from certify.files.paths import project_paths
from certify.harness.target import build_case

pytestmark = pytest.mark.premerge

CATALOG = load_catalog(project_paths().cells)
E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0 ** -6
E4M3_MIN_SUBNORMAL = 2.0 ** -9


def _inputs(op: str, cell: str) -> dict[str, torch.Tensor]:
    spec = CATALOG.ops[op]
    c = spec.cell(cell)
    return build_case(spec.model_copy(update={"inputs": cell_inputs(spec, c)}), c,
                      torch.device("cpu")).inputs


def test_the_fp8_quantiser_cell_reaches_saturation_and_subnormals_as_its_why_says():
    # "a channel in e4m3's subnormal range (2^-9 .. 2^-6 ...) and a channel past 448 that must saturate"
    why = CATALOG.ops["kv_fp8"].cell("decode_b32").why
    assert "subnormal" in why and "past 448" in why
    x = _inputs("kv_fp8", "decode_b32")["x"].float().abs()
    assert float(x.max()) > E4M3_MAX
    assert bool(((x >= E4M3_MIN_SUBNORMAL) & (x < E4M3_MIN_NORMAL)).any())
    assert bool(((x > 0) & (x < E4M3_MIN_SUBNORMAL)).any()), "no value below 2^-9 to flush"
