"""Benchmark the breakable prefill graph against eager prefill: TTFT, capture cost, graph memory,
and what padding does to the logits.

Run on the GPU machine from the repository root:
    python3 bench/prefill_graph.py [--layers N] [--lengths 128,512,2048,6000] [--kv bf16]
                                   [--draft-length K] [--repeats 5] [--out DIR]
    python3 bench/prefill_graph.py --smoke   # the tiny model on the CPU, nothing written
It writes ``prefill_graph.md`` into DIR (default reports/bench) with the date, the GPU and the
versions. Weights are drawn on the device as in bench/engine.py.

Two engines over the same weights, one request each (``max_num_tokens`` 8192: a prompt of up to
8192 tokens is one context step): ``eager`` and ``prefill_graph: breakable``
(impl/model/prefill_graphs.py). The graphed engine captures every token bucket first
(``capture_all``): the boot cost, each bucket's capture time and the device memory the graphs hold
(reserved by the allocator after the captures, less before) are reported. Then per prompt length
L, after one warm run of each engine, ``--repeats`` runs of generate(max_new_tokens=1) on fresh
random prompts, alternating the engines; TTFT is the median wall time of a run (the step ends by
reading its token). Each repeat's prompt is the same for both engines, so the last row's logits are
compared: bit-equal (a prompt that fills its bucket must be), the greedy token, and the largest
difference of the top token's log-probability (the eager top token, under both).
``--smoke`` runs the tiny model on the CPU with the graphs' CPU stand-in (EagerPieces: the forward
re-run over the static buffers), checks the tokens and the full-bucket bits, writes nothing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common  # noqa: E402 (the checkout's root on the import path)
from impl.model.admission import Request  # noqa: E402
from impl.model.engine import Engine  # noqa: E402
from impl.model.engine_config import EngineConfig, SpeculativeConfig  # noqa: E402
from impl.model.prefill_graphs import EagerPieces, PrefillGraphs  # noqa: E402
from spec.config import ModelConfig  # noqa: E402
from spec.model import init_weights  # noqa: E402

MAX_TOKENS = 8192
SMOKE = dict(model="tiny", device="cpu", lengths="16,37", repeats=2, layers=None)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("target", "tiny"), default="target")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--lengths", default="128,512,2048,6000")
    ap.add_argument("--kv", default="bf16", choices=("bf16", "fp8", "nvfp4"))
    ap.add_argument("--state", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--draft-length", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="reports/bench")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        for name, value in SMOKE.items():
            setattr(args, name, value)
    return args


def engine(cfg: ModelConfig, weights, args, graph: str) -> Engine:
    """One request's engine. On the CPU the rule refuses the graph, so the graphed engine is an
    eager one of two slots with prefill graphs over the CPU stand-in, the second slot as scratch."""
    k = args.draft_length
    top = max(int(n) for n in args.lengths.split(","))
    on_cpu = not args.device.startswith("cuda")
    config = EngineConfig(model=args.model, device=args.device, kv_cache_dtype=args.kv,
                          state_dtype=args.state, max_batch_size=2 if on_cpu else 1,
                          max_num_tokens=min(MAX_TOKENS, top + 16), max_seq_len=top + 16 + 2 * k,
                          speculative=SpeculativeConfig(draft_length=k) if k else None,
                          prefill_graph="eager" if on_cpu else graph)
    e = Engine(config, weights, cfg=cfg, log_calls=True)
    if on_cpu and graph == "breakable":
        e.prefill_graphs = PrefillGraphs(e.model, e.cache, config.max_num_tokens,
                                         capture=EagerPieces(), scratch=1)
    return e


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def ttft(e: Engine, prompt: tuple[int, ...], cuda: bool) -> tuple[float, torch.Tensor]:
    """Seconds of one generate(max_new_tokens=1), and the logits row that chose its token."""
    e.calls.clear()
    sync(cuda)
    t0 = time.perf_counter()
    e.generate([Request(request_id="r", prompt=prompt, max_new_tokens=1)])
    seconds = time.perf_counter() - t0
    last = [c for c in e.calls if c.kind == "trunk"][-1]
    return seconds, last.logits[-1].float()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    cfg = ModelConfig.tiny() if args.model == "tiny" else ModelConfig.target()
    if args.layers:
        cfg = ModelConfig(**{**cfg.model_dump(), "num_layers": args.layers})
    cuda = args.device.startswith("cuda")
    weights = init_weights(cfg, seed=0, dtype=torch.bfloat16, device=args.device)
    eager, graphed = engine(cfg, weights, args, "eager"), engine(cfg, weights, args, "breakable")
    g = graphed.prefill_graphs
    sync(cuda)
    before = torch.cuda.memory_reserved() if cuda else 0
    per_bucket = []
    t0 = time.perf_counter()
    for b in g.buckets:
        t1 = time.perf_counter()
        g.capture(b)
        sync(cuda)
        per_bucket.append((b, time.perf_counter() - t1))
        print(f"captured bucket {b} in {per_bucket[-1][1]:.2f} s", flush=True)
    boot = time.perf_counter() - t0
    pool = (torch.cuda.memory_reserved() - before) if cuda else 0
    lengths = [int(n) for n in args.lengths.split(",")]
    gen = torch.Generator().manual_seed(7)
    rows, failures = [], []
    for n in lengths:
        bucket = g.bucket(n)
        warm = tuple(torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist())
        ttft(eager, warm, cuda), ttft(graphed, warm, cuda)
        times = {"eager": [], "graph": []}
        equal, same_token, worst = 0, 0, 0.0
        for _ in range(args.repeats):
            prompt = tuple(torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist())
            te, le = ttft(eager, prompt, cuda)
            tg, lg = ttft(graphed, prompt, cuda)
            times["eager"].append(te)
            times["graph"].append(tg)
            equal += torch.equal(le, lg)
            top = int(le.argmax())
            same_token += top == int(lg.argmax())
            worst = max(worst, abs(float(torch.log_softmax(le, -1)[top]
                                         - torch.log_softmax(lg, -1)[top])))
        if n == bucket and equal != args.repeats:
            failures.append(f"{n} tokens fill bucket {bucket}, and {args.repeats - equal} of "
                            f"{args.repeats} logits rows differ from eager")
        e_ms, g_ms = (statistics.median(times[k]) * 1e3 for k in ("eager", "graph"))
        rows.append(f"| {n} | {bucket} | {e_ms:.1f} | {g_ms:.1f} | {e_ms / g_ms:.2f}x | "
                    f"{equal}/{args.repeats} | {same_token}/{args.repeats} | {worst:.3g} |")
        print(rows[-1], flush=True)
    if args.smoke:
        print("smoke: " + ("; ".join(failures) if failures else "ok"), flush=True)
        return 1 if failures else 0
    import triton  # noqa: PLC0415

    spec = f", MTP draft length {args.draft_length}" if args.draft_length else ""
    lines = [f"# Breakable prefill graph against eager prefill, {args.model} geometry with "
             f"{cfg.num_layers} layers ({dt.date.today()})", "",
             f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
             f"{triton.__version__}; KV {args.kv}, state {args.state}{spec}; one request, "
             f"max_num_tokens {graphed.config.max_num_tokens}.", "",
             f"Capture of {len(g.buckets)} buckets: {boot:.1f} s in all; graph memory "
             f"{pool / 2**30:.2f} GiB (reserved after the captures less before).", "",
             "| bucket | capture s |", "|---|---|",
             *[f"| {b} | {s:.2f} |" for b, s in per_bucket], "",
             f"TTFT: median of {args.repeats} runs of generate(max_new_tokens=1), fresh random "
             "prompts, the engines alternating. Logits: the last row's, eager against graph, on "
             "the same prompts; logprob diff = the largest |difference| of the eager top token's "
             "log-probability.", "",
             "| prompt | bucket | eager ms | graph ms | speed-up | bit-equal | same token | "
             "logprob diff |", "|---|---|---|---|---|---|---|---|", *rows]
    if failures:
        lines += ["", "FAILED: " + "; ".join(failures)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bench_common.write_report(out / "prefill_graph.md", lines)
    print("\n".join(lines), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
