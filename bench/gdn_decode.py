"""Benchmark the GDN decode step on the GPU: each variant against the peers and the memory floor.

Run on the GPU machine from the repository root:
    python3 bench/gdn_decode.py [--out DIR]
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
import platform
from pathlib import Path

import torch

from certify.catalog import load_op_file
from certify.harness import build_case, run_spec, run_variant, variant_callable
from certify.oracles import tolerance
from certify.paths import project_paths
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
            if state_dtype == "float32":
                for peer, make in PEERS.items():
                    row[peer], row[peer + "_err"] = time_peer(make, case)
            rows.append(row)
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    import triton

    versions["triton"] = triton.__version__
    for peer, module in (("flashinfer", "flashinfer"), ("fla", "fla")):
        try:
            versions[peer] = __import__(module).__version__
        except Exception:  # noqa: BLE001 - an absent peer is reported in its column
            versions[peer] = "not installed"
    head = ["state", "batch", "floor us", *[f"{v.name} us" for v in op.variants],
            "best / floor", *[f"{p} us (rel err of o)" for p in PEERS]]
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
                                         f"{best / r['floor_us']:.2f}x",
                                         *[_peer_cell(r, p) for p in PEERS]]) + " |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gdn_decode.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _peer_cell(row: dict, peer: str) -> str:
    t = row.get(peer)
    if t is None:
        return "-"
    if isinstance(t, str):
        return f"not run ({t})"
    return f"{t:.1f} ({row[peer + '_err']:.1e})"


if __name__ == "__main__":
    main()
