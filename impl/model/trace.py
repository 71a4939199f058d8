"""This target's reach tracer: one scenario -> the engine's forward at the target geometry, on meta
tensors (no memory, no GPU), with every op call recorded (``[tool.certify] tracer`` names ``TRACER``).

A scenario (certify/scenarios.yaml, validated by ``Scenario``) is one engine step and what follows it:
decode rows, prompt chunks (a context step, or a mixed step next to decode rows) or an MTP verify step
(K + 1 rows a request), each request at a stated length. The tracer builds that step as the engine
does (``Engine.step``: decode rows first in arrival order, then the prompt chunks; a 1-row chunk is a
decode row for the GDN layers) and runs ``Model.trunk`` over an ``EngineCache`` allocated on meta, its
requests holding their earlier tokens (positions and block keys set on the host planes, as if stored).
With speculation it then runs what ``Engine._after_verify`` / ``_after_trunk`` run: greedy
verification and the commit (``Model.commit_gdn`` and ``rollback_commit`` for the PLE history, planes
truncated to the accepted length), then ``Engine._draft``: the draft layer over the kept rows (with
IndexShare, the trunk's last QSA selection for them) and K - 1 one-row draft passes. Values do not exist
on meta, so acceptance is the scenario's ``accepted`` and ops that branch on values run their
shape-only stand-ins (``Ops(shape_only=True)``, and the spec's ``# meta:`` fast paths).

Video input. The target has no vision tower, so a scenario whose prompt chunks carry ``frames`` runs at
the tiny geometry (``model: tiny``, the model the engine serves frames for) in a multimodal engine. A
frame request's prompt is the frame task's: ``BOS``, then its placeholder run, then text. Its first
chunk (the one starting at token 0: the engine runs the tower when the request is submitted, before
that step) runs ``vision_tower`` through ``impl.model.vision.prepare_frames``, as ``Engine.submit``
does; the step then splices the tower's rows and rotates every row by the [3, N] mRoPE positions of
``impl.model.vision.step_inputs``, as ``Engine._trunk_pass`` does. The reach records only the calls of
the ops that video input alone dispatches (``impl.model.ops.MULTIMODAL_OPS``) from such a scenario:
the reach describes the target geometry, and the tiny trunk's other calls (hidden 128, 8 experts, ...)
lie outside the domains the op files declare for it.

One forward serves every mode: the forward runs the reference variants (the spec's paths, which have the
meta fast paths) and records each call's axes; the variant each (arch, batch-invariant) mode runs is then
chosen by a ``Dispatcher`` for that mode from the same calls. That is sound because the engine's op calls
and their axes never depend on the variant chosen (``Ops`` binds every variant in one calling
convention). A mode the engine would refuse (``engine_config.check`` for the scenario's configuration on
that arch) is recorded as refused with the rules' reasons, as ``Engine`` would refuse it.

The step construction mirrors engine.py's and is checked against it: tests/framework/test_reach.py runs
the real engine on the tiny geometry and compares the ops and axis names it dispatches with this
driver's on the same geometry.
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from functools import lru_cache
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from certify.catalog.load import Catalog
from certify.reach import Mode, ModeTrace
from certify.reach.scenarios import ScenarioBase
from certify.catalog.schema import EXACT, Variant
from impl.model.cache import PAGE, EngineCache, scrub_pages, truncate_planes
from impl.model.dispatch import DispatchError, Dispatcher, OpCall
from impl.model.engine_config import (EngineConfig, MoeBackend, RuleContext, SpeculativeConfig,
                                      check)
from impl.model.model import Model, Span, StepOutput, StepRows
from impl.model.ops import MULTIMODAL_OPS, Ops
from impl.model.vision import FramePrompt, prepare_frames, step_inputs, vision_geometry
from spec.config import ModelConfig
from spec.model import Weights, init_weights
from spec.ops.qsa import QsaPlanes
from spec.ops.vision import FRAME_TOKEN, VisionWeights, init_vision_weights

META = torch.device("meta")
_STATE = {"fp32": torch.float32, "bf16": torch.bfloat16}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Requests(_Strict):
    """``requests`` requests, each holding ``context`` tokens after the step."""

    requests: int = Field(ge=1)
    context: int = Field(ge=1)


class Chunk(_Strict):
    """One prompt chunk of ``chunk`` rows ending at token ``context`` of its prompt."""

    chunk: int = Field(ge=1)
    context: int = Field(ge=1)
    last: bool = Field(True, description="the chunk ends the prompt (a token is emitted; with "
                                         "speculation the request then drafts)")
    frames: int = Field(0, ge=0, description="video frames the request carries (0: none), their "
                                            "placeholder run right after its token 0 (BOS); needs "
                                            "a model with a vision tower (model: tiny)")

    @model_validator(mode="after")
    def _fits(self) -> Chunk:
        if self.chunk > self.context:
            raise ValueError(f"a chunk of {self.chunk} rows cannot end at token {self.context}")
        return self

    @property
    def start(self) -> int:
        return self.context - self.chunk

    def prompt(self, tokens_per_frame: int) -> tuple[int, ...]:
        """The request's prompt as far as the scenario sees it: BOS, the frame run, then text up to
        token ``context`` (one more when the chunk does not end the prompt)."""
        run = self.frames * tokens_per_frame
        n = max(self.context + (0 if self.last else 1), 1 + run + 1)
        return (1, *(FRAME_TOKEN,) * run, *(0,) * (n - 1 - run))


class Scenario(ScenarioBase):
    """One engine step of the target model (and, with speculation, the draft passes after it)."""

    decode: tuple[Requests, ...] = ()
    prefill: tuple[Chunk, ...] = ()
    verify: tuple[Requests, ...] = ()
    kv_dtype: Literal["bf16", "fp8", "nvfp4"] = "bf16"
    state_dtype: Literal["fp32", "bf16"] = "fp32"
    draft_length: int | None = Field(None, ge=1, le=7)
    accepted: int | None = Field(None, ge=0, le=7, description="verify: drafts accepted a request "
                                                               "(default: all)")
    index_share: bool = False
    gdn_commit: Literal["cached", "recompute"] = "cached"
    moe_backend: MoeBackend = "auto"
    max_num_tokens: int = Field(8192, ge=1)
    model: Literal["target", "tiny"] = Field("target", description=(
        "the geometry the step runs at: the target, or the tiny model (the one with a vision tower, "
        "for prompt chunks with frames)"))

    @model_validator(mode="after")
    def _one_engine_step(self) -> Scenario:
        if not (self.decode or self.prefill or self.verify):
            raise ValueError("a scenario needs decode, prefill or verify rows")
        k = self.draft_length
        if self.verify and not k:
            raise ValueError("verify rows need draft_length (K + 1 rows a request)")
        if self.verify and (self.decode or self.prefill):
            raise ValueError("a verify step holds verify rows only (the engine's verify steps wait "
                             "for prompts to finish)")
        if k and self.decode:
            raise ValueError("with speculation the engine never runs one-row decode steps: use verify")
        if self.accepted is not None and (not self.verify or self.accepted > k):
            raise ValueError("accepted applies to verify rows and is at most draft_length")
        if self.index_share and not k:
            raise ValueError("index_share needs speculation (draft_length)")
        for g in self.verify:
            if g.context < k + 1:
                raise ValueError(f"a verify request at context {g.context} cannot hold K + 1 rows")
        if self.rows > self.max_num_tokens:
            raise ValueError(f"the step's {self.rows} rows exceed max_num_tokens {self.max_num_tokens}")
        if self.multimodal:
            vision = vision_geometry(self.model)
            if vision is None:
                raise ValueError(f"frames need a model with a vision tower; the {self.model} model "
                                 f"has none (model: tiny)")
            for c in self.prefill:
                if c.frames and (c.frames > vision.max_frames or c.frames % vision.group):
                    raise ValueError(f"a request carries whole groups of {vision.group} frames, at "
                                     f"most {vision.max_frames}; got {c.frames}")
                if c.frames and c.last and c.context < 1 + c.frames * vision.tokens_per_frame + 1:
                    raise ValueError(f"a prompt of {c.context} tokens cannot hold BOS, the run of "
                                     f"{c.frames} frames and a text token")
        self.engine_config(Mode("cpu"))  # a field the engine's configuration refuses fails here
        return self

    @property
    def multimodal(self) -> bool:
        """Whether a request of the step carries frames (the engine serving it has video input)."""
        return any(c.frames for c in self.prefill)

    @property
    def rows(self) -> int:
        k1 = (self.draft_length or 0) + 1
        return (sum(g.requests for g in self.decode) + sum(c.chunk for c in self.prefill)
                + sum(g.requests for g in self.verify) * k1)

    @property
    def requests(self) -> int:
        return (sum(g.requests for g in self.decode) + len(self.prefill)
                + sum(g.requests for g in self.verify))

    @property
    def max_context(self) -> int:
        return max([g.context for g in (*self.decode, *self.verify)]
                   + [c.context for c in self.prefill])

    def engine_config(self, mode: Mode) -> EngineConfig:
        """The configuration an engine serving this step runs with, in ``mode``."""
        spec = (SpeculativeConfig(draft_length=self.draft_length, index_share=self.index_share)
                if self.draft_length else None)
        return EngineConfig(model=self.model, device="cuda" if mode.arch.startswith("sm_") else "cpu",
                            kv_cache_dtype=self.kv_dtype,
                            state_dtype=self.state_dtype, max_batch_size=self.requests,
                            max_num_tokens=self.max_num_tokens, max_seq_len=self.max_context,
                            speculative=spec, batch_invariant=mode.batch_invariant,
                            gdn_commit=self.gdn_commit, moe_backend=self.moe_backend,
                            multimodal=self.multimodal)


# ------------------------------------------------------------------------------------- the forward


@lru_cache(maxsize=2)
def _meta_model(model: str) -> tuple[ModelConfig, Weights]:
    cfg = EngineConfig(model=model).model_geometry()
    return cfg, init_weights(cfg, dtype=torch.bfloat16, device=META)


def _meta_vision(model: str, dtype: torch.dtype) -> VisionWeights:
    """The model's tower on meta (its shapes are what the tracer needs; the values do not exist)."""
    return init_vision_weights(vision_geometry(model), torch.Generator().manual_seed(0), dtype=dtype,
                               device=META)


class _ReferenceDispatcher(Dispatcher):
    """Chooses each op's reference variant (``impl: spec``) whatever the arch: the forward that records
    the calls runs the spec's paths, which run on meta; the modes' choices are made afterwards."""

    def candidates(self, name: str) -> list[Variant]:
        tier = self.numerics.get(name, EXACT)
        return [v for v in self.op(name).variants if v.impl == "spec" and v.numerics == tier]


def index_share_honoured() -> bool:
    """Whether the engine's model passes the trunk's selection to the draft layer (IndexShare)."""
    return ("selection" in StepOutput.__dataclass_fields__
            and len(inspect.signature(Model.draft).parameters) >= 6)


class _Forward:
    """One scenario's passes over a fresh meta cache, recording every op call."""

    def __init__(self, sc: Scenario, catalog: Catalog, cfg: ModelConfig, weights: Weights):
        self.sc, self.cfg, self.k = sc, cfg, sc.draft_length or 0
        self.d = _ReferenceDispatcher(catalog, "cpu", batch_invariant=True)
        self.model = Model(weights, cfg, Ops(self.d, shape_only=True), gdn_commit=sc.gdn_commit)
        self.ops = self.model.ops
        self.share = sc.index_share and index_share_honoured()
        # (slot, rows, start, GDN mode, ends its prompt) in the engine's row order: decode rows in
        # arrival order, then the prompt chunks (Engine._schedule); verify steps hold verify rows only.
        plan: list[tuple[int, int, int, str, bool]] = []
        # Per row group of the plan, (its chunk when it carries frames, else None; the engine's
        # scheduling mode).
        self.modes: list[tuple[Chunk | None, str]] = []
        for g in sc.decode:
            plan += [(len(plan) + i, 1, g.context - 1, "decode", True) for i in range(g.requests)]
            self.modes += [(None, "decode")] * g.requests
        for c in sc.prefill:  # a 1-row chunk is a decode row for the GDN layers (Engine.step)
            plan.append((len(plan), c.chunk, c.start, "decode" if c.chunk == 1 else "prefill", c.last))
            self.modes.append((c if c.frames else None, "prefill"))
        for g in sc.verify:
            plan += [(len(plan) + i, self.k + 1, g.context - self.k - 1, "verify", True)
                     for i in range(g.requests)]
            self.modes += [(None, "verify")] * g.requests
        self.plan = plan
        self.weights = weights
        self.cache = self._cache(weights)

    def _frame_prompt(self, c: Chunk) -> FramePrompt:
        """The chunk's request as ``Engine.submit`` prepares it: its frames through the tower, its
        rows and its prompt's mRoPE positions."""
        vision = vision_geometry(self.sc.model)
        tower = _meta_vision(self.sc.model, self.weights.dtype)
        frames = torch.empty(c.frames, vision.channels, vision.frame_size, vision.frame_size,
                             dtype=torch.float32, device=META)
        return prepare_frames(c.prompt(vision.tokens_per_frame), frames, tower, vision, self.ops)

    def _cache(self, weights: Weights) -> EngineCache:
        """A pool with the pages the requests hold (``Engine`` sizes it for max_seq_len a slot), each
        request holding its tokens before the step: pages taken and scrubbed as ``ensure_pages`` does,
        positions and block keys of the earlier tokens marked stored on the host planes."""
        sc, k = self.sc, self.k
        per_slot = -(-(sc.max_context + k + 1) // PAGE)
        need = sum(-(-(start + rows + k + 1) // PAGE) for _, rows, start, _, _ in self.plan)
        cache = EngineCache.allocate(self.cfg, len(self.plan), sc.max_context + k + 1, weights.dtype,
                                     sc.kv_dtype, _STATE[sc.state_dtype], META, with_mtp=bool(k),
                                     num_pages=min(need, len(self.plan) * per_slot))
        taken: list[int] = []
        for slot, rows, start, _, _ in self.plan:
            cache.assign(slot)
            taken += cache.pages.ensure(slot, start + rows)
            cache.lengths[slot] = cache.mtp_lengths[slot] = start
        planes = [*cache.qsa_indices(), None] if cache.mtp is not None else cache.qsa_indices()
        for i in planes:
            p = cache.layers[i] if i is not None else cache.mtp
            scrub_pages(p, taken)
            self._mark_stored(p, cache)
        return cache

    def _mark_stored(self, p: QsaPlanes, cache: EngineCache) -> None:
        pos, valid = p.pos_plane, p.block_key_valid
        table = cache.pages.block_table
        for slot, _, start, _, _ in self.plan:
            if start:
                t = torch.arange(start)
                pos[table[slot, t // PAGE].long(), t % PAGE] = t.to(pos.dtype)
                valid[table[slot, :start // PAGE].long()] = True

    breaks: _SpanwiseMarks | None = None   # where the trunk's spanwise parts run (piece_calls)
    read_out = True                        # the trunk reads out the rows that need logits

    def run(self, trunk_only: bool = False) -> list[OpCall]:
        # A frame request's tower call belongs to the step of its first chunk (Engine.submit runs it
        # just before); a later chunk's request ran it steps before, outside this step's trace.
        earlier = {i: self._frame_prompt(c) for i, (c, _) in enumerate(self.modes)
                   if c is not None and c.start > 0}
        self.d.start_trace()
        frames = [earlier[i] if i in earlier else self._frame_prompt(c) if c is not None else None
                  for i, (c, _) in enumerate(self.modes)]
        spans = [Span(slot, lo, lo + rows, start, mode) for (slot, rows, start, mode, _), lo in
                 zip(self.plan, _offsets([rows for _, rows, _, _, _ in self.plan]))]
        # The rows the engine reads logits for (Engine._trunk_pass): verify rows, decode rows and
        # the last row of a chunk that ends its prompt.
        logit_rows: list[int] = []
        for sp, (_, _, _, mode, last) in zip(spans, self.plan):
            if mode == "verify":
                logit_rows += list(range(sp.lo, sp.hi))
            elif mode == "decode" or last:
                logit_rows.append(sp.hi - 1)
        # Frame requests (Engine._trunk_pass): the tower's rows spliced at their placeholders, and
        # every row of the step rotated by [3, N] mRoPE positions.
        splice, rope = step_inputs([(fp, mode, sp.start, sp.rows)
                                    for fp, (_, mode), sp in zip(frames, self.modes, spans)])
        rows = StepRows.build(spans)
        rows.rope_positions = rope
        if self.breaks is not None:
            rows.breaks, self.breaks.rows = self.breaks, rows
        out = self.model.trunk(torch.zeros(sum(sp.rows for sp in spans), dtype=torch.int64),
                               rows, self.cache, logit_rows if self.read_out else [], splice)
        if trunk_only:
            return self.d.stop_trace()
        if self.sc.verify:
            self._after_verify(spans, out)
        elif self.k:  # a context step with speculation: the draft layer reads the chunks' rows
            self._draft([(sp, last) for sp, (_, _, _, _, last) in zip(spans, self.plan)], out)
        return self.d.stop_trace()

    def _after_verify(self, spans: list[Span], out: StepOutput) -> None:
        """``Engine._after_verify`` and ``_commit``: greedy verification, the commit of row
        ``accepted`` of every request, then the draft layer over the kept rows."""
        k, cache, ops = self.k, self.cache, self.ops
        R = len(spans)
        ops.greedy_verify(out.logits.view(R, k + 1, -1), torch.zeros(R, k, dtype=torch.int64),
                          torch.full((R,), k, dtype=torch.int64))
        a = self.sc.accepted if self.sc.accepted is not None else k
        num_accepted = torch.full((R,), a + 1, dtype=torch.int64)
        rec, slots = out.record, [sp.slot for sp in spans]
        self.model.commit_gdn(rec, cache, slots, num_accepted)
        ops.rollback_commit({"h": rec.ple_history[:len(slots)]}, num_accepted)
        for sp in spans:
            keep = sp.start + a + 1
            for li in cache.qsa_indices():
                truncate_planes(cache.layers[li], cache.pages.block_table[sp.slot], keep,
                                sp.start + sp.rows)
            cache.lengths[sp.slot] = keep
        self._draft([(Span(sp.slot, sp.lo, sp.lo + a + 1, sp.start, "prefill"), True) for sp in spans],
                    out)

    def _draft(self, items: list[tuple[Span, bool]], trunk: StepOutput) -> None:
        """``Engine._draft``: the draft layer reads the rows (h_t, x_{t+1}) (IndexShare: with the
        trunk's selection), then requests whose next token is known draft K - 1 more rows."""
        cache, k = self.cache, self.k
        spans, h_rows, sel_rows = [], [], []
        for (sp, _), lo in zip(items, _offsets([sp.rows for sp, _ in items])):
            if cache.mtp_lengths[sp.slot] > sp.start:  # the previous round's speculative rows
                truncate_planes(cache.mtp, cache.pages.block_table[sp.slot], sp.start,
                                cache.mtp_lengths[sp.slot])
                cache.mtp_lengths[sp.slot] = sp.start
            spans.append(Span(sp.slot, lo, lo + sp.rows, sp.start, "prefill"))
            h_rows.append(trunk.hidden[sp.lo:sp.hi])
            if self.share:
                sel_rows.append(trunk.selection[sp.lo:sp.hi])
        extra = (torch.cat(sel_rows),) if self.share else ()
        rows = StepRows.build(spans)
        finishing = [sp for sp, (_, last) in zip(spans, items) if last]
        out = self.model.draft(torch.cat(h_rows), torch.zeros(rows.rows, dtype=torch.int64), rows,
                               cache, extra[0] if extra else None, [sp.hi - 1 for sp in finishing])
        if not finishing:
            return
        h = torch.cat([out.hidden[sp.hi - 1:sp.hi] for sp in finishing])
        for _ in range(k - 1):
            step = [Span(sp.slot, j, j + 1, cache.mtp_lengths[sp.slot], "decode")
                    for j, sp in enumerate(finishing)]
            for sp in step:
                cache.ensure_pages(sp.slot, sp.start + 1)
            out = self.model.draft(h, torch.zeros(len(step), dtype=torch.int64), StepRows.build(step),
                                   cache)
            h = out.hidden


def _offsets(sizes: list[int]) -> list[int]:
    out, at = [], 0
    for n in sizes:
        out.append(at)
        at += n
    return out


def forward_calls(sc: Scenario, catalog: Catalog, cfg: ModelConfig | None = None,
                  weights: Weights | None = None, trunk_only: bool = False) -> list[OpCall]:
    """Every op call of the scenario's passes, in order (reference variants; see the module doc);
    with ``trunk_only`` the trunk pass's only. ``cfg`` / ``weights`` default to the scenario's
    geometry on meta (the driver test passes others)."""
    if cfg is None or weights is None:
        cfg, weights = _meta_model(sc.model)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # host-side index work on small tensors: threads only add overhead
    try:
        return _Forward(sc, catalog, cfg, weights).run(trunk_only)
    finally:
        torch.set_num_threads(threads)


class _SpanwiseMarks:
    """Runs the trunk's spanwise parts in line (over ``rows``, the step's), marking where in the
    dispatcher's trace each one's calls lie."""

    def __init__(self, d: Dispatcher):
        self.d = d
        self.rows: StepRows | None = None
        self.marks: list[tuple[int, int]] = []

    def run(self, fn, *tensors, shared=None):
        start = len(self.d.trace)
        out = fn(replace(self.rows, breaks=None), *tensors)
        self.marks.append((start, len(self.d.trace)))
        return out


def piece_calls(sc: Scenario, catalog: Catalog) -> list[OpCall]:
    """The op calls of the scenario's trunk pass outside its spanwise parts (``Model.spanwise``) and
    before its read-out: what a breakable prefill graph (impl/model/prefill_graphs.py) captures."""
    cfg, weights = _meta_model(sc.model)
    fw = _Forward(sc, catalog, cfg, weights)
    fw.breaks, fw.read_out = _SpanwiseMarks(fw.d), False
    calls = fw.run(trunk_only=True)
    inside = {i for a, b in fw.breaks.marks for i in range(a, b)}
    return [c for i, c in enumerate(calls) if i not in inside]


# ------------------------------------------------------------------------------------- the tracer


class Tracer:
    """``[tool.certify] tracer``: what certify.reach asks of a target."""

    scenario_model = Scenario

    def describe(self) -> dict:
        cfg = ModelConfig.target()
        kinds = cfg.layer_kinds()
        tiny, vision = ModelConfig.tiny(), vision_geometry("tiny")
        return {
            "forward": "impl.model.model.Model.trunk and Model.draft on meta tensors "
                       "(impl/model/trace.py)",
            "geometry": f"ModelConfig.target(): hidden {cfg.hidden}, {kinds.count('gdn')} GDN + "
                        f"{kinds.count('qsa')} QSA layers, {cfg.num_experts} experts, vocabulary "
                        f"{cfg.vocab_size}, bf16 weights",
            "geometry_frames": f"scenarios with frames (model: tiny): ModelConfig.tiny(), hidden "
                               f"{tiny.hidden}, with its vision tower ({vision.channels} x "
                               f"{vision.frame_size} x {vision.frame_size} frames, "
                               f"{vision.tokens_per_frame} tokens a frame, groups of {vision.group}), "
                               f"bf16 weights; only the calls of {', '.join(MULTIMODAL_OPS)} are "
                               f"recorded (the reach describes the target geometry)",
            "index_share": ("the draft layer takes the trunk's last QSA selection for the rows the "
                            "trunk computed" if index_share_honoured() else
                            "NOT honoured by the engine yet: scenarios with index_share trace as "
                            "without it"),
        }

    def trace(self, scenario: Scenario, catalog: Catalog, modes: list[Mode]) -> dict[str, ModeTrace]:
        cfg, _ = _meta_model(scenario.model)
        out: dict[str, ModeTrace] = {}
        runnable = []
        for mode in modes:
            refusals = check(scenario.engine_config(mode), RuleContext(cfg, catalog, mode.arch))
            if refusals:
                out[mode.key] = ModeTrace(refused="; ".join(map(str, refusals)))
            else:
                runnable.append(mode)
        if not runnable:
            return out
        calls = forward_calls(scenario, catalog)
        if scenario.model != "target":   # the target's reach: the tiny model's video ops only
            calls = [c for c in calls if c.op in MULTIMODAL_OPS]
        for mode in runnable:
            d = Dispatcher(catalog, mode.arch, batch_invariant=mode.batch_invariant,
                           pinned=scenario.engine_config(mode).pinned_variants())
            d.start_trace()
            no_variant: dict[str, str] = {}
            for c in calls:  # past a call no variant runs, to record what the others dispatch
                try:
                    d.choose(c.op, **dict(c.axes))
                except DispatchError as e:
                    no_variant.setdefault(c.op, str(e))
            out[mode.key] = ModeTrace(calls=[(c.op, c.variant, dict(c.axes)) for c in d.stop_trace()],
                                      no_variant=no_variant)
        return out


TRACER = Tracer()
