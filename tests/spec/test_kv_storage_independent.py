"""The KV storage ops of the catalog and the storage seam's loads against formulations written
independently of them (docs/spec.md, "KV storage"), on the catalog cells' own inputs.

- ``kv_fp8_op`` against torch's own float8 cast (``torch.float8_e4m3fn``) after the clamp the prose
  states, over the cells' inputs: every bf16 bit pattern once, and decode rows with subnormals and
  saturating values (a bf16 value widens exactly to fp32, so torch's fp32 -> e4m3 cast rounds the
  exact value once); the read-back against the e4m3 value table decoded from the bit layout.
- ``kv_nvfp4_op`` against the per-block Python-float quantiser (fp32 arithmetic at the four points
  the prose names) and a per-element decode ``(code * sf) * gs`` in fp32, then the cast to bf16.
- ``fp8_load``, ``nvfp4_load`` (the loads ``qsa_sparse_gqa`` reads K and V through) against the same
  decodes; ``nvfp4_global_scale`` against ``amax / 2688`` rounded to fp32; ``kv_bytes_per_token``
  against bits per element.
Codes and bytes are compared bitwise, as the catalog's oracles do.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from certify.catalog.load import load_catalog
from certify.files.paths import project_paths
from certify.harness.target import build_case
from spec.cases.kv_storage import kv_fp8_op, kv_nvfp4_op
from spec.ops.kv_storage import (fp8_load, fp8_quantize, kv_bytes_per_token, nvfp4_global_scale,
                                 nvfp4_load, nvfp4_quantize)
from tests.spec.test_second_formulations_storage import E4M3_TABLE, _f32, nvfp4_reference

pytestmark = pytest.mark.premerge

CATALOG = load_catalog(project_paths().cells)
FP8 = torch.float8_e4m3fn
GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)   # e2m1 magnitudes, docs/spec.md


def _inputs(op: str, cell: str) -> dict[str, torch.Tensor]:
    spec = CATALOG.ops[op]
    return build_case(spec, spec.cell(cell), torch.device("cpu")).inputs


def _e2m1(code: int) -> float:
    return -GRID[code & 7] if code & 8 else GRID[code & 7]


@pytest.mark.second_formulation("spec.cases.kv_storage:kv_fp8_op", "spec.ops.kv_storage:fp8_load")
@pytest.mark.parametrize("cell", ("decode_b32", "all_bf16_values"))
def test_kv_fp8_equals_torchs_float8_cast_after_the_clamp(cell):
    x = _inputs("kv_fp8", cell)["x"]
    assert x.dtype == torch.bfloat16
    got = kv_fp8_op(x)
    torch_codes = x.float().clamp(-448.0, 448.0).to(FP8).view(torch.uint8)
    assert torch.equal(got["codes"], torch_codes)
    table = torch.tensor(E4M3_TABLE, dtype=torch.float64)
    assert torch.equal(got["deq"].double(), table[got["codes"].long()])
    assert got["deq"].dtype == torch.bfloat16
    assert torch.equal(fp8_load((got["codes"].view(FP8),), torch.float32),
                       table[got["codes"].long()].float())
    # float64 inputs of the same values give the same bytes (their exact value is the same).
    assert torch.equal(kv_fp8_op(x.double())["codes"], torch_codes)
    # wrong: the other e4m3 format (fnuz: bias 8, largest finite 240) gives other bytes.
    fnuz = x.float().clamp(-240.0, 240.0).to(torch.float8_e4m3fnuz).view(torch.uint8)
    assert not torch.equal(fnuz, torch_codes)


def test_kv_fp8_special_values_as_the_prose_states():
    x = torch.tensor([-0.0, 0.0, math.inf, -math.inf, math.nan, 1e6, 2.0 ** -10, 2.0 ** -11])
    assert fp8_quantize(x).view(torch.uint8).tolist() == [0x80, 0x00, 0x7E, 0xFE, 0x7F, 0x7E,
                                                          0x00, 0x00]


def nvfp4_by_block(x: torch.Tensor, gs: float):
    """Bytes (two codes a byte, element 2i low) and scale bytes per row, and the dequantised
    values ``fp32(code * sf * gs)`` widened to float64, by the per-block reference in fp32."""
    rows = x.float().reshape(-1, x.shape[-1]).tolist()
    packed, scales, deq = [], [], []
    for row in rows:
        codes, sfb = nvfp4_reference(row, gs, fp32=True)
        packed.append([codes[i] | (codes[i + 1] << 4) for i in range(0, len(codes), 2)])
        scales.append(sfb)
        deq.append([_f32(_e2m1(c) * E4M3_TABLE[sfb[i // 16]] * gs) for i, c in enumerate(codes)])
    shape = x.shape
    return (torch.tensor(packed, dtype=torch.uint8).reshape(*shape[:-1], shape[-1] // 2),
            torch.tensor(scales, dtype=torch.uint8).reshape(*shape[:-1], shape[-1] // 16),
            torch.tensor(deq, dtype=torch.float64).reshape(shape))


@pytest.mark.second_formulation("spec.cases.kv_storage:kv_nvfp4_op",
                                "spec.ops.kv_storage:nvfp4_load")
@pytest.mark.parametrize("cell", ("decode_b32", "ties_pow2_gs"))
def test_kv_nvfp4_equals_the_per_block_quantiser_and_decode(cell):
    inp = _inputs("kv_nvfp4", cell)
    x, gs = inp["x"], inp["gs"]
    got = kv_nvfp4_op(x, gs)
    packed, sf, deq = nvfp4_by_block(x, float(gs))
    assert torch.equal(got["packed"], packed) and torch.equal(got["sf"], sf)
    # (code * sf) * gs rounds once in fp32 and then to bf16: bf16 of the fp32 value.
    assert torch.equal(got["deq"], deq.float().to(torch.bfloat16))
    load = functools.partial(nvfp4_load, gs=gs)
    assert torch.equal(load((got["packed"], got["sf"].view(FP8)), torch.float32), deq.float())
    # wrong: the nibbles swapped in every byte.
    swapped = (packed >> 4) | ((packed & 0xF) << 4)
    assert not torch.equal(got["packed"], swapped)


@pytest.mark.second_formulation("spec.ops.kv_storage:nvfp4_global_scale")
def test_nvfp4_global_scale_is_amax_over_6_times_448_in_fp32():
    # amax fp32 and 2688 = 6 x 448 exact: the float64 quotient of two fp32 values rounded to fp32 is
    # the correctly rounded quotient (53 >= 2 x 24 + 2), so _f32(a / 2688) is the definition.
    gen = torch.Generator().manual_seed(8)
    amax = (torch.rand(500, generator=gen) * torch.exp2(torch.randint(-20, 20, (500,),
                                                                      generator=gen))).tolist()
    for a in amax + [448.0 * 6, 1.0, 2.0 ** -30]:
        a = _f32(a)
        gs = nvfp4_global_scale(torch.tensor(a, dtype=torch.float32))
        assert gs.dtype == torch.float32 and float(gs) == _f32(a / 2688.0), a
    # with it, the largest block's scale is exactly 448 (byte 0x7E).
    x = torch.randn(4, 64, generator=gen)
    _, sf = nvfp4_quantize(x, nvfp4_global_scale(x.abs().max()))
    assert int(sf.view(torch.uint8).max()) == 0x7E
    with pytest.raises(ValueError):
        nvfp4_global_scale(0.0)


@pytest.mark.second_formulation("spec.ops.kv_storage:kv_bytes_per_token")
def test_kv_bytes_per_token_from_bits_per_element():
    bits = {"bf16": 16, "fp8": 8, "nvfp4": 4 + 8 / 16}        # nvfp4: a nibble + a scale byte / 16
    for heads, dim in ((2, 256), (1, 16), (3, 64)):
        for dtype, b in bits.items():
            assert kv_bytes_per_token(heads, dim, dtype) == 2 * heads * dim * b / 8, (dtype, heads)
    # docs/spec.md, "Geometry": the target's bf16 2048, fp8 1024, nvfp4 576.
    assert [kv_bytes_per_token(2, 256, d) for d in ("bf16", "fp8", "nvfp4")] == [2048, 1024, 576]
    with pytest.raises(ValueError):
        kv_bytes_per_token(2, 24, "nvfp4")
