"""Admission: every request is checked on its own before it gets a slot (DESIGN.md, "The engine").

``validate_request`` raises ``RequestRejected(request_id, field, reason)`` for the first problem of one
request; ``admit`` runs it over a batch, so a bad request fails alone and the others pass through as the
same objects, in their order.

Limits (decisions):
- ``prompt``: 1 .. ``max_seq_len - max_new_tokens - K`` token ids (K = the draft length, 0 without
  speculation: verify and draft rows run up to K positions past the last emitted token); without chunked prefill the whole prompt
  is one context step, so it must also fit ``max_num_tokens``. Token ids are ints in
  ``0 .. vocab_size - 1`` (bools are refused).
- ``max_new_tokens`` >= 1.
- Sampling: only greedy decoding is supported (speculative verify and the spec's MTP are greedy), so
  ``temperature`` must be 0. ``top_k`` is 0 (off) or 1 .. vocab_size and ``top_p`` lies in (0, 1]; with
  greedy decoding they change nothing, but an invalid value is still refused.
- ``draft_length``: a per-request override is refused when speculation is off, and when it differs from
  the engine's draft length (the draft length cannot change at run time; see ``static_draft_length``).
- ``request_id``: non-empty and unique within one ``admit`` call (a repeat is rejected, the first kept).
- ``frames`` (video input, ``EngineConfig.multimodal``; docs/spec.md, "Vision input"): a float32
  tensor [F, C, H, W] of pixels in [0, 1], C, H, W the tower's (``impl.model.vision``), 1 <= F <=
  ``max_frames`` and F a multiple of the tower's group (it runs whole groups of frames). The prompt
  holds the frames' placeholder tokens (``FRAME_TOKEN``) in one contiguous run, exactly F x the tokens
  a frame gives, one per spliced row: the prompt's length is the spliced prompt's, so the limits above
  hold for it. In a multimodal engine placeholder tokens without frames are refused (elsewhere the id
  is a token like any other); frames sent to an engine with multimodal off or to a model without a
  vision tower are refused. Other unknown fields (``images``, ...) are refused at
  construction.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
from pydantic import BaseModel, ConfigDict

from impl.model.engine_config import EngineConfig
from impl.model.vision import vision_geometry
from spec.config import ModelConfig
from spec.ops.vision import FRAME_TOKEN


class SamplingParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0


class Request(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    request_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int = 16
    sampling: SamplingParams = SamplingParams()
    draft_length: int | None = None
    # Generation ends at the first of these tokens (kept in the output), or at max_new_tokens.
    stop_token_ids: tuple[int, ...] = ()
    # Video frames [F, C, H, W], float32 pixels in [0, 1]; their rows replace the prompt's
    # FRAME_TOKEN placeholders (EngineConfig.multimodal).
    frames: torch.Tensor | None = None


class RequestRejected(ValueError):
    def __init__(self, request_id: str, field: str, reason: str):
        self.request_id = request_id
        self.field = field
        self.reason = reason
        super().__init__(f"request {request_id!r} rejected: {field}: {reason}")


def validate_request(request: Request, model_config: ModelConfig, engine_config: EngineConfig) -> None:
    """Raise ``RequestRejected`` naming the field at fault, or return None."""
    rid = request.request_id

    def reject(field: str, reason: str) -> None:
        raise RequestRejected(rid, field, reason)

    if not rid:
        reject("request_id", "must be a non-empty string")
    if request.max_new_tokens < 1:
        reject("max_new_tokens", f"must be >= 1, got {request.max_new_tokens}")
    n = len(request.prompt)
    if n == 0:
        reject("prompt", "is empty; a request needs at least one prompt token")
    # Speculation writes up to K positions past the last emitted token (verify rows, draft rows),
    # so a speculative engine keeps K positions of the window free.
    k = engine_config.speculative.draft_length if engine_config.speculative else 0
    limit = engine_config.max_seq_len - request.max_new_tokens - k
    if n > limit:
        spec = f" and draft length {k}" if k else ""
        reject("prompt", f"has {n} tokens; with max_new_tokens {request.max_new_tokens}{spec} at "
                         f"most {max(limit, 0)} fit max_seq_len {engine_config.max_seq_len}")
    if not engine_config.enable_chunked_prefill and n > engine_config.max_num_tokens:
        reject("prompt", f"has {n} tokens, more than max_num_tokens {engine_config.max_num_tokens}; "
                         f"without chunked prefill a prompt is one context step")
    vocab = model_config.vocab_size
    for i, t in enumerate(request.prompt):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            reject("prompt", f"token {i} is {t!r}, not a token id in 0..{vocab - 1}")
    for i, t in enumerate(request.stop_token_ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            reject("stop_token_ids", f"entry {i} is {t!r}, not a token id in 0..{vocab - 1}")
    s = request.sampling
    if s.temperature != 0:
        reject("sampling.temperature",
               f"is {s.temperature}; only greedy decoding (temperature 0) is supported")
    if not (s.top_k == 0 or 1 <= s.top_k <= vocab):
        reject("sampling.top_k", f"is {s.top_k}; must be 0 (off) or in 1..{vocab}")
    if not 0 < s.top_p <= 1:
        reject("sampling.top_p", f"is {s.top_p}; must lie in (0, 1]")
    if request.draft_length is not None:
        spec = engine_config.speculative
        if spec is None:
            reject("draft_length", "a draft length override needs speculation, which is off")
        elif request.draft_length != spec.draft_length:
            reject("draft_length", f"is {request.draft_length}; the engine's draft length is fixed at "
                                   f"{spec.draft_length}")
    _check_frames(request, engine_config, reject)


def _check_frames(request: Request, engine_config: EngineConfig, reject) -> None:
    """The frames and their placeholders (module docstring); ``reject(field, reason)`` raises."""
    frames = request.frames
    marks = [i for i, t in enumerate(request.prompt) if t == FRAME_TOKEN]
    if frames is None:
        if marks and engine_config.multimodal:   # elsewhere id FRAME_TOKEN is a token like any
            reject("prompt", f"holds {len(marks)} frame placeholder token(s) (id {FRAME_TOKEN}) but "
                             f"the request carries no frames")
        return
    if not engine_config.multimodal:
        reject("frames", "video input is off in this engine (EngineConfig.multimodal)")
    vision = vision_geometry(engine_config.model)
    if vision is None:
        reject("frames", f"the {engine_config.model} model has no vision tower")
    if frames.dim() != 4:
        reject("frames", f"must be [F, C, H, W], got shape {tuple(frames.shape)}")
    if frames.dtype != torch.float32:
        reject("frames", f"must be float32 pixels in [0, 1], got {frames.dtype}")
    F, C, H, W = frames.shape
    want = (vision.channels, vision.frame_size, vision.frame_size)
    if (C, H, W) != want:
        reject("frames", f"each frame must be {want[0]} x {want[1]} x {want[2]} (C, H, W), got "
                         f"{C} x {H} x {W}")
    if not 1 <= F <= vision.max_frames:
        reject("frames", f"holds {F} frames; a request carries 1..{vision.max_frames}")
    if F % vision.group:
        reject("frames", f"holds {F} frames, not a multiple of {vision.group}: the tower runs whole "
                         f"groups of {vision.group} frames")
    if not bool(torch.isfinite(frames).all()) or float(frames.min()) < 0 or float(frames.max()) > 1:
        reject("frames", "pixels must be finite and lie in [0, 1]")
    need = F * vision.tokens_per_frame
    if len(marks) != need:
        reject("prompt", f"holds {len(marks)} frame placeholder token(s) (id {FRAME_TOKEN}); {F} "
                         f"frames of {vision.tokens_per_frame} tokens need {need}")
    if marks[-1] - marks[0] + 1 != need:
        reject("prompt", f"the frame placeholder tokens (id {FRAME_TOKEN}) must form one "
                         f"contiguous run, found them spread over positions {marks[0]}..{marks[-1]}")


def admit(requests: Iterable[Request], model_config: ModelConfig, engine_config: EngineConfig
          ) -> tuple[list[Request], list[RequestRejected]]:
    """(accepted requests, unchanged and in order; one rejection per bad request, in order)."""
    accepted: list[Request] = []
    rejected: list[RequestRejected] = []
    seen: set[str] = set()
    for r in requests:
        try:
            if r.request_id in seen:
                raise RequestRejected(r.request_id, "request_id", "repeats an earlier request's id")
            validate_request(r, model_config, engine_config)
        except RequestRejected as e:
            rejected.append(e)
            continue
        seen.add(r.request_id)
        accepted.append(r)
    return accepted, rejected


__all__: Sequence[str] = ("Request", "SamplingParams", "RequestRejected", "validate_request", "admit")
