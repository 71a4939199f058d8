"""Benchmark the per-layer embeddings at the target's tables on the GPU: the Triton variant with its
tables E and G in device memory, in pinned host memory (``cudaHostAlloc``) and in registered
pageable host memory (``cudaHostRegister``, the engine's ``ple_tables='host'``), beside the torch
variant and the bytes floor.

Run on the GPU machine from the repository root:
    python3 bench/ple.py [--out DIR]
    python3 bench/ple.py --smoke      # reduced tables on the CPU (interpreter), nothing written
It writes ``ple.md`` into DIR (default reports/bench) with the date, the GPU and the versions.

Tables at the target: E [151936, 48 x 256] and G [sum of the 16 primes, 768], bf16 (3.7 + 1.6 GB),
random; the host copies are the device's bytes. Rows: decode steps of 1, 32 and 128 requests (a
history per row, random ids) and one request's 8192-token prompt chunk. A row reads, per layer, 256
values of E and 256 of one G row (2 x 512 contiguous bytes): the gathered bytes are T x 48 x 1024.
Times are medians of CUDA-graph replays of the whole op (the context GEMM included, whose W_ple
[3072, 12288] stays on the device). The floor column is the device-memory floor: W_ple, the gathered
rows, x_emb read and e written once, over the copy bandwidth measured in the same run; the host
placements read their gathered rows over the PCIe link instead, whose rate the last column gives.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
from pathlib import Path

if "--smoke" in sys.argv[1:]:   # the interpreter is chosen when a kernel is decorated
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common  # noqa: E402 (the checkout's root on the import path)
from impl.kernels.ple import torch_ple, triton_ple  # noqa: E402
from spec.config import ModelConfig  # noqa: E402
from spec.ops.ple import NgramHashConfig, ple_embed  # noqa: E402

ROWS = [("decode 1", 1), ("decode 32", 32), ("decode 128", 128), ("prompt chunk 8192", 8192)]


def _hash(cfg: ModelConfig, gen: torch.Generator) -> tuple[NgramHashConfig, tuple]:
    """Random odd multipliers and the geometry's primes (``ModelConfig.ple_hash_primes``), as the
    config and as the kernels' tensors (int64 bits, on the CPU)."""
    from impl.model.ops import _hash_constants  # noqa: PLC0415

    primes = cfg.ple_hash_primes()

    def odd() -> int:
        return int(torch.randint(0, 2 ** 62, (1,), generator=gen)) * 2 + 1
    mults = tuple(tuple(tuple(odd() for _ in range(n)) for _ in order)
                  for n, order in zip(cfg.ple_ngram_orders, primes))
    hc = NgramHashConfig(multipliers=mults, primes=primes, pad_id=cfg.pad_id)
    return hc, _hash_constants(hc, torch.device("cpu"))


def _inputs(cfg, T: int, per_row: bool, gen: torch.Generator, device: str) -> dict:
    V, C = cfg.vocab_size, cfg.hidden
    ids = torch.randint(0, V, (T,), generator=gen)
    history = torch.randint(0, V, (T, 2) if per_row else (2,), generator=gen)
    x = torch.randn(T, C, generator=gen).to(torch.bfloat16)
    return {"ids": ids.to(device), "history": history.to(device), "x_emb": x.to(device)}


def smoke() -> None:
    cfg = ModelConfig.tiny()
    gen = torch.Generator().manual_seed(0)
    hc, (m2, m3, pr) = _hash(cfg, gen)
    L, P, C = cfg.num_layers, cfg.ple_dim, cfg.hidden
    table = torch.randn(cfg.vocab_size, L * P, generator=gen).to(torch.bfloat16)
    ngram = torch.randn(hc.table_rows, L * P // hc.num_heads, generator=gen).to(torch.bfloat16)
    w_ple = (torch.randn(C, L * P, generator=gen) / C ** 0.5).to(torch.bfloat16)
    norm_w = torch.randn(P, generator=gen) * 0.1
    for T, per_row in ((1, True), (8, False)):
        inp = _inputs(cfg, T, per_row, gen, "cpu")
        e = torch.empty(T, L, P, dtype=torch.bfloat16)
        triton_ple.ple_embed(**inp, table=table, ngram_table=ngram, w_ple=w_ple, norm_w=norm_w,
                             mult2=m2, mult3=m3, primes=pr, e=e)
        want = ple_embed(inp["ids"], inp["history"], inp["x_emb"].double(), table.double(),
                         ngram.double(), w_ple.double(), norm_w.double(), hc)
        err = float(((e.double() - want).abs() / want.abs().amax(-1, keepdim=True)).max())
        ok = err <= 2 ** -8
        print(f"smoke T {T}: max error {err:.2e} of the row maximum: {'ok' if ok else 'FAILED'}")
        if not ok:
            raise SystemExit(1)
    print("smoke passed; nothing written")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="reports/bench")
    ap.add_argument("--smoke", action="store_true",
                    help="reduced tables on the CPU (Triton's interpreter), a check against the "
                         "float64 spec, nothing timed or written")
    args = ap.parse_args()
    if args.smoke:
        return smoke()
    import triton  # noqa: PLC0415
    import triton.testing  # noqa: PLC0415

    from bench_common import copy_bandwidth, graph_us  # noqa: PLC0415
    from impl.model.placement import HostMapped, cuda_alias  # noqa: PLC0415

    cfg = ModelConfig.target()
    L, P, C = cfg.num_layers, cfg.ple_dim, cfg.hidden
    gen = torch.Generator().manual_seed(0)
    dgen = torch.Generator(device="cuda").manual_seed(0)
    hc, consts = _hash(cfg, gen)
    m2, m3, pr = (t.cuda() for t in consts)
    table = torch.randn(cfg.vocab_size, L * P, device="cuda", generator=dgen).to(torch.bfloat16)
    ngram = torch.randn(hc.table_rows, L * P // hc.num_heads, device="cuda",
                        generator=dgen).to(torch.bfloat16)
    w_ple = (torch.randn(C, L * P, device="cuda", generator=dgen) / C ** 0.5).to(torch.bfloat16)
    norm_w = torch.randn(P, device="cuda", generator=dgen) * 0.1
    bw = copy_bandwidth()
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in (table, ngram)]
    for h, t in zip(pinned, (table, ngram)):
        h.copy_(t)
    mapped = HostMapped()
    places = {"device": (table, ngram),
              "pinned host": tuple(cuda_alias(h, torch.device("cuda")) for h in pinned),
              "registered host": (mapped.map(table, "cuda"), mapped.map(ngram, "cuda"))}
    tb = (table.numel() + ngram.numel()) * 2
    lines = [f"# PLE embedding at the target's tables ({dt.date.today()})", "",
             f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
             f"{triton.__version__}; copy bandwidth {bw / 1e9:.0f} GB/s (read + write); tables "
             f"E + G {tb / 1e9:.2f} GB.", "",
             "| rows | placement | triton us | gathered MB | device floor us | % of floor | "
             "gathered GB/s | torch us (device tables) |", "|---|---|---|---|---|---|---|---|"]
    for label, T in ROWS:
        inp = _inputs(cfg, T, T <= 128, gen, "cuda")
        gathered = T * L * 2 * P * 2
        floor_bytes = w_ple.numel() * 2 + gathered + T * C * 2 + T * L * P * 2
        floor = floor_bytes / bw * 1e6
        want = None
        torch_us = None
        for name, (tab, ng) in places.items():
            e = torch.empty(T, L, P, dtype=torch.bfloat16, device="cuda")
            run = lambda: triton_ple.ple_embed(**inp, table=tab, ngram_table=ng, w_ple=w_ple,  # noqa: E731,B023
                                                norm_w=norm_w, mult2=m2, mult3=m3, primes=pr, e=e)
            run()
            if want is None:
                want = e.clone()
                ref = torch.empty_like(e)
                torch_ple.ple_embed(**inp, table=table, ngram_table=ngram, w_ple=w_ple,
                                    norm_w=norm_w, mult2=m2, mult3=m3, primes=pr, e=ref)
                diff = float((ref.float() - e.float()).abs().max())
                print(f"{label}: triton vs torch max |diff| {diff:.3g}", flush=True)
                torch_us = triton.testing.do_bench(
                    lambda: torch_ple.ple_embed(**inp, table=table, ngram_table=ngram,  # noqa: B023
                                                w_ple=w_ple, norm_w=norm_w, mult2=m2, mult3=m3,
                                                primes=pr, e=ref), rep=100,
                    return_mode="median") * 1e3
            elif not torch.equal(e, want):
                raise SystemExit(f"{label}: {name} tables give other values than the device's")
            us = graph_us(run)
            lines.append(f"| {label} | {name} | {us:.1f} | {gathered / 1e6:.2f} | {floor:.1f} | "
                         f"{100 * floor / us:.0f} % | {gathered / us / 1e3:.1f} | "
                         f"{torch_us:.1f} |")
            print(lines[-1], flush=True)
    mapped.release()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    bench_common.write_report(out_dir / "ple.md", lines)


if __name__ == "__main__":
    main()
