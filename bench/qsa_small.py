"""Benchmark the Triton QSA append, index store and index scores against the spec / torch path and the
memory floor.

Run on the GPU machine from the repository root:
    python3 bench/qsa_small.py [--out DIR]      # writes DIR/qsa_small.md (default reports/bench)
    python3 bench/qsa_small.py --smoke          # tiny shapes on the CPU (interpreter), no report
Shapes: a decode step of 128 requests and a 16K-token prefill chunk (one request), at the target
geometry (2 KV heads x 256, index 16 heads x 128), built by the cells' own input builders. The floor is
the bytes the op must move (inputs read once, new slots / scores written once) over the device-to-device
copy bandwidth measured in the same run. Kernels are timed in place (the engine's convention); the
spec path is the spec function (which clones whole pools, as its pure form must), so its column is the
cost of the reference, not a tuned torch peer. Each kernel is checked against the spec before timing.
Times: median of CUDA-graph replays (triton.testing), microseconds.
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import time
from pathlib import Path

import torch

import bench_common  # noqa: E402 (the checkout's root on the import path)
from certify.harness.target import run_spec, run_variant
from certify.harness.oracles import bitwise, tolerance
from impl.kernels.qsa import triton_append, triton_index
from spec.cases.qsa import index_scores_case, index_store_case, kv_append_case
from spec.ops import qsa
from bench_common import copy_bandwidth  # noqa: E402  (bench/ is the script's folder)

SHAPES = {"decode_b128": dict(step="decode", batch=128, rows=128, context=131072),
          "prefill_16k": dict(step="prefill", batch=1, rows=16384, context=16384)}
SMOKE = {"decode_b4": dict(step="decode", batch=4, rows=4, context=300),
         "prefill_96": dict(step="prefill", batch=1, rows=96, context=128)}
APPEND = dict(act_dtype="bfloat16", kv_heads=2, head_dim=256)
INDEX = dict(plane_dtype="bfloat16", act_dtype="bfloat16", index_dim=128, index_heads=16)
T0 = time.perf_counter()


def say(what: str) -> None:
    """Progress on stdout, so a run cut short by its time limit shows where it was."""
    print(f"[{time.perf_counter() - T0:.0f}s] {what}", flush=True)




def timed(call, cuda: bool, graph: bool = True) -> float:
    """Microseconds: CUDA-graph replay median on the GPU (plain launches for a call that synchronises
    with the host, as the spec path does), one wall-clock call on the CPU (smoke)."""
    call()
    if cuda:
        import triton.testing

        torch.cuda.synchronize()
        if not graph:
            return triton.testing.do_bench(call, rep=200, return_mode="median") * 1e3
        return triton.testing.do_bench_cudagraph(call, rep=200) * 1e3
    t0 = time.perf_counter()
    call()
    return (time.perf_counter() - t0) * 1e6


def _append_bytes(case, fmt: str) -> int:
    n = case.inputs["k"].numel()  # per K (and V): n tokens x heads x dim
    per = {"bf16": 2, "fp8": 1, "nvfp4": 0.5 + 1 / 16}[fmt]
    rows = case.inputs["seq_ids"].numel()
    return int(2 * (2 * n + n * per) + rows * 12)  # read bf16 k, v; write slots; seq, pos, page, pos


def bench_append(axes: dict, cuda: bool, dev) -> list[dict]:
    out = []
    for kv, fmt in (("bfloat16", "bf16"), ("fp8", "fp8"), ("nvfp4", "nvfp4")):
        case = kv_append_case(dict(axes, kv_dtype=kv, **APPEND), torch.Generator().manual_seed(1), dev)
        say(f"append {fmt}: case built")
        got = run_variant(triton_append.qsa_kv_append, case)
        ref = run_spec(qsa.qsa_kv_append, case, reference=False)
        ok = all(bitwise(n, got[n].cpu(), ref[n].cpu()).passed for n in case.outputs)
        i = case.inputs
        kp = (i["k_cache"],) if isinstance(i["k_cache"], torch.Tensor) else i["k_cache"]
        vp = (i["v_cache"],) if isinstance(i["v_cache"], torch.Tensor) else i["v_cache"]
        _, k_gs = triton_append.seam_format(kp, i["store"])
        _, v_gs = triton_append.seam_format(vp, i["store_v"])
        kern = lambda: triton_append.kv_append(kp, vp, i["pos_plane"], i["block_table"],  # noqa: E731
                                               i["seq_ids"], i["positions"], i["k"], i["v"], fmt,
                                               k_gs, v_gs)
        spec = lambda: qsa.qsa_kv_append(**i)  # noqa: E731
        out.append({"op": f"qsa_kv_append {fmt}", "ok": ok, "kernel": timed(kern, cuda),
                    "spec": timed(spec, cuda, graph=False), "bytes": _append_bytes(case, fmt)})
    return out


def bench_index(axes: dict, cuda: bool, dev) -> list[dict]:
    out = []
    case = index_store_case(dict(axes, **INDEX), torch.Generator().manual_seed(2), dev)
    say("index store: case built")
    got = run_variant(triton_index.qsa_index_store, case)
    ref = run_spec(qsa.qsa_index_store, case, reference=False)
    ok = all(bitwise(n, got[n].cpu(), ref[n].cpu()).passed for n in case.outputs)
    i = case.inputs
    kern = lambda: triton_index.index_store(i["index_plane"], i["block_keys"],  # noqa: E731
                                            i["block_key_valid"], i["block_table"], i["seq_ids"],
                                            i["positions"], i["k_index"])
    n, dim = i["k_index"].shape
    done = int((i["positions"] % 32 == 31).sum())
    nbytes = 2 * n * dim * 2 + done * (32 * dim * 2 + dim * 2) + n * 12
    # the spec's index store loops over pages on the host: too slow to graph-capture, timed once
    out.append({"op": "qsa_index_store", "ok": ok, "kernel": timed(kern, cuda),
                "spec": timed(lambda: qsa.qsa_index_store(**i), cuda, graph=False), "bytes": nbytes})
    say("index store: timed")
    case = index_scores_case(dict(axes, **INDEX), torch.Generator().manual_seed(3), dev)
    say("index scores: case built")
    got = run_variant(triton_index.qsa_index_scores, case)["scores"]
    ref = run_spec(qsa.qsa_index_scores, case, reference=True)["scores"]
    say("index scores: float64 spec done")
    # a sanity check that the timed code computes the op (a wrong score is far off); the bands are the
    # cells' job. Ulps are taken against the whole table's largest score: a row with a single column
    # whose heads cancel would otherwise be measured against its own tiny value
    v = tolerance("scores", got.cpu().flatten(), ref.cpu().flatten(), 64, 16, allow_matching_inf=True)
    ok = v.passed or print(v.problems)
    i = case.inputs
    scores = torch.empty(case.outputs["scores"].shape, dtype=torch.float32, device=dev)
    kern = lambda: triton_index.index_scores(i["q_index"], i["w_index"], i["seq_ids"],  # noqa: E731
                                             i["positions"], i["block_table"], i["block_keys"],
                                             scores)
    rows, heads, dim = i["q_index"].shape
    distinct = int(i["block_table"].ge(0).sum())
    nbytes = rows * (heads * dim * 2 + heads * 2 + 8) + distinct * dim * 2 + scores.numel() * 4
    out.append({"op": "qsa_index_scores", "ok": ok, "kernel": timed(kern, cuda),
                "spec": timed(lambda: qsa.qsa_index_scores(**i), cuda, graph=False), "bytes": nbytes})
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="reports/bench")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, no report")
    args = p.parse_args()
    cuda = not args.smoke
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke for the CPU check")
    dev = torch.device("cuda" if cuda else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    bw = copy_bandwidth() if cuda else float("nan")
    rows = []
    for name, axes in (SMOKE if args.smoke else SHAPES).items():
        for r in bench_append(axes, cuda, dev) + bench_index(axes, cuda, dev):
            r["shape"] = name
            r["floor"] = r["bytes"] / bw * 1e6
            rows.append(r)
            if not r["ok"]:
                print(f"{name} {r['op']}: CHECK FAILED against the spec")
    import triton

    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "triton": triton.__version__}
    gpu = torch.cuda.get_device_name() if cuda else "cpu (interpreter)"
    head = ["shape", "op", "checked", "bytes", "floor us", "triton us", "triton / floor", "spec us"]
    lines = [f"# QSA append / index store / index scores, {gpu}, {dt.date.today().isoformat()}", "",
             f"Versions: {versions}. Copy bandwidth (read + write) measured in this run: "
             f"{bw / 1e12:.2f} TB/s. Kernel times: median of CUDA-graph replays, in place; spec "
             "times: the spec function (pure: it clones whole planes; index store and scores loop "
             "on the host, timed once).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([r["shape"], r["op"], "yes" if r["ok"] else "FAILED",
                                         str(r["bytes"]), f"{r['floor']:.1f}", f"{r['kernel']:.1f}",
                                         f"{r['kernel'] / r['floor']:.2f}x", f"{r['spec']:.1f}"])
                     + " |")
    print("\n".join(lines))
    if not all(r["ok"] for r in rows):
        raise SystemExit(1)
    if args.smoke:
        print("smoke passed; nothing written")
    else:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        bench_common.write_report(out / "qsa_small.md", lines)


if __name__ == "__main__":
    main()
