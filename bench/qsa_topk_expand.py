"""Benchmark QSA top-k selection fused with expansion: the fused Triton kernel against the torch
composition, and both against the memory floor.

Run on the GPU machine from the repository root:
    python3 bench/qsa_topk_expand.py [--out DIR]
It writes ``qsa_topk_expand.md`` (a table with the date, the GPU, the versions and the speed-up) into
DIR (default reports/bench). Two shapes:
- decode: 128 rows, one a request, over 131072-token contexts (4096 score columns);
- prefill: the 16384 rows of one 16K-token prefill (512 columns), each row's t cut inside its table.
Inputs are the cells' builder (spec/cases/qsa.py ``topk_expand_case``: every tie rule, NaN, +-0.0).

- Each variant is first checked bitwise against the other and against the float64 spec on the first
  256 rows (the spec runs a Python loop a row; certification itself is the cells' job).
- Times are medians in microseconds: of CUDA-graph replays (triton.testing.do_bench_cudagraph) and of
  plain launches (triton.testing.do_bench, CUDA events). Input and output sets rotate over at least
  256 MiB, so the decode shape is not timed out of L2.
- The floor is the bytes that must move (scores and per-row integers read once, ids and tokens
  written once) over the device-to-device copy bandwidth measured in the same run.

``--smoke`` runs both variants at tiny shapes on whatever device there is (Triton's interpreter on a
CPU), checks them, and writes nothing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import sys
from pathlib import Path

import bench_common  # noqa: E402 (the checkout's root on the import path)
from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import torch

from certify.files.paths import project_paths
from impl.kernels.qsa import torch_topk_expand, triton_topk_expand
from spec.cases.qsa import TPB, WIDTH_BLOCKS, topk_expand_case
from spec.ops.qsa import qsa_topk_expand
from bench_common import copy_bandwidth  # noqa: E402  (bench/ is the script's folder)

VARIANTS = {"triton": triton_topk_expand.qsa_topk_expand, "torch": torch_topk_expand.qsa_topk_expand}
SHAPES = {  # name -> cell axes
    "decode_b128_131k": {"step": "decode", "batch": 128, "rows": 128, "context": 131072},
    "prefill_16k": {"step": "prefill", "batch": 1, "rows": 16384, "context": 16384},
}
SMOKE = {
    "decode_b4_2400": {"step": "decode", "batch": 4, "rows": 4, "context": 2400},
    "prefill_8_512": {"step": "prefill", "batch": 1, "rows": 8, "context": 512},
}
TARGETS = {"decode_b128_131k": 5.0, "prefill_16k": 4.0}  # the speed-ups asked of the fused kernel
CHECK_ROWS = 256
ROTATE_BYTES = 256 << 20


def build(axes: dict, device: str) -> dict[str, torch.Tensor]:
    full = {**axes, "score_pattern": "mixed_ties", "edge_rows": False}
    case = topk_expand_case(full, torch.Generator().manual_seed(axes["rows"]), "cpu")
    return {k: v.to(device) for k, v in case.inputs.items()}


def outputs(n: int, device: str) -> dict[str, torch.Tensor]:
    """Poisoned output buffers (-7 is no valid id or token: an unwritten element shows)."""
    return {"selected": torch.full((n, WIDTH_BLOCKS), -7, dtype=torch.int64, device=device),
            "tokens": torch.full((n, TPB * WIDTH_BLOCKS), -7, dtype=torch.int64, device=device)}


def check(inputs: dict[str, torch.Tensor]) -> dict[str, bool]:
    """Each variant against the other on every row and against the float64 spec on the first rows."""
    got = {}
    for name, fn in VARIANTS.items():
        out = outputs(inputs["scores"].shape[0], inputs["scores"].device.type)
        fn(**inputs, **out)
        got[name] = {k: v.cpu() for k, v in out.items()}
    head = {k: v[:CHECK_ROWS].cpu() for k, v in inputs.items()}
    want_sel, want_tok = qsa_topk_expand(head["scores"].double(), head["positions"],
                                         head["context_lens"])
    agree = all(torch.equal(got["triton"][k], got["torch"][k]) for k in ("selected", "tokens"))
    return {name: agree and torch.equal(g["selected"][:CHECK_ROWS], want_sel)
            and torch.equal(g["tokens"][:CHECK_ROWS], want_tok) for name, g in got.items()}


def moved_bytes(inputs: dict[str, torch.Tensor]) -> int:
    n = inputs["scores"].shape[0]
    read = inputs["scores"].numel() * 4 + n * 8  # scores, positions and lengths (int32)
    return read + n * WIDTH_BLOCKS * 8 * (1 + TPB)  # ids and tokens, int64


def rotating_call(fn, inputs: dict[str, torch.Tensor]):
    """A call that cycles through copies of the inputs and outputs spanning ROTATE_BYTES."""
    sets = max(1, -(-ROTATE_BYTES // moved_bytes(inputs)))
    n, dev = inputs["scores"].shape[0], inputs["scores"].device.type
    copies = [({k: v.clone() for k, v in inputs.items()}, outputs(n, dev)) for _ in range(sets)]
    turn = [0]

    def call() -> None:
        i, o = copies[turn[0] % sets]
        turn[0] += 1
        fn(**i, **o)
    return call




def time_us(call) -> tuple[float, float]:
    """(median of CUDA-graph replays, median of plain launches), microseconds."""
    import triton.testing

    call()
    torch.cuda.synchronize()
    plain = triton.testing.do_bench(call, warmup=50, rep=200, return_mode="median")
    try:
        graph = triton.testing.do_bench_cudagraph(call, rep=200, return_mode="median")
    except Exception as e:  # noqa: BLE001 - a path that cannot be captured keeps its plain time
        print(f"graph capture failed ({type(e).__name__}: {str(e)[:80]}); graph time is NaN")
        graph = float("nan")
    return graph * 1e3, plain * 1e3


def smoke() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name, axes in SMOKE.items():
        ok = check(build(axes, device))
        print(f"smoke {name} on {device}: " + ", ".join(f"{v} {'ok' if p else 'FAILED'}"
                                                        for v, p in ok.items()))
        if not all(ok.values()):
            sys.exit(1)
    print("smoke passed; nothing written")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(project_paths().reports / "bench"))
    p.add_argument("--smoke", action="store_true", help="tiny shapes on any device, writes nothing")
    args = p.parse_args()
    if args.smoke:
        smoke()
        return
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: timings come from the GPU machine only (use --smoke here)")
    import triton

    bw = copy_bandwidth()
    rows = []
    for name, axes in SHAPES.items():
        inputs = build(axes, "cuda")
        ok = check(inputs)
        row = {"shape": name, "rows": axes["rows"], "cols": inputs["scores"].shape[1],
               "floor": moved_bytes(inputs) / bw * 1e6}
        for v, fn in VARIANTS.items():
            if not ok[v]:
                print(f"{v} {name}: check failed, not timed")
            row[v] = time_us(rotating_call(fn, inputs)) if ok[v] else (float("nan"),) * 2
        rows.append(row)
        del inputs
        torch.cuda.empty_cache()
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "triton": triton.__version__}
    lines = [f"# QSA top-k + expand, {torch.cuda.get_device_name()}, {dt.date.today().isoformat()}", "",
             f"Versions: {versions}. Copy bandwidth (read + write) measured in this run: "
             f"{bw / 1e12:.2f} TB/s. Times: medians in microseconds, of CUDA-graph replays and (in "
             f"brackets) of plain launches; inputs rotate over {ROTATE_BYTES >> 20} MiB. Each variant "
             f"checked bitwise against the other and the float64 spec first (NaN = failed).", "",
             "| shape | rows | columns | floor us | triton us | torch us | speed-up (graph / plain) "
             "| target | triton / floor |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        (tg, tp), (cg, cp) = r["triton"], r["torch"]
        lines.append(f"| {r['shape']} | {r['rows']} | {r['cols']} | {r['floor']:.1f} | {tg:.1f} "
                     f"({tp:.1f}) | {cg:.1f} ({cp:.1f}) | {cg / tg:.2f}x / {cp / tp:.2f}x | "
                     f">= {TARGETS[r['shape']]:.0f}x | {tg / r['floor']:.2f}x |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bench_common.write_report(out / "qsa_topk_expand.md", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
