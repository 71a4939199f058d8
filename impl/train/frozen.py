"""A trained checkpoint as a frozen ``TrainModel``: the inverse of ``TrainModel.to_weights``, for
training a new part (the vision tower, impl/train/train_frames.py) through the trunk without changing
it.

The routed experts are the checkpoint's NVFP4 weights dequantized exactly; their inputs are quantized
with the checkpoint's own global scales (x_gs, h_gs) with a straight-through gradient, so the frozen
trunk computes the engine's MoE function (``FrozenMoE``). Everything else is the checkpoint's bf16
weights widened to fp32; the trunk runs in fp32 where the engine rounds activations to bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from impl.train import ops
from impl.train.model import GDN, HC, Layer, MoE, TrainModel
from spec.config import ModelConfig
from spec.model import HCSiteWeights, LayerWeights, MoEWeights, Weights


class FrozenMoE(MoE):
    """``MoE`` over exact dequantized experts, inputs quantized at the checkpoint's global scales."""

    def forward(self, u: torch.Tensor, cfg: ModelConfig, **_) -> torch.Tensor:
        p = torch.softmax(u @ self.router.T, -1)
        ids = torch.sort(p.detach(), dim=-1, descending=True, stable=True).indices[..., :cfg.moe_top_k]
        w_sel = torch.gather(p, -1, ids)
        w_sel = w_sel / w_sel.sum(-1, keepdim=True)
        dense = torch.zeros_like(p).scatter(-1, ids, w_sel)
        x = ops.fake_nvfp4(u, self.x_gs)
        h = F.silu(torch.einsum("btc,eic->btei", x, self.gate)) * torch.einsum("btc,eic->btei", x,
                                                                                self.up)
        h = ops.fake_nvfp4(h, self.h_gs)
        y = torch.einsum("btei,eci->btec", h, self.down)
        routed = (dense[..., None] * y).sum(2)
        shared = (F.silu(u @ self.s_gate.T) * (u @ self.s_up.T)) @ self.s_down.T
        return routed + torch.sigmoid(u @ self.s_sg)[..., None] * shared


def _set(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    getattr(module, name).data = value.detach().to(torch.float32).clone()


def _hc(mod: HC, w: HCSiteWeights) -> None:
    _set(mod, "phi", w.phi)
    _set(mod, "bias", w.bias)


def _moe(mod: MoE, w: MoEWeights) -> None:
    _set(mod, "router", w.router)
    e = w.experts
    for name in ("gate", "up", "down"):
        _set(mod, name, getattr(e, name).dequantize(torch.float32))
    for name, t in (("s_gate", w.shared.w_gate), ("s_up", w.shared.w_up),
                    ("s_down", w.shared.w_down), ("s_sg", w.shared.w_sg)):
        _set(mod, name, t)
    mod.__class__ = FrozenMoE
    mod.x_gs, mod.h_gs = e.x_gs.float().reshape(()), e.h_gs.float().reshape(())


def _layer(mod: Layer, w: LayerWeights) -> None:
    _set(mod, "norm_mixer", w.norm_mixer)
    _set(mod, "norm_moe", w.norm_moe)
    _hc(mod.hc_mixer, w.hc_mixer)
    _hc(mod.hc_moe, w.hc_moe)
    m = w.mixer
    if isinstance(mod.mixer, GDN):
        for name in ("in_proj_qkvz", "in_proj_ba", "conv_w", "A_log", "dt_bias", "norm_w",
                     "out_proj"):
            _set(mod.mixer, name, getattr(m, name))
    else:
        for name in ("w_q", "w_gate", "w_k", "w_v", "q_norm", "k_norm", "w_qI", "w_kI", "kI_norm",
                     "w_wI", "w_o"):
            _set(mod.mixer, name, getattr(m, name))
    _moe(mod.moe, w.moe)
    if w.ple is not None:
        _set(mod, "ple_gate", w.ple.w_gate)
        _set(mod, "ple_out", w.ple.w_out)
        _set(mod, "ple_norm", w.ple.norm_w)


def frozen_model(weights: Weights, cfg: ModelConfig) -> TrainModel:
    """A ``TrainModel`` computing ``weights``' trunk, every parameter frozen, in eval mode."""
    model = TrainModel(cfg)
    for name, t in (("embed", weights.embed), ("lm_head", weights.lm_head),
                    ("final_norm", weights.final_norm), ("ple_table", weights.ple.table),
                    ("ple_ngram", weights.ple.ngram_table), ("ple_w", weights.ple.w_ple),
                    ("ple_norm", weights.ple.norm_w)):
        _set(model, name, t)
    model.hash_cfg = weights.ple.hash_cfg
    for mod, w in zip(model.layers, weights.layers):
        _layer(mod, w)
    model.requires_grad_(False)
    return model.eval()
