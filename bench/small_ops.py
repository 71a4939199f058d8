"""Benchmark the small fused kernels on the GPU: each sm_90 variant against torch eager (the spec's
own bf16 path, a plain torch composition) and the memory floor.

Run on the GPU machine from the repository root:
    python3 bench/small_ops.py [--out DIR]
It writes ``small_ops.md`` into DIR (default reports/bench) with the date, the GPU and the versions.
Shapes are the target's launches (decode 128 requests, a 16384-token prefill chunk, 128 x 8 verify
logit rows). The floor is the bytes every input is read once and every output written once, over the
device-to-device copy bandwidth measured in the same run. Times are medians of plain launches (a
wrapper may read a value on the host, which a CUDA graph cannot hold); each variant is checked
against the float64 spec first with a loose sanity band (certification is the cells' job).
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common  # noqa: E402
from bench_common import copy_bandwidth  # noqa: E402

from certify.catalog.load import load_op_file  # noqa: E402
from certify.harness.target import build_case, resolve, run_spec, run_variant, variant_callable  # noqa: E402
from certify.harness.oracles import tolerance  # noqa: E402
from certify.files.paths import project_paths  # noqa: E402

# (op, label, axes overriding the op's first cell)
SHAPES = [
    ("rmsnorm", "decode 128 x 3072", {"rows": 128, "hidden": 3072}),
    ("rmsnorm", "prefill 16384 x 3072", {"rows": 16384, "hidden": 3072}),
    ("qk_norm_rope", "decode 128, 24 + 2 heads x 256", {"step": "decode", "rows": 128,
                                                        "context": 131072, "rope": "plain"}),
    ("qk_norm_rope", "prefill 16384, 24 + 2 heads x 256", {"step": "prefill", "rows": 16384,
                                                           "context": 16384, "rope": "plain"}),
    ("logits_cast", "verify 1024 x 151936", {"rows": 1024, "value_set": "lm_logits"}),
]


def _nbytes(x) -> int:
    return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0


SMOKE_SHAPES = [
    ("rmsnorm", "smoke", {"rows": 4, "hidden": 256}),
    ("qk_norm_rope", "smoke", {"step": "decode", "rows": 2, "context": 4096, "rope": "plain"}),
    ("logits_cast", "smoke", {"rows": 2, "value_set": "lm_logits"}),
]
DEVICE = torch.device("cuda")


def _time(call, graph: bool) -> float:
    import triton.testing

    call()
    if DEVICE.type == "cpu":  # --smoke: one timed call, only to show the script runs
        import time
        t0 = time.perf_counter()
        call()
        return (time.perf_counter() - t0) * 1e6
    torch.cuda.synchronize()
    if graph:
        return triton.testing.do_bench_cudagraph(call, rep=200) * 1e3
    return triton.testing.do_bench(call, rep=200, return_mode="median") * 1e3


def bench_one(op_name: str, axes: dict, bw: float) -> dict:
    op = load_op_file(project_paths().cells / f"{op_name}.yaml")
    base = op.cells[0]
    cell = base.model_copy(update={"id": "bench", "axes": {**base.axes, **axes}})
    case = build_case(op, cell, DEVICE)
    spec = resolve(op.spec)
    ref = run_spec(spec, case, True)
    moved = sum(_nbytes(v) for v in case.inputs.values()) + \
        sum(int(torch.Size(o.shape).numel()) * torch.empty((), dtype=o.dtype).element_size()
            for o in case.outputs.values())
    row = {"floor_us": moved / bw * 1e6, "bytes": moved}
    for v in op.variants:
        if "sm_90" not in v.archs:
            continue
        fn = variant_callable(op, v.name)
        got = run_variant(fn, case)
        ok = all(tolerance(n, got[n].cpu(), ref[n].cpu(), 64, 4).passed
                 if got[n].is_floating_point() else torch.equal(got[n].cpu(), ref[n].cpu())
                 for n in case.outputs)
        outs = {n: torch.empty(o.shape, dtype=o.dtype, device=DEVICE) for n, o in case.outputs.items()}
        # plain launches: a wrapper may read a value on the host (the RoPE table's extent)
        row[v.name] = _time(lambda: fn(**case.inputs, **outs), graph=False) if ok else float("nan")
    row["torch eager"] = _time(lambda: run_spec(spec, case, False), graph=False)
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(project_paths().reports / "bench"))
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU; writes no report")
    args = p.parse_args()
    global DEVICE
    if args.smoke:
        DEVICE = torch.device("cpu")
        for op, label, axes in SMOKE_SHAPES:
            print(op, label, bench_one(op, axes, 1e10))
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    bw = copy_bandwidth()
    rows = [(op, label, bench_one(op, axes, bw)) for op, label, axes in SHAPES]
    import triton

    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "triton": triton.__version__}
    head = ["op", "shape", "MB moved", "floor us", "triton us", "floor / triton", "torch eager us",
            "eager / triton"]
    lines = [f"# Small fused kernels, {torch.cuda.get_device_name()}, {dt.date.today().isoformat()}",
             "", f"Versions: {versions}. Copy bandwidth (read + write) measured in this run: "
             f"{bw / 1e12:.2f} TB/s. Times: medians of plain launches, microseconds (a small "
             "kernel's time includes what its launch costs; torch eager is the spec's bf16 path). NaN = the variant failed its check "
             "against the float64 spec.", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for op, label, r in rows:
        t = r.get("triton", float("nan"))
        lines.append(f"| {op} | {label} | {r['bytes'] / 1e6:.1f} | {r['floor_us']:.1f} | {t:.1f} | "
                     f"{r['floor_us'] / t:.0%} | {r['torch eager']:.1f} | "
                     f"{r['torch eager'] / t:.1f}x |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bench_common.write_report(out / "small_ops.md", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
