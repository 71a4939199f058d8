"""Benchmark the GDN prefill on the GPU: the Triton chunked kernel against the peers and the memory floor.

Run on the GPU machine from the repository root:
    python3 bench/gdn_prefill.py [--out DIR] [--seq-lens 8192,1024,4096] [--sweep]
    python3 bench/gdn_prefill.py --smoke      # short_t37's shape on the CPU (interpreter), nothing written
It writes ``gdn_prefill.md`` (tables with the date, the GPU and the versions) into DIR (default
reports/bench). One sequence (batch 1) at the target geometry (16 key heads, 48 value heads, d 128,
bf16 q/k/v/z, fp32 state), continuing from a random state as a chunked prefill does.

- The floor is the bytes that must move (q, k, v, z, a, b read once, out written once, the fp32 state
  read and written) over the device-to-device copy bandwidth measured in the same run.
- Every timing is a median (triton.testing.do_bench_cudagraph; a peer whose launch cannot be captured
  in a CUDA graph falls back to do_bench's median of plain launches, and its cell says so).
- Each timed variant's out and final_state are first checked against the float64 spec with the cell
  bands of certify/cells/gdn_prefill.yaml (the measured ulp / relative-RMS are printed; certification
  itself is the cells' job). The peers compute the recurrence only (no gated norm): their o is checked
  against the float64 recurrence output and their final state against the float64 final state
  (relative Frobenius error), and they are timed without the norm, so the comparison is conservative
  for the fused kernel.
- After its timing, each variant's buffers (what the last CUDA-graph replay wrote) are compared bitwise
  with the checked call's outputs: a launch that reads a stale host value or a stream it was not
  ordered on shows there.
- A chunked kernel's launches are also timed one by one, and one pipelined over ranges of chunks
  (gluon_chunked) is timed whole at one range, two equal ones, three of falling length and its default
  schedule, each compared bitwise with the checked call.
- torch_recurrent (a Python loop of ~10 launches a row) is not timed at these lengths.
- ``--sweep`` also times the Triton kernel's launch configurations (state-column tile, warps, stages).
- ``--smoke`` runs each timed variant that has a CPU arch (triton_chunked through Triton's
  interpreter, torch_chunked) at the cell short_t37's shape (2 sequences of 37 tokens) on the CPU and
  checks it against the float64 spec with that cell's bands; gluon_chunked (no interpreter) and the
  peers (CUDA kernels) are skipped with the reason printed; nothing is timed or written.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import importlib.util
import os
import platform
from pathlib import Path

import torch

import bench_common  # noqa: E402 (the checkout's root on the import path)
from certify.catalog.load import load_op_file
from certify.harness.target import build_case, resolve, run_spec, run_variant, variant_callable
from certify.harness.oracles import tolerance
from certify.files.paths import project_paths
from spec.ops import gdn
from spec.ops.norms import EPS as NORM_EPS
from bench_common import copy_bandwidth  # noqa: E402  (bench/ is the script's folder)

TIMED = ("gluon_chunked", "triton_chunked", "torch_chunked", "flashinfer_chunked")
# the variants the engine dispatches on sm_90, per numerics tier, in the catalog's order
DISPATCHED = {"exact": ("gluon_chunked", "triton_chunked"), "bf16_operands": ("flashinfer_chunked",)}
# the chunked kernels whose launches (prologue, state pass, norm) are timed one by one too: their
# modules (the catalog's impl paths) have a launch_plan
LAUNCHES = ("gluon_chunked", "triton_chunked")
# Configurations seen to run on the H200 (2026-11-29); bv 32 with 8 warps, and k^T taken by tl.trans of
# the loaded k tile ("tload": False), hit an illegal memory access in Triton 3.6, which ends the
# process's CUDA context: run --sweep in a process of its own.
SWEEP = [dict(bv=32, num_stages=2), dict(bv=16, num_stages=1), dict(bv=64, num_stages=1),
         dict(bv=64, num_warps=8), dict(bv=128, num_warps=8), dict(dot="tf32")]




def bench(call) -> tuple[float, str]:
    """(median microseconds, how): CUDA-graph replays, else plain launches."""
    import triton.testing

    call()
    torch.cuda.synchronize()
    try:
        return triton.testing.do_bench_cudagraph(call, rep=300) * 1e3, "graph"
    except Exception:  # noqa: BLE001 - a launch that cannot be captured is timed plainly
        torch.cuda.synchronize()
        return triton.testing.do_bench(call, rep=300, return_mode="median") * 1e3, "plain"


def _buffers(case):
    o = case.outputs
    return (torch.empty(o["out"].shape, dtype=o["out"].dtype, device="cuda"),
            torch.empty(o["final_state"].shape, dtype=o["final_state"].dtype, device="cuda"))


def check(name, got, ref, bands) -> tuple[bool, str]:
    parts, ok = [], True
    for out_name, (mu, mr) in bands.items():
        v = tolerance(out_name, got[out_name].cpu(), ref[out_name].cpu(), mu, mr)
        ok &= v.passed
        parts.append(f"{v.metrics[out_name + '.ulp']:.3g} / {v.metrics[out_name + '.rel_rms']:.3g}")
        if not v.passed:
            print(f"{name}: {v.problems}")
    return ok, " ; ".join(parts)


def _same_bits(out, fin, got) -> bool:
    """Whether the buffers a timed call wrote hold bitwise the checked call's outputs."""
    return torch.equal(out, got["out"].to(out.device)) and torch.equal(
        fin, got["final_state"].to(fin.device))


def _rel(got, ref) -> float:
    return float((got.double() - ref).norm() / ref.norm())


def _recurrence_ref(case, interleaved: bool = False):
    """float64 recurrence output o [B, T, HV, V] and final state; ``interleaved`` maps value head h to
    key head h % HK instead of the spec's h // (HV / HK) (used only to identify a peer's mapping)."""
    i = {n: (x.double() if x.is_floating_point() else x) for n, x in case.inputs.items()}
    q, k = i["q"], i["k"]
    if interleaved:
        rep = i["v"].shape[2] // q.shape[2]
        q, k = (x.repeat(1, 1, rep, 1) for x in (q, k))
    g, beta = gdn.gdn_gates(i["a"], i["b"], i["A_log"], i["dt_bias"])
    o, _, fin = gdn.gdn_recurrent(q, k, i["v"], g, beta, i["state"], record=False)
    return o, fin


def peer_fla(case, refs, op_ref):
    """fla's chunk_gated_delta_rule: q, k repeated to the value heads, g in log space, state
    [B, HV, K, V] fp32, l2norm in the kernel."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    i = case.inputs
    g, beta = gdn.gdn_gates(i["a"], i["b"], i["A_log"], i["dt_bias"])
    hv, hk = i["v"].shape[2], i["q"].shape[2]
    q, k = (i[n].repeat_interleave(hv // hk, dim=2).contiguous() for n in ("q", "k"))
    call = lambda: fla_chunk(q=q, k=k, v=i["v"], g=g, beta=beta,  # noqa: E731
                             initial_state=i["state"].clone(), output_final_state=True,
                             use_qk_l2norm_in_kernel=True)
    o, fin = call()[:2]
    o_ref, fin_ref = refs["grouped"]
    return call, f"o {_rel(o, o_ref):.1e}, state {_rel(fin, fin_ref):.1e}"


def _flashinfer_call(case):
    """FlashInfer's chunk_gated_delta_rule (SM90 CuTe DSL) on the case: tokens flattened with
    cu_seqlens, the decay given as alpha = exp(g), beta fp32, state [N, HV, V, K] (transposed),
    l2norm in the kernel, GVA heads passed as they are (16 q/k heads, 48 v heads). Returns the call
    and the output and final-state buffers it writes."""
    from flashinfer.gdn_prefill import chunk_gated_delta_rule as fi_chunk

    i = case.inputs
    B, T, hk, K = i["q"].shape
    hv, V = i["v"].shape[2:]
    g, beta = gdn.gdn_gates(i["a"], i["b"], i["A_log"], i["dt_bias"])
    q, k = (i[n].reshape(B * T, hk, K) for n in ("q", "k"))
    v = i["v"].reshape(B * T, hv, V)
    alpha = g.exp().reshape(B * T, hv).contiguous()
    bet = beta.reshape(B * T, hv).contiguous()
    s0 = i["state"].transpose(-1, -2).contiguous()
    cu = torch.arange(0, B + 1, device="cuda", dtype=torch.int32) * T
    out = torch.empty(B * T, hv, V, dtype=v.dtype, device="cuda")
    fin = torch.empty_like(s0)
    call = lambda: fi_chunk(q, k, v, g=alpha, beta=bet, scale=None,  # noqa: E731
                            initial_state=s0, output_final_state=True, cu_seqlens=cu,
                            use_qk_l2norm_in_kernel=True, output=out, output_state=fin)
    return call, out, fin


def peer_flashinfer(case, refs, op_ref):
    """FlashInfer's recurrence alone (_flashinfer_call), checked against the float64 recurrence
    under each head mapping in ``refs``."""
    B, T, hv, V = case.inputs["v"].shape
    call, out, fin = _flashinfer_call(case)
    call()
    torch.cuda.synchronize()
    o = out.reshape(B, T, hv, V)
    st = fin.transpose(-1, -2)
    errs = []
    for name, (o_ref, fin_ref) in refs.items():
        errs.append(f"{name} heads: o {_rel(o, o_ref):.1e}, state {_rel(st, fin_ref):.1e}")
    return call, "; ".join(errs)


def peer_flashinfer_norm(case, refs, op_ref):
    """The whole op as an engine composes it from the peers: FlashInfer's recurrence
    (_flashinfer_call) and then fla's gated RMSNorm (FusedRMSNormGated, swish gate, the spec's eps)
    of its o with z, so the timing covers what the variants compute, checked against the float64
    op's output."""
    from fla.modules import FusedRMSNormGated

    i = case.inputs
    B, T, hv, V = i["v"].shape
    recurrence, o, _ = _flashinfer_call(case)
    norm = FusedRMSNormGated(V, eps=NORM_EPS, activation="swish").to("cuda")
    with torch.no_grad():
        norm.weight.copy_(i["norm_w"].float())
    z = i["z"].reshape(B * T, hv, V)

    def call():
        recurrence()
        with torch.no_grad():
            return norm(o, z)

    got = call().reshape(B, T, hv, V)
    torch.cuda.synchronize()
    return call, f"out {_rel(got, op_ref['out']):.1e} (against the float64 op)"


PEERS = {"flashinfer": peer_flashinfer, "fla": peer_fla, "flashinfer+fla_norm": peer_flashinfer_norm}
SMOKE_CELL = "short_t37"   # batch 2, 37 tokens: one partial chunk
CPU_ARCHS = {"cpu", "cpu-interpret"}


def tier_bands(op, name, cell) -> dict[str, tuple[float, float]]:
    """The bands of the variant's numerics tier at the cell (the cell's own for the exact tier)."""
    return {n: (b.max_ulp, b.max_rel_rms)
            for n, b in op.oracle_of(op.variant(name), cell).outputs.items()}


def tier_ref(op, name, case, refs: dict) -> dict:
    """The float64 outputs of the variant's numerics tier's spec path, computed once per tier."""
    tier = op.variant(name).numerics
    if tier not in refs:
        refs[tier] = run_spec(resolve(op.spec_of(op.variant(name))), case, True)
    return refs[tier]


def smoke(op) -> None:
    """Each timed variant with a CPU arch at short_t37's shape on the CPU, checked against the float64
    spec with the cell's bands; the others and the peers skipped with the reason; nothing timed or
    written."""
    cell = next(c for c in op.cells if c.id == SMOKE_CELL)
    case = build_case(op, cell, torch.device("cpu"))
    tier_refs: dict[str, dict] = {}
    shape = f"{SMOKE_CELL} (batch {cell.axes['batch']}, {cell.axes['seq_len']} tokens)"
    failed = False
    for name in TIMED:
        archs = set(op.variant(name).archs)
        if not archs & CPU_ARCHS:
            why = "Gluon has no interpreter" if name.startswith("gluon") else "no CPU arch"
            print(f"smoke {name} {shape}: skipped ({why}; archs {sorted(archs)})")
            continue
        try:
            ok, errs = check(name, run_variant(variant_callable(op, name), case),
                             tier_ref(op, name, case, tier_refs), tier_bands(op, name, cell))
        except Exception as e:  # noqa: BLE001 - reported, and the smoke fails
            ok, errs = False, f"{type(e).__name__}: {str(e)[:200]}"
        print(f"smoke {name} {shape}: {'ok' if ok else 'FAILED'} (out ulp / rel RMS eps ; final "
              f"state ulp / rel RMS eps: {errs})", flush=True)
        failed |= not ok
    for peer, module in (("flashinfer", "flashinfer"), ("fla", "fla")):
        here = "installed" if importlib.util.find_spec(module) else "not installed"
        print(f"smoke peer {peer}: skipped (CUDA kernels, timed on the GPU only; {here})")
    if failed:
        raise SystemExit(1)
    print("smoke passed; nothing written")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(project_paths().reports / "bench"))
    p.add_argument("--seq-lens", default="8192,1024,4096")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--no-peers", action="store_true")
    p.add_argument("--smoke", action="store_true",
                   help="short_t37's shape on the CPU (Triton's interpreter): checks each timed "
                        "variant that runs there, times nothing, writes nothing")
    args = p.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel is decorated
        return smoke(load_op_file(project_paths().cells / "gdn_prefill.yaml"))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from impl.kernels.gdn import triton_chunked

    op = load_op_file(project_paths().cells / "gdn_prefill.yaml")
    cell0 = next(c for c in op.cells if c.id == "long_t8192")
    bw = copy_bandwidth()
    rows, sweep_rows, peer_notes = [], [], []
    for T in (int(x) for x in args.seq_lens.split(",")):
        cell = cell0.model_copy(update={"id": f"bench_t{T}", "axes": {**cell0.axes, "seq_len": T}})
        case = build_case(op, cell, torch.device("cuda"))
        tier_refs: dict[str, dict] = {}
        ref = tier_ref(op, "gluon_chunked", case, tier_refs)
        bands = tier_bands(op, "gluon_chunked", cell0)
        i = case.inputs
        nbytes = sum(i[n].numel() * i[n].element_size() for n in ("q", "k", "v", "z", "a", "b"))
        nbytes += i["z"].numel() * 2 + 2 * i["state"].numel() * 4
        row = {"T": T, "floor_us": nbytes / bw * 1e6}
        for name in TIMED:
            try:
                fn = variant_callable(op, name)
                got = run_variant(fn, case)
                ok, errs = check(name, got, tier_ref(op, name, case, tier_refs),
                                 tier_bands(op, name, cell0))
            except Exception as e:  # noqa: BLE001 - a variant that cannot run here is reported
                ok, errs = False, f"not run ({type(e).__name__}: {str(e)[:80]})"
            out, fin = _buffers(case)
            row[name] = bench(lambda: fn(**i, out=out, final_state=fin))[0] if ok else float("nan")
            if ok:   # the timed replays wrote out and fin: the same bits as the checked launch?
                same = _same_bits(out, fin, got)
                errs += f"; CUDA-graph replay {'bitwise equal to' if same else 'DIFFERS from'} the checked call"
            row[name + "_err"] = errs
            if ok and name in LAUNCHES:
                module = importlib.import_module(op.impl_path(op.variant(name)).partition(":")[0])
                plan = module.launch_plan(**i, out=out, final_state=fin)
                row[name + "_launches"] = ", ".join(f"{n} {bench(la)[0]:.1f}" for n, la in plan)
                if hasattr(module, "default_schedule"):   # pipelined over ranges of chunks
                    default = module.default_schedule(cell.axes["batch"], -(-T // 64))
                    parts = []
                    for sched in dict.fromkeys(((1, 1.0), (2, 1.0), (3, module.RATIO), default)):
                        # each timed, then its last replay's bits against the checked call
                        us = bench(lambda sched=sched: module.gdn_prefill_chunked(
                            **i, out=out, final_state=fin, _schedule=sched))[0]
                        same = _same_bits(out, fin, got)
                        parts.append(f"{sched[0]} x {sched[1]} {us:.1f}"
                                     + ("" if same else " (DIFFERS from the checked call)"))
                    row[name + "_launches"] += (
                        "; whole call by ranges of chunks (ranges x length ratio): " + ", ".join(parts)
                        + f" (default {default[0]} x {default[1]})")
        if args.sweep and T == 8192:
            for cfg in SWEEP:
                fn = lambda **kw: triton_chunked.gdn_prefill_chunked(**kw, _config=cfg)  # noqa: E731
                try:
                    ok, errs = check(f"triton {cfg}", run_variant(fn, case), ref, bands)
                    out, fin = _buffers(case)
                    us = bench(lambda: fn(**i, out=out, final_state=fin))[0]
                    parts = []
                    for lname, launch in triton_chunked.launch_plan(**i, out=out, final_state=fin,
                                                                    config=cfg):
                        kern = launch()
                        regs = f", {kern.n_regs} regs, {kern.n_spills} spills" if hasattr(
                            kern, "n_regs") else ""
                        parts.append(f"{lname} {bench(launch)[0]:.1f}{regs}")
                    errs += " ; " + ", ".join(parts)
                except Exception as e:  # noqa: BLE001 - a configuration that fails to build is listed
                    ok, errs, us = False, f"{type(e).__name__}: {str(e)[:300]}", float("nan")
                sweep_rows.append((cfg, us, ok, errs))
                print("sweep", cfg, f"{us:.1f}", ok, errs, flush=True)
        refs = {"grouped": _recurrence_ref(case)}
        for peer, make in ({} if args.no_peers else PEERS).items():
            try:
                if peer == "flashinfer":
                    refs.setdefault("interleaved", _recurrence_ref(case, interleaved=True))
                call, err = make(case, refs, ref)
                us, how = bench(call)
                row[peer] = f"{us:.1f}" + ("" if how == "graph" else " (plain launches)")
                peer_notes.append(f"T={T} {peer}: {err}")
            except Exception as e:  # noqa: BLE001 - a missing or incompatible peer is reported
                row[peer] = f"not run ({type(e).__name__}: {str(e)[:80]})"
        rows.append(row)
        print(row, flush=True)
        del case, ref, refs, tier_refs
        torch.cuda.empty_cache()
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    import triton

    versions["triton"] = triton.__version__
    for peer, module in (("flashinfer", "flashinfer"), ("fla", "fla")):
        try:
            versions[peer] = __import__(module).__version__
        except Exception:  # noqa: BLE001 - an absent peer is reported in its column
            versions[peer] = "not installed"
    cfg = triton_chunked.default_config(128)
    head = ["T", "floor us", "gluon_chunked us", "triton_chunked us", "torch_chunked us",
            "flashinfer_chunked us", "flashinfer us", "fla us", "exact dispatched / floor",
            "exact dispatched / flashinfer", "exact dispatched / fla",
            "flashinfer+fla_norm us", "bf16_operands dispatched / flashinfer",
            "bf16_operands dispatched / flashinfer+fla_norm"]
    lines = [f"# GDN prefill, one sequence, {torch.cuda.get_device_name()}, "
             f"{dt.date.today().isoformat()}", "",
             f"Versions: {versions}. Copy bandwidth (read + write) measured in this run: "
             f"{bw / 1e12:.2f} TB/s. Geometry: 16 key heads, 48 value heads, d_k = d_v = 128, bf16 "
             f"q/k/v/z, fp32 state. Times: median, microseconds (CUDA-graph replays unless noted). "
             f"triton_chunked runs its default configuration {cfg}; each variant was checked against "
             f"its numerics tier's float64 spec path with the tier's bands at long_t8192 first (NaN = "
             f"failed the check or did not run). The dispatched variant of a tier is the first of "
             f"{DISPATCHED} that passed (the catalog's order on sm_90); flashinfer_chunked is "
             f"FlashInfer's kernel inside the variant's wrapper (the l2norm and the gated norm "
             f"launches included). The peers flashinfer and fla run the recurrence only (no gated norm); "
             f"flashinfer+fla_norm is the whole op from the peers: FlashInfer's recurrence, then "
             f"fla's gated RMSNorm.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def ratio(a, b) -> str:
        try:
            return f"{a / float(str(b).split()[0]):.2f}x"
        except (ValueError, IndexError, ZeroDivisionError):
            return "-"

    for r in rows:
        disp, disp_bf16 = (next((r[n] for n in names if r[n] == r[n]), float("nan"))
                           for names in DISPATCHED.values())
        lines.append("| " + " | ".join([str(r["T"]), f"{r['floor_us']:.1f}", f"{r['gluon_chunked']:.1f}",
                                         f"{r['triton_chunked']:.1f}", f"{r['torch_chunked']:.1f}",
                                         f"{r['flashinfer_chunked']:.1f}",
                                         str(r.get("flashinfer", "-")), str(r.get("fla", "-")),
                                         f"{disp / r['floor_us']:.2f}x", ratio(disp, r.get("flashinfer")),
                                         ratio(disp, r.get("fla")),
                                         str(r.get("flashinfer+fla_norm", "-")),
                                         ratio(disp_bf16, r.get("flashinfer")),
                                         ratio(disp_bf16, r.get("flashinfer+fla_norm"))]) + " |")
    lines += ["", "Errors against float64 (out ulp / relative RMS eps ; final state ulp / relative RMS eps) "
              "and each launch (us):", ""]
    for r in rows:
        for n in ("gluon_chunked", "triton_chunked", "flashinfer_chunked"):
            lines.append(f"- T={r['T']} {n}: {r[n + '_err']}; launches: {r.get(n + '_launches', '-')}")
    lines += ["", "Peer checks (relative Frobenius error against the float64 recurrence; 'grouped' is "
              "the spec's head mapping, value head h reads key head h // 3; 'interleaved' reads "
              "h % 16):", ""] + [f"- {n}" for n in peer_notes]
    if sweep_rows:
        lines += ["", "Launch configurations of triton_chunked at T = 8192 (state pass; the prep and "
                  "norm launches are fixed):", "", "| config | us | within bands | out ulp / rms ; "
                  "state ulp / rms ; per launch us |", "|---|---|---|---|"]
        lines += [f"| {c} | {us:.1f} | {ok} | {e} |" for c, us, ok, e in sweep_rows]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bench_common.write_report(out / "gdn_prefill.md", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
