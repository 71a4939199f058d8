"""The FlashInfer wrappers (impl/kernels/gdn/flashinfer_ops.py) against a stand-in for flashinfer that
implements the contract the module's docstring states, with the spec in float64: K-major decode state
updated in place, V-major prefill state, grouped value heads, raw gates for decode and alpha = exp(g)
for prefill, l2norm inside for decode and in the wrapper for prefill, o rounded to bf16; the prefill
stand-in computes the bf16_operands tier's path (the tier the prefill variant claims). The stand-in checks every shape, dtype and layout it
is given, so the wrappers are certified on the CPU against the contract; whether FlashInfer keeps
that contract is for the sm_90 receipts (the cell files' flashinfer variants) to say.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from certify.catalog.load import load_op_file
from certify.harness.extended import certify_cell
from certify.files.paths import project_paths
from impl.kernels.gdn import flashinfer_ops
from spec.ops import gdn

BF16 = torch.bfloat16


def _check(x: torch.Tensor, shape: tuple, dtype: torch.dtype, name: str) -> None:
    assert tuple(x.shape) == tuple(shape), f"{name}: shape {tuple(x.shape)}, contract {shape}"
    assert x.dtype == dtype, f"{name}: {x.dtype}, contract {dtype}"
    assert x.is_contiguous(), f"{name}: not contiguous"


def _decode(q, k, v, state, A_log, a, dt_bias, b, scale=None, output=None, use_qk_l2norm=True):
    B, _, H, K = q.shape
    HV, V = v.shape[2:]
    assert HV % H == 0 and scale is None and use_qk_l2norm and output is None
    for x, shape, dtype, name in ((q, (B, 1, H, K), BF16, "q"), (k, (B, 1, H, K), BF16, "k"),
                                  (v, (B, 1, HV, V), BF16, "v"), (a, (B, 1, HV), BF16, "a"),
                                  (b, (B, 1, HV), BF16, "b"), (A_log, (HV,), torch.float32, "A_log"),
                                  (dt_bias, (HV,), torch.float32, "dt_bias"),
                                  (state, (B, HV, K, V), torch.float32, "state")):
        _check(x, shape, dtype, name)
    g, beta = gdn.gdn_gates(a.double(), b.double(), A_log.double(), dt_bias.double())
    o, _, final = gdn.gdn_recurrent(q.double(), k.double(), v.double(), g, beta, state.double(),
                                    record=False)
    state.copy_(final)                       # K-major, in place
    return o.to(BF16), state


def _prefill(state_layout: str):
    def run(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
            use_qk_l2norm_in_kernel, output, output_state):
        N, H, K = q.shape
        HV, V = v.shape[1:]
        seqs = cu_seqlens.numel() - 1
        assert scale is None and output_final_state and not use_qk_l2norm_in_kernel
        for x, shape, dtype, name in ((q, (N, H, K), BF16, "q"), (k, (N, H, K), BF16, "k"),
                                      (v, (N, HV, V), BF16, "v"), (g, (N, HV), torch.float32, "g"),
                                      (beta, (N, HV), torch.float32, "beta"),
                                      (initial_state, (seqs, HV, V, K), torch.float32, "state"),
                                      (output, (N, HV, V), BF16, "output")):
            _check(x, shape, dtype, name)
        assert cu_seqlens.dtype == torch.int32
        for i in range(seqs):
            lo, hi = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
            s0 = initial_state[i].double()
            s0 = s0.transpose(-1, -2) if state_layout == "V-major" else s0
            # the bf16_operands tier's path on the q, k it was given (normalised, bf16)
            o, final = gdn.gdn_chunked_bf16_operands(
                q[None, lo:hi].double(), k[None, lo:hi].double(), v[None, lo:hi].double(),
                g[None, lo:hi].double().log(), beta[None, lo:hi].double(), s0[None],
                skip=frozenset({"qk_operands"}))
            output[lo:hi] = o[0].to(BF16)
            final = final[0].transpose(-1, -2) if state_layout == "V-major" else final[0]
            output_state[i] = final.float()
        return output, output_state
    return run


@pytest.fixture
def flashinfer_stand_in(monkeypatch):
    def install(state_layout: str = "V-major"):
        pkg = types.ModuleType("flashinfer")
        dec = types.ModuleType("flashinfer.gdn_decode")
        pre = types.ModuleType("flashinfer.gdn_prefill")
        dec.gated_delta_rule_decode = _decode
        pre.chunk_gated_delta_rule = _prefill(state_layout)
        pkg.gdn_decode, pkg.gdn_prefill = dec, pre
        for name, mod in (("flashinfer", pkg), ("flashinfer.gdn_decode", dec),
                          ("flashinfer.gdn_prefill", pre)):
            monkeypatch.setitem(sys.modules, name, mod)
    return install


def _cell(op, cell_id):
    return next(c for c in op.cells if c.id == cell_id)


def test_decode_wrapper_keeps_the_contract_and_the_cells_bands(flashinfer_stand_in):
    flashinfer_stand_in()
    op = load_op_file(project_paths().cells / "gdn_decode.yaml")
    for cell_id in ("b1_fp32",):
        out = certify_cell(op, "flashinfer", _cell(op, cell_id), "cpu",
                           impl_override=flashinfer_ops.gdn_decode)
        assert out.status == "passed", out.message
        assert out.metrics["out.ulp"] <= 2


def test_decode_wrapper_refuses_a_bf16_pool(flashinfer_stand_in):
    flashinfer_stand_in()
    op = load_op_file(project_paths().cells / "gdn_decode.yaml")
    out = certify_cell(op, "flashinfer", _cell(op, "b32_bf16"), "cpu",
                       impl_override=flashinfer_ops.gdn_decode)
    assert out.status == "error" and "fp32 state" in out.message


def test_prefill_wrapper_keeps_the_contract_and_the_cells_bands(flashinfer_stand_in):
    flashinfer_stand_in()
    op = load_op_file(project_paths().cells / "gdn_prefill.yaml")
    out = certify_cell(op, "flashinfer_chunked", _cell(op, "short_t37"), "cpu",
                       impl_override=flashinfer_ops.gdn_prefill_chunked)
    assert out.status == "passed", out.message


def test_a_stand_in_with_the_other_state_layout_fails_the_oracle(flashinfer_stand_in):
    """The check bites: the same wrapper against a stand-in reading the state K-major (the decode
    layout) fails the state band, so a wrapper that forgot the transpose would fail too."""
    flashinfer_stand_in("K-major")
    op = load_op_file(project_paths().cells / "gdn_prefill.yaml")
    out = certify_cell(op, "flashinfer_chunked", _cell(op, "short_t37"), "cpu",
                       impl_override=flashinfer_ops.gdn_prefill_chunked)
    assert out.status == "failed", out.message
