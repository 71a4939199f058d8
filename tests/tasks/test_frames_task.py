"""The frame task (impl/tasks/frames.py): pixels drawn by code from the sample's seed, the bright
square in the answer's frame only, the prompt's frame run, and the pinned set covering the pixels."""

from __future__ import annotations

import random

import torch

from impl.tasks import TASKS
from impl.tasks.evalsets import EVAL_SETS, content_hash, samples
from impl.tasks.frames import FrameParams, FrameSample, draw_frames
from impl.tasks.tokenizer import BOS, END, END_REPEAT, encode
from spec.ops.vision import FRAME_TOKEN


def test_the_square_is_in_the_answers_frame_only():
    for s in samples("frames")[:40]:
        f = s.frames
        assert f.shape == (4, 3, 16, 16) and f.dtype == torch.float32
        assert float(f.min()) >= 0 and float(f.max()) <= 1
        bright = (f.min(dim=1).values > 0.8).flatten(1).sum(-1)   # pixels bright in every channel
        assert bright.tolist() == [36 if i == int(s.answer) else 0 for i in range(4)]


def test_the_pixels_are_a_function_of_the_seed():
    s = samples("frames")[3]
    assert torch.equal(s.frames, draw_frames(s.meta["seed"], 4, s.meta["target"]))
    assert not torch.equal(s.frames, draw_frames(s.meta["seed"] + 1, 4, s.meta["target"]))


def test_the_prompt_holds_one_run_of_frame_rows_and_the_answer_is_a_digit():
    s = TASKS["frames"].generate(random.Random(0), FrameParams(frames=6), 0)
    ids = s.prompt_ids()
    assert ids == [BOS, *[FRAME_TOKEN] * 24, *encode("\n?FR=")]
    assert s.answer in {f"0{i}" for i in range(6)}
    train, mask = s.training_example()
    assert train[:len(ids)] == ids and not any(mask[:len(ids)])
    assert train[len(ids):] == [*encode(s.answer), *[END] * END_REPEAT] and all(mask[len(ids):])


def test_the_pinned_hash_covers_the_pixels():
    items = list(samples("frames")[:5])
    assert content_hash(items) == content_hash(list(samples("frames")[:5]))
    s = items[2]
    moved = FrameSample(s.task, s.prompt, s.answer, meta={**s.meta, "seed": s.meta["seed"] + 1})
    assert content_hash(items[:2] + [moved] + items[3:]) != content_hash(items)
    assert EVAL_SETS["frames"].size == len(samples("frames"))


def test_answers_are_spread_over_the_frames():
    counts = [sum(s.answer == f"0{i}" for s in samples("frames")[:64]) for i in range(4)]
    assert min(counts) >= 10, counts
