"""A request's state as a hand-off from a context engine, and its adoption by a generation engine.

A hand-off is taken after the context engine has read the whole prompt and emitted the first token
(and, when it drafts, drafted d_1..d_K). It carries exactly the request's state:

- the request, the tokens emitted so far, the pending token, the drafts, the lengths the trunk and
  the draft layer have stored;
- for every QSA layer, and the MTP draft layer when the context engine drafts: the pages the request
  holds, one part per transfer role (impl/model/disagg/roles.py: K and V, their block scales with
  nvfp4 KV, the side planes packed or one part each);
- for every GDN layer the slot's recurrent state and conv window, and the slot's PLE n-gram history;
- when only the generation engine drafts: the trunk's hidden rows of the prompt (and, with
  IndexShare, its last QSA layer's selection rows), which the generation engine's draft layer reads
  as an aggregated engine's reads them after each prompt chunk (``Engine.draft_prompt``).

Its form: a manifest (JSON-able: the request and tokens, the sender's storage and draft layer, its
transfer roles, and the parts by name, dtype and shape, in payload order) and one uint8 payload of
the parts' bytes. ``extract`` gathers the request's pages and slot entries (bytes in proportion to
the request, none in proportion to the pools). ``adopt`` first checks the hand-off against the
generation engine (``TransferRejected`` names the field at fault and the engine is left as it was),
then gives the request a free slot and fresh pages and writes every part into them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from pydantic import ValidationError

from impl.model.admission import Request, RequestRejected, validate_request
from impl.model.cache import EngineCache, GDNPool
from impl.model.disagg.roles import PAGE, SIDE_PLANES, TransferRoles, transfer_roles
from spec.ops.qsa import QsaPlanes, selection_width

if TYPE_CHECKING:
    from impl.model.engine import Engine, Sequence

FORMAT = 1
# the storage fields of a manifest a receiving engine must match, besides the geometry
STORAGE_FIELDS = ("model_dtype", "kv_cache_dtype", "state_dtype", "tokens_per_block")


class TransferRejected(ValueError):
    """A hand-off the receiving engine cannot continue; ``field`` names what does not match."""

    def __init__(self, request_id: str, field: str, reason: str):
        self.request_id = request_id
        self.field = field
        self.reason = reason
        super().__init__(f"hand-off of request {request_id!r} rejected: {field}: {reason}")


@dataclass
class Handoff:
    manifest: dict
    payload: torch.Tensor      # uint8 [manifest["payload_bytes"]], on the sender's device

    @property
    def request_id(self) -> str:
        return str(self.manifest.get("request", {}).get("request_id", "?"))

    @property
    def done(self) -> bool:
        return bool(self.manifest.get("done"))


@dataclass(frozen=True)
class Part:
    """One named tensor of a hand-off: ``read(slot, pages)`` from a cache, ``write(slot, pages,
    value)`` into one (absent for the prompt rows, which no cache holds)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    read: Callable[[int, torch.Tensor], torch.Tensor] | None = None
    write: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def as_data(self) -> dict:
        return {"name": self.name, "dtype": str(self.dtype).removeprefix("torch."),
                "shape": list(self.shape)}


def _on(t: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    return pages.to(t.device)


def _as_bytes(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(rows, -1)


def _from_bytes(b: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    b = b.reshape(-1)                         # one row of bytes, whatever the strides were
    if b.storage_offset() % dtype.itemsize:   # a wider dtype's view starts on its own alignment
        b = b.clone()
    return b.view(dtype).reshape(shape)


def _kv_pools(planes: QsaPlanes, kv_cache_dtype: str) -> dict[str, torch.Tensor]:
    if kv_cache_dtype == "nvfp4":
        return {"k_codes": planes.k_cache[0], "k_scales": planes.k_cache[1],
                "v_codes": planes.v_cache[0], "v_scales": planes.v_cache[1]}
    return {"k": planes.k_cache, "v": planes.v_cache}


def _paged_part(name: str, pool: torch.Tensor, n_pages: int) -> Part:
    def read(slot, pages):
        return pool[_on(pool, pages)]

    def write(slot, pages, value):
        pool[_on(pool, pages)] = value.to(pool.device)
    return Part(name, pool.dtype, (n_pages, *pool.shape[1:]), read, write)


def _packed_side_part(name: str, planes: QsaPlanes, n_pages: int) -> Part:
    """The side planes of a page as one record: index | positions | block key | valid flag."""
    pools = [getattr(planes, p) for p in SIDE_PLANES]
    widths = [math.prod(p.shape[1:]) * p.dtype.itemsize for p in pools]

    def read(slot, pages):
        return torch.cat([_as_bytes(p[_on(p, pages)], len(pages)).to(pools[0].device)
                          for p in pools], dim=1)

    def write(slot, pages, value):
        for pool, chunk in zip(pools, value.split(widths, dim=1)):
            pool[_on(pool, pages)] = _from_bytes(chunk, pool.dtype,
                                                 (len(pages), *pool.shape[1:])).to(pool.device)
    return Part(name, torch.uint8, (n_pages, sum(widths)), read, write)


def _layer_parts(prefix: str, planes: QsaPlanes, roles: TransferRoles, n_pages: int) -> list[Part]:
    kv = _kv_pools(planes, roles.kv_cache_dtype)
    parts = []
    for role in roles.roles:
        name = f"{prefix}.{role.name}"
        if role.planes == SIDE_PLANES:
            parts.append(_packed_side_part(name, planes, n_pages))
        else:
            (plane,) = role.planes
            pool = kv[plane] if plane in kv else getattr(planes, plane)
            parts.append(_paged_part(name, pool, n_pages))
    return parts


def _slot_part(name: str, pool: torch.Tensor) -> Part:
    def read(slot, pages):
        return pool[slot]

    def write(slot, pages, value):
        pool[slot] = value.to(pool.device)
    return Part(name, pool.dtype, tuple(pool.shape[1:]), read, write)


def cache_parts(cache: EngineCache, roles: TransferRoles, n_pages: int, draft_layer: bool
                ) -> list[Part]:
    """The parts of one request's cache state, in payload order: every layer's (QSA pages by
    role, or the GDN state and conv window), the draft layer's pages (``draft_layer``), the PLE
    history."""
    parts: list[Part] = []
    for li, layer in enumerate(cache.layers):
        if isinstance(layer, GDNPool):
            parts += [_slot_part(f"layer{li}.gdn_state", layer.state),
                      _slot_part(f"layer{li}.conv_window", layer.conv)]
        else:
            parts += _layer_parts(f"layer{li}", layer, roles, n_pages)
    if draft_layer:
        parts += _layer_parts("mtp", cache.mtp, roles, n_pages)
    parts.append(_slot_part("ple_history", cache.ple_history))
    return parts


def row_parts(cache: EngineCache, prompt_len: int, hidden: bool, selection: bool) -> list[Part]:
    """The prompt's trunk rows a drafting generation engine reads: hidden [L, C] in the trunk's
    accumulation dtype, and the selection rows [L, W] (int64) with IndexShare."""
    cfg = cache.cfg
    parts = []
    if hidden:
        acc = torch.float64 if cache.act == torch.float64 else torch.float32
        parts.append(Part("prompt_hidden", acc, (prompt_len, cfg.hidden)))
    if selection:
        width = selection_width(cfg.top_k_blocks, cfg.sink_blocks, cfg.local_blocks)
        parts.append(Part("prompt_selection", torch.int64, (prompt_len, width)))
    return parts


def roles_of(cache: EngineCache) -> TransferRoles:
    return transfer_roles(cache.cfg, cache.kv_dtype, cache.act)


def storage_of(engine: Engine) -> dict:
    """What the receiver must match: the geometry, the storage fields, the draft layer."""
    c = engine.config
    return json.loads(json.dumps({
        "geometry": engine.cfg.model_dump(mode="json"),
        **{f: getattr(c, f) for f in STORAGE_FIELDS},
        "draft_length": engine.k, "index_share": engine.index_share}))


def _pack(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    flat = [t.contiguous().view(torch.uint8).reshape(-1).to(device) for t in tensors]
    return torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8, device=device)


def extract(engine: Engine, seq: Sequence) -> Handoff:
    """The hand-off of ``seq`` (prompt read, first token emitted; or finished), read from
    ``engine``'s cache. Nothing in the engine changes: ``Engine.detach`` frees the slot."""
    request = seq.request
    manifest = {"format": FORMAT, "request": request.model_dump(mode="json"),
                "done": seq.done, "output": list(seq.output), "pending": seq.pending,
                "drafts": list(seq.drafts), "storage": storage_of(engine)}
    device = engine.weights.device
    if seq.done:
        manifest.update(parts=[], payload_bytes=0)
        return Handoff(json.loads(json.dumps(manifest)), _pack([], device))
    if seq.in_prompt:
        raise ValueError(f"request {request.request_id!r} has read {seq.prompt_done} of its "
                         f"{len(request.prompt)} prompt tokens; a hand-off follows the whole "
                         f"prompt")
    cache = engine.cache
    n_pages = cache.pages.held[seq.slot]
    pages = torch.tensor(cache.pages.pages_of(seq.slot), dtype=torch.int64)
    roles = roles_of(cache)
    parts = cache_parts(cache, roles, n_pages, draft_layer=bool(engine.k))
    values = [p.read(seq.slot, pages) for p in parts]
    if seq.prompt_rows:
        hidden = torch.cat([h for h, _ in seq.prompt_rows])
        selection = [s for _, s in seq.prompt_rows if s is not None]
        parts += row_parts(cache, len(request.prompt), True, bool(selection))
        values += [hidden] + ([torch.cat(selection).to(torch.int64)] if selection else [])
    for part, value in zip(parts, values):
        if value.dtype != part.dtype or tuple(value.shape) != part.shape:
            raise AssertionError(f"{part.name}: read {value.dtype} {tuple(value.shape)}, its part "
                                 f"says {part.dtype} {part.shape}")
    manifest.update(
        length=cache.lengths[seq.slot], mtp_length=cache.mtp_lengths[seq.slot], pages=n_pages,
        roles=roles.as_data(), parts=[p.as_data() for p in parts],
        payload_bytes=sum(p.nbytes for p in parts))
    return Handoff(json.loads(json.dumps(manifest)), _pack(values, device))


# ------------------------------------------------------------------------------ the receiver


def _check_storage(engine: Engine, m: dict, rid: str) -> None:
    theirs, ours = m.get("storage") or {}, storage_of(engine)
    if theirs.get("geometry") != ours["geometry"]:
        diff = sorted(k for k in ours["geometry"]
                      if (theirs.get("geometry") or {}).get(k) != ours["geometry"][k])
        raise TransferRejected(rid, "geometry", f"the sender's model geometry differs in "
                                                f"{', '.join(diff) or 'its fields'}")
    for f in STORAGE_FIELDS:
        if theirs.get(f) != ours[f]:
            raise TransferRejected(rid, f, f"the hand-off is stored as {theirs.get(f)!r}; this "
                                           f"engine stores {ours[f]!r}")


def _check_drafting(engine: Engine, m: dict, rid: str) -> tuple[bool, bool, bool]:
    """(draft-layer pages, hidden rows, selection rows) the hand-off must carry for this engine."""
    sent_k, sent_share = m["storage"].get("draft_length", 0), m["storage"].get("index_share")
    names = {p.get("name") for p in m.get("parts", [])}
    if sent_k:
        if (sent_k, sent_share) != (engine.k, engine.index_share):
            raise TransferRejected(rid, "draft layer", (
                f"the context engine drafted with draft_length {sent_k} and index_share "
                f"{sent_share}; this engine drafts with draft_length {engine.k} and index_share "
                f"{engine.index_share}" if engine.k else
                f"the context engine drafted (draft_length {sent_k}); this engine does not draft"))
        return True, False, False
    if engine.k and "prompt_hidden" not in names:
        raise TransferRejected(rid, "draft layer", "this engine drafts, and the hand-off carries "
                               "neither a draft layer's pages nor the prompt rows its draft layer "
                               "reads (the context engine's peer does not speculate)")
    if not engine.k and "prompt_hidden" in names:
        raise TransferRejected(rid, "draft layer", "the hand-off carries prompt rows for a draft "
                               "layer; this engine does not draft")
    return False, bool(engine.k), engine.index_share


def check(engine: Engine, handoff: Handoff) -> tuple[Request, list[Part]]:
    """The request and the parts to write, or ``TransferRejected`` for the first mismatch."""
    m, rid = handoff.manifest, handoff.request_id
    if m.get("format") != FORMAT:
        raise TransferRejected(rid, "format", f"hand-off format {m.get('format')!r}; this engine "
                                              f"reads format {FORMAT}")
    try:
        request = Request.model_validate(m.get("request"))
    except ValidationError as e:
        raise TransferRejected(rid, "request", f"not a request: {e.errors()[0]['msg']}") from None
    _check_storage(engine, m, rid)
    if any(s.request.request_id == rid for s in engine.running.values()):
        raise TransferRejected(rid, "request_id", "is already being served")
    if m.get("done"):
        return request, []
    try:
        validate_request(request, engine.cfg, engine.config)
    except RequestRejected as e:
        raise TransferRejected(rid, e.field, e.reason) from None
    draft_pages, hidden, selection = _check_drafting(engine, m, rid)
    ours = roles_of(engine.cache).as_data()
    if m.get("roles") != ours:
        raise TransferRejected(rid, "roles", f"the sender registers {m.get('roles')}; this engine "
                                             f"registers {ours}")
    cache, L = engine.cache, len(request.prompt)
    if m.get("length") != L:
        raise TransferRejected(rid, "length", f"the trunk stored {m.get('length')} tokens of a "
                                              f"{L}-token prompt; a hand-off follows the prompt")
    n_pages = m.get("pages")
    need = -(-max(L, m.get("mtp_length", 0)) // PAGE)
    if not isinstance(n_pages, int) or not need <= n_pages <= cache.pages.pages_per_slot:
        raise TransferRejected(rid, "pages", f"{n_pages!r} pages for {L} stored tokens; this "
                                             f"engine gives a request {need} to "
                                             f"{cache.pages.pages_per_slot} pages")
    if n_pages > len(cache.pages.free):
        raise TransferRejected(rid, "pages", f"needs {n_pages} pages; {len(cache.pages.free)} are "
                                             f"free")
    parts = cache_parts(cache, roles_of(cache), n_pages, draft_pages)
    parts += row_parts(cache, L, hidden, selection)
    want = [p.as_data() for p in parts]
    if m.get("parts") != want:
        got = m.get("parts") or []
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got),
                                                                                  len(want)))
        raise TransferRejected(rid, "parts", f"part {first} is "
                                             f"{got[first] if first < len(got) else 'missing'}; "
                                             f"this engine reads "
                                             f"{want[first] if first < len(want) else 'no more'}")
    size = sum(p.nbytes for p in parts)
    if m.get("payload_bytes") != size or handoff.payload.numel() != size:
        raise TransferRejected(rid, "payload", f"{handoff.payload.numel()} bytes; the parts hold "
                                               f"{size}")
    return request, parts


def adopt(engine: Engine, handoff: Handoff) -> Sequence:
    """Continue a handed-off request in ``engine``: check it (``TransferRejected``, nothing
    changed), give it a free slot and pages, write its state; returns its ``Sequence``, running
    from the next step. A hand-off of a finished request returns it finished, taking nothing."""
    from impl.model.engine import Sequence

    request, parts = check(engine, handoff)
    m = handoff.manifest
    seq = Sequence(request, 0, prompt_done=len(request.prompt), output=list(m["output"]),
                   pending=m["pending"], drafts=list(m["drafts"]), done=bool(m["done"]))
    if seq.done:
        return seq
    slot = engine.attach(seq)
    cache = engine.cache
    cache.ensure_pages(slot, m["pages"] * PAGE)
    pages = torch.tensor(cache.pages.pages_of(slot), dtype=torch.int64)
    rows: dict[str, torch.Tensor] = {}
    offset = 0
    for part in parts:
        chunk = handoff.payload[offset:offset + part.nbytes]
        offset += part.nbytes
        value = _from_bytes(chunk, part.dtype, part.shape)
        if part.write is None:
            rows[part.name] = value
        else:
            part.write(slot, pages, value)
    cache.lengths[slot] = m["length"]
    cache.mtp_lengths[slot] = m["mtp_length"]
    if "prompt_hidden" in rows:
        engine.draft_prompt(seq, rows["prompt_hidden"], rows.get("prompt_selection"))
    return seq
