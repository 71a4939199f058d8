"""Time the hyper-connection Sinkhorn kernel (impl/kernels/hc/triton_hc.py ``_sinkhorn_kernel``) over
its launch shapes on the GPU, and check each against the shipped shape bit for bit.

Run on the GPU machine from the repository root:
    python3 bench/hc_sinkhorn.py [--out DIR]
    python3 bench/hc_sinkhorn.py --smoke      # a few tokens on the CPU (interpreter), nothing written
It writes ``hc_sinkhorn.md`` into DIR (default reports/bench): per token count (a decode step's 1,
32 and 128 rows, a 4096-row chunk) and per (tokens a program, warps), the median of CUDA-graph
replays and whether the result equals the shipped shape's bit for bit.
``--smoke`` launches every shape at 1 and 19 tokens on the CPU through Triton's interpreter (the
warps are not modelled there), checks each bit for bit against the shipped shape and the shipped
shape against the float64 spec (spec.ops.hc.sinkhorn, the sinkhorn cells' band), times nothing and
writes nothing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
from pathlib import Path

if "--smoke" in sys.argv[1:]:   # the interpreter is chosen when a kernel is decorated: before triton_hc
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common  # noqa: E402
from bench_common import graph_us  # noqa: E402

from certify.harness.oracles import tolerance  # noqa: E402
from impl.kernels.hc import triton_hc  # noqa: E402
from spec.ops.hc import SINKHORN_ITERS, sinkhorn  # noqa: E402

SHIPPED = (triton_hc.SINKHORN_TOKENS, triton_hc.SINKHORN_WARPS)
SHAPES = [SHIPPED] + [s for s in [(32, 4), (32, 1), (16, 1), (8, 1), (4, 1), (1, 1), (64, 2),
                                  (128, 4)] if s != SHIPPED]
TOKENS = (1, 32, 128, 4096)
SMOKE_TOKENS = (1, 19)   # one token; two and a part programs of the shipped 8
SINKHORN_BAND = (83, 4)  # certify/cells/sinkhorn.yaml: max ulp, max relative RMS (eps) of H


def _launch(M: torch.Tensor, out: torch.Tensor, bt: int, warps: int) -> None:
    T, n = M.shape[0], M.shape[-1]
    triton_hc._sinkhorn_kernel[(triton.cdiv(T, bt),)](M, out, T, SINKHORN_ITERS, N=n, BT=bt,
                                                      num_warps=warps)


def smoke() -> None:
    """Every shape at a few tokens on the CPU (interpreted): bit for bit the shipped shape's
    result, which is within the sinkhorn cells' band of the float64 spec; nothing timed or written."""
    gen = torch.Generator().manual_seed(0)
    failed = False
    for T in SMOKE_TOKENS:
        M = torch.exp(torch.randn(T, 4, 4, generator=gen) * 2).contiguous()
        ref = torch.empty_like(M)
        _launch(M, ref, *SHAPES[0])
        v = tolerance("H", ref, sinkhorn(M.double()), *SINKHORN_BAND)
        ulp = v.metrics.get("H.ulp", float("nan"))
        print(f"smoke {T} tokens, shipped {SHAPES[0]} vs float64 spec: {ulp:.3g} ulp "
              f"{'ok' if v.passed else 'FAILED ' + '; '.join(v.problems)}", flush=True)
        failed |= not v.passed
        for bt, warps in SHAPES[1:]:
            out = torch.full_like(M, float("nan"))
            _launch(M, out, bt, warps)
            same = torch.equal(out.view(torch.int32), ref.view(torch.int32))
            print(f"smoke {T} tokens, {bt} tokens a program, {warps} warps: "
                  f"{'same bits as shipped' if same else 'FAILED: differs from shipped'}")
            failed |= not same
    if failed:
        raise SystemExit(1)
    print("smoke passed; nothing written")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="reports/bench")
    ap.add_argument("--smoke", action="store_true",
                    help="a few tokens on the CPU (Triton's interpreter): every shape checked, "
                         "nothing timed or written")
    args = ap.parse_args()
    if args.smoke:
        return smoke()
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
    bench_common.write_report(out_dir / "hc_sinkhorn.md", lines)


if __name__ == "__main__":
    main()
