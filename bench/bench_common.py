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


_BEFORE: dict[Path, str] = {}   # each report file as this process first found it


def _demoted(lines: list[str]) -> list[str]:
    """Headings one level down, so a run's own title becomes a section of the report file."""
    return ["#" + line if line.startswith("#") else line for line in lines]


def write_report(path: Path, lines: list[str]) -> None:
    """Write one run's report (``lines``, a ``# title`` first) into ``path`` without losing the runs
    already there: the file keeps its title and introduction (what precedes its first ``## ``
    section), then this run as the newest section, then the earlier sections. A file that is one
    earlier run (no sections) becomes that run's section. A script that writes its report several
    times in one run (rows kept as they come) replaces its own section each time. The write is
    atomic."""
    from certify.files.atomic import atomic_write_text  # noqa: PLC0415

    path = Path(path)
    if not lines or not lines[0].startswith("# "):
        raise ValueError(f"{path}: a report starts with a '# ' title line, got {lines[:1]!r}")
    if path not in _BEFORE:
        _BEFORE[path] = path.read_text(encoding="utf-8") if path.exists() else ""
    old = _BEFORE[path].rstrip("\n").split("\n") if _BEFORE[path].strip() else []
    if not old:
        atomic_write_text(path, "\n".join(lines) + "\n")
        return
    first = next((i for i, line in enumerate(old) if line.startswith("## ")), None)
    if first is None:                    # the whole file is one earlier run
        head, earlier = [old[0], ""], _demoted(old)
    else:
        head, earlier = old[:first], old[first:]
    run = _demoted(lines)
    while run and not run[-1].strip():
        run.pop()
    atomic_write_text(path, "\n".join([*head, *run, "", *earlier]) + "\n")
