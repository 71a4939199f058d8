"""Benchmark the GDN decode step on the GPU: each variant against the peers and the memory floor.

Run on the GPU machine from the repository root:
    python3 bench/gdn_decode.py [--out DIR]
It writes ``gdn_decode.md`` (a table with the date, the GPU and the versions) into DIR (default
reports/bench). The floor is the state bytes (read + write of every request's state) over the
device-to-device copy bandwidth measured in the same run. Every timing is the median of CUDA-graph
replays (triton.testing.do_bench), after a correctness check against the float64 spec.
Peers (FlashInfer, fla) are timed when they import; otherwise their column says so.
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
from pathlib import Path

import torch

from certify.catalog import load_op_file
from certify.harness import build_case, run_spec, run_variant, variant_callable
from certify.oracles import tolerance
from certify.paths import project_paths
from spec.ops import gdn

BATCHES = (1, 32, 128)


def copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB of fp32, bytes read + written per second: the best of plain
    launches and graph replays (medians), so the floor is never flattered by a slow copy."""
    import triton.testing

    src = torch.randn(1 << 29, device="cuda")
    dst = torch.empty_like(src)
    nbytes = 2 * src.numel() * src.element_size()
    ms = min(triton.testing.do_bench(lambda: dst.copy_(src), rep=300, return_mode="median"),
             triton.testing.do_bench_cudagraph(lambda: dst.copy_(src), rep=300))
    return nbytes / (ms * 1e-3)


def time_variant(fn, case) -> float:
    import triton.testing

    inputs = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in case.inputs.items()}
    out = torch.empty(case.outputs["out"].shape, dtype=case.outputs["out"].dtype, device="cuda")
    call = lambda: fn(**inputs, out=out)  # noqa: E731
    call()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(call, rep=200) * 1e3  # microseconds


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(project_paths().reports / "bench"))
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    op = load_op_file(project_paths().cells / "gdn_decode.yaml")
    bw = copy_bandwidth()
    rows = []
    for state_dtype in ("float32", "bfloat16"):
        for batch in BATCHES:
            cell = op.cells[0].model_copy(update={"id": f"bench_b{batch}_{state_dtype}",
                                                  "axes": {"batch": batch,
                                                           "state_dtype": state_dtype}})
            case = build_case(op, cell, torch.device("cuda"))
            ref = run_spec(gdn.gdn_decode, case, True)
            state_bytes = 2 * batch * case.inputs["state_pool"][0].numel() * \
                case.inputs["state_pool"].element_size()
            floor_us = state_bytes / bw * 1e6
            row = {"state": state_dtype, "batch": batch, "floor_us": floor_us}
            for v in op.variants:
                if "sm_90" not in v.archs:
                    continue
                fn = variant_callable(op, v.name)
                got = run_variant(fn, case)
                # A sanity check that the timed code computes the op (a wrong result is far off);
                # certification with derived bands is the cells' job, not the benchmark's.
                verdict = tolerance("out", got["out"].cpu(), ref["out"].cpu(), 64, 4)
                ok = verdict.passed
                if not ok:
                    print(f"{v.name} b{batch} {state_dtype}: check failed: {verdict.problems}")
                row[v.name] = time_variant(fn, case) if ok else float("nan")
                row[v.name + "_ok"] = ok
            rows.append(row)
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    import triton

    versions["triton"] = triton.__version__
    head = ["state", "batch", "floor us", *[f"{v.name} us" for v in op.variants],
            "best / floor"]
    lines = [f"# GDN decode step, {torch.cuda.get_device_name()}, {dt.date.today().isoformat()}", "",
             f"Versions: {versions}. Copy bandwidth (read + write) measured in this run: "
             f"{bw / 1e12:.2f} TB/s. Times: median of CUDA-graph replays, microseconds; each "
             f"variant checked against the float64 spec first (NaN = failed the check).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        times = [r.get(v.name, float("nan")) for v in op.variants]
        best = min((t for t in times if t == t), default=float("nan"))
        lines.append("| " + " | ".join([r["state"], str(r["batch"]), f"{r['floor_us']:.1f}",
                                         *[f"{t:.1f}" for t in times],
                                         f"{best / r['floor_us']:.2f}x"]) + " |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gdn_decode.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
