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
- ``step_inputs``: for one step's rows, the rows to splice (step row index -> tower row) and the
  [3, N] rotary positions, or (None, None) when no request of the step carries frames (its rows then
  rotate by their plain positions, which equal rows would give bit for bit). The KV cache, the QSA
  planes and the selection keep the token's index in the sequence as its position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spec.config import ModelConfig
from spec.ops.vision import FRAME_TOKEN, VisionConfig, VisionWeights, frame_positions

VISION_GEOMETRY: dict[str, VisionConfig | None] = {
    "tiny": VisionConfig(out_width=ModelConfig.tiny().hidden),
    "target": None,
}


def vision_geometry(preset: str) -> VisionConfig | None:
    return VISION_GEOMETRY.get(preset)


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
