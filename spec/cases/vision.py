"""Input builder of the vision tower (op ``vision_tower``, docs/spec.md, "Vision input").

frames: bf16 pixels in [-1, 1] (the engine's normalisation of [0, 1] pixels), smooth gradients with a
bright square in one frame of every group, as the frame task's frames hold; weights: the tower's
seeded initialisation (spec.ops.vision.init_vision_weights) in bf16, with its norm weights drawn
around 0 instead of at 0, so the (1 + w) factor of every norm is exercised.
"""

from __future__ import annotations

import torch

from certify.harness.target import Case, OutSpec
from spec.cases.common import DTYPES, randn, uniform
from spec.ops.vision import VisionConfig, init_vision_weights


def vision_case(axes: dict, gen: torch.Generator, device) -> Case:
    act = DTYPES[axes["act_dtype"]]
    cfg = VisionConfig(frame_size=axes["frame_size"])
    F, S = axes["frames"], cfg.frame_size
    ramp = torch.linspace(-0.8, 0.8, S)
    frames = (ramp[None, None, :, None] * uniform(gen, F, cfg.channels, 1, 1, lo=-1.0, hi=1.0)
              + ramp[None, None, None, :] * uniform(gen, F, cfg.channels, 1, 1, lo=-1.0, hi=1.0))
    frames = frames + randn(gen, F, cfg.channels, S, S, scale=0.05)
    side = S // 4
    for g in range(F // cfg.group):
        f = g * cfg.group + int(torch.randint(cfg.group, (1,), generator=gen))
        r, c = (int(v) for v in torch.randint(S - side + 1, (2,), generator=gen))
        frames[f, :, r:r + side, c:c + side] = 1.0
    frames = frames.clamp(-1.0, 1.0)
    w = init_vision_weights(cfg, gen).as_dict()
    for name in ("attn_norm", "mlp_norm", "out_norm"):
        w[name] = randn(gen, *w[name].shape, scale=0.1)
    inputs = {"frames": frames.to(act).to(device)}
    inputs |= {k: v.to(act).to(device) for k, v in w.items()}
    inputs["heads"] = cfg.heads
    return Case(inputs=inputs,
                outputs={"out": OutSpec((F * cfg.tokens_per_frame, cfg.out_width), act)})
