"""Replay an engine's logged model passes through spec/model.py, pass for pass.

The engine logs every trunk pass (requests, start positions, token ids, GDN mode), every commit (the
accepted count per request) and every draft pass (with the hidden rows it was given). The replay runs
the same passes through the reference forward on its own cache, one sequence per request:

- trunk pass: ``forward`` over the same tokens at the same positions (``verify=True`` for a verify
  step); the reference cache is snapshotted before a verify step;
- commit: the cached-replay oracle of docs/spec.md: the snapshot is restored and each request's first
  ``num_accepted`` verify rows are run again alone (``verify=True``); those logits must equal the
  verify step's rows and leave the state the engine committed;
- draft pass: ``mtp_draft`` with the engine's h_prev rows, after rolling the draft cache back to the
  pass's start (speculative rows of the previous round are dropped, as the engine drops them).

Every pass yields (what, engine logits, reference logits, engine hidden, reference hidden).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from impl.model.admission import Request
from impl.model.engine import ModelCall
from spec.config import ModelConfig
from spec.model import Weights, forward, mtp_draft, new_cache
from spec.ops.moe import NvFp4Experts, NvFp4Weight


@dataclass
class Pass:
    what: str
    engine_logits: torch.Tensor
    spec_logits: torch.Tensor
    engine_hidden: torch.Tensor | None = None
    spec_hidden: torch.Tensor | None = None


def widen(weights: Weights) -> Weights:
    """The same model in float64: every bf16 / fp32 dense tensor widened exactly (NVFP4 codes, scales
    and global scales unchanged), so the float64 forward is the ideal of *these* weights."""
    seen: dict[int, object] = {}

    def walk(obj):
        if id(obj) in seen:
            return seen[id(obj)]
        if isinstance(obj, torch.Tensor):
            out = obj.to(torch.float64) if obj.dtype in (torch.bfloat16, torch.float32) else obj
        elif isinstance(obj, (NvFp4Weight, NvFp4Experts)):
            out = obj  # codes, block scales and global scales are the model as stored
        elif isinstance(obj, list):
            out = [walk(o) for o in obj]
        elif dataclasses.is_dataclass(obj):
            out = dataclasses.replace(obj, **{f.name: walk(getattr(obj, f.name))
                                              for f in dataclasses.fields(obj)
                                              if f.init and f.name not in ("k_gs", "v_gs")})
        else:
            out = obj
        seen[id(obj)] = out
        return out

    return walk(weights)


def replay(calls: list[ModelCall], weights: Weights, cfg: ModelConfig, *, kv_dtype: str,
           state_dtype: torch.dtype, max_len: int) -> list[Pass]:
    order: dict[str, int] = {}
    for call in calls:
        for rid, *_ in call.spans:
            order.setdefault(rid, len(order))
    B = len(order)
    cache = new_cache(cfg, B, max_len, dtype=weights.dtype, kv_dtype=kv_dtype,
                      state_dtype=state_dtype, device=weights.device)
    passes: list[Pass] = []
    snapshot = None
    last_verify: ModelCall | None = None
    for call in calls:
        if call.kind == "trunk":
            verify = call.spans[0][3] == "verify"
            if verify:
                snapshot, last_verify = cache.clone(), call
            toks = [torch.empty(0, dtype=torch.int64) for _ in range(B)]
            for rid, start, ids, _ in call.spans:
                s = order[rid]
                if cache.lengths[s] != start:
                    raise AssertionError(f"{rid}: the engine ran a trunk pass at position {start}, "
                                         f"the reference holds {cache.lengths[s]} tokens")
                toks[s] = torch.tensor(ids, dtype=torch.int64)
            logits, hidden = forward(weights, cfg, toks, cache, return_hidden=True, verify=verify)
            rows = [order[rid] for rid, *_ in call.spans]
            spec_logits = torch.cat([logits[s] for s in rows])[call.logit_rows]
            passes.append(Pass(f"trunk {call.spans[0][3]}", call.logits, spec_logits, call.hidden,
                               torch.cat([hidden[s] for s in rows])))
        elif call.kind == "commit":
            cache = snapshot
            for (rid, start, ids, _), off in zip(last_verify.spans, _offsets(last_verify)):
                s = order[rid]
                n = call.accepted[rid]
                toks = [torch.empty(0, dtype=torch.int64) for _ in range(B)]
                toks[s] = torch.tensor(ids[:n], dtype=torch.int64)
                logits = forward(weights, cfg, toks, cache, verify=True)[s]
                engine_rows = torch.stack([last_verify.logits_at(off + i) for i in range(n)])
                passes.append(Pass(f"commit {rid} a={n - 1}", engine_rows, logits))
        else:
            h, toks = [], []
            for s in range(B):
                h.append(torch.empty(0, cfg.hidden, dtype=call.h_prev.dtype))
                toks.append(torch.empty(0, dtype=torch.int64))
            row = 0
            for rid, start, ids, _ in call.spans:
                s = order[rid]
                cache.mtp_lengths[s] = start  # the engine dropped the rows past it
                wide = weights.dtype == torch.float64
                h[s] = call.h_prev[row:row + len(ids)].to(torch.float64 if wide
                                                          else call.h_prev.dtype)
                toks[s] = torch.tensor(ids, dtype=torch.int64)
                row += len(ids)
            logits, hidden = mtp_draft(weights, cfg, h, toks, cache)
            rows = [order[rid] for rid, *_ in call.spans]
            spec_logits = torch.cat([logits[s] for s in rows])[call.logit_rows]
            passes.append(Pass("draft", call.logits, spec_logits, call.hidden,
                               torch.cat([hidden[s] for s in rows])))
    return passes


def _offsets(call: ModelCall) -> list[int]:
    offs, row = [], 0
    for _, _, ids, _ in call.spans:
        offs.append(row)
        row += len(ids)
    return offs


def first_mismatch(passes: list[Pass]) -> str | None:
    """None when every pass is bit for bit equal; else a description of the first that is not."""
    for i, p in enumerate(passes):
        if not torch.equal(p.engine_logits, p.spec_logits):
            d = (p.engine_logits - p.spec_logits).abs().max().item()
            return f"pass {i} ({p.what}): logits differ (max |diff| {d:.3g})"
        if p.engine_hidden is not None and not torch.equal(p.engine_hidden, p.spec_hidden):
            return f"pass {i} ({p.what}): hidden rows differ"
    return None


def token_logits(calls: list[ModelCall], request: Request) -> list[torch.Tensor]:
    """The logits rows that emitted ``request``'s tokens in plain decoding: its prompt's last row,
    then its decode rows (trunk passes only)."""
    rows = []
    for call in calls:
        row = 0
        for rid, start, ids, mode in call.spans:
            if call.kind == "trunk" and rid == request.request_id and (
                    mode == "decode" or start + len(ids) == len(request.prompt)):
                rows.append(call.logits_at(row + len(ids) - 1))
            row += len(ids)
    return rows
