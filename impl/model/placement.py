"""Moving a model's weights to the engine's device."""

from __future__ import annotations

import dataclasses

import torch


def to_device(obj, device: str | torch.device):
    """A copy of a weights tree with every tensor on ``device`` (dataclasses rebuilt field by field,
    lists element by element; anything else kept as it is)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, list):
        return [to_device(o, device) for o in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(to_device(o, device) for o in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: to_device(getattr(obj, f.name), device)
                                          for f in dataclasses.fields(obj) if f.init})
    return obj
