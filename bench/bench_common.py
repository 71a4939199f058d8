"""What every benchmark script shares: the memory floor's bandwidth, measured in the same run, and
the GPU time of a call replayed from a CUDA graph.

Scripts run as ``python3 bench/NAME.py`` from the repository root, so this folder is on their import
path and ``import bench_common`` finds this module; importing it puts the checkout's root on the path
as well, so a script finds ``certify``, ``impl`` and ``spec`` with nothing installed (the GPU machine).
A script imports it before any of those.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))


def copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB of fp32, bytes read + written per second: the best of plain
    launches and graph replays (medians), so the floor is never flattered by a slow copy."""
    import triton.testing

    src = torch.randn(1 << 29, device="cuda")
    dst = torch.empty_like(src)
    nbytes = 2 * src.numel() * src.element_size()
    ms = min(triton.testing.do_bench(lambda: dst.copy_(src), rep=300, return_mode="median"),
             triton.testing.do_bench_cudagraph(lambda: dst.copy_(src), rep=300))
    del src, dst
    return nbytes / (ms * 1e-3)


def graph_us(fn) -> float:
    """Median microseconds of ``fn`` replayed from a CUDA graph (the GPU's time, no launch cost),
    after two warm-up calls (compiles) and one capture."""
    import triton.testing

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, rep=50, return_mode="median") * 1e3
