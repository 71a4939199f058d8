"""Perf records for dispatch (GPU): every variant of an op timed at every shape the forward reaches.

Run on the GPU machine from the repository root:
    python3 bench/perf_records.py --op gdn_prefill [--cell long_t8192] [--arch sm_90] [--out DIR]
    python3 bench/perf_records.py --smoke [--op OP] [--cell CELL]   # on the CPU, nothing written

For each shape the reach file (reports/reach.json) records for the op in the arch's mode, each
variant of the op on the arch (whose packages are installed) is first checked against its tier's
oracle at that shape (the oracle of the template cell whose axes the shape replaces: ``--cell``, or
the op's cell sharing the most axis values with the shape; a tier variant takes its tier's bands),
then timed: the median of CUDA-graph replays (bench_common's method), or, for a call over 20 ms (a
row-at-a-time loop), the median of three plain calls, or, over 500 ms, one call after a warm-up. A
variant that fails its check gets no record. The records are merged into DIR/<arch>.jsonl (default
reports/perf), which certify.perf.check_dispatch and tests/framework/test_perf_dispatch.py read.
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import time

import torch

import bench_common  # noqa: F401 (the checkout's root on the import path)
from bench_common import graph_us
from certify.catalog.load import load_op_file
from certify.files.paths import project_paths
from certify.harness import oracles
from certify.harness.requirements import missing, versions
from certify.harness.target import build_case, resolve, run_spec, run_variant, variant_callable
from certify.perf.records import PerfRecord, perf_dir, write_perf
from certify.reach import load_reach
from certify.perf.dispatch import traced_shapes

SLOW_MS = 20.0
VERY_SLOW_MS = 500.0   # a call this slow (a Python loop over 8192 rows) is timed once, after a warm-up


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_call(fn, cuda: bool = True) -> tuple[float, str]:
    fn()
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    once = (time.perf_counter() - t0) * 1e3
    if once > VERY_SLOW_MS:
        return once * 1e3, "once"
    if once > SLOW_MS or not cuda:
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            _sync()
            runs.append((time.perf_counter() - t0) * 1e6)
        return sorted(runs)[1], "plain"
    try:
        return graph_us(fn), "graph"
    except Exception:  # noqa: BLE001 - a call that cannot be captured is timed plainly
        import triton.testing
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, rep=200, return_mode="median") * 1e3, "plain"


def nearest_cell(op, axes: dict):
    """The op's cell sharing the most axis values with the shape (the first such in file order), so
    a shape takes the bands of a cell of its own kind (its state dtype, its KV dtype)."""
    return max(op.cells, key=lambda c: sum(op.axes_of(c).get(k) == v for k, v in axes.items()))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--op", default="gdn_prefill")
    p.add_argument("--cell", default=None,
                   help="the cell whose oracle and axes the shapes start from (default: for each "
                        "shape, the op's cell that shares the most axis values with it)")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--out", default=None, help="records folder (default reports/perf)")
    p.add_argument("--smoke", action="store_true",
                   help="the same steps on the CPU at one cell's own shape (--cell, default the "
                        "op's first cell; short_t37 for gdn_prefill): every CPU variant must pass "
                        "its check after the others' timed calls; no records")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    paths = project_paths()
    op = load_op_file(paths.cells / f"{args.op}.yaml")
    if args.smoke:
        args.cell = args.cell or ("short_t37" if op.op == "gdn_prefill" else op.cells[0].id)
        args.arch = "cpu"
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: perf records come from the GPU machine (use --smoke here)")
    shapes = ([op.axes_of(op.cell(args.cell))] if args.smoke else
              traced_shapes(load_reach(paths.reach), args.arch).get(op.op, []))
    if not shapes:
        raise SystemExit(f"the reach file records no call of {op.op} on {args.arch}")
    device = torch.device("cpu" if args.smoke else "cuda")
    records, failed = [], []
    today = dt.date.today().isoformat()
    base_versions = {"python": platform.python_version(), "torch": torch.__version__,
                     "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none"}
    for axes in shapes:
        template = op.cell(args.cell) if args.cell else nearest_cell(op, axes)
        cell = template.model_copy(update={"id": "perf", "axes": {**template.axes, **{
            k: v for k, v in axes.items() if k in template.axes or k in op.axes}}})
        case = build_case(op, cell, device)
        refs: dict[str, dict] = {}
        for v in op.variants:
            if args.arch not in v.archs or missing(v):
                continue
            try:
                impl = variant_callable(op, v.name)
                got = run_variant(impl, case)
                if v.numerics not in refs:
                    refs[v.numerics] = run_spec(resolve(op.spec_of(v)), case, reference=True)
                oracle = op.oracle_of(v, cell)
                problems = []
                for name, band in oracle.outputs.items():
                    verdict = oracles.tolerance(name, got[name].cpu(), refs[v.numerics][name].cpu(),
                                                band.max_ulp, band.max_rel_rms)
                    problems += verdict.problems
                if oracle.kind != "tolerance":
                    problems.append("only tolerance oracles are checked here")
                if problems:
                    print(f"{v.name} at {axes}: no record, its check failed: {problems}", flush=True)
                    failed.append(v.name)
                    continue
                bufs = {n: torch.empty(s.shape, dtype=s.dtype, device=device)
                        for n, s in case.outputs.items() if n not in case.inplace}
                # the timed calls update copies of the in-place inputs (a decode's state), so the
                # next variant is checked on the inputs the reference saw
                timed = {n: (x.clone() if n in case.inplace.values() else x)
                         for n, x in case.inputs.items()}
                us, how = time_call(lambda i=timed, b=bufs: impl(**i, **b), cuda=not args.smoke)
            except Exception as e:  # noqa: BLE001 - a variant that cannot run here is reported
                print(f"{v.name} at {axes}: not timed ({type(e).__name__}: {str(e)[:200]})",
                      flush=True)
                continue
            records.append(PerfRecord(op=op.op, variant=v.name, arch=args.arch,
                                      axes=op.axes_of(cell), us=round(us, 2), how=how,
                                      script="bench/perf_records.py", date=today,
                                      versions=base_versions | versions(v)))
            print(f"{'smoke ' if args.smoke else ''}{v.name} at {axes}: {us:.1f} us ({how})",
                  flush=True)
        del case, refs
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.smoke:
        if failed or not records:
            raise SystemExit(f"smoke: {', '.join(failed) or 'no variant'} failed the check")
        print(f"smoke passed ({len(records)} variants checked and timed); nothing written")
        return
    out = write_perf(args.out or perf_dir(paths), records)
    print("wrote", ", ".join(map(str, out)))


if __name__ == "__main__":
    main()
