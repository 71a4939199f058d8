"""Train the vision tower on the frame task through the frozen tiny checkpoint.

    python -m impl.train.train_frames --out checkpoints/flashnext-tiny-vision.safetensors

The language model is the committed checkpoint, frozen (impl/train/frozen.py): only the tower,
its read-out projection included, learns, so the checkpoint's bytes and every other gate's references
stay as they are; the tower's weights go to a second file (``impl.model.vision.save_vision``).

A batch is ``--batch`` samples of the frame task (impl/tasks/frames.py) drawn from seeds
``"train:frames:<step>:<i>"`` (a sample whose pixels' seed is an evaluation sample's is redrawn); the
frames are normalised as the engine does (``2 x - 1``), run through the tower in fp32
(``tower_fp32``, the torch variant's function), spliced at the placeholder rows, and the trunk reads
them with the prompt's mRoPE positions (``frame_positions``), as the engine does. The loss is the
cross-entropy of the answer's two digits and of the END after them. One thread, AdamW, cosine schedule.

Progress prints the held-out accuracy of the answer (both digits, teacher forced, on the first 64 samples of the
``frames`` evaluation set); the gate ``frames`` measures the engine's own greedy answers.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from impl.kernels.vision.torch_vision import tower_fp32
from impl.model.checkpoint import load_checkpoint
from impl.model.vision import save_vision, vision_geometry
from impl.tasks.evalsets import samples
from impl.tasks.frames import FrameParams, Frames
from impl.tasks.tokenizer import END, encode
from impl.train.frozen import frozen_model
from spec.ops.vision import FRAME_TOKEN, VisionWeights, frame_positions, init_vision_weights

ROOT = Path(__file__).resolve().parents[2]
CHECKPOINT = ROOT / "checkpoints" / "flashnext-tiny.safetensors"
EVAL_SAMPLES = 64


def _batch(items, model, tower: dict, heads: int):
    """(logits of the rows that predict the answer and its END [B, A + 1, V], targets [B, A + 1])."""
    geo = vision_geometry("tiny")
    ids = torch.tensor([s.prompt_ids() + [*encode(s.answer), END] for s in items])
    P = len(items[0].prompt_ids())
    pixels = torch.cat([s.frames for s in items]) * 2 - 1
    rows = tower_fp32(pixels, **tower, heads=heads).view(len(items), -1, geo.out_width)
    mask = ids[0] == FRAME_TOKEN
    x = model.embed[ids]
    x = torch.cat([x[:, :int(mask.nonzero()[0])], rows, x[:, int(mask.nonzero()[-1]) + 1:]], dim=1)
    pos = frame_positions(mask, int(items[0].meta["frames"]), geo.grid, geo.grid)
    logits, _ = model(ids, embeds=x, rope_positions=pos, attention="sparse")
    A = len(items[0].answer)
    return logits[:, P - 1:P + A], ids[:, P:P + A + 1]


def train(steps: int, batch: int, lr: float, seed: int, log=print) -> tuple[VisionWeights, dict]:
    torch.manual_seed(seed)
    ckpt = load_checkpoint(CHECKPOINT, dtype=torch.float32)
    model = frozen_model(ckpt.weights, ckpt.cfg)
    geo = vision_geometry("tiny")
    init = init_vision_weights(geo, torch.Generator().manual_seed(seed)).as_dict()
    # Read-out rows start at the token embeddings' scale, so the trunk reads them as it reads tokens.
    init["w_out"] = init["w_out"] * float(ckpt.weights.embed.float().pow(2).mean().sqrt())
    tower = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
    opt = torch.optim.AdamW(tower.values(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    task, params = Frames(), FrameParams(frames=4)
    held_out = list(samples("frames")[:EVAL_SAMPLES])
    banned = {s.meta["seed"] for s in samples("frames")}

    def draw(step: int, i: int):
        rng = random.Random(f"train:frames:{step}:{i}")
        while True:
            s = task.generate(rng, params, i)
            if s.meta["seed"] not in banned:
                return s

    def accuracy() -> float:
        with torch.no_grad():
            logits, target = _batch(held_out, model, tower, geo.heads)
        right = (logits[:, :-1].argmax(-1) == target[:, :-1]).all(-1)
        return 100.0 * float(right.float().mean())

    t0, history = time.perf_counter(), []
    log(f"step 0: held-out answer accuracy {accuracy():.1f} % (chance 25.0 %)")
    for step in range(1, steps + 1):
        logits, target = _batch([draw(step, i) for i in range(batch)], model, tower, geo.heads)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(tower.values(), 1.0)
        opt.step()
        sched.step()
        if step % 25 == 0 or step == steps:
            acc, value = accuracy(), float(loss.detach())
            history.append((step, round(value, 4), acc))
            log(f"step {step}: loss {value:.4f}, held-out answer accuracy {acc:.1f} % "
                f"({time.perf_counter() - t0:.0f} s)")
    weights = VisionWeights(**{k: v.detach().clone() for k, v in tower.items()})
    info = {"steps": steps, "batch": batch, "lr": lr, "seed": seed,
            "held_out_answer_accuracy": history[-1][2], "seconds": round(time.perf_counter() - t0),
            "history": history}
    return weights, info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "checkpoints" / "flashnext-tiny-vision.safetensors",
                   help="where the tower's weights go (default: %(default)s)")
    p.add_argument("--steps", type=int, default=300, help="optimiser steps (default: %(default)s)")
    p.add_argument("--batch", type=int, default=32, help="samples a step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=5e-3, help="peak learning rate (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="the tower's initialisation (default: %(default)s)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    weights, info = train(args.steps, args.batch, args.lr, args.seed)
    save_vision(args.out, weights, vision_geometry("tiny"), info)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
