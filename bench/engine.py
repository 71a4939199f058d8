"""Benchmark the engine's decode at the target's geometry: tokens per second against the bytes floor.

Run on the GPU machine from the repository root:
    python3 bench/engine.py [--layers N] [--batch 1,8,32] [--kv bf16] [--modes eager,graphs,torch]
                            [--out DIR]
    python3 bench/engine.py --smoke      # the tiny model on the CPU, a few tokens, nothing written
It writes ``engine.md`` into DIR (default reports/bench) with the date, the GPU and the versions.
Weights are drawn on the device (spec.model.init_weights: fp32 draws from the device's generator,
one nvfp4 global scale per expert stack), so the 48-layer model needs no host copy. ``--layers``
keeps the first N layers (the layer rule unchanged) where the whole model does not fit or a quick
figure is enough. ``--model tiny --device cpu`` runs the same script on the CPU's tiny model.

Per batch size B and mode: after two warm runs (one full-length prompt, then B short ones: every
kernel compiled, the batch's first graphs captured), one run of B random prompts of
``--prompt-len`` tokens to ``--new-tokens`` tokens, greedy, each step timed on the host (a step ends
by reading its tokens). The prefill time is the sum of the steps that read prompts; the decode step
time is the median decode step (a graph captured mid-run at a new table width is one outlier). The
floor is the bytes one decode step must move (``decode_step_bytes``; with ``--draft-length`` one
speculative step, ``speculative_step_bytes``) over the device-to-device copy bandwidth measured in
the same run. The issue's protocol: ``--prompt-len 8192 --batch 1,32,128``.
``--modes`` picks the engines timed at every batch size: ``eager`` (the fast variants, step by
step), ``graphs`` (the same with decode steps replayed from CUDA graphs), ``all_graphs`` (the
same with context steps replayed from breakable prefill graphs too) and ``torch`` (only the
variants written in torch: the peer).
``--smoke`` runs the tiny model on the CPU (batches 1 and 2, 8-token prompts, 3 new tokens, the eager
and torch modes, the kernel profile of the eager runs), checks that every request produced its tokens
and that every run had decode steps, and writes nothing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common  # noqa: E402 (the checkout's root on the import path)
from impl.model.admission import Request  # noqa: E402
from impl.model.engine import Engine  # noqa: E402
from impl.model.engine_config import EngineConfig, SpeculativeConfig  # noqa: E402
from spec.config import ModelConfig  # noqa: E402
from spec.model import init_weights  # noqa: E402
from spec.ops.kv_storage import NVFP4_BLOCK  # noqa: E402

BF16 = 2


def distinct_experts(cfg: ModelConfig, rows: int) -> float:
    """Expected distinct experts ``rows`` tokens select in one layer under uniform routing (the
    random weights' router is close to uniform): E (1 - (1 - k / E)^rows)."""
    E, k = cfg.num_experts, cfg.moe_top_k
    return E * (1.0 - (1.0 - k / E) ** rows)


def decode_step_bytes(cfg: ModelConfig, rows: int, context: int, kv: str, state: str) -> dict:
    """Bytes one decode step of ``rows`` requests at ``context`` tokens must move, by part: every
    dense weight once (bf16), the routed experts the rows select (nvfp4 codes + e4m3 block scales),
    each row's gathered embedding and PLE rows, the KV the sparse attention selects plus the index
    keys it scores (every context token), the GDN state read and written, the fp32 logits written.
    The MTP layer is left out (plain decoding)."""
    p = cfg.param_breakdown()
    L, C, V, P = cfg.num_layers, cfg.hidden, cfg.vocab_size, cfg.ple_dim
    routed_per_layer = cfg.num_experts * 3 * cfg.expert_inter * C
    dense = (p["lm_head"] + p["final_norm"] + p["gdn_mixers"] + p["qsa_mixers"] + p["hc_and_norms"]
             + p["ple_projections"] + p["moe"] - L * routed_per_layer)
    selected = min(context, (cfg.top_k_blocks + cfg.sink_blocks + cfg.local_blocks)
                   * cfg.tokens_per_block)
    ngram_rows = len(cfg.ple_ngram_orders) * cfg.ple_hash_heads
    gathered = C + L * P + ngram_rows * (L * P // cfg.ple_num_heads)
    return {
        "dense weights": dense * BF16,
        "routed experts": L * distinct_experts(cfg, rows) * expert_bytes(cfg),
        "embedding + PLE rows": rows * gathered * BF16,
        "KV selected + index keys": cfg.num_qsa_layers * rows * (
            selected * cfg.kv_bytes_per_token_per_layer(kv)
            + context * cfg.qsa_side_plane_bytes_per_token()),
        "GDN state r+w": 2 * rows * cfg.gdn_state_bytes_per_slot(state),
        "logits": rows * V * 4,
    }


def speculative_step_bytes(cfg: ModelConfig, requests: int, context: int, kv: str, state: str,
                           draft_length: int) -> dict:
    """Bytes one speculative step must move, by part: the trunk verifies K + 1 rows a request
    (``decode_step_bytes`` over those rows, except that a request's GDN state is read once and
    written once, its accepted row's, and its index keys and selected KV are read once for all its
    rows), then K draft passes, each reading the MTP layer's weights other than its routed experts,
    the LM head, the experts its rows select, one embedding row, the draft layer's KV and index
    keys a request, and writing each row's fp32 logits (the passes run one after another: each
    drafts from the last one's token). The verify buffer of the cached commit is not in the floor:
    a commit that re-runs the accepted rows keeps none."""
    K, C, V = draft_length, cfg.hidden, cfg.vocab_size
    trunk = decode_step_bytes(cfg, requests * (K + 1), context, kv, state)
    once = decode_step_bytes(cfg, requests, context, kv, state)
    for part in ("KV selected + index keys", "GDN state r+w"):
        trunk[part] = once[part]
    routed = cfg.num_experts * 3 * cfg.expert_inter * C
    mtp_dense = cfg.param_breakdown()["mtp"] - cfg.mtp_layers * routed
    attention = once["KV selected + index keys"] / cfg.num_qsa_layers
    one_pass = ((mtp_dense + V * C) * BF16
                + cfg.mtp_layers * distinct_experts(cfg, requests) * expert_bytes(cfg)
                + requests * C * BF16 + cfg.mtp_layers * attention + requests * V * 4)
    return {**trunk, "draft passes": K * one_pass}


def expert_bytes(cfg: ModelConfig) -> float:
    """One routed expert's gate, up and down matrices: nvfp4 codes and e4m3 block scales."""
    return 3 * cfg.expert_inter * cfg.hidden * (1 / 2 + 1 / NVFP4_BLOCK)


def step_bytes(cfg: ModelConfig, requests: int, context: int, kv: str, state: str,
               draft_length: int) -> dict:
    """The floor's bytes of one generation step: a decode step, or with a draft length a
    speculative one."""
    if draft_length:
        return speculative_step_bytes(cfg, requests, context, kv, state, draft_length)
    return decode_step_bytes(cfg, requests, context, kv, state)


def _requests(cfg: ModelConfig, rows: int, prompt_len: int, new: int, seed: int) -> list[Request]:
    gen = torch.Generator().manual_seed(seed)
    return [Request(request_id=f"r{i}", max_new_tokens=new,
                    prompt=tuple(torch.randint(0, cfg.vocab_size, (prompt_len,),
                                               generator=gen).tolist()))
            for i in range(rows)]


MODES = {"eager": {}, "graphs": {"cuda_graphs": True},
         "all_graphs": {"cuda_graphs": True, "prefill_graph": "breakable"},
         "torch": {"torch_only": True}}


def step_tokens(rows: int, prompt_len: int) -> int:
    """The engine's ``max_num_tokens``: a step reads at most 8192 prompt tokens (chunked prefill)."""
    return max(rows, min(8192, rows * prompt_len))


def _engine(cfg, weights, args, rows: int, mode: str, prompt_len: int, new: int) -> Engine:
    k = args.draft_length
    config = EngineConfig(model=args.model, device=args.device, kv_cache_dtype=args.kv,
                          state_dtype=args.state, max_batch_size=rows,
                          max_num_tokens=max(step_tokens(rows, prompt_len), rows * (k + 1)),
                          max_seq_len=prompt_len + new + 8 + 2 * k,
                          speculative=SpeculativeConfig(draft_length=k) if k else None,
                          **MODES[mode])
    return Engine(config, weights, cfg=cfg)


@dataclass
class StepTimes:
    prefill: float                 # seconds of the steps that read prompts (context / mixed)
    decode: list[float]            # seconds of each full generation step (decode, or verify with
                                   # its commit and draft passes): every request generating
    partial: int = 0               # decode steps with fewer rows (the others prefilling or done)
    captures: list[float] = field(default_factory=list)   # decode steps that captured a graph

    def median_decode(self) -> float:
        return statistics.median(self.decode)

    def spread(self) -> str:
        q = statistics.quantiles(self.decode, n=10) if len(self.decode) >= 2 else self.decode * 9
        return f"{q[0] * 1e3:.2f}-{q[-1] * 1e3:.2f}"


def timed_run(engine: Engine, requests: list[Request]) -> StepTimes:
    """One run, each step timed on the host: a step ends by reading its tokens, which waits for
    the device. A decode step counts as full when every request of the run is running and none
    is prefilling; a step that captured a CUDA graph (a new batch bucket or table width) is kept
    apart, so the decode figure is the steady state's."""
    for r in requests:
        engine.submit(r)
    times = StepTimes(0.0, [])
    while not engine.idle:
        kinds = dict(engine.step_kinds)
        captured = len(engine.graphs.graphs) if engine.graphs is not None else 0
        full = not engine.waiting and len(engine.running) == len(requests) and not any(
            s.in_prompt for s in engine.running.values())
        t0 = time.perf_counter()
        engine.step()
        dt_step = time.perf_counter() - t0
        kind = next(k for k, n in engine.step_kinds.items() if n != kinds.get(k, 0))
        if kind not in ("decode", "verify"):
            times.prefill += dt_step
        elif engine.graphs is not None and len(engine.graphs.graphs) > captured:
            times.captures.append(dt_step)
        elif full:
            times.decode.append(dt_step)
        else:
            times.partial += 1
    return times


def kernel_profile(engine: Engine, requests: list[Request], steps: int = 3) -> list[str]:
    """The GPU kernels of ``steps`` decode steps, by name: time and launches a step (torch.profiler,
    eager launches; a kernel's GPU time is the same replayed from a graph)."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    for r in requests:
        engine.submit(r)
    before = engine.step_kinds.get("decode", 0)
    while engine.step_kinds.get("decode", 0) == before and not engine.idle:
        engine.step()
    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
        if cuda:
            torch.cuda.synchronize()
    while not engine.idle:
        engine.step()
    self_time = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    rows = [(self_time(e) / steps, e.count / steps, e.key)
            for e in prof.key_averages() if self_time(e) > 0]
    rows.sort(reverse=True)
    total = max(sum(t for t, _, _ in rows), 1e-9)
    out = [f"GPU kernel time a decode step: {total / 1e3:.2f} ms in "
           f"{sum(c for _, c, _ in rows):.0f} launches", "",
           "| us a step | share | launches a step | kernel |", "|---|---|---|---|"]
    out += [f"| {t:.1f} | {100 * t / total:.1f} % | {c:.0f} | `{k[:90]}` |" for t, c, k in rows[:40]]
    return out


def finished_tokens(engine: Engine, requests: list[Request]) -> dict[str, int]:
    """Tokens each of ``requests`` produced in ``engine`` (absent: it did not finish)."""
    ids = {r.request_id for r in requests}
    return {s.request.request_id: len(s.output) for s in engine.finished
            if s.request.request_id in ids}


# --smoke: the tiny model on the CPU, a couple of tokens, every mode that runs there
SMOKE = {"model": "tiny", "device": "cpu", "layers": None, "batch": "1,2", "prompt_len": 8,
         "new_tokens": 3, "modes": "eager,torch", "peer_tokens": 3, "peer_prompt_len": 8,
         "profile": True}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("target", "tiny"), default="target")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--kv", default="bf16", choices=("bf16", "fp8", "nvfp4"))
    ap.add_argument("--state", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=16,
                    help="full decode steps wanted (each request also gets one token a prefill step)")
    ap.add_argument("--modes", default="eager,graphs,torch",
                    help="comma-separated: eager, graphs (cuda only), all_graphs (cuda only), torch")
    ap.add_argument("--peer-tokens", type=int, default=4,
                    help="full decode steps in the torch mode's runs (it is the slow one)")
    ap.add_argument("--peer-prompt-len", type=int, default=64,
                    help="prompt tokens in the torch mode's runs")
    ap.add_argument("--draft-length", type=int, default=0,
                    help="MTP speculation at this draft length: the generation step is a verify "
                         "step (its trunk graphed in the graphs mode) with its commit and draft "
                         "passes; no floor is computed for it")
    ap.add_argument("--out", default="reports/bench")
    ap.add_argument("--profile", action="store_true",
                    help="also write engine_profile.md: the GPU kernels of a decode step, by name "
                         "(eager mode, each batch)")
    ap.add_argument("--smoke", action="store_true",
                    help="the tiny model on the CPU, batches 1 and 2, a few tokens, the eager and "
                         "torch modes; checks every request finished, writes nothing")
    args = ap.parse_args()
    if args.smoke:
        for name, value in SMOKE.items():
            setattr(args, name, value)
    cfg = ModelConfig.tiny() if args.model == "tiny" else ModelConfig.target()
    if args.layers:
        cfg = ModelConfig(**{**cfg.model_dump(), "num_layers": args.layers})
    cuda = args.device.startswith("cuda")
    t0 = time.perf_counter()
    weights = init_weights(cfg, seed=0, dtype=torch.bfloat16, device=args.device)
    if cuda:
        torch.cuda.synchronize()
    drawn = time.perf_counter() - t0
    if cuda:
        from bench_common import copy_bandwidth  # noqa: PLC0415
        bw = copy_bandwidth()
        import triton  # noqa: PLC0415

        where = (f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
                 f"{triton.__version__}; copy bandwidth "
                 f"{bw / 1e9:.0f} GB/s (read + write); weights drawn in {drawn:.0f} s, "
                 f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB held")
    else:
        bw = None
        where = f"CPU, torch {torch.__version__}; weights drawn in {drawn:.1f} s (no floor on the CPU)"
    spec = (f", MTP draft length {args.draft_length} (a step: verify, commit, draft passes)"
            if args.draft_length else "")
    lines = [f"# Engine decode, {args.model} geometry with {cfg.num_layers} layers "
             f"({dt.date.today()})", "", where + spec + ".", "",
             f"Random prompts, greedy, KV {args.kv}, state {args.state}. Per batch and mode one "
             "run of B requests submitted together, each step timed on the host: prefill s = the "
             "steps that read prompts (chunks of at most 8192 tokens; requests that finished their "
             "prompt decode in them); step ms = the median full decode step (all B requests "
             "decoding; p10-p90 beside it; steps that captured a CUDA graph are kept apart); "
             "tokens/s = B / median step. Each request generates the full steps wanted plus one "
             "token a prefill step, so that every request is still running when the last prompt "
             "ends. Modes: eager (the fast variants, launched step by step), graphs (the same, "
             "decode steps replayed from CUDA graphs), all_graphs (graphs, and context steps "
             "replayed from breakable prefill graphs), torch (only the variants written in torch, "
             f"eager, {args.peer_prompt_len}-token prompts, {args.peer_tokens} full steps). The "
             "floor is the step's bytes (below, at the step's mean context) over the copy "
             "bandwidth.", "",
             "| batch | mode | prompt | prefill s | decode tokens/s | step ms | p10-p90 ms | "
             "full steps | floor MB | floor ms | % of floor | largest floor part |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    batches = [int(b) for b in args.batch.split(",")]
    profile_lines = [f"# Decode-step kernels, {args.model} geometry with {cfg.num_layers} layers "
                     f"({dt.date.today()})", "", where + ".", ""]
    modes = args.modes.split(",")
    steps: dict[tuple[int, str], float] = {}
    out_dir = Path(args.out)
    for rows in batches:
        for mode in modes:
            torch_mode = mode == "torch"
            plen = args.peer_prompt_len if torch_mode else args.prompt_len
            wanted = args.peer_tokens if torch_mode else args.new_tokens
            new = wanted + -(-rows * plen // step_tokens(rows, plen))
            parts = step_bytes(cfg, rows, plen + new // 2, args.kv, args.state, args.draft_length)
            total = sum(parts.values())
            big = max(parts, key=parts.get)
            engine = _engine(cfg, weights, args, rows, mode, plen, new)
            # Compiles (and captures the first graphs): one full-length prompt, then short ones.
            timed_run(engine, _requests(cfg, 1, plen, 2, seed=0))
            timed_run(engine, _requests(cfg, rows, 8, 3, seed=0))
            requests = _requests(cfg, rows, plen, new, seed=1)
            times = timed_run(engine, requests)
            produced = finished_tokens(engine, requests)
            ok = bool(times.decode) and produced == {r.request_id: new for r in requests}
            if args.smoke:
                print(f"smoke {mode} b{rows}: {len(times.decode)} full decode steps, tokens a "
                      f"request {sorted(produced.values())} of {new}: {'ok' if ok else 'FAILED'}",
                      flush=True)
            if not ok:
                raise SystemExit(f"batch {rows} {mode}: {len(times.decode)} full decode steps, "
                                 f"tokens a request {sorted(produced.values())} of {new}")
            step = times.median_decode()
            steps[(rows, mode)] = step
            floor = f"{total / bw * 1e3:.2f}" if bw else "-"
            share = f"{100 * total / bw / step:.1f} %" if bw else "-"
            lines.append(f"| {rows} | {mode} | {plen} | {times.prefill:.2f} | {rows / step:.1f} | "
                         f"{step * 1e3:.2f} | {times.spread()} | {len(times.decode)} | "
                         f"{total / 1e6:.0f} | {floor} | {share} | "
                         f"{big} {100 * parts[big] / total:.0f} % |")
            print(lines[-1] + (f" ({len(times.captures)} capture steps, {times.partial} partial)"),
                  flush=True)
            if args.profile and mode == "eager":
                profile_lines += ["", f"## batch {rows}", ""] + kernel_profile(
                    engine, _requests(cfg, rows, plen, 8, seed=2))
                print("\n".join(profile_lines[-14:]), flush=True)
            del engine
            if cuda:
                torch.cuda.empty_cache()
            if not args.smoke:   # a later batch that runs out of time keeps this one's rows
                out_dir.mkdir(parents=True, exist_ok=True)
                bench_common.write_report(out_dir / "engine.md", lines)
    ratios = [f"- batch {rows}: {mode} {steps[(rows, 'torch')] / steps[(rows, mode)]:.1f}x "
              "faster than torch" for rows in batches for mode in ("eager", "graphs", "all_graphs")
              if (rows, mode) in steps and (rows, "torch") in steps]
    ratios += [f"- batch {rows}: graphs {steps[(rows, 'eager')] / steps[(rows, 'graphs')]:.1f}x "
               "faster than eager" for rows in batches
               if (rows, "eager") in steps and (rows, "graphs") in steps]
    if ratios:
        lines += ["", "Generation step against the torch-only engine or the eager one (its step over "
                  "this one's):", ""]
        lines += ratios
    context = args.prompt_len + args.new_tokens // 2
    lines += ["", f"Bytes a {'speculative' if args.draft_length else 'decode'} step must move, by part "
              "(MB), at the largest batch:", ""]
    parts = step_bytes(cfg, batches[-1], context, args.kv, args.state, args.draft_length)
    lines += [f"- {name}: {value / 1e6:.1f}" for name, value in parts.items()]
    if args.smoke:
        print("smoke passed; nothing written")
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    bench_common.write_report(out_dir / "engine.md", lines)
    if args.profile:
        bench_common.write_report(out_dir / "engine_profile.md", profile_lines)


if __name__ == "__main__":
    main()
