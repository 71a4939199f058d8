"""The transfer roles and the side-plane packing (impl/model/disagg/roles.py) are the same on every
tensor-parallel / attention-DP layout, so peers of different layouts register the same roles; the
packing keeps every side record off the page sizes of the K/V and block-scale records."""

from __future__ import annotations

import pytest
import torch

from impl.model.disagg.roles import (ADP2, TP1, TP2, Layout, head_splits, side_plane_collides,
                                     side_planes_packed, transfer_roles)
from spec.config import ModelConfig

GEOMETRIES = {"tiny": ModelConfig.tiny(), "target": ModelConfig.target()}
KV = ("bf16", "fp8", "nvfp4")
BF16 = torch.bfloat16


@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_roles_and_packing_are_equal_on_tp1_tp2_and_adp2(geometry, kv):
    cfg = GEOMETRIES[geometry]
    roles = {layout.name: transfer_roles(cfg, kv, BF16, layout) for layout in (TP1, TP2, ADP2)}
    assert roles["TP1"] == roles["TP2"] == roles["ADP2"], roles
    assert len({str(r.as_data()) for r in roles.values()}) == 1


@pytest.mark.parametrize("geometry,kv", [("tiny", "fp8"), ("target", "fp8"), ("target", "nvfp4")])
def test_a_rank_local_decision_would_differ_between_layouts(geometry, kv):
    """What the layout-independent decision guards against: asked of the rank's own heads only, the
    collision check answers differently on TP1 (2 heads a rank) and TP2 (1 head a rank)."""
    cfg = GEOMETRIES[geometry]
    tp1 = side_plane_collides(cfg, kv, BF16, TP1.kv_heads_per_rank(cfg))
    tp2 = side_plane_collides(cfg, kv, BF16, TP2.kv_heads_per_rank(cfg))
    adp2 = side_plane_collides(cfg, kv, BF16, ADP2.kv_heads_per_rank(cfg))
    assert tp1 != tp2 and adp2 == tp1


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_side_planes_are_packed_for_fp8_and_nvfp4_never_for_bf16(geometry):
    cfg = GEOMETRIES[geometry]
    assert [side_planes_packed(cfg, kv, BF16) for kv in KV] == [False, True, True]
    names = [r.name for r in transfer_roles(cfg, "bf16", BF16).roles]
    assert names == ["k", "v", "index_plane", "pos_plane", "block_keys", "block_key_valid"]
    names = [r.name for r in transfer_roles(cfg, "nvfp4", BF16).roles]
    assert names == ["k_codes", "v_codes", "k_scales", "v_scales", "side"]


@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_no_side_record_has_a_kv_page_size_on_any_layout(geometry, kv):
    cfg = GEOMETRIES[geometry]
    roles = transfer_roles(cfg, kv, BF16).roles
    for heads in head_splits(cfg):
        kv_sizes = {r.rank_page_bytes(heads) for r in roles if r.per_kv_head}
        side_sizes = {r.rank_page_bytes(heads) for r in roles if not r.per_kv_head}
        assert not kv_sizes & side_sizes, (heads, kv_sizes, side_sizes)


def test_the_page_bytes_are_the_geometrys():
    """Tiny geometry (head_dim 64, index_dim 32, bf16 activations), one KV head's page of 32 tokens:
    fp8 K 32 x 64 = 2048 bytes, the index plane 32 x 32 x 2 = 2048 (the TP2 collision); the packed
    side record 2048 + 128 positions + 64 block key + 1 flag = 2241."""
    cfg = GEOMETRIES["tiny"]
    roles = {r.name: r for r in transfer_roles(cfg, "fp8", BF16).roles}
    assert roles["k"].page_bytes == 2048 and roles["k"].rank_page_bytes(2) == 4096
    assert roles["side"].page_bytes == 2241 and roles["side"].rank_page_bytes(2) == 2241


def test_a_layout_that_does_not_split_the_heads_is_refused():
    with pytest.raises(ValueError, match="layout TP3: tensor_parallel 3 does not split "
                                         "num_kv_heads 2 evenly"):
        transfer_roles(GEOMETRIES["tiny"], "fp8", BF16, Layout("TP3", tensor_parallel=3))


def test_a_kv_dtype_that_is_no_storage_format_is_named():
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8' is not a KV storage format"):
        transfer_roles(GEOMETRIES["tiny"], "int8", BF16)
