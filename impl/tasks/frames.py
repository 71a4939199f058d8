"""Which frame holds the bright square: the tiny checkpoint's video task (docs/spec.md, "Vision
input"), the multimodal gate's evaluation set.

A sample carries ``frames`` (default 4) synthetic frames, 3 x 16 x 16 float32 pixels in [0, 1] that
this module draws from the sample's seed with Python's ``random`` (the same bytes on every platform):
dim noise in every frame (uniform in [0, 0.35]) and, in one frame, a bright 6 x 6 square (uniform in
[0.85, 1]) at a random place. The prompt reads the frames' placeholder rows and asks for the frame's
index as two digits, in MQAR's query form (impl/tasks/mqar.py), so the frozen trunk's recall of a
value after ``?KEY=`` is what answers; a guess is right 1 time in ``frames``.

    BOS <FRAME_TOKEN x frames x 4> \\n?FR=   ->   02

``prompt`` holds the text after the frame run (``\\n?FR=``); ``prompt_ids`` puts the run before it. The record a set's content hash covers adds the frames' sha256, so the pinned hash
covers the pixels too.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

import torch
from pydantic import Field

from impl.tasks.base import Params, Sample, exact_match
from impl.tasks.tokenizer import BOS, END, END_REPEAT, encode
from spec.ops.vision import FRAME_TOKEN, VisionConfig

HEAD, TAIL = "", "\n?FR="
VISION = VisionConfig()
SQUARE = 6


class FrameParams(Params):
    frames: int = Field(4, ge=2, le=VISION.max_frames, multiple_of=VISION.group)


def draw_frames(seed: int, frames: int, target: int) -> torch.Tensor:
    """[frames, C, S, S] float32: dim noise, and the bright square in frame ``target``."""
    rng = random.Random(seed)
    C, S = VISION.channels, VISION.frame_size
    px = [rng.uniform(0.0, 0.35) for _ in range(frames * C * S * S)]
    out = torch.tensor(px, dtype=torch.float32).view(frames, C, S, S)
    r, c = rng.randrange(S - SQUARE + 1), rng.randrange(S - SQUARE + 1)
    bright = [rng.uniform(0.85, 1.0) for _ in range(C * SQUARE * SQUARE)]
    out[target, :, r:r + SQUARE, c:c + SQUARE] = torch.tensor(bright).view(C, SQUARE, SQUARE)
    return out


@dataclass(frozen=True)
class FrameSample(Sample):
    """A frame task sample; ``meta`` holds the frame count, the pixels' seed and the answer frame."""

    @property
    def frames(self) -> torch.Tensor:
        return draw_frames(int(self.meta["seed"]), int(self.meta["frames"]),
                           int(self.meta["target"]))

    def prompt_ids(self) -> list[int]:
        run = [FRAME_TOKEN] * (int(self.meta["frames"]) * VISION.tokens_per_frame)
        return [BOS, *encode(HEAD), *run, *encode(TAIL)]

    def training_example(self) -> tuple[list[int], list[bool]]:
        ids = self.prompt_ids()
        mask = [False] * len(ids)
        ids += encode(self.answer) + [END] * END_REPEAT
        mask += [True] * (len(encode(self.answer)) + END_REPEAT)
        return ids, mask

    def record(self) -> dict[str, str]:
        digest = hashlib.sha256(self.frames.numpy().tobytes()).hexdigest()
        return {**super().record(), "frames_sha256": digest}


class Frames:
    name = "frames"
    params_model = FrameParams

    def generate(self, rng: random.Random, params: FrameParams, index: int) -> FrameSample:
        target = rng.randrange(params.frames)
        seed = rng.getrandbits(31)
        return FrameSample(self.name, HEAD + TAIL, f"{target:02d}",
                           meta={"frames": params.frames, "seed": seed, "target": target})

    score = staticmethod(exact_match)

    def max_new_tokens(self, params: FrameParams) -> int:
        return 3  # two digits and END
