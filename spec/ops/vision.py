"""The vision tower, its splice into the prompt and the mRoPE positions of frame tokens (docs/spec.md,
"Vision input").

Ops and functions defined here:
- ``vision_tower`` (op ``vision_tower``): frames [F, C, H, W] to one row of the model width per patch
  of every frame, [F * gh * gw, out_width], the frames processed in groups of ``G`` whole frames
  (G = ``pos_frame.shape[0]``): attention mixes the tokens of one group only, so a group's rows do not
  depend on any other frame.
- ``splice``: the prompt's embedding rows with the tower's rows put at its placeholder positions.
- ``frame_positions``: the [3, T] (t, h, w) mRoPE positions of a prompt holding one run of frame
  tokens, Qwen2-VL's rule (``get_rope_index``): text tokens carry one running position on all three
  rows; a frame token at (frame f, patch row i, patch column j) after text position s - 1 carries
  ``(s + f, s + i, s + j)``; the text after the run continues at ``s + max(F, gh, gw)``.
- ``mrope_sections``: the (t, h, w) frequency counts of a rotary width, (11, 11, 10) at 32
  frequencies (docs/spec.md, "QK norm + RoPE").

The tower, block by block (a small ViT in the pre-norm form; Dosovitskiy et al. 2021, "An Image is
Worth 16x16 Words"; the grouping of whole frames is Qwen2-VL's temporal grouping of video frames):
1. Patchify: frame f's patch (i, j) is its pixels ``[:, p*i : p*(i+1), p*j : p*(j+1)]`` flattened in
   (channel, row, column) order; the tokens of a frame are in raster order (i, then j), frames in order.
2. Embed: ``x = patch @ patch_w^T + pos_frame[f mod G] + pos_patch[i * gw + j]`` (no bias).
3. ``layers`` blocks: ``x += attn(rmsnorm(x, attn_norm[l]))`` then
   ``x += w_down[l] gelu_tanh(w_up[l] rmsnorm(x, mlp_norm[l]))``; attn is bidirectional multi-head
   softmax attention over the tokens of one group, ``qkv = h @ w_qkv[l]^T`` split [q | k | v] and per
   head, scale ``1 / sqrt(head_dim)``, then ``w_o[l]``.
4. Read-out: ``rmsnorm(x, out_norm) @ w_out^T``, one row of the model width per token.

Rounding points (*spec decision*, restated in docs/spec.md): the weights and frames are in the
activation dtype (bf16 in the model); every step above is computed in the accumulation dtype (fp32, or
float64 in reference mode) from them, and the result is rounded once, at the end, to the frames'
dtype. The tower is small, so carrying fp32 through it costs little and leaves one rounding to certify.
Products run row by row (``rowwise_matmul``) and a group's attention reads only its own tokens, so the
spec is batch-invariant: a frame's rows are the same whatever other frames or groups share the call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from spec.numerics import acc_dtype, is_reference_mode, out_cast, rowwise_matmul
from spec.ops.norms import rmsnorm

FRAME_TOKEN = 2  # the placeholder id of a frame token in a prompt (unprintable: no task text holds it)


@dataclass(frozen=True)
class VisionConfig:
    """The tower's geometry: frames ``channels x frame_size x frame_size`` cut into ``patch``-sized
    squares; ``group`` frames per tower group; ``max_frames`` a request may carry."""

    channels: int = 3
    frame_size: int = 16
    patch: int = 8
    group: int = 2
    width: int = 64
    layers: int = 2
    heads: int = 2
    mlp: int = 128
    out_width: int = 128
    max_frames: int = 8

    def __post_init__(self) -> None:
        for name in ("channels", "frame_size", "patch", "group", "width", "layers", "heads", "mlp",
                     "out_width", "max_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.frame_size % self.patch:
            raise ValueError(f"frame_size {self.frame_size} must be a multiple of patch {self.patch}")
        if self.width % self.heads:
            raise ValueError(f"width {self.width} must be a multiple of heads {self.heads}")
        if self.max_frames % self.group:
            raise ValueError(f"max_frames {self.max_frames} must be a multiple of group {self.group}")

    @property
    def grid(self) -> int:
        """Patches along a frame's side (gh = gw)."""
        return self.frame_size // self.patch

    @property
    def tokens_per_frame(self) -> int:
        return self.grid * self.grid

    @property
    def patch_dim(self) -> int:
        return self.channels * self.patch * self.patch


@dataclass
class VisionWeights:
    """The tower's parameters (names as ``vision_tower``'s arguments); layer weights stacked on dim 0."""

    patch_w: torch.Tensor    # [D, C p p]
    pos_frame: torch.Tensor  # [G, D]
    pos_patch: torch.Tensor  # [gh gw, D]
    attn_norm: torch.Tensor  # [L, D]
    w_qkv: torch.Tensor      # [L, 3D, D]
    w_o: torch.Tensor        # [L, D, D]
    mlp_norm: torch.Tensor   # [L, D]
    w_up: torch.Tensor       # [L, M, D]
    w_down: torch.Tensor     # [L, D, M]
    out_norm: torch.Tensor   # [D]
    w_out: torch.Tensor      # [out_width, D]

    def as_dict(self) -> dict[str, torch.Tensor]:
        return dict(vars(self))


def init_vision_weights(cfg: VisionConfig, gen: torch.Generator, dtype=torch.float32,
                        device="cpu") -> VisionWeights:
    """Seeded weights: projections of std 1/sqrt(fan_in), norms at 0 (zero-centred), small position
    embeddings."""
    D, L, M = cfg.width, cfg.layers, cfg.mlp

    def rnd(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype=dtype, device=device)

    return VisionWeights(
        patch_w=rnd(D, cfg.patch_dim, std=cfg.patch_dim ** -0.5),
        pos_frame=rnd(cfg.group, D, std=0.1), pos_patch=rnd(cfg.tokens_per_frame, D, std=0.1),
        attn_norm=torch.zeros(L, D, dtype=dtype, device=device),
        w_qkv=rnd(L, 3 * D, D, std=D ** -0.5), w_o=rnd(L, D, D, std=D ** -0.5),
        mlp_norm=torch.zeros(L, D, dtype=dtype, device=device),
        w_up=rnd(L, M, D, std=D ** -0.5), w_down=rnd(L, D, M, std=M ** -0.5),
        out_norm=torch.zeros(D, dtype=dtype, device=device),
        w_out=rnd(cfg.out_width, D, std=D ** -0.5))


def patchify(frames: torch.Tensor, patch: int) -> torch.Tensor:
    """[F, C, H, W] -> [F * gh * gw, C * patch * patch]: frame-major, patches in raster order, each
    patch flattened in (channel, row, column) order (step 1)."""
    if frames.dim() != 4:
        raise ValueError(f"frames must be [F, C, H, W], got shape {tuple(frames.shape)}")
    F, C, H, W = frames.shape
    if H % patch or W % patch:
        raise ValueError(f"frame size {H}x{W} must be a multiple of the patch {patch}")
    gh, gw = H // patch, W // patch
    x = frames.reshape(F, C, gh, patch, gw, patch).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(F * gh * gw, C * patch * patch)


def _attend(h: torch.Tensor, w_qkv: torch.Tensor, w_o: torch.Tensor, heads: int) -> torch.Tensor:
    """Bidirectional multi-head attention over the rows of one group (all in the acc dtype)."""
    n, D = h.shape
    dh = D // heads
    qkv = rowwise_matmul(h, w_qkv.T)
    q, k, v = (qkv[:, i * D:(i + 1) * D].reshape(n, heads, dh) for i in range(3))
    outs = []
    for hd in range(heads):
        s = rowwise_matmul(q[:, hd], k[:, hd].T.contiguous()) / math.sqrt(dh)
        p = torch.softmax(s, dim=-1)
        outs.append(rowwise_matmul(p, v[:, hd].contiguous()))
    return rowwise_matmul(torch.cat(outs, dim=-1), w_o.T)


def vision_tower(frames: torch.Tensor, patch_w: torch.Tensor, pos_frame: torch.Tensor,
                 pos_patch: torch.Tensor, attn_norm: torch.Tensor, w_qkv: torch.Tensor,
                 w_o: torch.Tensor, mlp_norm: torch.Tensor, w_up: torch.Tensor,
                 w_down: torch.Tensor, out_norm: torch.Tensor, w_out: torch.Tensor,
                 heads: int) -> torch.Tensor:
    """Op ``vision_tower``: frames [F, C, H, W] -> [F * gh * gw, out_width] (see the module docstring).

    F must be a multiple of the group G = ``pos_frame.shape[0]``; the patch size follows from
    ``patch_w`` [D, C p p]. Computed in acc_dtype of the inputs, rounded once to the frames' dtype
    (float64 stays float64).
    """
    tensors = (frames, patch_w, pos_frame, pos_patch, attn_norm, w_qkv, w_o, mlp_norm, w_up, w_down,
               out_norm, w_out)
    reference = is_reference_mode(*tensors)
    acc = acc_dtype(*tensors)
    F, C = frames.shape[0], frames.shape[1]
    G, D = pos_frame.shape
    patch = math.isqrt(patch_w.shape[1] // C)
    if patch * patch * C != patch_w.shape[1]:
        raise ValueError(f"patch_w's input width {patch_w.shape[1]} is not C * p * p for C = {C}")
    if F % G:
        raise ValueError(f"frame count {F} must be a multiple of the group {G}")
    if D % heads:
        raise ValueError(f"width {D} must be a multiple of heads {heads}")
    (patch_w, pos_frame, pos_patch, attn_norm, w_qkv, w_o, mlp_norm, w_up, w_down, out_norm,
     w_out) = (t.to(acc) for t in tensors[1:])
    tokens = patchify(frames.to(acc), patch)
    per_frame = tokens.shape[0] // F
    if per_frame != pos_patch.shape[0]:
        raise ValueError(f"{per_frame} patches a frame, but pos_patch holds {pos_patch.shape[0]}")
    per_group = G * per_frame
    frame_of = torch.arange(per_group, device=frames.device) // per_frame
    pos = pos_frame[frame_of] + pos_patch.repeat(G, 1)  # [G gh gw, D]: the group's position rows
    out = []
    for g in range(F // G):
        x = rowwise_matmul(tokens[g * per_group:(g + 1) * per_group], patch_w.T) + pos
        for layer in range(attn_norm.shape[0]):
            x = x + _attend(rmsnorm(x, attn_norm[layer]), w_qkv[layer], w_o[layer], heads)
            h = rmsnorm(x, mlp_norm[layer])
            up = torch.nn.functional.gelu(rowwise_matmul(h, w_up[layer].T), approximate="tanh")
            x = x + rowwise_matmul(up, w_down[layer].T)
        out.append(rowwise_matmul(rmsnorm(x, out_norm), w_out.T))
    return out_cast(torch.cat(out, dim=0), frames.dtype, reference)


def splice(embeds: torch.Tensor, rows: torch.Tensor, placeholder: torch.Tensor) -> torch.Tensor:
    """The prompt's embedding rows [T, C] with ``rows`` [n, C] put, in order, at the n positions
    where ``placeholder`` [T] (bool) is true; the other rows unchanged. Returns a new tensor."""
    n = int(placeholder.sum())
    if rows.shape[0] != n or rows.shape[1:] != embeds.shape[1:]:
        raise ValueError(f"{n} placeholder positions need rows [{n}, {embeds.shape[1]}], got "
                         f"{tuple(rows.shape)}")
    out = embeds.clone()
    out[placeholder] = rows.to(embeds.dtype)
    return out


def frame_run(placeholder: torch.Tensor) -> tuple[int, int]:
    """(start, length) of the one contiguous run of frame tokens in a prompt's placeholder mask;
    (0, 0) for a prompt without one. Refuses more than one run."""
    idx = torch.nonzero(placeholder).flatten()
    if idx.numel() == 0:
        return 0, 0
    start, n = int(idx[0]), int(idx.numel())
    if int(idx[-1]) - start + 1 != n:
        raise ValueError("the frame tokens of a prompt must form one contiguous run")
    return start, n


def frame_positions(placeholder: torch.Tensor, frames: int, grid_h: int,
                    grid_w: int) -> torch.Tensor:
    """The [3, T] int64 mRoPE positions (rows t, h, w) of a prompt whose ``placeholder`` [T] marks one
    run of ``frames * grid_h * grid_w`` frame tokens (frame-major, raster order): Qwen2-VL's rule,
    see the module docstring. A prompt without frame tokens gets its plain positions on all rows."""
    T = placeholder.shape[0]
    start, n = frame_run(placeholder)
    if n != frames * grid_h * grid_w:
        raise ValueError(f"{n} frame tokens in the prompt, but {frames} frames of {grid_h}x{grid_w} "
                         f"patches need {frames * grid_h * grid_w}")
    pos = torch.arange(T, dtype=torch.int64).repeat(3, 1)
    if n == 0:
        return pos
    f = torch.arange(frames).repeat_interleave(grid_h * grid_w)
    i = torch.arange(grid_h).repeat_interleave(grid_w).repeat(frames)
    j = torch.arange(grid_w).repeat(frames * grid_h)
    pos[:, start:start + n] = start + torch.stack([f, i, j])
    after = start + max(frames, grid_h, grid_w)
    pos[:, start + n:] = torch.arange(after, after + T - start - n, dtype=torch.int64)
    return pos


def mrope_sections(rotary_dim: int) -> tuple[int, int, int]:
    """(t, h, w) frequency counts for ``rotary_dim // 2`` frequencies: ``c, c, n - 2c`` with
    ``c = ceil(n / 3)``, which is (11, 11, 10) at the target's 32 and (3, 3, 2) at the tiny model's 8."""
    n = rotary_dim // 2
    c = -(-n // 3)
    if n - 2 * c < 1:
        raise ValueError(f"rotary_dim {rotary_dim} has too few frequencies for three mRoPE sections")
    return c, c, n - 2 * c
