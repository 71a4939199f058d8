"""Benchmark the MoE block at the target's 512-expert table on the GPU: the Triton grouped-GEMM variant
against the spec's own bf16 path and the bytes floor.

Run on the GPU machine from the repository root:
    python3 bench/moe.py [--out DIR]
    python3 bench/moe.py --smoke      # a reduced table at 2 rows on the CPU (interpreter), nothing written
It writes ``moe.md`` into DIR (default reports/bench) with the date, the GPU and the versions.
``--profile`` writes ``moe_profile.txt`` instead: per row count, each stage alone, a sweep of the
GEMMs' launch configs (gate|up's K parts included), all as medians of CUDA-graph replays (the GPU's
time, without the host's launches), the block launched eagerly and torch.profiler's kernel table of
three calls. ``--rows`` picks the row counts.
Weights are drawn on the GPU (N(0, 1/fan_in) quantized to nvfp4 by the spec's quantizer, one global
scale per matrix), so the 1.2 GB table takes seconds. Rows: decode at 1, 32 and 128 requests and an
8192-row prompt chunk. The floor is the bytes the step must move: the nvfp4 codes and block scales
of every expert the rows select, the router and the shared expert's bf16 weights, x read and the
output written once, over the device-to-device copy bandwidth measured in the same run. Times are
medians of plain launches (triton.testing.do_bench); each result is checked against the float64 spec
at one row first (certification is the cells' job).
``--smoke`` draws a reduced table on the CPU (16 experts of 512 x 256, top 4; the interpreted kernels
take K in steps of 512), runs the Triton variant through Triton's interpreter and the spec's bf16 path
at 2 rows, checks both against the float64 spec with a loose band, times nothing and writes nothing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import sys
from pathlib import Path

if "--smoke" in sys.argv[1:]:   # the interpreter is chosen when a kernel is decorated: before triton_moe
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common  # noqa: E402
from bench_common import copy_bandwidth, graph_us  # noqa: E402

from certify.harness.oracles import tolerance  # noqa: E402
from impl.kernels.moe import triton_moe  # noqa: E402
from spec.ops.kv_storage import NVFP4_BLOCK, nvfp4_global_scale, nvfp4_quantize  # noqa: E402
from spec.ops.moe import NvFp4Experts, NvFp4Weight, SharedExpert, moe  # noqa: E402

C, I, IS, E, K = 3072, 512, 512, 512, 10
ROWS = [("decode 1", 1), ("decode 32", 32), ("decode 128", 128), ("prefill chunk 8192", 8192)]
SPEC_MAX_ROWS = 32  # the spec's row-by-row path beyond this costs minutes
# --smoke: (hidden, expert inter, shared inter, experts, top k) and rows; a loose sanity band (max
# ulp, max relative RMS eps) against float64: a wrong result is far off, certification is the cells'
SMOKE_GEOMETRY, SMOKE_ROWS, SMOKE_BAND = (512, 256, 256, 16, 4), 2, (64, 16)


def _stack(out_f: int, in_f: int, gen: torch.Generator, experts: int = E,
           device: str = "cuda") -> NvFp4Weight:
    packed, sf, gs = [], [], []
    for e in range(experts):
        w = torch.randn(out_f, in_f, device=device, generator=gen) / math.sqrt(in_f)
        g = nvfp4_global_scale(w.abs().max().double().cpu()).to(device)
        p, s = nvfp4_quantize(w, g)
        packed.append(p)
        sf.append(s)
        gs.append(g)
    return NvFp4Weight(torch.stack(packed), torch.stack(sf), torch.stack(gs))


def _weights(gen: torch.Generator, geometry: tuple = (C, I, IS, E), device: str = "cuda"):
    C, I, IS, E = geometry  # noqa: N806 (the module's names, a reduced table under --smoke)
    router = (torch.randn(E, C, device=device, generator=gen) * 1.5 / math.sqrt(C)).bfloat16()
    scale = nvfp4_global_scale(torch.tensor(16.0)).to(device)
    experts = NvFp4Experts(_stack(I, C, gen, E, device), _stack(I, C, gen, E, device),
                           _stack(C, I, gen, E, device), scale, scale.clone())
    bf = lambda *s: (torch.randn(*s, device=device, generator=gen) / math.sqrt(s[-1])).bfloat16()  # noqa: E731
    shared = SharedExpert(bf(IS, C), bf(IS, C), bf(C, IS), bf(C))
    return router, experts, shared


def _floor_bytes(ids: torch.Tensor, T: int, geometry: tuple = (C, I, IS, E)) -> int:
    C, I, IS, E = geometry  # noqa: N806
    used = int(torch.unique(ids).numel())
    per_expert = 3 * (I * C // 2 + I * C // NVFP4_BLOCK) + 3 * 4
    dense = 2 * (E * C + 3 * IS * C + C)
    return used * per_expert + dense + 2 * T * C * 2


def _kwargs(experts: NvFp4Experts, shared: SharedExpert) -> dict:
    """The Triton variant's weight arguments."""
    return dict(gate_packed=experts.gate.packed, gate_sf=experts.gate.sf, gate_gs=experts.gate.gs,
                up_packed=experts.up.packed, up_sf=experts.up.sf, up_gs=experts.up.gs,
                down_packed=experts.down.packed, down_sf=experts.down.sf, down_gs=experts.down.gs,
                x_gs=experts.x_gs, h_gs=experts.h_gs, w_gate=shared.w_gate, w_up=shared.w_up,
                w_down=shared.w_down, w_sg=shared.w_sg)


def _reference(x, router, experts: NvFp4Experts, shared: SharedExpert, top_k: int) -> torch.Tensor:
    """The float64 spec of the block on ``x``."""
    return moe(x.double(), router.double(), NvFp4Experts(
        experts.gate, experts.up, experts.down, experts.x_gs.double(), experts.h_gs.double()),
        SharedExpert(*(t.double() for t in (shared.w_gate, shared.w_up, shared.w_down,
                                            shared.w_sg))), top_k)


def smoke() -> None:
    """The reduced table at a few rows on the CPU: the Triton variant (interpreted) and the spec's
    bf16 path, each checked against the float64 spec; nothing timed or written."""
    from impl.kernels.triton_support import INTERPRETING

    c, i, i_s, e, k = SMOKE_GEOMETRY
    gen = torch.Generator().manual_seed(0)
    router, experts, shared = _weights(gen, (c, i, i_s, e), "cpu")
    x = torch.randn(SMOKE_ROWS, c, generator=gen).bfloat16()
    ref = _reference(x, router, experts, shared, k)
    ids, _ = triton_moe.route(x, router, k)
    print(f"smoke {SMOKE_ROWS} rows, {e} experts of {i} x {c}, top {k}: "
          f"{int(torch.unique(ids).numel())} experts used, floor "
          f"{_floor_bytes(ids, SMOKE_ROWS, (c, i, i_s, e)) / 1e6:.2f} MB "
          f"(Triton {'interpreted' if INTERPRETING else 'compiled'})", flush=True)
    out = torch.empty_like(x)
    triton_moe.moe(x, router, k, **_kwargs(experts, shared), out=out)
    failed = False
    for name, got in (("triton", out), ("spec bf16", moe(x, router, experts, shared, k))):
        err = float((got.double() - ref).abs().max() / (ref.abs().max() * 2 ** -8))
        v = tolerance("out", got, ref, *SMOKE_BAND)
        print(f"smoke {name}: max err {err:.2f} (ulp of the max), "
              f"{v.metrics['out.ulp']:.3g} ulp / {v.metrics['out.rel_rms']:.3g} eps vs float64: "
              f"{'ok' if v.passed else 'FAILED ' + '; '.join(v.problems)}", flush=True)
        failed |= not v.passed
    if failed:
        raise SystemExit(1)
    print("smoke passed; nothing written")


def main() -> None:
    import triton
    import triton.testing

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="reports/bench")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--rows", default=",".join(str(t) for _, t in ROWS),
                    help="comma-separated row counts to run, of " + ", ".join(str(t) for _, t in ROWS))
    ap.add_argument("--smoke", action="store_true",
                    help="a reduced table at 2 rows on the CPU (Triton's interpreter): checks the "
                         "Triton variant and the spec's bf16 path, times nothing, writes nothing")
    args = ap.parse_args()
    if args.smoke:
        return smoke()
    wanted = {int(t) for t in args.rows.split(",")}
    rows = [(label, t) for label, t in ROWS if t in wanted]
    gen = torch.Generator(device="cuda").manual_seed(0)
    t0 = dt.datetime.now()
    router, experts, shared = _weights(gen)
    built = (dt.datetime.now() - t0).total_seconds()
    bw = copy_bandwidth()
    kw = _kwargs(experts, shared)
    lines = [f"# MoE block at 512 experts ({dt.date.today()})", "",
             f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
             f"{triton.__version__}; copy bandwidth {bw / 1e9:.0f} GB/s (read + write); weights "
             f"drawn in {built:.0f} s, {torch.cuda.memory_allocated() / 2**30:.1f} GiB held.", "",
             "| rows | experts used | floor MB | floor us | triton us | % of floor | spec bf16 us "
             "| triton vs spec | max err vs float64 (ulp of row max) |",
             "|---|---|---|---|---|---|---|---|---|"]
    if args.profile:
        _profile(router, experts, shared, kw, gen, Path(args.out), rows)
        return
    for label, T in rows:
        x = (torch.randn(T, C, device="cuda", generator=gen)).bfloat16()
        ids, _ = triton_moe.route(x, router, K)
        nbytes = _floor_bytes(ids, T)
        out = torch.empty_like(x)
        run = lambda: triton_moe.moe(x, router, K, **kw, out=out)  # noqa: E731
        run()
        ref = _reference(x[:1], router, experts, shared, K)
        err = float((out[:1].double() - ref).abs().max() / (ref.abs().max() * 2 ** -8))
        ms = triton.testing.do_bench(run, rep=200, return_mode="median")
        spec_ms = None
        if T <= SPEC_MAX_ROWS:
            spec_ms = triton.testing.do_bench(
                lambda: moe(x, router, experts, shared, K), rep=200, return_mode="median")
        floor_us = nbytes / bw * 1e6
        spec = f"{spec_ms * 1e3:.0f}" if spec_ms else "not run"
        ratio = f"{spec_ms / ms:.1f}x" if spec_ms else "-"
        lines.append(f"| {label} | {int(torch.unique(ids).numel())} | {nbytes / 1e6:.1f} | "
                     f"{floor_us:.0f} | {ms * 1e3:.0f} | {100 * floor_us / (ms * 1e3):.0f} % | "
                     f"{spec} | {ratio} | {err:.2f} |")
        print(lines[-1], flush=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    bench_common.write_report(out_dir / "moe.md", lines)


SWEEP = {"BN": (32, 64), "BK": (64, 128, 256), "num_stages": (2, 4), "SPLIT": (1, 4, 8, 12)}


def _profile(router, experts, shared, kw, gen, out_dir: Path, rows) -> None:
    """Per row count: each stage alone, a sweep of each GEMM's launch config (the other at its
    default), the whole block replayed from a CUDA graph, and torch.profiler's kernel table. Every
    time is a CUDA-graph replay's (``bench_common.graph_us``)."""
    import itertools

    import triton.testing
    from torch.profiler import ProfilerActivity, profile

    m = triton_moe
    bench = graph_us
    ekw = {k: kw[k] for k in ("gate_packed", "gate_sf", "gate_gs", "up_packed", "up_sf", "up_gs",
                              "down_packed", "down_sf", "down_gs", "x_gs", "h_gs")}
    text = []
    for label, T in rows:
        x = (torch.randn(T, C, device="cuda", generator=gen)).bfloat16()
        out = torch.empty_like(x)
        ids, w = m.route(x, router, K)
        regime_name, bm = m.regime(ids.numel(), E)
        rows_of, block_expert = m.expert_blocks(ids, E, bm)
        stages = {
            "route": lambda: m.route(x, router, K),
            "expert_blocks": lambda: m.expert_blocks(ids, E, bm),
            "quantize x": lambda: m.quantized_values(x, experts.x_gs),
            "routed_experts": lambda: m.routed_experts(x, ids, w, **ekw),
            "shared_expert": lambda: m.shared_expert(x, shared.w_gate, shared.w_up, shared.w_down,
                                                     shared.w_sg),
            "moe": lambda: m.moe(x, router, K, **kw, out=out),
        }
        text.append(f"## {label}: config {regime_name}, {block_expert.numel()} blocks of {bm} rows")
        for name, fn in stages.items():
            try:
                text.append(f"  {name:16s} {bench(fn):10.1f} us")
            except Exception as exc:  # noqa: BLE001  (a stage that does not capture is a result)
                text.append(f"  {name:16s} capture failed: {exc!r}"[:300])
        base = m.routed_experts(x, ids, w, **ekw).float()
        for gemm in ("gate_up", "down"):
            results = []
            for bn, bk, st, split in itertools.product(*SWEEP.values()):
                if gemm == "down" and split != 1:
                    continue
                cfg = {gemm: {"BN": bn, "BK": bk, "num_stages": st}
                       | ({"SPLIT": split} if gemm == "gate_up" else {})}
                try:
                    got = m.routed_experts(x, ids, w, **ekw, config=cfg).float()
                    rel = float((got - base).abs().max() / base.abs().max())
                    results.append((bench(lambda: m.routed_experts(x, ids, w, **ekw, config=cfg)),
                                    bn, bk, st, split, rel))
                except Exception as exc:  # noqa: BLE001  (a config that does not compile is a result)
                    text.append(f"  {gemm} BN {bn} BK {bk} stages {st} split {split}: "
                                f"{type(exc).__name__}")
            results.sort()
            text.append(f"  sweep {gemm} (routed_experts us, BN, BK, stages, split, max rel diff): "
                        + "; ".join(f"{t:.1f} {bn} {bk} {st} {sp} {rel:.1e}"
                                    for t, bn, bk, st, sp, rel in results[:8]))
        text.append(f"  moe launched eagerly {triton.testing.do_bench(stages['moe'], rep=50, return_mode='median') * 1e3:10.1f} us")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                m.moe(x, router, K, **kw, out=out)
            torch.cuda.synchronize()
        text.append(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20))
        print("\n".join(text[-12:-1]), flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "moe_profile.txt").write_text("\n".join(text) + "\n")


if __name__ == "__main__":
    main()
