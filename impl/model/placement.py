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


# cudaHostRegister's flags: portable (every context) and mapped (a device address)
_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02


class _DeviceView:
    """``__cuda_array_interface__`` over a device address: torch.as_tensor wraps it without a copy."""

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": shape, "typestr": typestr,
                                         "strides": None, "version": 3}


def cuda_alias(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor on ``device`` aliasing ``host``, a CPU tensor in memory the device can address
    (registered with ``cudaHostRegister``, or pinned by ``cudaHostAlloc``): under unified
    addressing the device reads it at its host address, checked by reading the first rows back."""
    raw = {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8"}[host.element_size()]
    with torch.cuda.device(device):
        view = torch.as_tensor(_DeviceView(host.data_ptr(), tuple(host.shape), raw), device=device)
    view = view.view(host.dtype)
    probe = min(host.shape[0], 4) if host.dim() else 0
    if probe and not torch.equal(view[:probe].cpu(), host[:probe]):
        raise RuntimeError("the device does not read this host memory at its host address (no "
                           "unified addressing for it)")
    return view


class HostMapped:
    """Tensors kept in host memory, registered with the CUDA runtime and mapped into the device's
    address space (``cudaHostRegister``: pageable memory made device-readable in place, not
    ``cudaHostAlloc``'s pinned allocations), each read by the device through a CUDA tensor that
    aliases it (``cuda_alias``). Keeps the host tensors alive; ``release`` unregisters them."""

    def __init__(self):
        self._host: list[torch.Tensor] = []

    def map(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A CUDA tensor on ``device`` aliasing a registered host copy of ``t`` (any device)."""
        host = torch.empty(t.shape, dtype=t.dtype)            # pageable
        host.copy_(t)
        nbytes = host.numel() * host.element_size()
        err = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, _REGISTER_PORTABLE_MAPPED)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: {err}")
        self._host.append(host)
        return cuda_alias(host, device)

    def release(self) -> None:
        for host in self._host:
            torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
        self._host.clear()


def with_host_ple_tables(weights, device: torch.device, mapped: HostMapped):
    """``weights`` with the PLE tables E and G moved to mapped host memory (``HostMapped``); every
    other tensor stays where it is."""
    ple = weights.ple
    return dataclasses.replace(weights, ple=dataclasses.replace(
        ple, table=mapped.map(ple.table, device), ngram_table=mapped.map(ple.ngram_table, device)))
