"""Benchmark the GDN decode step on the GPU: each variant against the peers and the memory floor.

Run on the GPU machine from the repository root:
    python3 bench/gdn_decode.py [--out DIR]
    python3 bench/gdn_decode.py --smoke      # batch 2 on the CPU (interpreter), nothing written
It writes ``gdn_decode.md`` (a table with the date, the GPU and the versions) into DIR (default
reports/bench). The floor is the state bytes (read + write of every request's state) over the
device-to-device copy bandwidth measured in the same run. Every timing is the median of CUDA-graph
replays (triton.testing.do_bench), after a correctness check against the float64 spec.
Peers (FlashInfer, fla) are timed on the fp32 state when they import, otherwise their column says
why not; they run the recurrence only (no gated norm, no pool indirection), so the comparison is
conservative for the fused variants. Their output o is checked against the float64 spec's o and the
relative error printed beside the time.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
from pathlib import Path

import torch

import bench_common  # noqa: E402 (the checkout's root on the import path)
from certify.catalog.load import load_op_file
from certify.harness.target import build_case, run_spec, run_variant, variant_callable
from certify.harness.oracles import tolerance
from certify.files.paths import project_paths
from spec.ops import gdn
from bench_common import copy_bandwidth  # noqa: E402  (bench/ is the script's folder)

BATCHES = (1, 32, 128)


def time_variant(fn, case) -> float:
    import triton.testing

    inputs = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in case.inputs.items()}
    out = torch.empty(case.outputs["out"].shape, dtype=case.outputs["out"].dtype, device="cuda")
    call = lambda: fn(**inputs, out=out)  # noqa: E731
    call()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(call, rep=200) * 1e3  # microseconds


def _peer_inputs(case):
    """The decode step's inputs as the peers take them: one row a request ([B, 1, ...]), the state
    gathered from the pool into [B, HV, K, V] fp32 (the peers' in-place state), and the float64
    reference of the recurrence output o (before the gated norm, which the peers do not fuse)."""
    i = case.inputs
    rows = {n: i[n].unsqueeze(1).contiguous() for n in ("q", "k", "v", "a", "b")}
    state = i["state_pool"][i["slots"].long()].float().contiguous()
    g, beta = gdn.gdn_gates(*(x.double() for x in (rows["a"], rows["b"], i["A_log"], i["dt_bias"])))
    o_ref, _, _ = gdn.gdn_recurrent(rows["q"].double(), rows["k"].double(), rows["v"].double(), g,
                                    beta, state.double(), record=False)
    return rows, state, o_ref


def _rel_err(got, ref) -> float:
    return float((got.double() - ref).norm() / ref.norm())


def peer_flashinfer(case):
    """FlashInfer's GDN decode (K-major state [B, HV, K, V], fp32), recurrence only."""
    from flashinfer import gdn_decode as fi

    rows, state, o_ref = _peer_inputs(case)
    i = case.inputs
    call = lambda st: fi.gated_delta_rule_decode(  # noqa: E731
        q=rows["q"], k=rows["k"], v=rows["v"], state=st, A_log=i["A_log"], a=rows["a"],
        dt_bias=i["dt_bias"], b=rows["b"], scale=None, use_qk_l2norm=True)
    out = call(state.clone())
    out = out[0] if isinstance(out, tuple) else out
    err = _rel_err(out.reshape(o_ref.shape), o_ref)
    return lambda: call(state), err


def peer_fla(case):
    """fla's fused recurrent gated delta rule (state [B, HV, K, V] fp32), recurrence only."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fr

    rows, state, o_ref = _peer_inputs(case)
    i = case.inputs
    g, beta = gdn.gdn_gates(rows["a"], rows["b"], i["A_log"], i["dt_bias"])
    hv, hk = rows["v"].shape[2], rows["q"].shape[2]
    q, k = (rows[n].repeat_interleave(hv // hk, dim=2) for n in ("q", "k"))
    call = lambda: fr(q=q, k=k, v=rows["v"], g=g, beta=beta, initial_state=state,  # noqa: E731
                      output_final_state=True, use_qk_l2norm_in_kernel=True)
    out = call()[0]
    return call, _rel_err(out.reshape(o_ref.shape), o_ref)


PEERS = {"flashinfer": peer_flashinfer, "fla": peer_fla}


def time_peer(make, case):
    """(microseconds, relative error of o against float64) or the reason the peer did not run."""
    import triton.testing

    try:
        call, err = make(case)
        call()
        torch.cuda.synchronize()
        return triton.testing.do_bench_cudagraph(call, rep=200) * 1e3, err
    except Exception as e:  # noqa: BLE001 - a missing or incompatible peer is reported, not fatal
        return f"{type(e).__name__}: {str(e)[:80]}", None


def check_variant(op, name, case, ref) -> tuple[object, bool, str]:
    """(the variant's callable, whether its out is near the float64 spec, why not). A variant that
    raises (FlashInfer's on a bf16 state pool, say) is reported, not fatal. A sanity check that the
    timed code computes the op (a wrong result is far off); certification with derived bands is the
    cells' job, not the benchmark's."""
    fn = variant_callable(op, name)
    try:
        got = run_variant(fn, case)
    except Exception as e:  # noqa: BLE001 - reported in the variant's column
        return fn, False, f"{type(e).__name__}: {str(e)[:80]}"
    verdict = tolerance("out", got["out"].cpu(), ref["out"].cpu(), 64, 4)
    return fn, verdict.passed, "" if verdict.passed else "; ".join(verdict.problems)[:120]


def _case(op, batch: int, state_dtype: str, device: str):
    cell = op.cells[0].model_copy(update={"id": f"bench_b{batch}_{state_dtype}",
                                          "axes": {"batch": batch, "state_dtype": state_dtype}})
    return build_case(op, cell, torch.device(device))


def smoke(op) -> None:
    """Each variant that runs on a CPU arch, at batch 2, checked against the spec; nothing timed or
    written."""
    for state_dtype in ("float32", "bfloat16"):
        case = _case(op, 2, state_dtype, "cpu")
        ref = run_spec(gdn.gdn_decode, case, True)
        for v in op.variants:
            if {"cpu", "cpu-interpret"} & set(v.archs):
                _, ok, why = check_variant(op, v.name, case, ref)
                print(f"smoke {v.name} b2 {state_dtype}: {'ok' if ok else 'FAILED ' + why}")
                if not ok:
                    raise SystemExit(1)
    print("smoke passed; nothing written")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(project_paths().reports / "bench"),
                   help="the folder gdn_decode.md is written to")
    p.add_argument("--smoke", action="store_true",
                   help="batch 2 on the CPU (Triton's interpreter): checks each CPU variant, times "
                        "nothing, writes nothing")
    args = p.parse_args()
    op = load_op_file(project_paths().cells / "gdn_decode.yaml")
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel is decorated
        return smoke(op)
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: timings come from the GPU machine (use --smoke here)")
    torch.backends.cuda.matmul.allow_tf32 = False
    bw = copy_bandwidth()
    rows = []
    for state_dtype in ("float32", "bfloat16"):
        for batch in BATCHES:
            case = _case(op, batch, state_dtype, "cuda")
            ref = run_spec(gdn.gdn_decode, case, True)
            state_bytes = 2 * batch * case.inputs["state_pool"][0].numel() * \
                case.inputs["state_pool"].element_size()
            row = {"state": state_dtype, "batch": batch, "floor_us": state_bytes / bw * 1e6,
                   "variants": {}, "peers": {}}
            for v in op.variants:
                if "sm_90" not in v.archs:
                    continue
                fn, ok, why = check_variant(op, v.name, case, ref)
                if not ok:
                    print(f"{v.name} b{batch} {state_dtype}: not timed: {why}")
                row["variants"][v.name] = time_variant(fn, case) if ok else why
            if state_dtype == "float32":
                for peer, make in PEERS.items():
                    row["peers"][peer] = time_peer(make, case)
            rows.append(row)
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    import triton

    versions["triton"] = triton.__version__
    for peer, module in (("flashinfer", "flashinfer"), ("fla", "fla")):
        try:
            versions[peer] = __import__(module).__version__
        except Exception:  # noqa: BLE001 - an absent peer is reported in its column
            versions[peer] = "not installed"
    timed = [v.name for v in op.variants if "sm_90" in v.archs]
    head = ["state", "batch", "floor us", *[f"{v} us" for v in timed],
            "best / floor", *[f"peer {p} us (rel err of o)" for p in PEERS]]
    lines = [f"# GDN decode step, {torch.cuda.get_device_name()}, {dt.date.today().isoformat()}", "",
             f"Versions: {versions}. Copy bandwidth (read + write) measured in this run: "
             f"{bw / 1e12:.2f} TB/s. Times: median of CUDA-graph replays, microseconds; each "
             f"variant checked against the float64 spec first (a reason instead of a time: it "
             f"failed the check or raised).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        times = [r["variants"].get(v, "-") for v in timed]
        best = min((t for t in times if isinstance(t, float)), default=float("nan"))
        lines.append("| " + " | ".join([r["state"], str(r["batch"]), f"{r['floor_us']:.1f}",
                                         *[_time_cell(t) for t in times],
                                         f"{best / r['floor_us']:.2f}x",
                                         *[_peer_cell(r["peers"].get(p)) for p in PEERS]]) + " |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bench_common.write_report(out / "gdn_decode.md", lines)
    print("\n".join(lines))


def _time_cell(t) -> str:
    return f"{t:.1f}" if isinstance(t, float) else ("-" if t == "-" else f"not timed ({t})")


def _peer_cell(result) -> str:
    if result is None:
        return "-"
    t, err = result
    if isinstance(t, str):
        return f"not run ({t})"
    return f"{t:.1f} ({err:.1e})"


if __name__ == "__main__":
    main()
