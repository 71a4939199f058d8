"""``init_weights`` on a device other than the CPU (spec/model.py ``_Draw``): fp32 draws from that
device's generator and one quantizer call per NVFP4 stack. CI has no GPU, so the device branch runs
here on the CPU (``on_host`` off): the same shapes and dtypes as the CPU's weights, another model."""

from __future__ import annotations

import dataclasses

import torch

import spec.model as model
from spec.config import ModelConfig
from spec.ops.moe import NvFp4Weight


def _leaves(obj, path=""):
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _leaves(getattr(obj, f.name), f"{path}.{f.name}")
    elif isinstance(obj, (list, tuple)):
        for i, x in enumerate(obj):
            yield from _leaves(x, f"{path}[{i}]")


def _device_branch(monkeypatch) -> None:
    real = model._Draw.__init__

    def init(self, seed, device):
        real(self, seed, device)
        self.on_host = False   # the branch a cuda device takes, here with the CPU's generator

    monkeypatch.setattr(model._Draw, "__init__", init)


def test_device_draws_have_the_host_draws_shapes_and_dtypes(monkeypatch):
    cfg = ModelConfig.tiny()
    host = dict(_leaves(model.init_weights(cfg, seed=0, dtype=torch.bfloat16)))
    _device_branch(monkeypatch)
    dev = dict(_leaves(model.init_weights(cfg, seed=0, dtype=torch.bfloat16)))
    assert dev.keys() == host.keys()
    for k in host:
        assert (dev[k].shape, dev[k].dtype) == (host[k].shape, host[k].dtype), k
    assert not torch.equal(dev[".embed"], host[".embed"])   # another model, not the host's draws


def test_a_device_drawn_stack_shares_one_global_scale_and_keeps_nvfp4_accuracy(monkeypatch):
    _device_branch(monkeypatch)
    d = model._Draw(5, torch.device("cpu"))
    w = d.nvfp4((4, 32, 64), 0.125)
    assert isinstance(w, NvFp4Weight) and w.packed.shape == (4, 32, 32) and w.sf.shape == (4, 32, 4)
    assert torch.equal(w.gs, w.gs[:1].expand(4))
    dense = torch.randn((4, 32, 64), generator=torch.Generator().manual_seed(5)) * 0.125
    err = (w.dequantize(torch.float32) - dense).pow(2).mean().sqrt() / dense.pow(2).mean().sqrt()
    # e2m1 with a per-16 e4m3 scale: about 10 % relative RMS on Gaussian blocks (9.6 % here); a wrong scale or
    # nibble order gives O(1)
    assert err < 0.15, float(err)
