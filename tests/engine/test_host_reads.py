"""An eager decode step reads no device value on the host, and an eager verify step only the two of
qsa_sparse_gqa's row tiling a QSA layer. On a GPU each such read (``.item()``,
``int(t)``, ``bool(t)``, a nonzero or unique whose size the host needs) waits for every kernel queued
before it, so the host stops queueing the step's next layers until the GPU catches up. Here the
engine runs the GPU kernels' bindings on the CPU (Triton's interpreter arch first, as
tests/engine/test_kernel_bindings.py does) while a dispatch mode records every host read made in
the trunk of a decode or verify step, with the project frames it came from. Host-to-device copies
are not seen on the CPU; tests/engine/test_engine_gpu.py checks both under torch's sync debug
mode on the GPU."""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import traceback
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from impl.model.model import Model
from tests.engine import test_engine as engine_tests
from tests.engine.test_kernel_bindings import InterpreterFirst

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter arch is the CPU's")

ROOT = Path(__file__).resolve().parents[2]
# aten ops whose result the host must read from the device (a value, or a size that depends on values)
HOST_READS = frozenset({"_local_scalar_dense", "nonzero", "unique", "_unique", "_unique2",
                        "unique_dim", "unique_consecutive", "masked_select"})
# reads that run for host tensors only, never on a GPU's: the Triton QK norm + RoPE checks the
# positions' range when they are on the CPU (impl/kernels/norms/triton_qk_norm_rope.py)
CPU_ONLY = ("impl/kernels/norms/triton_qk_norm_rope.py",)


class HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in HOST_READS:
            frames = [f for f in traceback.extract_stack()
                      if f.filename.startswith(str(ROOT)) and "/tests/" not in f.filename]
            where = [f"{Path(f.filename).relative_to(ROOT)}:{f.lineno}" for f in frames[-3:]]
            if not (where and where[-1].startswith(CPU_ONLY)):
                self.seen.append((name, " <- ".join(reversed(where))))
        return func(*args, **(kwargs or {}))


# The one read left in eager steps: qsa_sparse_gqa's row tiling (rows of one request share a tile,
# as in a verify step) sizes its launch from the tile count and the widest union of a tile's
# selections, two reads a QSA layer; a captured step tiles statically instead
# (impl/kernels/qsa/triton_sparse_gqa.py, row_tiles). Decode steps tile nothing.
TILING = "impl/kernels/qsa/triton_sparse_gqa.py"


@pytest.mark.parametrize("kv,k", [("bf16", None), ("fp8", None), ("nvfp4", None), ("bf16", 3)])
def test_eager_decode_and_verify_steps_read_no_device_value(weights, kv, k, monkeypatch):
    trunk = Model.trunk
    reads = HostReads()
    kinds: list[str] = []

    def watched(self, ids, rows, *args, **kwargs):
        if rows.kind not in ("decode", "verify"):
            return trunk(self, ids, rows, *args, **kwargs)
        kinds.append(rows.kind)
        with reads:
            return trunk(self, ids, rows, *args, **kwargs)

    monkeypatch.setattr(Model, "trunk", watched)
    e = engine_tests._engine(weights, kv=kv, k=k, invariant=False)
    e.dispatcher = e.model.ops.d = InterpreterFirst(e.dispatcher.catalog, "cpu")
    e.generate(engine_tests._requests([21, 21, 21, 21], new=4))
    assert kinds and set(kinds) == ({"verify"} if k else {"decode"}), kinds
    assert ("triton_rows" if k else "triton_decode") in e.dispatcher.variants_ran()["qsa_sparse_gqa"]
    tiling = [r for r in reads.seen if r[1].startswith(TILING)]
    others = [r for r in reads.seen if r not in tiling]
    assert not others, f"{len(others)} host reads in {len(kinds)} {kinds[0]} steps: {others[:3]}"
    qsa_layers = sum(lw.kind == "qsa" for lw in weights.layers)
    assert len(tiling) == (2 * qsa_layers * len(kinds) if k else 0), tiling[:4]
