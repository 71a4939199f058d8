"""Benchmark the QSA sparse GQA decode step: the split-K variants (triton_decode for every page format,
gluon_decode for nvfp4 pages) against the KV-bytes floor and a torch eager peer (gather + SDPA), for
bf16, fp8 and nvfp4 KV; the table marks the variant the sm_90 dispatch rules choose per format.

Run on the GPU machine from the repository root:
    python3 bench/qsa_sparse_gqa.py [--out DIR]
It writes ``qsa_sparse_gqa.md`` (date, GPU, versions) into DIR (default reports/bench). The floor is
the bytes of the selected K and V actually read (plus nvfp4 block scales) over the device-to-device
copy bandwidth measured in the same run (bench/bench_common.py's copy_bandwidth). Timings are medians
of CUDA-graph replays after a check against the float64 spec on a subset of rows.
``--smoke`` runs tiny shapes on the CPU (Triton's interpreter) and writes nothing. ``--shapes`` also
times the decode kernel under a grid of launch shapes (tokens a tile, warps, pipeline stages, programs
per SM) for each format and writes ``qsa_sparse_gqa_shapes.md``: how the wrapper's ``_DECODE_SHAPE``
was chosen. Each shape's output is checked against the default shape's (within 2 ulp: the tile size
and the split count change the fp32 summation order, nothing else) before it is timed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import platform
import time
from pathlib import Path

import torch

import bench_common  # noqa: E402 (the checkout's root on the import path)
from certify.harness.oracles import tolerance
from certify.files.paths import project_paths
from impl.kernels.qsa.kv_tiles import FMT_BF16, FMT_FP8, FMT_NVFP4
from impl.kernels.qsa.triton_sparse_gqa import _DECODE_SHAPE, triton_decode
from certify.catalog.load import load_catalog
from certify.catalog.rules import evaluate
from certify.harness.target import variant_callable
from spec.ops.kv_storage import fp8_load, fp8_quantize, nvfp4_global_scale, nvfp4_load, nvfp4_quantize
from spec.ops.qsa import qsa_sparse_gqa

TPB = 32


def decode_inputs(batch: int, sel_blocks: int, ctx_blocks: int, n_q: int, n_kv: int, d: int,
                  kv: str, device: str, seed: int = 0) -> dict:
    """``batch`` decode rows, each selecting ``sel_blocks`` full blocks (32 tokens each) of its own
    ``ctx_blocks``-block context, pages shuffled over the pool; seeded, never zeros."""
    gen = torch.Generator().manual_seed(seed)
    pages = torch.randperm(batch * ctx_blocks, generator=gen).reshape(batch, ctx_blocks).int()
    tokens = torch.empty(batch, sel_blocks * TPB, dtype=torch.int64)
    for b in range(batch):
        blocks = torch.randperm(ctx_blocks, generator=gen)[:sel_blocks].sort().values
        tokens[b] = (blocks[:, None] * TPB + torch.arange(TPB)).flatten()
    # the pools (1 GiB of bf16 at the benchmark shape) are drawn and quantized where they live
    dgen = torch.Generator(device=device).manual_seed(seed + 1)
    shape = (batch * ctx_blocks, TPB, n_kv, d)
    k = (torch.randn(*shape, generator=dgen, device=device) + 0.1).bfloat16().float()
    v = (torch.randn(*shape, generator=dgen, device=device) + 0.1).bfloat16().float()
    q = (torch.randn(batch, n_q, d, generator=dgen, device=device) * 2).bfloat16()
    gate = (torch.randn(batch, n_q, d, generator=dgen, device=device) * 2).bfloat16()

    def store(x):
        if kv == "bf16":
            return x.bfloat16(), None
        if kv == "fp8":
            return fp8_quantize(x), fp8_load
        gs = nvfp4_global_scale(float(x.abs().max()))
        return nvfp4_quantize(x, gs), functools.partial(nvfp4_load, gs=gs.to(device))

    (kc, lk), (vc, lv) = store(k), store(v)
    return dict(q=q, gate=gate, tokens=tokens.to(device),
                seq_ids=torch.arange(batch, dtype=torch.int32, device=device),
                block_table=pages.to(device), k_cache=kc, v_cache=vc, load=lk, load_v=lv)


def kv_bytes(inp: dict) -> int:
    """Bytes of the selected K and V slots (every pool of each, scales included)."""
    n_tok = int((inp["tokens"] >= 0).sum())
    total = 0
    for cache in (inp["k_cache"], inp["v_cache"]):
        for pool in ((cache,) if isinstance(cache, torch.Tensor) else cache):
            total += n_tok * pool[0, 0].numel() * pool.element_size()
    return total


def torch_peer(inp: dict):
    """Eager peer: gather the selected slots, dequantize with the spec's load, SDPA (GQA expanded)."""
    q, tokens, table = inp["q"], inp["tokens"], inp["block_table"]
    n, n_q, d = q.shape
    pages = table.long().gather(1, tokens // TPB)
    offs = tokens % TPB

    def gather(cache, load):
        pools = (cache,) if isinstance(cache, torch.Tensor) else cache
        parts = tuple(p[pages, offs] for p in pools)  # [N, W, n_kv, ...]
        x = parts[0] if load is None else load(parts, torch.bfloat16)
        return x.transpose(1, 2)  # [N, n_kv, W, D]

    def call():
        k, v = gather(inp["k_cache"], inp["load"]), gather(inp["v_cache"], inp["load_v"])
        rep = n_q // k.shape[1]
        o = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, None, :], k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))
        return (o[:, :, 0].float() * torch.sigmoid(inp["gate"].float())).bfloat16()
    return call


def check(inp: dict, rows: int = 4, fn=None) -> float:
    """Max ulp of a decode variant's output (default triton_decode) against the float64 spec on the
    first ``rows`` rows."""
    sub = dict(inp, **{n: inp[n][:rows].contiguous() for n in ("q", "gate", "tokens", "seq_ids")})
    out = torch.full_like(sub["q"], float("nan"))
    (fn or triton_decode)(**sub, out=out)
    cpu = {n: (v.cpu() if isinstance(v, torch.Tensor) else
               tuple(p.cpu() for p in v) if isinstance(v, tuple) else v) for n, v in sub.items()}
    for n in ("load", "load_v"):
        if isinstance(cpu[n], functools.partial):
            cpu[n] = functools.partial(cpu[n].func, gs=cpu[n].keywords["gs"].cpu())
    ref = qsa_sparse_gqa(**{n: (v.double() if isinstance(v, torch.Tensor) and n in ("q", "gate")
                                else v) for n, v in cpu.items()})
    v = tolerance("out", out.cpu(), ref, 8, 4)
    if not v.passed:
        raise SystemExit(f"check failed: {v.problems}")
    return v.metrics["out.ulp"]


OP = load_catalog(project_paths().cells).ops["qsa_sparse_gqa"]
KV_AXIS = {"bf16": "bfloat16", "fp8": "fp8", "nvfp4": "nvfp4"}


def decode_variants(kv: str, inp: dict) -> tuple[list[str], str | None]:
    """The decode variants that read ``kv`` pages on sm_90 at ``inp``'s geometry, and the one the
    catalog's dispatch rules choose there (first match in file order,
    certify/cells/qsa_sparse_gqa.yaml). The spec's own path (``impl: spec``, the batch-invariant
    reference) is no kernel to time."""
    q = inp["q"]
    axes = {"step": "decode", "kv_dtype": KV_AXIS[kv], "batch": q.shape[0], "rows": q.shape[0],
            "act_dtype": "bfloat16", "q_heads": q.shape[1], "head_dim": q.shape[-1]}
    found = [v.name for v in OP.variants
             if "sm_90" in v.archs and v.impl != "spec" and evaluate(v.dispatch, axes)]
    return found, found[0] if found else None


SHAPES = [(n, w, s, p) for n in (32, 64) for w in (2, 4, 8) for s in (1, 2, 3) for p in (2, 4)]


def time_shapes(inp: dict, default_out: torch.Tensor, floor: float) -> dict[tuple, str]:
    """Each launch shape's median time and share of the floor, after its output agrees with the
    default shape's within 2 ulp."""
    import triton.testing

    ref = default_out.double()
    cells = {}
    for shp in SHAPES:
        o = torch.full_like(inp["q"], float("nan"))
        try:
            triton_decode(**inp, out=o, shape=shp)
            if not tolerance("out", o, ref, 2, 1).passed:
                cells[shp] = "differs"
                continue
            us = triton.testing.do_bench_cudagraph(lambda: triton_decode(**inp, out=o, shape=shp),
                                                   rep=100) * 1e3
            cells[shp] = f"{us:.1f} ({floor / us:.0%})"
        except Exception as e:  # noqa: BLE001 - a shape that cannot compile is reported, not fatal
            torch.cuda.synchronize()
            cells[shp] = f"fails ({type(e).__name__})"
    return cells


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(project_paths().reports / "bench"))
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, no report")
    p.add_argument("--shapes", action="store_true", help="also time a grid of launch shapes")
    args = p.parse_args()
    if args.smoke:
        for kv in ("bf16", "fp8", "nvfp4"):
            inp = decode_inputs(2, 2, 4, 4, 2, 32, kv, "cpu")
            print(f"smoke {kv}: max ulp vs float64 spec {check(inp, 2):.2f}; "
                  f"KV bytes {kv_bytes(inp)}; peer ran: {torch_peer(inp)().shape}")
            # the dispatch rules read every axis they name at the bench's geometry (sm_90 rules)
            print(f"smoke {kv}: sm_90 decode variants {decode_variants(kv, inp)[0]}")
        return
    import triton
    import triton.testing

    from bench_common import copy_bandwidth  # the floor measure every benchmark shares

    torch.backends.cuda.matmul.allow_tf32 = False
    bw = copy_bandwidth()
    lines_rows = []
    shape_rows: dict[tuple, dict[str, str]] = {}
    t0 = time.perf_counter()
    for kv in ("bf16", "fp8", "nvfp4"):
        inp = decode_inputs(128, 64, 256, 24, 2, 256, kv, "cuda")
        print(f"[{time.perf_counter() - t0:.0f}s] {kv}: inputs built", flush=True)
        nbytes = kv_bytes(inp)
        floor = nbytes / bw * 1e6
        peer = torch_peer(inp)
        try:
            peer_us = f"{triton.testing.do_bench(peer, rep=200, return_mode='median') * 1e3:.1f}"
        except Exception as e:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
            peer_us = f"not run ({type(e).__name__})"
        variants, chosen = decode_variants(kv, inp)
        for name in variants:
            fn = variant_callable(OP, name)
            ulp = check(inp, fn=fn)
            print(f"[{time.perf_counter() - t0:.0f}s] {kv} {name}: checked, max ulp {ulp:.2f}",
                  flush=True)
            out = torch.empty_like(inp["q"])
            try:
                us = triton.testing.do_bench_cudagraph(lambda fn=fn, inp=inp, out=out: fn(**inp, out=out), rep=200) * 1e3
            except Exception as e:  # noqa: BLE001 - a wrapper that syncs cannot be captured
                print(f"graph capture failed ({type(e).__name__}); timing plain launches")
                torch.cuda.synchronize()
                us = triton.testing.do_bench(lambda fn=fn, inp=inp, out=out: fn(**inp, out=out), rep=200,
                                             return_mode="median") * 1e3
            if args.shapes and name == "triton_decode":
                for shp, cell in time_shapes(inp, out, floor).items():
                    shape_rows.setdefault(shp, {})[kv] = cell
                print(f"[{time.perf_counter() - t0:.0f}s] {kv}: shapes timed", flush=True)
            lines_rows.append(f"| {kv} | {name}{' *' if name == chosen else ''} | {nbytes / 1e6:.1f} | "
                              f"{floor:.1f} | {us:.1f} | {floor / us:.0%} | "
                              f"{nbytes / (us * 1e-6) / 1e12:.2f} | {ulp:.2f} | {peer_us} |")
        del inp
        torch.cuda.empty_cache()
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "triton": triton.__version__}
    lines = [f"# QSA sparse GQA decode, {torch.cuda.get_device_name()}, {dt.date.today().isoformat()}",
             "", f"Versions: {versions}. 128 decode rows, 2048 selected keys a row (64 blocks of 32 "
             f"out of 256), 24 q heads / 2 KV heads / head_dim 256. Copy bandwidth (read + write) "
             f"measured in this run: {bw / 1e12:.2f} TB/s. Floor = selected K/V bytes (+ scales) / "
             "that bandwidth. Times: median of CUDA-graph replays (Triton, Gluon), median of eager "
             "calls (peer), microseconds. * marks the variant the sm_90 dispatch rules choose for the "
             "format (certify/cells/qsa_sparse_gqa.yaml).", "",
             "| KV | variant | KV MB | floor us | us | floor / time | TB/s | max ulp (4 rows) | "
             "torch gather + SDPA us |", "|---|---|---|---|---|---|---|---|---|", *lines_rows]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bench_common.write_report(out / "qsa_sparse_gqa.md", lines)
    print("\n".join(lines))
    if args.shapes:
        chosen = {kv: tuple(_DECODE_SHAPE[f]) for kv, f in (("bf16", FMT_BF16), ("fp8", FMT_FP8),
                                                             ("nvfp4", FMT_NVFP4))}
        table = [f"# QSA sparse GQA decode launch shapes, {torch.cuda.get_device_name()}, "
                 f"{dt.date.today().isoformat()}", "",
                 f"Versions: {versions}. The shape of qsa_sparse_gqa.md (same inputs, same run): "
                 "microseconds (median of CUDA-graph replays) and the share of the KV-bytes floor; "
                 "* marks the wrapper's choice (_DECODE_SHAPE); 'differs' = the output left the "
                 "2-ulp agreement with the default shape, 'fails' = it did not compile or run.", "",
                 "| tokens a tile | warps | stages | programs / SM | bf16 | fp8 | nvfp4 |",
                 "|---|---|---|---|---|---|---|"]
        for shp in sorted(shape_rows):
            cells = [shape_rows[shp].get(kv, "") + (" *" if chosen[kv] == shp else "")
                     for kv in ("bf16", "fp8", "nvfp4")]
            table.append(f"| {' | '.join(map(str, shp))} | {' | '.join(cells)} |")
        bench_common.write_report(out / "qsa_sparse_gqa_shapes.md", table)
        print("\n".join(table))


if __name__ == "__main__":
    main()
