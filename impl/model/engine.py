"""The engine: requests and slots, step scheduling, chunked prefill, MTP speculation with rollback.

``Engine(config, weights)`` refuses an unsupported configuration before building anything (the rules of
``engine_config``), then allocates the slots, the page pool and the state pools. ``generate(requests)``
admits each request on its own (a bad one is reported and the others run), then steps until every
admitted request is done and returns, per request, its tokens and statistics.

Scheduling (deterministic: the same requests give the same steps):
- A waiting request takes the lowest free slot, in arrival order.
- Without speculation a step holds one decode row for every request past its prompt, then chunks of
  the prompts still being read, in arrival order, up to ``max_num_tokens`` rows (a **mixed** step
  when both kinds are present). A chunk ends at the budget or the prompt's end; without chunked
  prefill a prompt is only scheduled whole.
- With speculation (draft length K) a step is either a **context** step (prompt chunks only) or a
  **verify** step (K+1 rows for every request past its prompt): while a prompt is being read the
  verifying requests wait, so every verify step has the shape the verify cells certify.
- After a context chunk the draft layer reads the chunk's rows (h_t, x_{t+1}); at the end of a
  prompt it drafts d_1..d_K. After a verify step: greedy acceptance (``greedy_verify``), commit of the
  accepted row (``Model.commit_gdn``: GDN state and conv window, by ``EngineConfig.gdn_commit``;
  ``rollback_commit``: PLE history; the KV, index and block-key planes truncated), the draft layer's
  speculative rows rolled back, then it reads the accepted rows and drafts again.

Video input (``EngineConfig.multimodal``, impl/model/vision.py): a request's frames run through the
vision tower once, when it is submitted; each context step splices the tower's rows at the prompt's
placeholder rows it reads, and every row of a step holding a frame request rotates by [3, N] mRoPE
positions (the prompt's, then the sequence index plus the request's delta).

With ``cuda_graphs`` the trunk of a decode step (every row a decode row) or of a verify step
replays a captured graph of its batch bucket (impl/model/graphs.py); with ``prefill_graph:
breakable`` the trunk of a context or mixed step replays the graph of its token bucket, its
spanwise parts run eagerly between the graph's pieces (impl/model/prefill_graphs.py); other steps,
and what follows a trunk (acceptance, commit, the draft layer), run eagerly.

Disaggregated serving (impl/model/disagg/) moves a request between engines after its prompt:
``detach`` frees its slot on the context engine, ``attach`` gives it one on the generation engine,
and ``draft_prompt`` lets a generation engine's draft layer read a prompt its peer's trunk read.

Greedy decoding only (admission refuses sampling). The per-step logits of every model pass can be
logged (``log_calls``) so a test can replay the same passes through spec/model.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from impl.model.admission import Request, RequestRejected, admit, validate_request
from impl.model.cache import EngineCache, GDNPool, truncate_planes
from impl.model.dispatch import Dispatcher
from impl.model.engine_config import (ConfigRefused, EngineConfig, Refusal, RoutePlan,
                                      default_context, engine_memory, route, verify_rows)
from impl.model.graphs import StepGraphs
from impl.model.memory import FITS_RULE, FITS_STATEMENT, memory_shortfall
from impl.model.prefill_graphs import PrefillGraphs
from impl.model.model import Model, Span, StepOutput, StepRows
from impl.model.ops import Ops
from impl.model.placement import HostMapped, with_host_ple_tables
from impl.model.vision import FramePrompt, prepare_frames, step_inputs, vision_geometry
from spec.config import ModelConfig
from spec.model import Weights
from spec.ops.mtp import acceptance_length, greedy_argmax
from spec.ops.vision import VisionWeights

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


@dataclass
class Sequence:
    """A request while it runs."""

    request: Request
    arrival: int
    slot: int | None = None
    prompt_done: int = 0                 # prompt tokens the trunk has stored
    output: list[int] = field(default_factory=list)
    pending: int | None = None           # emitted, not yet stored by the trunk
    drafts: list[int] = field(default_factory=list)
    draft_hidden: torch.Tensor | None = None
    accepted: list[int] = field(default_factory=list)   # num_accepted per verify step
    done: bool = False
    # The trunk's rows of the prompt (hidden [n, C], selection [n, W] or None) per chunk, kept by a
    # context engine for a generation peer whose draft layer reads them (impl/model/disagg/).
    prompt_rows: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)
    frames: FramePrompt | None = None    # the tower's rows and the prompt's mRoPE positions

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.request.prompt

    @property
    def in_prompt(self) -> bool:
        return self.prompt_done < len(self.prompt)


@dataclass
class GenerationResult:
    request_id: str
    tokens: list[int] = field(default_factory=list)
    error: str | None = None
    num_accepted: list[int] = field(default_factory=list)

    @property
    def acceptance_length(self) -> float | None:
        return acceptance_length(self.num_accepted) if self.num_accepted else None


@dataclass
class GenerationReport:
    results: dict[str, GenerationResult]
    steps: int
    generated_tokens: int
    seconds: float
    step_kinds: dict[str, int]
    variants: dict[str, list[str]]

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else float("inf")

    @property
    def acceptance_length(self) -> float | None:
        counts = [n for r in self.results.values() for n in r.num_accepted]
        return acceptance_length(counts) if counts else None


@dataclass
class ModelCall:
    """One logged model pass: which requests, at which positions, with which inputs and outputs."""

    kind: str                            # "trunk" | "draft" | "commit"
    spans: list[tuple[str, int, list[int], str]]   # (request id, start, token ids, mode)
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    h_prev: torch.Tensor | None = None
    accepted: dict[str, int] | None = None        # commit: request id -> num_accepted
    logit_rows: list[int] | None = None           # the pass's rows that ``logits`` holds

    def logits_at(self, row: int) -> torch.Tensor:
        return self.logits[self.logit_rows.index(row)]


@dataclass
class VerifyPass:
    plan: list[tuple[Sequence, str, int]]
    spans: list[Span]
    out: StepOutput


class Engine:
    """Serves greedy generation for one model and one ``EngineConfig``."""

    def __init__(self, config: EngineConfig, weights: Weights, *, cfg: ModelConfig | None = None,
                 plan: RoutePlan | None = None, log_calls: bool = False,
                 vision: VisionWeights | None = None):
        # The engine dispatches for its configured device (a CPU engine on a GPU machine runs the
        # CPU variants); the weights must already live there.
        ctx = default_context(config, cfg)              # the rules read the geometry served
        self.plan = plan or route(config, ctx)          # refuses before anything is built
        if weights.device.type != config.device:
            raise ValueError(f"the weights are on {weights.device.type}; the configuration's device "
                             f"is {config.device} (move them, or set EngineConfig.device)")
        arch = ctx.arch
        self.config = config
        self.cfg = cfg or config.model_geometry()
        if tuple(weights.embed.shape) != (self.cfg.vocab_size, self.cfg.hidden):
            raise ValueError(f"weights do not match the {config.model} geometry")
        want = _DTYPES[config.model_dtype]
        if weights.dtype != want:
            raise ValueError(f"weights are {weights.dtype}; the configuration's model_dtype is "
                             f"{config.model_dtype}")
        self.host_mapped = None
        if config.ple_tables == "host":    # rule ple_host_tables_on_cuda: a cuda device
            self.host_mapped = HostMapped()
            weights = with_host_ple_tables(weights, weights.device, self.host_mapped)
        self.weights = weights
        self.vision, self.vision_geometry = None, None
        if config.multimodal:     # rule multimodal_model_has_a_vision_tower: the preset has one
            self.vision_geometry = vision_geometry(config.model)
            self.vision = self._check_vision(vision, weights)
        self.k = config.speculative.draft_length if config.speculative else 0
        self.index_share = bool(config.speculative and config.speculative.index_share)
        if self.k and weights.mtp is None:
            raise ValueError("speculation needs the MTP draft layer's weights")
        # A context engine without a draft layer keeps the prompt's trunk rows for a drafting peer.
        peer_drafts = config.peer.speculative if config.peer is not None else None
        self.keep_prompt_rows = config.role == "context" and not self.k and peer_drafts is not None
        self.keep_prompt_selection = self.keep_prompt_rows and peer_drafts.index_share
        self.dispatcher = Dispatcher(ctx.catalog, arch, batch_invariant=config.batch_invariant,
                                     torch_only=config.torch_only, numerics=config.numerics,
                                     pinned=config.pinned_variants())
        self.model = Model(weights, self.cfg, Ops(self.dispatcher), gdn_commit=config.gdn_commit)
        state_dtype = _DTYPES[config.state_dtype]
        self.memory = engine_memory(config, ctx)   # what the cache below and the expert copy hold
        if weights.device.type == "cuda":
            short = memory_shortfall(self.memory, torch.cuda.mem_get_info(weights.device)[0])
            if short is not None:
                raise ConfigRefused([Refusal(FITS_RULE, FITS_STATEMENT, short)])
        self.cache = EngineCache.allocate(
            self.cfg, config.cache_slots, config.max_seq_len, weights.dtype,
            config.kv_cache_dtype, state_dtype, weights.device, with_mtp=bool(self.k),
            verify_rows=verify_rows(config))
        self.graphs = (StepGraphs(self.model, self.cache, config.max_batch_size,
                                  rows_per_request=self.k + 1 if self.k else 1)
                       if config.cuda_graphs else None)
        self.prefill_graphs = (PrefillGraphs(self.model, self.cache, config.prefill_graph_tokens,
                                             scratch=config.max_batch_size,
                                             max_seq_len=config.max_seq_len)
                               if config.captures_prefill else None)
        self.waiting: list[Sequence] = []
        self.running: dict[int, Sequence] = {}   # slot -> sequence
        self.finished: list[Sequence] = []
        self.steps = 0
        self.step_kinds: dict[str, int] = {}
        self._arrivals = 0
        self.calls: list[ModelCall] | None = [] if log_calls else None
        # Test hooks: force the accepted count of a verify (rid, greedy count) -> count; replace a
        # request's drafts (rid, position of the first draft, drafts) -> drafts.
        self.force_accept: Callable[[str, int], int] | None = None
        self.propose_hook: Callable[[str, int, list[int]], list[int]] | None = None

    def _check_vision(self, vision: VisionWeights | None, weights: Weights) -> VisionWeights:
        geo = self.vision_geometry
        if vision is None:
            raise ValueError("multimodal needs the vision tower's weights (Engine(..., vision=))")
        want = {"patch_w": (geo.width, geo.patch_dim), "w_out": (geo.out_width, geo.width),
                "pos_frame": (geo.group, geo.width), "pos_patch": (geo.tokens_per_frame, geo.width),
                "w_qkv": (geo.layers, 3 * geo.width, geo.width)}
        for name, shape in want.items():
            got = tuple(getattr(vision, name).shape)
            if got != shape:
                raise ValueError(f"vision weights: {name} is {list(got)}, the {self.config.model} "
                                 f"tower needs {list(shape)}")
        for name, t in vision.as_dict().items():
            if t.dtype != weights.dtype or t.device != weights.device:
                raise ValueError(f"vision weights: {name} is {t.dtype} on {t.device}; the model's "
                                 f"weights are {weights.dtype} on {weights.device}")
        return vision

    # ------------------------------------------------------------------ requests

    def submit(self, request: Request) -> None:
        """Queue one request; ``RequestRejected`` (and nothing changes) if it is invalid. A
        request's frames run through the vision tower here, once."""
        validate_request(request, self.cfg, self.config)
        ids = {s.request.request_id for s in [*self.waiting, *self.running.values()]}
        if request.request_id in ids:
            raise RequestRejected(request.request_id, "request_id", "is already being served")
        seq = Sequence(request, self._arrivals)
        if request.frames is not None:
            seq.frames = prepare_frames(request.prompt, request.frames, self.vision,
                                        self.vision_geometry, self.model.ops)
        self.waiting.append(seq)
        self._arrivals += 1

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def _admit_waiting(self) -> None:
        free = [s for s in range(self.config.max_batch_size) if s not in self.running]
        while self.waiting and free:
            seq = self.waiting.pop(0)
            seq.slot = free.pop(0)
            self.cache.assign(seq.slot)
            self.running[seq.slot] = seq

    # ------------------------------------------------------------------ scheduling

    def _schedule(self) -> list[tuple[Sequence, str, int]]:
        """(sequence, mode, rows) for the next step, in row order."""
        order = sorted(self.running.values(), key=lambda s: s.arrival)
        budget = self.config.max_num_tokens
        plan: list[tuple[Sequence, str, int]] = []
        prompting = [s for s in order if s.in_prompt]
        if self.k and not prompting:
            return [(s, "verify", self.k + 1) for s in order]
        if not self.k:
            for s in order:
                if not s.in_prompt:
                    plan.append((s, "decode", 1))
                    budget -= 1
        for s in prompting:
            left = len(s.prompt) - s.prompt_done
            if not self.config.enable_chunked_prefill:
                if left > budget:
                    continue
                n = left
            else:
                n = min(left, budget)
            if n <= 0:
                break
            plan.append((s, "prefill", n))
            budget -= n
        return plan

    # ------------------------------------------------------------------ one step

    def step(self) -> dict[str, list[int]]:
        """Run one step; returns the tokens each request emitted in it."""
        self._admit_waiting()
        plan = self._schedule()
        if not plan:
            return {}
        spans, out = self._trunk_pass(plan)
        kind = ("verify" if plan[0][1] == "verify" else
                "mixed" if {m for _, m, _ in plan} == {"decode", "prefill"} else
                "context" if plan[0][1] == "prefill" else "decode")
        self.step_kinds[kind] = self.step_kinds.get(kind, 0) + 1
        self.steps += 1
        emitted = (self._after_verify(plan, spans, out) if kind == "verify"
                   else self._after_trunk(plan, spans, out))
        self._retire()
        return emitted

    def _tokens(self, seq: Sequence, mode: str, n: int) -> list[int]:
        if mode == "prefill":
            return list(seq.prompt[seq.prompt_done:seq.prompt_done + n])
        if mode == "decode":
            return [seq.pending]
        return [seq.pending, *seq.drafts[:n - 1]]

    def _trunk_pass(self, plan: list[tuple[Sequence, str, int]]) -> tuple[list[Span], StepOutput]:
        """Run the trunk over ``plan``; logits only for rows that emit or verify a token."""
        spans, ids, row, logit_rows = [], [], 0, []
        for seq, mode, n in plan:
            if mode == "verify":
                logit_rows += list(range(row, row + n))
            elif mode == "decode" or seq.prompt_done + n == len(seq.prompt):
                logit_rows.append(row + n - 1)
            start = self.cache.lengths[seq.slot]
            # A 1-token prompt chunk is a decode row for the GDN layers (same function, per row).
            gdn_mode = "decode" if (mode == "prefill" and n == 1) else mode
            spans.append(Span(seq.slot, row, row + n, start, gdn_mode))
            self.cache.ensure_pages(seq.slot, start + n)
            ids += self._tokens(seq, mode, n)
            row += n
        splice, rope = step_inputs([(seq.frames, mode, sp.start, n)
                                    for (seq, mode, n), sp in zip(plan, spans)])
        modes = {mode for _, mode, _ in plan}
        if self.graphs is not None and modes in ({"decode"}, {"verify"}):
            out = self.graphs.step(spans, ids)
        elif self.prefill_graphs is not None and self.prefill_graphs.serves(
                spans, modes, frames=splice is not None or rope is not None):
            out = self.prefill_graphs.step(spans, ids, logit_rows)
        else:
            rows = StepRows.build(spans)
            rows.rope_positions = rope
            out = self.model.trunk(torch.tensor(ids, dtype=torch.int64), rows, self.cache,
                                   logit_rows, splice)
        self._log("trunk", plan, spans, ids, out)
        return spans, out

    # ------------------------------------------------------------------ replay hooks

    def sequence(self, request_id: str) -> Sequence:
        for seq in self.running.values():
            if seq.request.request_id == request_id:
                return seq
        raise KeyError(f"request {request_id!r} is not running")

    def verify_pass(self, drafts: dict[str, list[int]]) -> VerifyPass:
        """One verify pass over the named requests (arrival order): rows [pending, *drafts], all of
        the same length; no acceptance, no commit. For replay tests: the trunk state afterwards is
        what a step holds before its commit (the planes hold every row; the GDN pool the last row's
        state with the cached GDN commit, the pre-verify state with the recomputing one)."""
        seqs = sorted((self.sequence(rid) for rid in drafts), key=lambda s: s.arrival)
        widths = {len(drafts[s.request.request_id]) for s in seqs}
        if len(widths) != 1:
            raise ValueError("a verify pass runs the same number of rows for every request")
        for seq in seqs:
            seq.drafts = list(drafts[seq.request.request_id])
        rows = widths.pop() + 1
        plan = [(seq, "verify", rows) for seq in seqs]
        spans, out = self._trunk_pass(plan)
        return VerifyPass(plan, spans, out)

    def commit_pass(self, vp: VerifyPass, num_accepted: dict[str, int]) -> None:
        """Commit a verify pass: keep ``num_accepted[rid]`` rows of each request."""
        counts = torch.tensor([num_accepted[seq.request.request_id] for seq, _, _ in vp.plan],
                              dtype=torch.int64)
        self._commit(vp.plan, vp.spans, vp.out, counts)

    def _log(self, kind, plan, spans, ids, out: StepOutput, h_prev=None) -> None:
        if self.calls is None:
            return
        entries = [(seq.request.request_id, sp.start, ids[sp.lo:sp.hi], mode)
                   for (seq, mode, _), sp in zip(plan, spans)]
        rows = list(range(spans[-1].hi)) if out.logit_rows is None else list(out.logit_rows)
        self.calls.append(ModelCall(kind, entries, out.logits.detach().clone(),
                                    out.hidden.detach().clone(),
                                    None if h_prev is None else h_prev.detach().clone(),
                                    logit_rows=rows))

    def _emit(self, seq: Sequence, tokens: list[int], emitted: dict[str, list[int]]) -> None:
        room = seq.request.max_new_tokens - len(seq.output)
        tokens = tokens[:room]
        stops = seq.request.stop_token_ids
        stop_at = next((i for i, t in enumerate(tokens) if t in stops), None)
        if stop_at is not None:
            tokens = tokens[:stop_at + 1]   # the stop token ends the output; later ones are dropped
        seq.output += tokens
        emitted.setdefault(seq.request.request_id, []).extend(tokens)
        if stop_at is not None or len(seq.output) >= seq.request.max_new_tokens:
            seq.done = True
        elif tokens:
            seq.pending = tokens[-1]

    def _after_trunk(self, plan, spans, out: StepOutput) -> dict[str, list[int]]:
        emitted: dict[str, list[int]] = {}
        drafting: list[tuple[Sequence, Span, list[int]]] = []
        for (seq, mode, n), sp in zip(plan, spans):
            if mode == "prefill" and self.keep_prompt_rows:
                seq.prompt_rows.append((out.hidden[sp.lo:sp.hi].clone(),
                                        out.selection[sp.lo:sp.hi].clone()
                                        if self.keep_prompt_selection else None))
            if mode == "prefill":
                seq.prompt_done += n
                if seq.in_prompt:
                    if self.k:
                        nxt = list(seq.prompt[sp.start + 1:sp.start + n + 1])
                        drafting.append((seq, sp, nxt))
                    continue
            token = int(greedy_argmax(out.logits_at(sp.hi - 1)))
            self._emit(seq, [token], emitted)
            if self.k and not seq.done:
                nxt = list(seq.prompt[sp.start + 1:sp.start + n]) + [token]
                drafting.append((seq, sp, nxt))
        if drafting:
            self._draft(drafting, out)
        return emitted

    def _after_verify(self, plan, spans, out: StepOutput) -> dict[str, list[int]]:
        emitted: dict[str, list[int]] = {}
        K = self.k
        R = len(plan)
        logits = out.logits.view(R, K + 1, -1)
        drafts = torch.tensor([seq.drafts for seq, _, _ in plan], dtype=torch.int64)
        res = self.model.ops.greedy_verify(logits, drafts, torch.full((R,), K, dtype=torch.int64))
        num_accepted = res.num_accepted.clone()
        if self.force_accept is not None:
            for r, (seq, _, _) in enumerate(plan):
                num_accepted[r] = self.force_accept(seq.request.request_id, int(num_accepted[r]))
        self._commit(plan, spans, out, num_accepted)
        drafting = []
        for r, ((seq, _, _), sp) in enumerate(zip(plan, spans)):
            a = int(num_accepted[r]) - 1
            seq.accepted.append(a + 1)
            if a == int(res.num_accepted[r]) - 1:
                toks = [int(t) for t in res.emitted[r, :a + 1]]
            else:  # forced acceptance: keep drafts d_1..d_a and the trunk's prediction p_a
                toks = list(seq.drafts[:a]) + [int(res.predictions[r, a])]
            self._emit(seq, toks, emitted)
            if not seq.done:
                kept = Span(seq.slot, sp.lo, sp.lo + a + 1, sp.start, "prefill")
                drafting.append((seq, kept, toks))
        if self.calls is not None:
            self.calls.append(ModelCall("commit", [(seq.request.request_id, sp.start, [], "verify")
                                                   for (seq, _, _), sp in zip(plan, spans)],
                                        accepted={seq.request.request_id: int(num_accepted[r])
                                                  for r, (seq, _, _) in enumerate(plan)}))
        if drafting:
            self._draft(drafting, out)
        return emitted

    def _commit(self, plan, spans, out: StepOutput, num_accepted: torch.Tensor) -> None:
        """Keep row num_accepted - 1 of every verified request (docs/spec.md, "Rollback / commit")."""
        rec = out.record
        slots = [seq.slot for seq, _, _ in plan]
        self.model.commit_gdn(rec, self.cache, slots, num_accepted)
        hist = self.model.ops.rollback_commit(
            {"h": rec.ple_history[:len(slots)]}, num_accepted)
        for r, (seq, _, _) in enumerate(plan):
            slot, sp = seq.slot, spans[r]
            keep = sp.start + int(num_accepted[r])
            self.cache.ple_history[slot] = hist["h"][r]
            for li in self.cache.qsa_indices():
                truncate_planes(self.cache.layers[li], self.cache.pages.block_table[slot], keep,
                                sp.start + sp.rows)
            self.cache.lengths[slot] = keep

    def _draft(self, items: list[tuple[Sequence, Span, list[int]]], trunk: StepOutput) -> None:
        """The draft layer reads rows (h_t, x_{t+1}) of the trunk, then drafts K tokens for every
        request whose next token is known (its last row's next token is the emitted one). With
        IndexShare the rows the trunk just computed reuse its last QSA layer's selection at the same
        positions (docs/spec.md, "QSA" item 7); the speculative rows past the trunk score their own."""
        cache = self.cache
        spans, h_rows, sel_rows, ids, row = [], [], [], [], 0
        for seq, sp, nxt in items:
            slot = seq.slot
            # Roll back the previous round's speculative draft rows (positions >= the trunk's start).
            if cache.mtp_lengths[slot] > sp.start:
                truncate_planes(cache.mtp, cache.pages.block_table[slot], sp.start,
                                cache.mtp_lengths[slot])
                cache.mtp_lengths[slot] = sp.start
            n = sp.hi - sp.lo
            spans.append(Span(slot, row, row + n, sp.start, "prefill"))
            h_rows.append(trunk.hidden[sp.lo:sp.hi])
            if self.index_share:
                sel_rows.append(trunk.selection[sp.lo:sp.hi])
            ids += nxt
            row += n
        plan = [(seq, "prefill", sp.hi - sp.lo) for seq, sp, _ in items]
        h_prev = torch.cat(h_rows)
        shared = torch.cat(sel_rows) if self.index_share else None
        # Logits only where a draft is taken: the last row of a request whose next token is known.
        logit_rows = [sp.hi - 1 for (seq, _, _), sp in zip(items, spans)
                      if not seq.in_prompt and not seq.done]
        out = self.model.draft(h_prev, torch.tensor(ids, dtype=torch.int64), StepRows.build(spans),
                               cache, shared, logit_rows)
        self._log("draft", plan, spans, ids, out, h_prev)
        finishing = [(seq, sp) for (seq, _, _), sp in zip(items, spans)
                     if not seq.in_prompt and not seq.done]
        if not finishing:
            return
        for seq, sp in finishing:
            seq.drafts = [int(greedy_argmax(out.logits_at(sp.hi - 1)))]
            seq.draft_hidden = out.hidden[sp.hi - 1:sp.hi]
        for _ in range(self.k - 1):
            spans = [Span(seq.slot, j, j + 1, cache.mtp_lengths[seq.slot], "decode")
                     for j, (seq, _) in enumerate(finishing)]
            ids = [seq.drafts[-1] for seq, _ in finishing]
            h_prev = torch.cat([seq.draft_hidden for seq, _ in finishing])
            for seq, sp in zip((s for s, _ in finishing), spans):
                cache.ensure_pages(seq.slot, sp.start + 1)
            out = self.model.draft(h_prev, torch.tensor(ids, dtype=torch.int64),
                                   StepRows.build(spans), cache)
            self._log("draft", [(seq, "decode", 1) for seq, _ in finishing], spans, ids, out, h_prev)
            for j, (seq, _) in enumerate(finishing):
                seq.drafts.append(int(greedy_argmax(out.logits[j])))
                seq.draft_hidden = out.hidden[j:j + 1]
        if self.propose_hook is not None:
            for seq, _ in finishing:
                first = cache.lengths[seq.slot] + 1
                seq.drafts = list(self.propose_hook(seq.request.request_id, first, seq.drafts))

    # ------------------------------------------------------------------ hand-off hooks

    @property
    def free_slots(self) -> int:
        return self.config.max_batch_size - len(self.running)

    def attach(self, seq: Sequence) -> int:
        """A request handed over by a peer engine (impl/model/disagg/) takes the lowest free slot,
        fresh (zero state, no pages, no tokens), and runs from the next step; returns the slot."""
        free = [s for s in range(self.config.max_batch_size) if s not in self.running]
        if not free:
            raise RuntimeError(f"no free slot for request {seq.request.request_id!r}: all "
                               f"{self.config.max_batch_size} are running")
        seq.slot, seq.arrival = free[0], self._arrivals
        self._arrivals += 1
        self.cache.assign(seq.slot)
        self.running[seq.slot] = seq
        return seq.slot

    def detach(self, seq: Sequence) -> None:
        """A request handed to a peer engine leaves: its slot and pages are free."""
        self.cache.release(seq.slot)
        del self.running[seq.slot]
        seq.slot = None

    def draft_prompt(self, seq: Sequence, hidden: torch.Tensor,
                     selection: torch.Tensor | None) -> None:
        """The draft layer reads a handed-over prompt from the context engine's trunk rows
        (h_t, x_{t+1}), in chunks of ``max_num_tokens``, and drafts d_1..d_K after the last: what
        an aggregated engine's draft layer does after each context chunk."""
        prompt = seq.prompt
        nxt = [*prompt[1:], seq.pending]
        budget = self.config.max_num_tokens
        for lo in range(0, len(prompt), budget):
            hi = min(len(prompt), lo + budget)
            seq.prompt_done = hi   # a chunk before the last one drafts nothing
            rows = StepOutput(None, hidden[lo:hi],
                              selection=None if selection is None else selection[lo:hi])
            self._draft([(seq, Span(seq.slot, 0, hi - lo, lo, "prefill"), nxt[lo:hi])], rows)

    def _retire(self) -> None:
        for slot, seq in list(self.running.items()):
            if seq.done:
                self.cache.release(slot)
                del self.running[slot]
                self.finished.append(seq)

    # ------------------------------------------------------------------ the API

    def generate(self, requests: Iterable[Request], *,
                 progress: Callable[[int, int], None] | None = None) -> GenerationReport:
        """Admit every request on its own, run them to completion, report per request."""
        if self.config.role != "aggregated":
            raise RuntimeError(f"a {self.config.role} engine serves through the workers of "
                               f"impl.model.disagg, not generate()")
        requests = list(requests)
        accepted, rejected = admit(requests, self.cfg, self.config)
        results = {r.request_id: GenerationResult(r.request_id) for r in requests}
        for err in rejected:
            results[err.request_id] = GenerationResult(err.request_id, error=str(err))
        for r in accepted:
            try:
                self.submit(r)
            except RequestRejected as err:
                results[r.request_id] = GenerationResult(r.request_id, error=str(err))
        target = sum(r.max_new_tokens for r in accepted)
        t0 = time.perf_counter()
        steps0 = self.steps
        done_tokens = 0
        while not self.idle:
            for rid, toks in self.step().items():
                results[rid].tokens += toks
                done_tokens += len(toks)
            if progress is not None:
                progress(done_tokens, target)
        seconds = time.perf_counter() - t0
        for seq in self.finished:
            if seq.request.request_id in results:
                results[seq.request.request_id].num_accepted = list(seq.accepted)
        return GenerationReport(results, self.steps - steps0, done_tokens, seconds,
                                dict(self.step_kinds), self.dispatcher.variants_ran())
