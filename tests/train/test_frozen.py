"""The frozen trunk (impl/train/frozen.py) computes the checkpoint it was loaded from: a model's
exported weights, loaded back, give the model's own logits; and the training ops rotate frame
prompts by the spec's mRoPE angles."""

from __future__ import annotations

import torch

from impl.train import ops
from impl.train.frozen import FrozenMoE, frozen_model
from impl.train.model import TrainModel
from spec.config import ModelConfig
from spec.ops.rope import apply_neox_rope, rope_angles
from spec.ops.vision import frame_positions, mrope_sections

TINY = ModelConfig.tiny()


def test_exported_weights_loaded_back_give_the_models_logits():
    torch.manual_seed(0)
    model = TrainModel(TINY, seed=4)
    ids = torch.randint(4, 256, (2, 48), generator=torch.Generator().manual_seed(2))
    model.train()
    model(ids)                     # fills the NVFP4 calibration
    model.eval()
    model.set_qat(True)
    frozen = frozen_model(model.to_weights(), TINY)
    assert all(isinstance(layer.moe, FrozenMoE) for layer in frozen.layers)
    assert not any(p.requires_grad for p in frozen.parameters())
    with torch.no_grad():
        want, _ = model(ids)
        got, _ = frozen(ids)
    rel = float((got - want).abs().max() / want.abs().max())
    # fp32 sums in the same order on both sides: the only difference is the expert weights, exact
    # dequantized values here and fake-quantized values there (the same numbers)
    assert rel < 1e-5, rel


def test_the_training_rope_reads_the_frame_positions_as_the_spec_does():
    mask = torch.tensor([0, 0, 0] + [1] * 16 + [0] * 4, dtype=torch.bool)
    pos = frame_positions(mask, 4, 2, 2)
    x = torch.randn(1, pos.shape[1], 3, 32, dtype=torch.float64)
    got = ops.rope(x, pos, 16, 1e7)
    ang = rope_angles(pos, 16, 1e7, mrope_sections(16))
    want = apply_neox_rope(x[0], torch.cos(ang), torch.sin(ang))
    assert torch.allclose(got[0], want, rtol=0, atol=1e-12)
    plain = ops.rope(x, torch.arange(pos.shape[1]), 16, 1e7)
    assert not torch.allclose(got, plain)                                  # frame rows differ
    assert torch.equal(got[0, :3], plain[0, :3])                           # text before them not


def test_a_short_frame_run_moves_the_tower_only():
    from impl.train.train_frames import train
    from impl.model.vision import vision_geometry
    from spec.ops.vision import init_vision_weights

    logs = []
    weights, info = train(steps=2, batch=4, lr=5e-3, seed=0, log=logs.append)
    init = init_vision_weights(vision_geometry("tiny"), torch.Generator().manual_seed(0)).as_dict()
    moved = [k for k, v in weights.as_dict().items() if not torch.equal(v, init[k])]
    assert "patch_w" in moved and "w_qkv" in moved
    assert info["steps"] == 2 and len(info["history"]) == 1 and logs[0].startswith("step 0:")
