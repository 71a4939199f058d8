"""Admission of video requests (impl/model/admission.py): each bad frame request is rejected alone
with the field named, and the engine serves the others."""

from __future__ import annotations

import pytest
import torch

from impl.model.admission import Request, RequestRejected, admit, validate_request
from impl.model.engine import Engine
from impl.model.engine_config import EngineConfig
from impl.model.vision import vision_geometry
from spec.config import ModelConfig
from spec.ops.vision import FRAME_TOKEN, init_vision_weights

TINY = ModelConfig.tiny()
VISION = vision_geometry("tiny")
MM = EngineConfig(model="tiny", max_num_tokens=64, max_seq_len=256, multimodal=True)
OFF = EngineConfig(model="tiny", max_num_tokens=64, max_seq_len=256)
PER = VISION.tokens_per_frame


def frames(n: int = 2, **kw) -> torch.Tensor:
    return torch.rand(n, 3, 16, 16, generator=torch.Generator().manual_seed(n), **kw)


def prompt(n_frames: int = 2, before: int = 3, after: int = 2) -> tuple[int, ...]:
    return (1,) + (65,) * (before - 1) + (FRAME_TOKEN,) * (n_frames * PER) + (66,) * after


def req(rid: str = "v", **kw) -> Request:
    kw.setdefault("frames", frames())
    kw.setdefault("prompt", prompt())
    return Request(request_id=rid, **kw)


BAD = [
    (req(), OFF, "frames", "video input is off in this engine (EngineConfig.multimodal)"),
    (req(frames=frames()[0]), MM, "frames", "must be [F, C, H, W], got shape (3, 16, 16)"),
    (req(frames=frames(dtype=torch.float64)), MM, "frames",
     "must be float32 pixels in [0, 1], got torch.float64"),
    (req(frames=torch.rand(2, 3, 16, 32)), MM, "frames",
     "each frame must be 3 x 16 x 16 (C, H, W), got 3 x 16 x 32"),
    (req(frames=torch.rand(2, 1, 16, 16)), MM, "frames",
     "each frame must be 3 x 16 x 16 (C, H, W), got 1 x 16 x 16"),
    (req(frames=frames(10), prompt=prompt(10)), MM, "frames", "holds 10 frames; a request carries 1..8"),
    (req(frames=frames(3), prompt=prompt(3)), MM, "frames",
     "holds 3 frames, not a multiple of 2: the tower runs whole groups of 2 frames"),
    (req(frames=frames() * 2), MM, "frames", "pixels must be finite and lie in [0, 1]"),
    (req(frames=frames().masked_fill(torch.rand(2, 3, 16, 16) < 0.01, float("nan"))), MM, "frames",
     "pixels must be finite and lie in [0, 1]"),
    (req(prompt=prompt(1)), MM, "prompt",
     "holds 4 frame placeholder token(s) (id 2); 2 frames of 4 tokens need 8"),
    (req(prompt=(1,) + (FRAME_TOKEN,) * 4 + (65,) + (FRAME_TOKEN,) * 4), MM, "prompt",
     "the frame placeholder tokens (id 2) must form one contiguous run, found them spread over "
     "positions 1..9"),
    (req(frames=None), MM, "prompt",
     "holds 8 frame placeholder token(s) (id 2) but the request carries no frames"),
    (req(prompt=prompt(after=240), max_new_tokens=10), MM, "prompt",
     "has 251 tokens; with max_new_tokens 10 at most 246 fit max_seq_len 256"),
    (req(), MM.model_copy(update={"enable_chunked_prefill": False, "max_num_tokens": 12}), "prompt",
     "has 13 tokens, more than max_num_tokens 12; without chunked prefill a prompt is one context "
     "step"),
    (req(), MM.model_copy(update={"model": "target"}), "frames",
     "the target model has no vision tower"),
]


@pytest.mark.parametrize("bad,config,field,reason", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_a_bad_frame_request_is_rejected_naming_the_field(bad, config, field, reason):
    with pytest.raises(RequestRejected) as e:
        validate_request(bad, TINY, config)
    assert (e.value.field, e.value.reason) == (field, reason)


def test_good_frame_requests_pass():
    for n in (2, 4, 8):
        validate_request(req(frames=frames(n), prompt=prompt(n)), TINY, MM)
    validate_request(req(frames=frames(), prompt=(FRAME_TOKEN,) * (2 * PER)), TINY, MM)


def test_frames_of_another_type_are_refused_at_construction():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="frames"):
        Request(request_id="v", prompt=(1,), frames=[[0.0]])


def test_admit_bad_frame_requests_fail_alone():
    batch = []
    for i, (bad, config, _, _) in enumerate(BAD):
        if config is MM:
            batch.append(Request(request_id=f"good{i}", prompt=(1, 65 + i), max_new_tokens=3))
            batch.append(bad.model_copy(update={"request_id": f"bad{i}"}))
    accepted, rejected = admit(batch, TINY, MM)
    assert [r.request_id for r in accepted] == [r.request_id for r in batch
                                                if r.request_id.startswith("good")]
    assert [e.request_id for e in rejected] == [r.request_id for r in batch
                                                if r.request_id.startswith("bad")]


def test_the_engine_keeps_serving_beside_bad_frame_requests(weights):
    vision = init_vision_weights(VISION, torch.Generator().manual_seed(1), dtype=torch.bfloat16)
    engine = Engine(MM.model_copy(update={"max_batch_size": 4}), weights, vision=vision)
    good = [req("v0"), Request(request_id="t0", prompt=(1, 65, 66), max_new_tokens=4),
            req("v1", frames=frames(4), prompt=prompt(4), max_new_tokens=3)]
    bad = [req("b0", frames=frames(3), prompt=prompt(3)), req("b1", prompt=prompt(1)),
           req("b2", frames=frames() + 1)]
    report = engine.generate([good[0], bad[0], good[1], bad[1], good[2], bad[2]])
    for r in good:
        res = report.results[r.request_id]
        assert res.error is None and len(res.tokens) == r.max_new_tokens, r.request_id
    for r in bad:
        assert report.results[r.request_id].error.startswith(f"request {r.request_id!r} rejected: ")
        assert report.results[r.request_id].tokens == []
    assert engine.idle


def test_the_placeholder_id_is_a_plain_token_where_multimodal_is_off():
    validate_request(Request(request_id="t", prompt=(1, FRAME_TOKEN, 65)), TINY, OFF)
