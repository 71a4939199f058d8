"""The engine's command line.

``python -m impl.model.cli explain [options]``: why an engine configuration is accepted or refused (exit
0 accepted, 2 refused, including a field pydantic refuses).

``python -m impl.model.cli generate [options]``: greedy generation from a checkpoint (``--checkpoint``,
docs/checkpoint.md) or from seeded random weights of the tiny model (``--random-weights``), with a
progress display; prints each request's tokens, tokens per second, the acceptance length (with
speculation), the step kinds and the variant each op ran. Prompts are ``--prompt`` texts (UTF-8 bytes,
for a byte-vocabulary model such as tiny) or ``--random-prompts N --prompt-len L``. Exit 0, or 2 when
the configuration is refused or any request is rejected (the others still run).
"""

from __future__ import annotations

import argparse
import sys

from pydantic import ValidationError

from impl.model.engine_config import (EngineConfig, SpeculativeConfig, check, default_context,
                                      explain)


def _config_options(e: argparse.ArgumentParser, preset: str) -> None:
    """The EngineConfig fields as options; the choices are the config's own value sets (values the
    config admits but a rule refuses, such as fp16 state, stay choices: ``explain`` says why)."""
    from typing import get_args

    from impl.model import engine_config as ec

    def choice(name: str, kind, default: str, what: str) -> None:
        e.add_argument(name, default=default, choices=get_args(kind), help=f"{what} (default {default})")

    choice("--preset", ec.ModelPreset, preset, "model geometry")
    choice("--device", ec.Device, "cpu", "where the engine runs")
    choice("--model-dtype", ec.ModelDtype, "bf16", "weights and activations")
    choice("--kv-dtype", ec.KvCacheDtype, "bf16", "paged K/V storage")
    choice("--state-dtype", ec.StateDtype, "fp32", "GDN recurrent-state pool")
    choice("--moe-backend", ec.MoeBackend, "torch", "routed-expert kernels")
    e.add_argument("--max-batch-size", type=int, default=8, help="request slots (default 8)")
    e.add_argument("--max-num-tokens", type=int, default=8192,
                   help="rows a step may run, prompt chunks included (default 8192)")
    e.add_argument("--max-seq-len", type=int, default=131072,
                   help="prompt + output + draft positions a request may hold (default 131072)")
    e.add_argument("--no-chunked-prefill", action="store_true",
                   help="run each prompt as one context step")
    e.add_argument("--block-reuse", action="store_true",
                   help="EngineConfig.enable_block_reuse: read by the rules only; the engine does "
                        "not share KV pages between requests yet")
    e.add_argument("--draft-length", type=int, default=None,
                   help="MTP speculation with this many draft tokens a step (1..7; default off)")
    e.add_argument("--dynamic-draft-length", action="store_true",
                   help="let the draft length change at run time (refused: see explain)")
    e.add_argument("--index-share", action="store_true",
                   help="draft rows reuse the trunk's last QSA selection")
    e.add_argument("--batch-invariant", action="store_true",
                   help="run every op's reference variant (bitwise equal to spec/model.py)")
    e.add_argument("--cuda-graphs", action="store_true",
                   help="decode steps replay CUDA graphs captured per batch bucket (cuda only)")
    e.add_argument("--torch-only", action="store_true",
                   help="dispatch only the variants written in torch (the benchmarks' peer)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m impl.model.cli")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("explain", help="explain why a configuration is accepted or refused")
    _config_options(e, "target")
    e.add_argument("--arch", default=None,
                   help="explain for this arch instead of this machine's (e.g. sm_90 with --device "
                        "cuda: what the GPU would run, asked on any machine)")
    g = sub.add_parser("generate", help="greedy generation with a progress display")
    _config_options(g, "tiny")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a safetensors checkpoint (docs/checkpoint.md)")
    src.add_argument("--random-weights", action="store_true",
                     help="seeded random weights (tiny preset only)")
    g.add_argument("--seed", type=int, default=0,
                   help="seed of the random weights and random prompts (default 0)")
    g.add_argument("--prompt", action="append", default=[], help="a prompt text (repeatable)")
    g.add_argument("--random-prompts", type=int, default=0, help="this many random prompts")
    g.add_argument("--prompt-len", type=int, default=64,
                   help="tokens of each random prompt (default 64)")
    g.add_argument("--max-new-tokens", type=int, default=32,
                   help="tokens generated a request at most (default 32)")
    g.add_argument("--stop-token", type=int, action="append", default=[],
                   help="a token id that ends a request's output (repeatable; the tiny "
                        "checkpoint's tasks end every answer with END = 3)")
    return p


def _config(args) -> EngineConfig:
    spec = None
    if args.draft_length is not None:
        spec = SpeculativeConfig(draft_length=args.draft_length,
                                 dynamic_draft_length=args.dynamic_draft_length,
                                 index_share=args.index_share)
    return EngineConfig(
        model=args.preset, device=args.device, model_dtype=args.model_dtype, kv_cache_dtype=args.kv_dtype,
        state_dtype=args.state_dtype, moe_backend=args.moe_backend,
        max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens,
        max_seq_len=args.max_seq_len, enable_chunked_prefill=not args.no_chunked_prefill,
        enable_block_reuse=args.block_reuse, speculative=spec,
        batch_invariant=args.batch_invariant, cuda_graphs=args.cuda_graphs,
        torch_only=args.torch_only)


def _refused_fields(err: ValidationError) -> int:
    print("REFUSED (invalid field):")
    for e in err.errors():
        print(f"  {'.'.join(str(p) for p in e['loc'])}: {e['msg']}")
    return 2


def _generate(args, config: EngineConfig) -> int:
    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from impl.model.admission import Request
    from impl.model.engine import Engine
    from impl.model.engine_config import ConfigRefused, route
    from impl.model.placement import to_device

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[config.model_dtype]
    if args.checkpoint:
        from impl.model.checkpoint import CheckpointError, load_checkpoint
        try:
            ckpt = load_checkpoint(args.checkpoint, dtype=dtype)
        except FileNotFoundError:
            print(f"--checkpoint {args.checkpoint}: no such file (train one with "
                  "`python -m impl.train.train_tiny`, or use --random-weights)")
            return 2
        except CheckpointError as err:
            print(err)
            return 2
        weights, cfg = ckpt.weights, ckpt.cfg
    else:
        if config.model != "tiny":
            print("--random-weights builds the tiny model only (the target's weights do not fit)")
            return 2
        from spec.model import init_weights
        cfg = config.model_geometry()
        weights = init_weights(cfg, seed=args.seed, dtype=dtype)
    prompts = [tuple(text.encode()) for text in args.prompt]
    gen = torch.Generator().manual_seed(args.seed)
    prompts += [tuple(torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=gen).tolist())
                for _ in range(args.random_prompts)]
    if not prompts:
        print("no prompt: give --prompt TEXT or --random-prompts N")
        return 2
    requests = [Request(request_id=f"req{i}", prompt=p, max_new_tokens=args.max_new_tokens,
                        stop_token_ids=tuple(args.stop_token))
                for i, p in enumerate(prompts)]
    try:
        if config.device != "cpu":
            route(config)  # refuses an absent device before any tensor moves
            weights = to_device(weights, config.device)
        engine = Engine(config, weights, cfg=cfg)
    except ConfigRefused as err:
        print(err)
        return 2
    columns = (TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task("tokens", total=None)
        report = engine.generate(requests, progress=lambda done, total: bar.update(
            task, completed=done, total=total))
    rejected = 0
    for rid, res in report.results.items():
        if res.error:
            rejected += 1
            print(f"{rid}: REJECTED: {res.error}")
            continue
        text = bytes(t for t in res.tokens if t < 256).decode(errors="replace") \
            if cfg.vocab_size <= 256 else ""
        al = f" acceptance length {res.acceptance_length:.2f}" if res.acceptance_length else ""
        print(f"{rid}: {res.tokens}{al}" + (f"  {text!r}" if text else ""))
    print(f"{report.generated_tokens} tokens in {report.seconds:.2f} s: "
          f"{report.tokens_per_second:.1f} tokens/s over {report.steps} steps {report.step_kinds}")
    if report.acceptance_length is not None:
        print(f"acceptance length {report.acceptance_length:.3f} "
              f"(draft length {config.speculative.draft_length})")
    print("variants ran: " + ", ".join(f"{op}={'/'.join(v)}" for op, v in report.variants.items()))
    return 2 if rejected else 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = _config(args)
    except ValidationError as err:
        return _refused_fields(err)
    if args.command == "generate":
        return _generate(args, config)
    ctx = default_context(config, arch=args.arch)
    if args.arch:
        known = sorted({a for op in ctx.catalog.ops.values() for v in op.variants for a in v.archs})
        if args.arch not in known:
            print(f"--arch {args.arch}: no variant runs there; the catalog's archs are {known}")
            return 2
    print(explain(config, ctx))
    return 2 if check(config, ctx) else 0


if __name__ == "__main__":
    sys.exit(main())
