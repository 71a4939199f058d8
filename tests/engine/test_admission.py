"""Admission: each bad request is rejected alone with the field named; good requests pass unchanged."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from impl.model.admission import Request, RequestRejected, SamplingParams, admit, validate_request
from impl.model.engine_config import EngineConfig, SpeculativeConfig
from spec.config import ModelConfig

TINY = ModelConfig.tiny()
ENGINE = EngineConfig(model="tiny", max_num_tokens=64, max_seq_len=256)
NO_CHUNK = EngineConfig(model="tiny", max_num_tokens=64, max_seq_len=256, enable_chunked_prefill=False)
SPEC = EngineConfig(model="tiny", max_num_tokens=64, max_seq_len=256,
                    speculative=SpeculativeConfig(draft_length=3))


def req(rid: str = "r", **kw) -> Request:
    kw.setdefault("prompt", (1, 2, 3))
    return Request(request_id=rid, **kw)


BAD = [
    (req(prompt=()), ENGINE, "prompt", "is empty; a request needs at least one prompt token"),
    (req(prompt=(1,) * 250, max_new_tokens=10), ENGINE, "prompt",
     "has 250 tokens; with max_new_tokens 10 at most 246 fit max_seq_len 256"),
    (req(prompt=(1,) * 244, max_new_tokens=10), SPEC, "prompt",
     "has 244 tokens; with max_new_tokens 10 and draft length 3 at most 243 fit max_seq_len 256"),
    (req(prompt=(1,) * 65), NO_CHUNK, "prompt",
     "has 65 tokens, more than max_num_tokens 64; without chunked prefill a prompt is one context step"),
    (req(prompt=(1, 256)), ENGINE, "prompt", "token 1 is 256, not a token id in 0..255"),
    (req(prompt=(-1, 2)), ENGINE, "prompt", "token 0 is -1, not a token id in 0..255"),
    (req(max_new_tokens=0), ENGINE, "max_new_tokens", "must be >= 1, got 0"),
    (req(sampling=SamplingParams(temperature=0.7)), ENGINE, "sampling.temperature",
     "is 0.7; only greedy decoding (temperature 0) is supported"),
    (req(sampling=SamplingParams(top_k=-1)), ENGINE, "sampling.top_k", "is -1; must be 0 (off) or in 1..256"),
    (req(sampling=SamplingParams(top_k=257)), ENGINE, "sampling.top_k", "is 257; must be 0 (off) or in 1..256"),
    (req(sampling=SamplingParams(top_p=0.0)), ENGINE, "sampling.top_p", "is 0.0; must lie in (0, 1]"),
    (req(sampling=SamplingParams(top_p=1.5)), ENGINE, "sampling.top_p", "is 1.5; must lie in (0, 1]"),
    (req(draft_length=3), ENGINE, "draft_length",
     "a draft length override needs speculation, which is off"),
    (req(draft_length=5), SPEC, "draft_length", "is 5; the engine's draft length is fixed at 3"),
    (req(""), ENGINE, "request_id", "must be a non-empty string"),
]


@pytest.mark.parametrize("request_, engine, field, reason", BAD)
def test_bad_request_rejected_with_field(request_, engine, field, reason):
    with pytest.raises(RequestRejected) as e:
        validate_request(request_, TINY, engine)
    assert (e.value.request_id, e.value.field, e.value.reason) == (request_.request_id, field, reason)


def test_good_requests_pass():
    for r in (req(), req(prompt=(0, 255)), req(prompt=(1,) * 200, max_new_tokens=56),
              req(sampling=SamplingParams(top_k=1, top_p=0.9))):
        validate_request(r, TINY, ENGINE)
    validate_request(req(draft_length=3), TINY, SPEC)
    validate_request(req(prompt=(1,) * 64), TINY, NO_CHUNK)


def test_multimodal_and_unknown_fields_refused_at_construction():
    with pytest.raises(ValidationError):
        Request(request_id="m", prompt=(1,), images=["x.png"])


def test_admit_bad_requests_fail_alone():
    batch = []
    for i, (bad, _, field, _) in enumerate(b for b in BAD if b[1] is ENGINE and b[0].request_id):
        batch.append(req(f"good{i}", prompt=(i + 1, 7), max_new_tokens=4 + i))
        batch.append(bad.model_copy(update={"request_id": f"bad{i}"}))
    batch.append(req("good0", prompt=(9,)))  # repeated id: rejected, the first kept
    goods = [r for r in batch[:-1] if r.request_id.startswith("good")]
    snapshot = [r.model_dump() for r in goods]
    accepted, rejected = admit(batch, TINY, ENGINE)
    assert len(accepted) == len(goods)
    assert all(a is g for a, g in zip(accepted, goods))  # the same objects, in order
    assert [a.model_dump() for a in accepted] == snapshot  # unmodified
    assert [e.request_id for e in rejected] == [r.request_id for r in batch
                                                if r.request_id.startswith("bad")] + ["good0"]
    assert rejected[-1].field == "request_id"


def test_admit_alone_equals_admit_in_company():
    good = [req(f"g{i}", prompt=(i, i + 1)) for i in range(5)]
    alone, none = admit(good, TINY, ENGINE)
    assert none == [] and alone == good
    mixed = [good[0], req("x", prompt=()), *good[1:3], req("y", prompt=(999,)), *good[3:]]
    accepted, rejected = admit(mixed, TINY, ENGINE)
    assert accepted == alone
    assert [(e.request_id, e.field) for e in rejected] == [("x", "prompt"), ("y", "prompt")]
