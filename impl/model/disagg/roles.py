"""The transfer roles of a disaggregated pair, as data: which paged records a hand-off carries for
every QSA layer (and the MTP draft layer), their bytes, and whether the side planes travel packed.

A **role** is one kind of record a transfer registers per page: the K and V codes (and, with nvfp4
KV, their e4m3 block scales), split by KV heads when ranks split them; and the side planes (the
index plane, the position plane, the block keys and their valid flags), which every rank holding the
layer holds whole. A rank registers one region per role, and pools of one page size are grouped
together (the KV pool's rule), so a side record must never have the page size of a K/V or
block-scale record: on a layout where it had, its pages would be grouped with the K/V pages.

**Side-plane packing.** The side planes travel as one packed record a page (index | positions |
block key | valid flag) when any of them could have the page size of a K/V or block-scale record at
*some* split of the KV heads over ranks (every divisor of ``num_kv_heads`` heads a rank may hold),
and as one record each otherwise. Deciding over every split, not the split of the rank that computes
it, makes the decision the same on every tensor-parallel / attention-DP layout (TP1, TP2, ADP2), so
peers of different layouts register the same roles; a rank-local decision would pack on one layout
and not on another (``side_plane_collides`` at the rank's own heads differs between TP1 and TP2 for
fp8 KV at the tiny and the target geometry, and for nvfp4 KV at the target). At both geometries the
side planes are packed for fp8 and nvfp4 KV, never for bf16.

``transfer_roles`` returns the roles; a hand-off carries them (``TransferRoles.as_data``) and the
receiving engine compares them with its own before it reads a byte (impl/model/disagg/handoff.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spec.config import ModelConfig
from spec.ops.kv_storage import NVFP4_BLOCK
from spec.ops.qsa import TOKENS_PER_BLOCK

PAGE = TOKENS_PER_BLOCK

# the side planes of a QSA layer, in packed-record order (fields of spec.ops.qsa.QsaPlanes)
SIDE_PLANES = ("index_plane", "pos_plane", "block_keys", "block_key_valid")


@dataclass(frozen=True)
class Layout:
    """How ranks split the model: ``tensor_parallel`` ranks; with ``attention_dp`` the attention
    layers run data-parallel (every rank holds every KV head), else the ranks split the KV heads."""

    name: str
    tensor_parallel: int = 1
    attention_dp: bool = False

    def kv_heads_per_rank(self, cfg: ModelConfig) -> int:
        if self.attention_dp:
            return cfg.num_kv_heads
        if self.tensor_parallel < 1 or cfg.num_kv_heads % self.tensor_parallel:
            raise ValueError(f"layout {self.name}: tensor_parallel {self.tensor_parallel} does not "
                             f"split num_kv_heads {cfg.num_kv_heads} evenly")
        return cfg.num_kv_heads // self.tensor_parallel


TP1 = Layout("TP1")
TP2 = Layout("TP2", tensor_parallel=2)
ADP2 = Layout("ADP2", tensor_parallel=2, attention_dp=True)


@dataclass(frozen=True)
class Role:
    """One paged record: the planes it carries, in order, and its bytes a page (a K/V role's bytes
    are one KV head's; a rank's record holds its heads)."""

    name: str
    planes: tuple[str, ...]
    page_bytes: int
    per_kv_head: bool

    def rank_page_bytes(self, kv_heads: int) -> int:
        return self.page_bytes * kv_heads if self.per_kv_head else self.page_bytes


@dataclass(frozen=True)
class TransferRoles:
    kv_cache_dtype: str
    side_packed: bool
    roles: tuple[Role, ...]

    def as_data(self) -> dict:
        """The roles as JSON-able data (what a hand-off's manifest carries)."""
        return {"kv_cache_dtype": self.kv_cache_dtype, "side_packed": self.side_packed,
                "roles": [{"name": r.name, "planes": list(r.planes), "page_bytes": r.page_bytes,
                           "per_kv_head": r.per_kv_head} for r in self.roles]}


def kv_plane_bytes(cfg: ModelConfig, kv_cache_dtype: str) -> dict[str, int]:
    """Plane -> bytes of one KV head's page: the K and V codes, and the block scales with nvfp4."""
    dh = cfg.head_dim
    if kv_cache_dtype == "nvfp4":
        codes, scales = PAGE * dh // 2, PAGE * dh // NVFP4_BLOCK
        return {"k_codes": codes, "v_codes": codes, "k_scales": scales, "v_scales": scales}
    width = {"bf16": 2, "fp8": 1}.get(kv_cache_dtype)
    if width is None:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not a KV storage format "
                         f"(bf16, fp8, nvfp4)")
    return {"k": PAGE * dh * width, "v": PAGE * dh * width}


def side_plane_bytes(cfg: ModelConfig, act: torch.dtype) -> dict[str, int]:
    """Side plane -> bytes of its page (activation-dtype index rows and block key, int32 positions,
    a one-byte valid flag)."""
    width = act.itemsize
    return {"index_plane": PAGE * cfg.index_dim * width, "pos_plane": PAGE * 4,
            "block_keys": cfg.index_dim * width, "block_key_valid": 1}


def head_splits(cfg: ModelConfig) -> list[int]:
    """Every number of KV heads a rank may hold: num_kv_heads over each of its divisors."""
    n = cfg.num_kv_heads
    return [n // d for d in range(1, n + 1) if n % d == 0]


def side_plane_collides(cfg: ModelConfig, kv_cache_dtype: str, act: torch.dtype,
                        kv_heads: int) -> bool:
    """Whether a side plane's page has the size of a K/V or block-scale page of a rank holding
    ``kv_heads`` heads (a rank-local view: ``side_planes_packed`` asks it of every split)."""
    kv = {b * kv_heads for b in kv_plane_bytes(cfg, kv_cache_dtype).values()}
    return any(b in kv for b in side_plane_bytes(cfg, act).values())


def side_planes_packed(cfg: ModelConfig, kv_cache_dtype: str, act: torch.dtype) -> bool:
    """The packing decision: whether a side plane could collide at any split of the KV heads."""
    return any(side_plane_collides(cfg, kv_cache_dtype, act, h) for h in head_splits(cfg))


def transfer_roles(cfg: ModelConfig, kv_cache_dtype: str, act: torch.dtype,
                   layout: Layout = TP1) -> TransferRoles:
    """The roles a rank of ``layout`` registers for one QSA layer's pages: the same for every
    layout of the geometry (the layout is checked against the geometry, and decides nothing)."""
    layout.kv_heads_per_rank(cfg)
    kv = [Role(name, (name,), b, True) for name, b in kv_plane_bytes(cfg, kv_cache_dtype).items()]
    side_bytes = side_plane_bytes(cfg, act)
    packed = side_planes_packed(cfg, kv_cache_dtype, act)
    if packed:
        side = [Role("side", SIDE_PLANES, sum(side_bytes.values()), False)]
    else:
        side = [Role(name, (name,), side_bytes[name], False) for name in SIDE_PLANES]
    for h in head_splits(cfg):
        kv_sizes = {r.rank_page_bytes(h) for r in kv}
        clash = [r for r in side if r.page_bytes in kv_sizes]
        if clash:
            raise ValueError(f"the side record {clash[0].name} has {clash[0].page_bytes} bytes a "
                             f"page, the size of a K/V record of a rank holding {h} KV head(s), "
                             f"even packed: this geometry has no collision-free side-plane "
                             f"layout")
    return TransferRoles(kv_cache_dtype, packed, tuple(kv + side))
