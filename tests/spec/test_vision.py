"""vision_tower, the splice and the frame positions of docs/spec.md, "Vision input"."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spec.ops.rope import MROPE_SECTIONS, ROTARY_DIM, rope_angles
from spec.ops.vision import (FRAME_TOKEN, VisionConfig, frame_positions, init_vision_weights,
                             mrope_sections, patchify, splice, vision_tower)

CFG = VisionConfig(width=32, mlp=64, out_width=48)


def _frames(gen: torch.Generator, n: int, cfg: VisionConfig = CFG) -> torch.Tensor:
    return torch.rand(n, cfg.channels, cfg.frame_size, cfg.frame_size, generator=gen,
                      dtype=torch.float64) * 2 - 1


def _weights(seed: int, cfg: VisionConfig = CFG, dtype=torch.float64) -> dict:
    return init_vision_weights(cfg, torch.Generator().manual_seed(seed), dtype=dtype).as_dict()


@pytest.mark.certify_property("vision_tower")
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2 ** 31), groups=st.integers(2, 3), swap=st.integers(0, 5))
def test_a_group_of_frames_does_not_see_the_others_and_bf16_rounds_once(seed, groups, swap):
    gen = torch.Generator().manual_seed(seed)
    w = _weights(seed)
    frames = _frames(gen, CFG.group * groups)
    out = vision_tower(frames, **w, heads=CFG.heads)
    per_group = CFG.group * CFG.tokens_per_frame
    assert out.shape == (frames.shape[0] * CFG.tokens_per_frame, CFG.out_width)
    # Each group alone gives its own rows, bit for bit.
    for g in range(groups):
        alone = vision_tower(frames[g * CFG.group:(g + 1) * CFG.group], **w, heads=CFG.heads)
        assert torch.equal(alone, out[g * per_group:(g + 1) * per_group])
    # Changing a frame of one group moves that group's rows only.
    g = swap % groups
    other = frames.clone()
    other[g * CFG.group] = _frames(gen, 1)[0]
    moved = vision_tower(other, **w, heads=CFG.heads)
    for h in range(groups):
        rows = slice(h * per_group, (h + 1) * per_group)
        assert torch.equal(moved[rows], out[rows]) == (h != g)
    # The bf16 path: fp32 math, one rounding at the end, so within one bf16 ulp of the float64
    # value rounded once (fp32's error moves a value across a rounding boundary at most).
    fb = frames.to(torch.bfloat16)
    wb = {k: v.to(torch.bfloat16) for k, v in w.items()}
    lowp = vision_tower(fb, **wb, heads=CFG.heads)
    ideal = vision_tower(fb.double(), **{k: v.double() for k, v in wb.items()}, heads=CFG.heads)
    assert lowp.dtype == torch.bfloat16
    diff = (lowp.double() - ideal).abs()
    assert (diff <= ideal.abs() * 2 ** -7 + 1e-30).all()


@pytest.mark.certify_guard("vision_tower")
def test_vision_tower_guard():
    """One 1 x 2 x 2 frame, patch 2, width 2, one block of zero weights (it adds nothing):
    x = (1, 2) from W_patch picking the first two pixels; rmsnorm gives (1, 2) / sqrt(2.5); W_out sums
    them: 3 / sqrt(2.5 + 1e-6)."""
    frames = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]], dtype=torch.float64)
    z = lambda *s: torch.zeros(*s, dtype=torch.float64)  # noqa: E731
    out = vision_tower(frames, patch_w=torch.eye(2, 4, dtype=torch.float64), pos_frame=z(1, 2),
                       pos_patch=z(1, 2), attn_norm=z(1, 2), w_qkv=z(1, 6, 2), w_o=z(1, 2, 2),
                       mlp_norm=z(1, 2), w_up=z(1, 4, 2), w_down=z(1, 2, 4), out_norm=z(2),
                       w_out=torch.ones(1, 2, dtype=torch.float64), heads=1)
    assert out.tolist() == [[pytest.approx(3 / math.sqrt(2.5 + 1e-6), rel=1e-15)]]


def test_patchify_orders_frames_then_rows_then_columns_then_channels():
    frames = torch.arange(2 * 2 * 4 * 4).reshape(2, 2, 4, 4)
    p = patchify(frames, 2)
    assert p.shape == (8, 8)
    # frame 1, patch (1, 0): rows 2..3, columns 0..1 of both channels
    assert p[4 + 2].tolist() == frames[1, :, 2:4, 0:2].reshape(-1).tolist()


def test_the_tower_refuses_a_frame_count_that_splits_a_group():
    w = _weights(0)
    with pytest.raises(ValueError, match="multiple of the group"):
        vision_tower(_frames(torch.Generator().manual_seed(0), CFG.group + 1), **w, heads=CFG.heads)


def test_frame_positions_follow_qwen2_vl():
    """BOS, two text tokens, 2 frames of 2 x 2 patches, then two text tokens."""
    mask = torch.tensor([0, 0, 0] + [1] * 8 + [0, 0], dtype=torch.bool)
    pos = frame_positions(mask, 2, 2, 2)
    assert pos[:, :3].tolist() == [[0, 1, 2]] * 3
    assert pos[0, 3:11].tolist() == [3, 3, 3, 3, 4, 4, 4, 4]   # t: the frame
    assert pos[1, 3:11].tolist() == [3, 3, 4, 4, 3, 3, 4, 4]   # h: the patch row
    assert pos[2, 3:11].tolist() == [3, 4, 3, 4, 3, 4, 3, 4]   # w: the patch column
    assert pos[:, 11:].tolist() == [[5, 6]] * 3                  # 3 + max(2, 2, 2)


def test_frame_positions_refuse_a_split_run_and_a_wrong_count():
    with pytest.raises(ValueError, match="one contiguous run"):
        frame_positions(torch.tensor([0, 1, 0, 1], dtype=torch.bool), 2, 1, 1)
    with pytest.raises(ValueError, match="need 4"):
        frame_positions(torch.tensor([0, 1, 1, 1], dtype=torch.bool), 1, 2, 2)


def test_equal_rows_rotate_as_plain_positions():
    pos = frame_positions(torch.zeros(40, dtype=torch.bool), 0, 1, 1)
    assert torch.equal(rope_angles(pos), rope_angles(torch.arange(40)))


def test_mrope_sections_give_the_target_split_and_a_tiny_one():
    assert mrope_sections(ROTARY_DIM) == MROPE_SECTIONS
    assert mrope_sections(16) == (3, 3, 2)


def test_splice_puts_the_rows_at_the_placeholders_in_order():
    ids = torch.tensor([1, 65, FRAME_TOKEN, FRAME_TOKEN, 66])
    embeds = torch.arange(10.0).reshape(5, 2)
    rows = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]])
    out = splice(embeds, rows, ids == FRAME_TOKEN)
    assert out.tolist() == [[0, 1], [2, 3], [-1, -2], [-3, -4], [8, 9]]
    with pytest.raises(ValueError, match="2 placeholder positions"):
        splice(embeds, rows[:1], ids == FRAME_TOKEN)
