"""The spec's ``# meta:`` fast paths (shapes only, for the reach tracer) give what the full path gives
in shape and dtype, and the engine's shape-only stand-ins (``Ops(shape_only=True)``) match the spec ops
they stand for. On the CPU the fast paths never run, so numerics are untouched."""

from __future__ import annotations

import pytest
import torch

from certify.catalog.load import load_catalog
from certify.harness.target import build_case, resolve
from certify.files.paths import project_paths
from impl.model.ops import _moe_shape_only, _select_shape_only
from spec.config import ModelConfig
from spec.model import init_weights
from spec.numerics import rowwise_matmul
from spec.ops import moe as spec_moe
from spec.ops import qsa
from spec.ops.ple import ple_ngram_hash

CATALOG = load_catalog(project_paths().cells)
META = torch.device("meta")


def _meta(x):
    """Floating tensors move to meta; integer and bool tensors (the host-side bookkeeping: block
    tables, positions, flags) stay on the CPU, as the engine keeps them."""
    if isinstance(x, torch.Tensor) and x.dtype.is_floating_point:
        return x.to(META)
    if isinstance(x, tuple):
        return tuple(_meta(t) for t in x)
    return x


def _shapes(res) -> dict:
    if isinstance(res, torch.Tensor):
        res = {"out": res}
    elif isinstance(res, tuple):
        res = dict(enumerate(res))
    return {k: (tuple(v.shape), v.dtype) for k, v in res.items() if isinstance(v, torch.Tensor)}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _rows(axes: dict) -> int:
    """The work a cell's CPU run costs, roughly: its row-like axes multiplied."""
    n = 1
    for name in ("rows", "tokens", "batch", "seq_len"):
        n *= axes.get(name, 1)
    return n


@pytest.mark.parametrize("op_name", ["gdn_decode", "gdn_verify", "gdn_prefill", "gdn_gates",
                                     "hc_first_projection", "hc_up_projection", "sinkhorn",
                                     "qsa_index_store", "qsa_index_scores", "qsa_sparse_gqa"])
def test_a_meta_fast_path_keeps_shapes_and_dtypes(op_name):
    op = CATALOG.ops[op_name]
    cell = min(op.cells, key=lambda c: _rows(op.axes_of(c)))
    case = build_case(op, cell, torch.device("cpu"))
    spec = resolve(op.spec)
    cpu = spec(**{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in case.inputs.items()})
    meta = spec(**{k: _meta(v) for k, v in case.inputs.items()})
    assert _shapes(meta) == _shapes(cpu)
    assert all(t.device.type == "meta" for t in (meta.values() if isinstance(meta, dict) else
                                                 meta if isinstance(meta, tuple) else [meta])
               if isinstance(t, torch.Tensor) and t.dtype.is_floating_point)


def test_rowwise_matmul_on_meta():
    a, b = torch.randn(5, 7), torch.randn(7, 3)
    assert rowwise_matmul(a.to(META), b.to(META)).shape == rowwise_matmul(a, b).shape == (5, 3)


def test_ngram_hash_on_meta_ids():
    cfg = init_weights(ModelConfig.tiny(), seed=0).ple.hash_cfg
    ids, hist = torch.arange(5), torch.tensor([0, 0])
    assert ple_ngram_hash(ids.to(META), hist, cfg).shape == ple_ngram_hash(ids, hist, cfg).shape


def test_the_selection_stand_in_has_the_canonical_shape_and_count():
    """The window plus the lowest candidates: the real selection's shape and per-row count."""
    positions = torch.tensor([0, 31, 32, 95, 100, 2047, 4095, 131071])
    stand_in = _select_shape_only(positions, 64, 1, 2)
    scores = torch.randn(len(positions), 131072 // 32, generator=torch.Generator().manual_seed(0))
    real = qsa.qsa_select(scores, positions, 64, 1, 2)
    assert stand_in.shape == real.shape and stand_in.dtype == real.dtype
    assert torch.equal((stand_in >= 0).sum(1), (real >= 0).sum(1))


def test_the_moe_stand_in_has_the_blocks_shape():
    cfg = ModelConfig.tiny()
    w = init_weights(cfg, seed=0, dtype=torch.bfloat16).layers[0].moe
    u = torch.randn(3, cfg.hidden).to(torch.bfloat16)
    real = spec_moe.moe(u, w.router, w.experts, w.shared, cfg.moe_top_k)
    meta_w = init_weights(cfg, dtype=torch.bfloat16, device="meta").layers[0].moe
    stand_in = _moe_shape_only(u.to(META), meta_w, cfg.moe_top_k)
    assert (stand_in.shape, stand_in.dtype) == (real.shape, real.dtype)
