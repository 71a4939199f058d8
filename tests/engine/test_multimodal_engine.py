"""The multimodal splice (docs/spec.md, "Vision input" items 6-7): the engine puts the tower's rows
at a prompt's placeholder rows, in every chunking, and rotates the request's rows by the frame
positions; the frames reach the logits, and text requests beside them are untouched."""

from __future__ import annotations

import pytest
import torch

from impl.model.admission import Request
from impl.model.engine import Engine
from impl.model.engine_config import EngineConfig
from impl.model.vision import step_inputs, vision_geometry
from spec.ops.vision import FRAME_TOKEN, frame_positions, init_vision_weights, vision_tower
from tests.engine.spec_replay import token_logits

VISION = vision_geometry("tiny")
PER = VISION.tokens_per_frame


@pytest.fixture(scope="module")
def vision():
    return init_vision_weights(VISION, torch.Generator().manual_seed(3), dtype=torch.bfloat16)


def _engine(weights, vision, *, budget=64, batch=4, invariant=True, multimodal=True) -> Engine:
    config = EngineConfig(model="tiny", max_batch_size=batch, max_num_tokens=budget,
                          max_seq_len=256, batch_invariant=invariant, multimodal=multimodal)
    return Engine(config, weights, log_calls=True, vision=vision if multimodal else None)


def _frames(n: int, seed: int) -> torch.Tensor:
    return torch.rand(n, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


def _video(rid: str, n: int = 4, seed: int = 0, new: int = 4, frames=None) -> Request:
    prompt = (1, 70, 71, 72, 73) + (FRAME_TOKEN,) * (n * PER) + (74, 75, 10)
    return Request(request_id=rid, prompt=prompt, max_new_tokens=new,
                   frames=_frames(n, seed) if frames is None else frames)


def _text(rid: str, n: int, seed: int) -> Request:
    ids = torch.randint(32, 127, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return Request(request_id=rid, prompt=(1, *ids), max_new_tokens=4)


def test_the_splice_and_positions_are_the_specs_in_every_chunk(weights, vision):
    """A 7-row budget cuts the 16-row frame run into chunks that start and end inside it."""
    engine = _engine(weights, vision, budget=7, batch=2)
    seen = []
    trunk = engine.model.trunk

    def spy(ids, rows, cache, logit_rows=None, splice=None):
        seen.append((rows.spans, rows.rope_positions, splice))
        return trunk(ids, rows, cache, logit_rows, splice)

    engine.model.trunk = spy
    r = _video("v", n=4)
    report = engine.generate([r, _text("t", 9, 1)])
    assert report.results["v"].error is None
    n = len(r.prompt)
    got_rows = torch.full((n, weights.embed.shape[1]), float("nan"), dtype=torch.bfloat16)
    got_pos = {}
    slot = engine.finished[[s.request.request_id for s in engine.finished].index("v")].slot
    for spans, rope, splice in seen:
        assert rope is not None or all(sp.slot != slot for sp in spans)
        at = {} if splice is None else dict(zip(splice[0].tolist(), splice[1]))
        for sp in spans:
            if sp.slot != slot:
                continue
            for row in range(sp.lo, sp.hi):
                pos = sp.start + row - sp.lo
                got_pos[pos] = rope[:, row].tolist()
                if row in at:
                    got_rows[pos] = at[row]
    mask = torch.tensor(r.prompt) == FRAME_TOKEN
    want = vision_tower((r.frames * 2 - 1).to(torch.bfloat16), **vision.as_dict(),
                        heads=VISION.heads)
    assert torch.equal(got_rows[mask], want)
    assert torch.isnan(got_rows[~mask].float()).all()     # nothing spliced at a text row
    positions = frame_positions(mask, 4, VISION.grid, VISION.grid)
    delta = 5 + max(4, VISION.grid, VISION.grid) - (5 + 4 * PER)   # text resumes at s + max(F, gh, gw)
    assert [got_pos[p] for p in range(n)] == positions.T.tolist()
    decode = sorted(p for p in got_pos if p >= n)
    assert decode and all(got_pos[p] == [p + delta] * 3 for p in decode)


def test_step_inputs_leave_a_step_without_frames_alone():
    assert step_inputs([(None, "prefill", 0, 5), (None, "decode", 9, 1)]) == (None, None)


def test_a_frame_request_alone_batched_and_chunked_gives_the_same_logits(weights, vision):
    r = _video("v", n=8, seed=5)
    alone = _engine(weights, vision, budget=64, batch=1)
    one = alone.generate([r])
    crowd = _engine(weights, vision, budget=11, batch=4)
    many = crowd.generate([_text("a", 20, 2), r, _video("w", n=2, seed=6), _text("b", 3, 3)])
    assert crowd.step_kinds.get("mixed", 0) > 0
    assert many.results["v"].tokens == one.results["v"].tokens
    a, b = token_logits(alone.calls, r), token_logits(crowd.calls, r)
    assert len(a) == len(b) == 4
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_text_requests_beside_frames_are_those_of_a_text_engine(weights, vision):
    texts = [_text("a", 20, 2), _text("b", 37, 4)]
    plain = _engine(weights, vision, budget=16, multimodal=False)
    plain.generate(texts)
    mixed = _engine(weights, vision, budget=16)
    mixed.generate([texts[0], _video("v", n=2, seed=1), texts[1]])
    for r in texts:
        a, b = token_logits(plain.calls, r), token_logits(mixed.calls, r)
        assert len(a) == 4 and all(torch.equal(x, y) for x, y in zip(a, b)), r.request_id


def test_the_frames_reach_the_logits(weights, vision):
    """Other pixels, or the same frames in another order across groups, move the prompt's last
    logits row: the rows are spliced, and each frame keeps its own position."""
    base = _frames(4, 7)
    last = {}
    for name, frames in (("base", base), ("other", _frames(4, 8)),
                         ("swapped", base[[2, 3, 0, 1]]), ("same", base.clone())):
        engine = _engine(weights, vision, batch=1)
        r = _video(name, frames=frames, new=1)
        engine.generate([r])
        last[name] = token_logits(engine.calls, r)[0]
    assert torch.equal(last["same"], last["base"])
    assert not torch.equal(last["other"], last["base"])
    assert not torch.equal(last["swapped"], last["base"])


def test_the_default_dispatch_runs_the_torch_tower(weights, vision):
    report = _engine(weights, vision, invariant=False).generate([_video("v", n=2)])
    assert report.results["v"].error is None and len(report.results["v"].tokens) == 4
    assert report.variants["vision_tower"] == ["torch"]
