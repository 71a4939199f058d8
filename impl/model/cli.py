"""``python -m impl.model.cli explain [options]``: print why an engine configuration is accepted or
refused (exit 0 accepted, 2 refused, including a field pydantic refuses)."""

from __future__ import annotations

import argparse
import sys

from pydantic import ValidationError

from impl.model.engine_config import EngineConfig, SpeculativeConfig, check, explain


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m impl.model.cli")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("explain", help="explain why a configuration is accepted or refused")
    e.add_argument("--preset", default="target", help="model preset: target | tiny")
    e.add_argument("--model-dtype", default="bf16")
    e.add_argument("--kv-dtype", default="bf16")
    e.add_argument("--state-dtype", default="fp32")
    e.add_argument("--moe-backend", default="torch")
    e.add_argument("--max-batch-size", type=int, default=8)
    e.add_argument("--max-num-tokens", type=int, default=8192)
    e.add_argument("--max-seq-len", type=int, default=131072)
    e.add_argument("--no-chunked-prefill", action="store_true")
    e.add_argument("--block-reuse", action="store_true")
    e.add_argument("--draft-length", type=int, default=None, help="enables MTP speculation")
    e.add_argument("--dynamic-draft-length", action="store_true")
    e.add_argument("--index-share", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        spec = None
        if args.draft_length is not None:
            spec = SpeculativeConfig(draft_length=args.draft_length,
                                     dynamic_draft_length=args.dynamic_draft_length,
                                     index_share=args.index_share)
        config = EngineConfig(
            model=args.preset, model_dtype=args.model_dtype, kv_cache_dtype=args.kv_dtype,
            state_dtype=args.state_dtype, moe_backend=args.moe_backend,
            max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens,
            max_seq_len=args.max_seq_len, enable_chunked_prefill=not args.no_chunked_prefill,
            enable_block_reuse=args.block_reuse, speculative=spec)
    except ValidationError as err:
        print("REFUSED (invalid field):")
        for e in err.errors():
            print(f"  {'.'.join(str(p) for p in e['loc'])}: {e['msg']}")
        return 2
    print(explain(config))
    return 2 if check(config) else 0


if __name__ == "__main__":
    sys.exit(main())
