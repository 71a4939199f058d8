"""The rows kernel's tiling under CUDA-graph capture reads no value on the host and changes no bit.

Captured, ``row_tiles`` takes its bounds (a tile a row, a union of R x W tokens) instead of the
sizes it reads on the host eagerly. The tiles, their order and each union are the exact tiling's,
followed by empty places and tiles, so the kernel visits the same tokens in the same order: its
output must be the eager launch's bit for bit (docs/spec.md, "QSA").
"""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import torch

from certify.harness.target import run_variant
from impl.kernels.qsa import triton_sparse_gqa
from impl.kernels.qsa.triton_sparse_gqa import row_tiles, triton_rows
from spec.cases.qsa import sparse_gqa_case

AXES = {"step": "verify", "batch": 2, "rows": 8, "context": 2048, "kv_dtype": "bfloat16",
        "act_dtype": "bfloat16", "q_heads": 24, "kv_heads": 2, "head_dim": 256}


def _case():
    return sparse_gqa_case(AXES, torch.Generator().manual_seed(31), torch.device("cpu"))


def test_static_tiles_are_the_exact_tiles_then_empty_ones():
    x = _case().inputs
    n, w = x["tokens"].shape
    exact = row_tiles(x["tokens"], x["seq_ids"], 4)
    static = row_tiles(x["tokens"], x["seq_ids"], 4, static=True)
    t, u = exact[2].shape
    assert static[0].shape == (n, 4) and static[2].shape == (n, 4 * w)
    assert torch.equal(static[0][:t], exact[0]) and (static[0][t:] == -1).all()
    assert torch.equal(static[1][:t], exact[1])
    assert torch.equal(static[2][:t, :u], exact[2]) and (static[2][:, u:] == -1).all()
    assert torch.equal(static[3][:t, :, :u], exact[3]) and (static[3][:, :, u:] == 0).all()
    assert torch.equal(static[4][:t], exact[4]) and (static[4][t:] == 0).all()


def test_the_captured_tiling_gives_the_eager_bits(monkeypatch):
    case = _case()
    eager = run_variant(triton_rows, case)["out"]
    monkeypatch.setattr(triton_sparse_gqa, "graph_capturing", lambda t: True)
    captured = run_variant(triton_rows, case)["out"]
    assert torch.equal(captured.view(torch.int16), eager.view(torch.int16))
