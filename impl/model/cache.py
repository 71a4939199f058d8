"""The engine's per-request state: slots, a paged KV cache with its QSA planes, the GDN state pool.

- **Slots**: a request holds one slot (0 .. max_batch_size - 1) from admission to completion. The slot
  indexes the GDN state pool, the conv windows, the PLE n-gram history and its block-table row.
- **Pages**: 32-token pages (one QSA block each) from one free list shared by every request. The block
  table [slots, pages per request] maps a request's logical block b to a physical page (-1 = none);
  pages are taken when a step first writes a block and returned when the request finishes. Every QSA
  layer (and the MTP draft layer) has its own pools indexed by the same page: K and V (bf16, fp8, or
  nvfp4 codes + e4m3 scales), the index plane and block keys (activation dtype), the position plane and
  the block-key valid flags (on the pools' device; on the host when the pools are meta tensors, as
  the reach tracer's shape-only ops read them).
- A page is **scrubbed** when it is given to a request: positions -1, block key invalid, floating
  slots NaN (so a read of a slot this request never wrote poisons the result instead of reading the
  previous owner's data).
- **GDN state pool** per GDN layer: [slots, HV, d_k, d_v] in the state dtype (fp32 or bf16) and the
  conv window [slots, channels, 3] in the activation dtype; zeroed when a slot is assigned.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spec.config import ModelConfig
from spec.ops.kv_storage import FP8_DTYPE, NVFP4_BLOCK
from spec.ops.qsa import TOKENS_PER_BLOCK, QsaPlanes

PAGE = TOKENS_PER_BLOCK


def kv_pool_dtype(kv_dtype: str, act: torch.dtype) -> torch.dtype:
    """The element dtype of a bf16 / fp8 pool (nvfp4 pools are uint8 codes + e4m3 scales). In float64
    (reference) mode a 'bf16' pool stores float64, as spec/model.py does."""
    if kv_dtype == "bf16":
        return act if act == torch.float64 else torch.bfloat16
    if kv_dtype == "fp8":
        return FP8_DTYPE
    raise ValueError(f"kv_dtype {kv_dtype!r} has no single pool dtype")


def new_planes(cfg: ModelConfig, num_pages: int, act: torch.dtype, kv_dtype: str,
               device: torch.device) -> QsaPlanes:
    """Empty planes of one QSA layer over ``num_pages`` pages (every page scrubbed)."""
    nkv, dh, di = cfg.num_kv_heads, cfg.head_dim, cfg.index_dim

    def pool(width: int, dtype: torch.dtype) -> torch.Tensor:
        if dtype == torch.uint8:
            return torch.zeros(num_pages, PAGE, nkv, width, dtype=dtype, device=device)
        return torch.full((num_pages, PAGE, nkv, width), float("nan"), device=device).to(dtype)

    def kv():
        if kv_dtype == "nvfp4":
            return (pool(dh // 2, torch.uint8), pool(dh // NVFP4_BLOCK, FP8_DTYPE))
        return pool(dh, kv_pool_dtype(kv_dtype, act))

    nan = float("nan")
    # The position plane and the block-key flags live with the pools; over meta pools (the reach
    # tracer) they stay on the host, where the shape-only ops read them as values.
    flags = torch.device("cpu") if torch.device(device).type == "meta" else device
    return QsaPlanes(
        k_cache=kv(), v_cache=kv(),
        pos_plane=torch.full((num_pages, PAGE), -1, dtype=torch.int32, device=flags),
        index_plane=torch.full((num_pages, PAGE, di), nan, dtype=act, device=device),
        block_keys=torch.full((num_pages, di), nan, dtype=act, device=device),
        block_key_valid=torch.zeros(num_pages, dtype=torch.bool, device=flags))


def scrub_pages(planes: QsaPlanes, pages: list[int]) -> None:
    """Empty ``pages`` of every plane, in place: positions -1, keys invalid, floats NaN. Only those
    pages are written, so taking a page costs a page, not the pools' size."""
    if not pages:
        return

    index: dict[torch.device, torch.Tensor] = {}

    def idx(t: torch.Tensor) -> torch.Tensor:  # the pages, once per device
        if t.device not in index:
            index[t.device] = torch.tensor(pages, dtype=torch.long, device=t.device)
        return index[t.device]

    def poison(pool):
        if isinstance(pool, tuple):
            for p in pool:
                poison(p)
            return
        fill = 0 if pool.dtype == torch.uint8 else float("nan")
        pool[idx(pool)] = torch.tensor(fill, device=pool.device).to(pool.dtype)

    for pool in (planes.k_cache, planes.v_cache, planes.index_plane, planes.block_keys):
        poison(pool)
    planes.pos_plane.index_fill_(0, idx(planes.pos_plane), -1)
    planes.block_key_valid.index_fill_(0, idx(planes.block_key_valid), False)


def truncate_planes(planes: QsaPlanes, block_table_row: torch.Tensor, keep: int, upto: int) -> None:
    """Forget tokens ``keep .. upto - 1`` of one request (rollback), in place: their positions become
    -1 and the key of every block that loses a token is removed (docs/spec.md, "Rollback / commit").
    The K / V and index slots keep their bytes: no row reads a position it has not stored."""
    for b in range(keep // PAGE, (upto - 1) // PAGE + 1) if upto > keep else ():
        page = int(block_table_row[b])
        if page < 0:
            continue
        lo = max(keep - b * PAGE, 0)
        hi = min(upto - b * PAGE, PAGE)
        planes.pos_plane[page, lo:hi] = -1
        planes.block_key_valid[page] = False


class OutOfPages(RuntimeError):
    pass


@dataclass
class PagePool:
    """The free list of pages and the block table of every slot. A slot holds its pages as a
    prefix of its table row (blocks 0 .. held - 1): ``ensure`` extends it, ``release`` empties it,
    so a step's bookkeeping costs the pages it takes, not the pages the slot already holds."""

    num_pages: int
    slots: int
    pages_per_slot: int
    free: list[int] = field(default_factory=list)
    block_table: torch.Tensor = field(init=False)
    held: list[int] = field(init=False)

    def __post_init__(self) -> None:
        # Pages are handed out from the top down, so a page index rarely equals a block index.
        self.free = list(range(self.num_pages))
        self.block_table = torch.full((self.slots, self.pages_per_slot), -1, dtype=torch.int32)
        self.held = [0] * self.slots

    def pages_of(self, slot: int) -> list[int]:
        return self.block_table[slot, :self.held[slot]].tolist()

    def ensure(self, slot: int, length: int) -> list[int]:
        """Give ``slot`` pages for tokens 0 .. length - 1; returns the newly taken pages."""
        need = -(-length // PAGE)
        if need > self.pages_per_slot:
            raise OutOfPages(f"slot {slot}: {length} tokens need {need} pages, more than the "
                             f"{self.pages_per_slot} a request may hold")
        first = self.held[slot]
        if need <= first:
            return []
        if need - first > len(self.free):
            raise OutOfPages(f"slot {slot}: no free page for block {first + len(self.free)}")
        taken = [self.free.pop() for _ in range(need - first)]
        self.block_table[slot, first:need] = torch.tensor(taken, dtype=torch.int32)
        self.held[slot] = need
        return taken

    def release(self, slot: int) -> list[int]:
        pages = self.pages_of(slot)
        self.free.extend(reversed(pages))
        self.block_table[slot, :self.held[slot]] = -1   # the rest of the row is -1 already
        self.held[slot] = 0
        return pages


@dataclass
class GDNPool:
    """One GDN layer's recurrent state and conv window for every slot, and with the cached GDN
    commit (impl/model/model.py) the buffer a verify step writes the state after each of its rows
    into: [slots, rows a request, HV, K, V]. Eager steps and every captured verify graph share the
    buffer, so a verify step's record costs it once, whatever the number of graphs; commit reads it
    before the next trunk pass."""

    state: torch.Tensor
    conv: torch.Tensor
    verify_states: torch.Tensor | None = None

    def reset(self, slot: int) -> None:
        self.state[slot] = 0
        self.conv[slot] = 0

    def verify_scratch(self, requests: int, rows: int) -> torch.Tensor | None:
        """[requests, rows, HV, K, V], contiguous, in the verify buffer; None without one, or when
        the step holds more requests or rows than it was sized for."""
        buf = self.verify_states
        if buf is None or requests > buf.shape[0] or rows > buf.shape[1]:
            return None
        return buf.view(-1)[:requests * rows * buf[0, 0].numel()].view(requests, rows,
                                                                          *buf.shape[2:])


@dataclass
class EngineCache:
    """Every piece of per-request state the engine holds, for ``slots`` slots."""

    cfg: ModelConfig
    act: torch.dtype
    kv_dtype: str
    state_dtype: torch.dtype
    pages: PagePool
    layers: list[GDNPool | QsaPlanes]
    mtp: QsaPlanes | None
    ple_history: torch.Tensor                 # int64 [slots, 2], host side
    lengths: list[int]                        # tokens the trunk has stored, per slot
    mtp_lengths: list[int]                    # rows the draft layer has stored, per slot

    @classmethod
    def allocate(cls, cfg: ModelConfig, slots: int, max_seq_len: int, act: torch.dtype,
                 kv_dtype: str, state_dtype: torch.dtype, device: torch.device,
                 with_mtp: bool, num_pages: int | None = None,
                 verify_rows: int = 0) -> EngineCache:
        """``num_pages``: the size of the shared page pool; default every slot at ``max_seq_len`` (the
        reach tracer gives a step only the pages its requests hold: a 128-slot pool at 131K tokens
        would be a gigabyte of host-side position planes for shapes alone). ``verify_rows``: the
        rows a request verifies in a step (K + 1), for each GDN layer's verify buffer; 0: none."""
        pages_per_slot = -(-max_seq_len // PAGE)
        num_pages = slots * pages_per_slot if num_pages is None else num_pages
        store = torch.float64 if act == torch.float64 else state_dtype
        layers: list[GDNPool | QsaPlanes] = []
        for kind in cfg.layer_kinds():
            if kind == "gdn":
                layers.append(GDNPool(
                    torch.zeros(slots, cfg.gdn_value_heads, cfg.gdn_d_k, cfg.gdn_d_v, dtype=store,
                                device=device),
                    torch.zeros(slots, cfg.gdn_conv_channels, cfg.gdn_conv_kernel - 1, dtype=act,
                                device=device),
                    torch.empty(slots, verify_rows, cfg.gdn_value_heads, cfg.gdn_d_k,
                                cfg.gdn_d_v, dtype=store, device=device) if verify_rows else None))
            else:
                layers.append(new_planes(cfg, num_pages, act, kv_dtype, device))
        mtp = new_planes(cfg, num_pages, act, kv_dtype, device) if with_mtp else None
        return cls(cfg, act, kv_dtype, store, PagePool(num_pages, slots, pages_per_slot), layers,
                   mtp, torch.full((slots, 2), cfg.pad_id, dtype=torch.int64), [0] * slots,
                   [0] * slots)

    def qsa_indices(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if isinstance(layer, QsaPlanes)]

    def assign(self, slot: int) -> None:
        """A fresh request takes ``slot``: zero state, pad history, no pages, no tokens."""
        for layer in self.layers:
            if isinstance(layer, GDNPool):
                layer.reset(slot)
        self.ple_history[slot] = self.cfg.pad_id
        self.lengths[slot] = 0
        self.mtp_lengths[slot] = 0

    def ensure_pages(self, slot: int, length: int) -> None:
        """Pages for ``length`` tokens of ``slot``; newly taken pages are scrubbed in every plane."""
        taken = self.pages.ensure(slot, length)
        if taken:
            for i in self.qsa_indices():
                scrub_pages(self.layers[i], taken)
            if self.mtp is not None:
                scrub_pages(self.mtp, taken)

    def release(self, slot: int) -> None:
        self.pages.release(slot)
        self.lengths[slot] = 0
        self.mtp_lengths[slot] = 0
