"""The architectures a variant can run on, and which of them this machine has.

- ``cpu``: torch on the CPU.
- ``cpu-interpret``: Triton kernels through ``TRITON_INTERPRET=1`` on the CPU (fp32 math).
- ``sm_90`` (and other ``sm_XY``): a CUDA device of that compute capability.
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache

import torch


@lru_cache(maxsize=None)
def cuda_arch() -> str | None:
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def interpreter_available() -> bool:
    """Triton's interpreter runs only when no GPU drives Triton in this process (TRITON_INTERPRET is read
    when a kernel is decorated, so one process is either interpreting or compiling)."""
    if importlib.util.find_spec("triton") is None:
        return False
    return cuda_arch() is None or os.environ.get("TRITON_INTERPRET") == "1"


def choose_triton_mode() -> None:
    """With no GPU, Triton kernels run interpreted; the choice must precede any Triton import."""
    if cuda_arch() is None:
        os.environ.setdefault("TRITON_INTERPRET", "1")


def is_runtime_arch(arch: str) -> bool:
    """Whether a forward can dispatch for ``arch``: ``cpu-interpret`` certifies Triton kernels through
    the interpreter on behalf of a GPU arch, but no engine runs on it (``runtime_arch``)."""
    return arch != "cpu-interpret"


def present_archs() -> list[str]:
    archs = ["cpu"]
    if interpreter_available():
        archs.append("cpu-interpret")
    if cuda_arch():
        archs.append(cuda_arch())
    return archs


def device_for(arch: str) -> torch.device:
    return torch.device("cuda") if arch.startswith("sm_") else torch.device("cpu")


def runtime_arch() -> str:
    """The arch the target dispatches for in this process: the GPU if there is one, else the CPU."""
    return cuda_arch() or "cpu"
