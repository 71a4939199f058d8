"""Video input in the engine (docs/spec.md, "Vision input"): the tower's geometry per model preset,
one request's frames run through the tower once, and the splice of its rows and mRoPE positions into
the steps that read its prompt.

- ``vision_geometry(preset)``: the tower a model preset has (tiny: ``VisionConfig()`` read out to the
  model width), or None (the target has no vision geometry); rule ``multimodal_model_has_a_vision_tower``
  and admission read it.
- ``prepare_frames``: a request's float32 pixels in [0, 1] normalised to ``2 x - 1`` (the range the
  tower's cells certify), cast to the model's dtype, run through the op ``vision_tower`` in one call
  (its groups are whole frames, so one call equals one call per group), and the prompt's [3, P]
  positions (``spec.ops.vision.frame_positions``). ``FramePrompt.delta`` is what a row after the prompt
  adds to its index in the sequence to get its rotary position (Qwen2-VL's ``mrope_position_delta``):
  ``max(F, gh, gw) - F gh gw``.
- ``save_vision`` / ``load_vision``: the tower's weights in a safetensors file of their own (the
  tiny checkpoint's second file, ``checkpoints/flashnext-tiny-vision.safetensors``), bf16, with the
  geometry and the training record in its metadata; a file whose geometry or tensors do not match is
  refused naming the file and the tensor.
- ``step_inputs``: for one step's rows, the rows to splice (step row index -> tower row) and the
  [3, N] rotary positions, or (None, None) when no request of the step carries frames (its rows then
  rotate by their plain positions, which equal rows would give bit for bit). The KV cache, the QSA
  planes and the selection keep the token's index in the sequence as its position.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from spec.config import ModelConfig
from spec.ops.vision import (FRAME_TOKEN, VisionConfig, VisionWeights, frame_positions,
                             init_vision_weights)

VISION_GEOMETRY: dict[str, VisionConfig | None] = {
    "tiny": VisionConfig(out_width=ModelConfig.tiny().hidden),
    "target": None,
}


def vision_geometry(preset: str) -> VisionConfig | None:
    return VISION_GEOMETRY.get(preset)


VISION_FORMAT = "flashnext-vision/1"


def save_vision(path: str | Path, weights: VisionWeights, geometry: VisionConfig,
                training: dict | None = None) -> None:
    """Write the tower's weights (bf16) and geometry to ``path``."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().to(torch.bfloat16).contiguous().cpu()
               for k, v in weights.as_dict().items()}
    meta = {"format": VISION_FORMAT, "geometry": json.dumps(dataclasses.asdict(geometry)),
            "training": json.dumps(training or {})}
    save_file(tensors, str(path), metadata=meta)


def load_vision(path: str | Path, geometry: VisionConfig, dtype: torch.dtype = torch.bfloat16,
                device: str | torch.device = "cpu") -> VisionWeights:
    """The tower's weights of ``path``, checked against ``geometry``; ValueError names the problem."""
    from safetensors import safe_open

    path = Path(path)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != VISION_FORMAT:
            raise ValueError(f"{path}: not a vision tower file (format {meta.get('format')!r}, "
                             f"expected {VISION_FORMAT!r})")
        stored = json.loads(meta.get("geometry", "{}"))
        if stored != dataclasses.asdict(geometry):
            raise ValueError(f"{path}: geometry {stored} is not the model's tower {geometry}")
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    want = init_vision_weights(geometry, torch.Generator().manual_seed(0)).as_dict()
    for name, t in want.items():
        if name not in tensors or tensors[name].shape != t.shape:
            got = tuple(tensors[name].shape) if name in tensors else "missing"
            raise ValueError(f"{path}: tensor {name} is {got}, the tower needs {tuple(t.shape)}")
    return VisionWeights(**{k: tensors[k].to(dtype=dtype, device=device) for k in want})


@dataclass(frozen=True)
class FramePrompt:
    """One request's spliced prompt: the tower's rows [n, C] (model dtype, on the weights' device),
    the first placeholder's index, the prompt's [3, P] positions (host) and the delta of later rows."""

    rows: torch.Tensor
    start: int
    positions: torch.Tensor
    delta: int


def prepare_frames(prompt: tuple[int, ...], frames: torch.Tensor, weights: VisionWeights,
                   geometry: VisionConfig, ops) -> FramePrompt:
    """The request's tower rows and positions (admission has checked the frames and placeholders)."""
    dtype, device = weights.w_out.dtype, weights.w_out.device
    pixels = (frames.to(torch.float32) * 2 - 1).to(dtype=dtype, device=device)
    rows = ops.vision_tower(pixels, weights, geometry.heads)
    mask = torch.tensor(prompt, dtype=torch.int64) == FRAME_TOKEN
    grid = geometry.grid
    positions = frame_positions(mask, frames.shape[0], grid, grid)
    start = int(torch.nonzero(mask)[0])
    delta = int(positions[0, -1]) + 1 - len(prompt)
    return FramePrompt(rows, start, positions, delta)


def step_inputs(entries: list[tuple[FramePrompt | None, str, int, int]]
                ) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, torch.Tensor | None]:
    """``entries``: per request of the step, in row order, (its FramePrompt or None, mode, index of
    its first row in the sequence, rows). Returns ((step row indices [m], rows [m, C]) to splice, or
    None; [3, N] int64 rotary positions, or None when no entry carries frames)."""
    if all(fp is None for fp, _, _, _ in entries):
        return None, None
    pos, at, rows = [], [], []
    row = 0
    for fp, mode, first, n in entries:
        if fp is None:
            pos.append(torch.arange(first, first + n).repeat(3, 1))
        elif mode == "prefill":
            pos.append(fp.positions[:, first:first + n])
            lo, hi = max(first, fp.start), min(first + n, fp.start + fp.rows.shape[0])
            if lo < hi:
                at.append(torch.arange(lo, hi) - first + row)
                rows.append(fp.rows[lo - fp.start:hi - fp.start])
        else:
            pos.append(torch.arange(first, first + n).repeat(3, 1) + fp.delta)
        row += n
    splice = (torch.cat(at), torch.cat(rows)) if at else None
    return splice, torch.cat(pos, dim=1)
