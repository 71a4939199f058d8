"""Time the hyper-connection Sinkhorn kernel (impl/kernels/hc/triton_hc.py ``_sinkhorn_kernel``) over
its launch shapes on the GPU, and check each against the shipped shape bit for bit.

Run on the GPU machine from the repository root:
    python3 bench/hc_sinkhorn.py [--out DIR]
It writes ``hc_sinkhorn.md`` into DIR (default reports/bench): per token count (a decode step's 1,
32 and 128 rows, a 4096-row chunk) and per (tokens a program, warps), the median of CUDA-graph
replays and whether the result equals the shipped shape's bit for bit.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import graph_us  # noqa: E402

from impl.kernels.hc import triton_hc  # noqa: E402
from spec.ops.hc import SINKHORN_ITERS  # noqa: E402

SHIPPED = (triton_hc.SINKHORN_TOKENS, triton_hc.SINKHORN_WARPS)
SHAPES = [SHIPPED] + [s for s in [(32, 4), (32, 1), (16, 1), (8, 1), (4, 1), (1, 1), (64, 2),
                                  (128, 4)] if s != SHIPPED]
TOKENS = (1, 32, 128, 4096)


def _launch(M: torch.Tensor, out: torch.Tensor, bt: int, warps: int) -> None:
    T, n = M.shape[0], M.shape[-1]
    triton_hc._sinkhorn_kernel[(triton.cdiv(T, bt),)](M, out, T, SINKHORN_ITERS, N=n, BT=bt,
                                                      num_warps=warps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="reports/bench")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    lines = [f"# HC Sinkhorn kernel launch shapes ({dt.date.today()})", "",
             f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
             f"{triton.__version__}. {SINKHORN_ITERS} rounds over 4 x 4 matrices; us = median of "
             "CUDA-graph replays; same = bit for bit the shipped shape's result "
             f"({triton_hc.SINKHORN_TOKENS} tokens a program, {triton_hc.SINKHORN_WARPS} warps).", "",
             "| tokens | tokens a program | warps | us | same |", "|---|---|---|---|---|"]
    for T in TOKENS:
        M = torch.exp(torch.randn(T, 4, 4, device="cuda", generator=gen) * 2).contiguous()
        ref = torch.empty_like(M)
        _launch(M, ref, *SHAPES[0])
        for bt, warps in SHAPES:
            out = torch.full_like(M, float("nan"))
            _launch(M, out, bt, warps)
            same = torch.equal(out.view(torch.int32), ref.view(torch.int32))
            us = graph_us(lambda: _launch(M, out, bt, warps))  # noqa: B023
            lines.append(f"| {T} | {bt} | {warps} | {us:.1f} | {'yes' if same else 'NO'} |")
            print(lines[-1], flush=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "hc_sinkhorn.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
