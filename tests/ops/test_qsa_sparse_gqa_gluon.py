"""The Gluon nvfp4 decode kernel (impl/kernels/qsa/gluon_sparse_gqa.py) on a machine without a GPU.

Its numerics are certified on sm_90 only (Gluon has no interpreter: reports/receipts/sm_90.jsonl,
cell decode_b8_8k_nvfp4). What the CPU can check: that the host-side gathers of q and of the output
columns name exactly the elements the kernel's in-register reshape / permute puts on each logical
index (a mismatch would pair q with the wrong elements of K, or store o's columns in the wrong place,
and only the GPU receipt would notice), that the kernel compiles for sm_90 with every operand
conversion proved free of data movement (tools/sm90_compile_check.py), and that the wrapper refuses
what it cannot run."""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from impl.kernels.qsa import gluon_sparse_gqa as gsg
from spec.cases.qsa import sparse_gqa_case

ROOT = Path(__file__).resolve().parents[2]


def _kernel_view(x_phys: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """What ``_decoded_operand`` does to a [tokens, d] tile in physical order, in torch: split d into
    (byte, nibble) = the join of the decoder's low and high outputs, view one axis of 2 per bit,
    permute to the logical order, flatten."""
    n, d = x_phys.shape
    bytes_then_nibble = x_phys.reshape(n, d // 2, 2)          # d = 2 * byte + nibble
    split = bytes_then_nibble.reshape(gsg._SPLIT.value)
    return split.permute(order).reshape(n, d)


@pytest.mark.parametrize("which", ["K", "V"])
def test_logical_order_matches_the_host_tables(which: str) -> None:
    d = gsg.HEAD_DIM
    phys = torch.arange(d).repeat(gsg.TILE, 1)                  # each element holds its physical d
    order = gsg._K_ORDER.value if which == "K" else gsg._V_ORDER.value
    table = gsg._Q_PERM if which == "K" else gsg._O_PERM
    logical = _kernel_view(phys, order)
    assert sorted(table) == list(range(d))                     # a permutation
    assert torch.equal(logical, torch.tensor(table).repeat(gsg.TILE, 1))


def test_the_permuted_dot_is_the_dot() -> None:
    """QK over the logical order with q gathered by _Q_PERM equals QK in d order, and PV's logical
    columns land on d through _O_PERM: the algebra the kernel relies on, in float64."""
    gen = torch.Generator().manual_seed(7)
    d, n = gsg.HEAD_DIM, gsg.TILE
    q = torch.randn(12, d, generator=gen, dtype=torch.float64)
    k = torch.randn(n, d, generator=gen, dtype=torch.float64)
    v = torch.randn(n, d, generator=gen, dtype=torch.float64)
    p = torch.rand(12, n, generator=gen, dtype=torch.float64)
    k_log = _kernel_view(k, gsg._K_ORDER.value)
    q_log = q[:, torch.tensor(gsg._Q_PERM)]
    torch.testing.assert_close(q_log @ k_log.T, q @ k.T, rtol=1e-12, atol=1e-12)
    o_log = p @ _kernel_view(v, gsg._V_ORDER.value)
    o = torch.empty_like(o_log)
    o[:, torch.tensor(gsg._O_PERM)] = o_log                     # the kernel's store
    torch.testing.assert_close(o, p @ v, rtol=1e-12, atol=1e-12)


def _decode_case(kv: str):
    axes = dict(step="decode", batch=2, rows=2, context=256, kv_dtype=kv, act_dtype="bfloat16",
                q_heads=24, kv_heads=2, head_dim=256)
    return sparse_gqa_case(axes, torch.Generator().manual_seed(0), "cpu").inputs


def test_refuses_pages_other_than_nvfp4() -> None:
    case = _decode_case("fp8")
    with pytest.raises(ValueError, match="nvfp4 pages only"):
        gsg.gluon_decode(**case, out=torch.empty_like(case["q"]))


@pytest.mark.skipif(not triton_support.INTERPRETING, reason="the refusal is the interpreter's")
def test_refuses_the_interpreter_with_a_reason() -> None:
    case = _decode_case("nvfp4")
    with pytest.raises(ValueError, match="interpreter does not run Gluon"):
        gsg.gluon_decode(**case, out=torch.empty_like(case["q"]))


def test_compiles_for_sm90_with_free_operand_conversions(tmp_path) -> None:
    """Every ``convert_layout(..., assert_trivial=True)`` of the kernel is checked by the compiler:
    the decoded K and V tiles reach the tensor cores without a shared-memory round trip."""
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "tools/sm90_compile_check.py", "--op", "qsa_sparse_gqa",
                          "--sass"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert re.search(r"^OK\s+qsa_sparse_gqa::gluon_decode::decode_b8_8k_nvfp4", out.stdout, re.M), \
        out.stdout + out.stderr[-3000:]
