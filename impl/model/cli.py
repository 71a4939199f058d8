"""The engine's command line.

``python -m impl.model.cli explain [options]``: why an engine configuration is accepted or refused (exit
0 accepted, 2 refused, including a field pydantic refuses).

``python -m impl.model.cli generate [options]``: greedy generation from a checkpoint (``--checkpoint``,
docs/checkpoint.md) or from seeded random weights of the tiny model (``--random-weights``), with a
progress display; prints each request's tokens, tokens per second, the acceptance length (with
speculation), the step kinds and the variant each op ran. Prompts are ``--prompt`` texts or
``--random-prompts N --prompt-len L``. Exit 0, or 2 when the configuration is refused or any request
is rejected (the others still run).

Video input (``--multimodal``, the tiny model only): ``--frames N`` gives every prompt N synthetic
frames, drawn by the frame task's maker (``impl.tasks.frames``: dim noise, a bright square in one
frame) from ``--seed`` and the request's index, and puts their placeholder run (``FRAME_TOKEN`` x N x
the tower's tokens a frame) at the prompt's start, after ``BOS`` where the tokenizer prepends it. The
frame task's prompt is that run then ``\\n?FR=``; the tiny checkpoint answers with the index of the
frame holding the square, which each result line shows. The tower's weights are ``--vision FILE``; by
default the checkpoint's own file beside it (``NAME-vision.safetensors``: the committed one is
``checkpoints/flashnext-tiny-vision.safetensors``), or seeded random ones with ``--random-weights``.
With ``--multimodal`` random prompts leave out the placeholder id, which a multimodal engine refuses
outside a frame run.

A checkpoint whose vocabulary is the tasks' byte tokenizer (impl/tasks/tokenizer.py, 256 ids: the
tiny checkpoint) reads a ``--prompt`` as the tasks do: ``BOS`` then the text's bytes (printable ASCII
and newline). Its requests stop at the tokenizer's ``END`` unless ``--stop-token`` names other stop
tokens or ``--no-stop-token`` turns stopping off. Random weights, trained on nothing, read the UTF-8
bytes and stop only at ``--stop-token``. The printed text leaves the stop token out.

Every problem a run can see before it starts is refused before the first step, in one message and
without a traceback (exit 2): an option out of range (argparse), a field pydantic refuses, a refusal
rule of impl/model/engine_config.py (named, as ``explain`` names it; checked before the weights load
and again on the checkpoint's geometry), a missing or invalid checkpoint file (naming the file and the
field at fault), a checkpoint of another preset's geometry, a prompt the tokenizer cannot read, a
stop token outside the vocabulary, ``--frames`` or ``--vision`` without ``--multimodal``, a frame
count the model's tower does not take, a missing or invalid vision tower file.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from pydantic import ValidationError

from impl.model.engine_config import (EngineConfig, SpeculativeConfig, check, default_context,
                                      explain)

# The checkpoint the project commits (docs/training.md trains it again), relative to the checkout.
TINY_CHECKPOINT = "checkpoints/flashnext-tiny.safetensors"
_TINY_VISION = "checkpoints/flashnext-tiny-vision.safetensors"   # its vision tower (--multimodal)
_ROOT = Path(__file__).resolve().parents[2]

_DESCRIPTION = """\
The Flash-Next engine from the command line.

  explain   whether an engine configuration is accepted or refused (by which rule), and which
            variant each op runs on this machine (or on --arch)
  generate  greedy generation on the tiny model, from a checkpoint (the committed one is
            checkpoints/flashnext-tiny.safetensors) or from seeded random weights

`python -m impl.model.cli COMMAND --help` lists a command's options and their defaults."""

_GENERATE_EPILOG = """\
prompt format of the tiny checkpoint (impl/tasks/: BOS is prepended, answers end with END = 3):
  arithmetic  "Q: <problem> How many <items> does <name> have now?\\nA:"  ->  " <steps>\\n#### N"
  mqar        "AB=12 QX=08 MD=77\\n?QX="                                 ->  "08"
  retrieval   "<letters, with records KXQT=5519023784;>\\n?KXQT="          ->  "5519023784"
  frames      --multimodal --frames 4 --prompt $'\\n?FR='                ->  "02" (the square's frame)
(in bash, $'...' writes the newline: --prompt $'AB=12 QX=08 MD=77\\n?QX=')

examples (from the repository root; an answer ends at END, which the text leaves out; an arithmetic
answer takes up to 89 tokens, more than the default --max-new-tokens):
  python -m impl.model.cli generate --checkpoint checkpoints/flashnext-tiny.safetensors \\
    --prompt $'Q: Mia has 14 pens. She buys 3 boxes of 6 pens each. How many pens does Mia have now?\\nA:' \\
    --max-new-tokens 96
  python -m impl.model.cli generate --checkpoint checkpoints/flashnext-tiny.safetensors \\
    --prompt $'AB=12 QX=08 MD=77 KE=40\\n?QX='
  python -m impl.model.cli generate --checkpoint checkpoints/flashnext-tiny.safetensors \\
    --multimodal --frames 4 --prompt $'\\n?FR='"""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each option's help ends with its default (a flag's is ``off``) unless the help already says
    it; descriptions and epilogs keep their line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if action.default is False:
            return f"{text} (default: off)"
        return f"{text} (default: {action.default})"


def _int_at_least(low: int):
    """An argparse type: an int >= ``low`` (argparse names the option when it is not)."""
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    parse.__name__ = "int"
    return parse


def _config_options(e: argparse.ArgumentParser, preset: str) -> None:
    """The EngineConfig fields as options; the choices are the config's own value sets (values the
    config admits but a rule refuses, such as fp16 state, stay choices: ``explain`` says why)."""
    from typing import get_args

    from impl.model import engine_config as ec

    def choice(name: str, kind, default: str, what: str) -> None:
        e.add_argument(name, default=default, choices=get_args(kind), help=what)

    choice("--preset", ec.ModelPreset, preset, "model geometry")
    choice("--device", ec.Device, "cpu", "where the engine runs")
    choice("--model-dtype", ec.ModelDtype, "bf16", "weights and activations")
    choice("--kv-dtype", ec.KvCacheDtype, "bf16", "paged K/V storage")
    choice("--state-dtype", ec.StateDtype, "fp32", "GDN recurrent-state pool")
    choice("--moe-backend", ec.MoeBackend, "auto",
           "the moe op's variant: triton (grouped GEMMs), torch (the composition) or spec_lowp "
           "(the reference); auto: the dispatch rules' choice")
    choice("--gdn-commit", ec.GdnCommit, "cached",
           "how a verify step's GDN state is committed: from the states it recorded after every "
           "row, or by re-running the accepted rows from the pre-verify state (draft length <= 3)")
    choice("--ple-tables", ec.PleTables, "device",
           "where the PLE tables E and G live: device memory, or host memory mapped into the "
           "device (cuda only)")
    e.add_argument("--max-batch-size", type=int, default=8, help="request slots")
    e.add_argument("--max-num-tokens", type=int, default=8192,
                   help="rows a step may run, prompt chunks included")
    e.add_argument("--max-seq-len", type=int, default=131072,
                   help="prompt + output + draft positions a request may hold")
    e.add_argument("--tokens-per-block", type=int, default=32,
                   help="tokens a KV page holds (the QSA block; only the spec's 32 is accepted)")
    e.add_argument("--no-chunked-prefill", action="store_true",
                   help="run each prompt as one context step")
    e.add_argument("--block-reuse", action="store_true",
                   help="EngineConfig.enable_block_reuse: read by the rules only; the engine does "
                        "not share KV pages between requests yet")
    e.add_argument("--draft-length", type=int, default=None,
                   help="MTP speculation with this many draft tokens a step, 1..7 (default: off)")
    e.add_argument("--dynamic-draft-length", action="store_true",
                   help="let the draft length change at run time; needs --draft-length (refused by "
                        "rule static_draft_length: see explain)")
    e.add_argument("--index-share", action="store_true",
                   help="draft rows reuse the trunk's last QSA selection; needs --draft-length")
    e.add_argument("--batch-invariant", action="store_true",
                   help="run every op's reference variant (bitwise equal to spec/model.py)")
    e.add_argument("--cuda-graphs", action="store_true",
                   help="decode steps replay CUDA graphs captured per batch bucket (--device cuda only)")
    e.add_argument("--prefill-graph", choices=["eager", "breakable"], default="eager",
                   help="context and mixed steps replay a CUDA graph per token bucket, broken "
                        "around the parts that read the step's spans (--device cuda only)")
    e.add_argument("--prefill-graph-max-tokens", type=int, default=None, metavar="N",
                   help="capture prefill graphs for steps of at most N tokens (default: "
                        "--max-num-tokens); larger steps run eagerly")
    e.add_argument("--torch-only", action="store_true",
                   help="dispatch only the variants written in torch (the benchmarks' peer)")
    e.add_argument("--no-moe-expert-copy", action="store_true",
                   help="drop the second copy of the routed experts that a large MoE launch of "
                        "another weight layout reads (explain shows whether one is kept)")
    e.add_argument("--multimodal", action="store_true",
                   help="accept video frames in requests (EngineConfig.multimodal; tiny only, no "
                        "speculation, disaggregation or CUDA graphs: explain shows the rules); "
                        "generate attaches frames with --frames")
    e.add_argument("--numerics", action="append", default=[], metavar="OP=TIER",
                   help="choose OP's variants from its numerics TIER (e.g. "
                        "gdn_prefill=bf16_operands; default: every op's exact tier); repeatable")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m impl.model.cli", description=_DESCRIPTION,
                                formatter_class=_HelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           title="commands")
    e = sub.add_parser("explain", help="explain why a configuration is accepted or refused",
                       formatter_class=_HelpFormatter,
                       description="Whether an engine configuration is accepted or refused (each "
                                   "refusal names its rule)\nand which variant each op runs; exit 0 "
                                   "accepted, 2 refused.")
    _config_options(e, "target")
    e.add_argument("--arch", default=None,
                   help="explain for this arch of the catalog instead of this machine's (e.g. "
                        "sm_90 with --device cuda: what the GPU would run, asked on any machine; "
                        "another arch is refused, naming the catalog's) (default: this machine's)")
    g = sub.add_parser("generate", help="greedy generation with a progress display",
                       formatter_class=_HelpFormatter, epilog=_GENERATE_EPILOG,
                       description="Greedy generation from a checkpoint or from seeded random "
                                   "weights of the tiny model;\nprints each request's tokens and "
                                   "text, tokens per second and the variant each op ran.\nExit 0, "
                                   "or 2 when the configuration is refused or a request is "
                                   "rejected.")
    _config_options(g, "tiny")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="FILE",
                     help=f"a safetensors checkpoint (docs/checkpoint.md); the project commits "
                          f"{TINY_CHECKPOINT} (default: none; this or --random-weights is required)")
    src.add_argument("--random-weights", action="store_true",
                     help="seeded random weights (tiny preset only)")
    g.add_argument("--seed", type=int, default=0,
                   help="seed of the random weights and random prompts")
    g.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="a prompt text, repeatable; the tiny checkpoint reads BOS + its bytes, "
                        "printable ASCII and newline (format: below), random weights its UTF-8 "
                        "bytes (default: none)")
    g.add_argument("--random-prompts", type=_int_at_least(0), default=0, metavar="N",
                   help="this many prompts of random token ids")
    g.add_argument("--prompt-len", type=_int_at_least(1), default=64,
                   help="tokens of each random prompt")
    g.add_argument("--max-new-tokens", type=_int_at_least(1), default=32,
                   help="tokens generated a request at most")
    g.add_argument("--frames", type=_int_at_least(1), default=0, metavar="N",
                   help="give every prompt N synthetic frames (impl/tasks/frames.py's maker: dim "
                        "noise, a bright square in one frame; seeded by --seed and the request), "
                        "their placeholder run at the prompt's start, after BOS; needs --multimodal; "
                        "N a multiple of the tower's group up to its max_frames (tiny: 2, 4, 6 or 8) "
                        "(default: 0, text prompts only)")
    g.add_argument("--vision", metavar="FILE", default=None,
                   help="the vision tower's weights for --multimodal (impl/model/vision.py's file "
                        "format) (default: with --checkpoint NAME.safetensors, NAME-vision.safetensors "
                        "beside it, e.g. checkpoints/flashnext-tiny-vision.safetensors; with "
                        "--random-weights, seeded random weights)")
    stop = g.add_mutually_exclusive_group()
    stop.add_argument("--stop-token", type=_int_at_least(0), action="append", default=None,
                      metavar="ID",
                      help="a token id that ends a request's output, repeatable; replaces the "
                           "default (default: the tokenizer's END = 3 for a checkpoint of the "
                           "tasks' byte vocabulary, such as tiny; none for random weights)")
    stop.add_argument("--no-stop-token", action="store_true",
                      help="stop at no token: every request generates --max-new-tokens")
    return p


class _Refused(Exception):
    """A problem found before the run starts: main prints the message (one line where it can) and
    exits 2, without a traceback."""


def _config(args) -> EngineConfig:
    spec = None
    if args.draft_length is not None:
        spec = SpeculativeConfig(draft_length=args.draft_length,
                                 dynamic_draft_length=args.dynamic_draft_length,
                                 index_share=args.index_share)
    else:
        for flag, on in (("--dynamic-draft-length", args.dynamic_draft_length),
                         ("--index-share", args.index_share)):
            if on:
                raise _Refused(f"{flag} is a setting of MTP speculation: it needs --draft-length K "
                               f"(1..7)")
    return EngineConfig(
        model=args.preset, device=args.device, model_dtype=args.model_dtype, kv_cache_dtype=args.kv_dtype,
        state_dtype=args.state_dtype, moe_backend=args.moe_backend,
        max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens,
        max_seq_len=args.max_seq_len, tokens_per_block=args.tokens_per_block,
        enable_chunked_prefill=not args.no_chunked_prefill,
        enable_block_reuse=args.block_reuse, speculative=spec,
        batch_invariant=args.batch_invariant, cuda_graphs=args.cuda_graphs,
        prefill_graph=args.prefill_graph,
        prefill_graph_max_tokens=args.prefill_graph_max_tokens, torch_only=args.torch_only, numerics=_numerics(args.numerics), ple_tables=args.ple_tables,
        moe_expert_copy=not args.no_moe_expert_copy, gdn_commit=args.gdn_commit,
        multimodal=args.multimodal)


def _numerics(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        op, sep, tier = item.partition("=")
        if not sep or not op or not tier:
            raise _Refused(f"--numerics {item!r}: give OP=TIER, e.g. gdn_prefill=bf16_operands")
        out[op] = tier
    return out


def _refused_fields(err: ValidationError) -> int:
    print("REFUSED (invalid field):")
    for e in err.errors():
        print(f"  {'.'.join(str(p) for p in e['loc'])}: {e['msg']}")
    return 2


def _missing_checkpoint(path: str) -> str:
    """What to do when ``--checkpoint`` names no file: where the committed checkpoint is, how it
    is trained, and the run that needs none."""
    committed = _ROOT / TINY_CHECKPOINT
    if committed.is_file():
        where = f"the project commits the tiny checkpoint as {TINY_CHECKPOINT} (--checkpoint {committed})"
    else:
        where = f"this checkout lacks the committed tiny checkpoint {TINY_CHECKPOINT}"
    return (f"--checkpoint {path}: no such file; {where}; `python -m impl.train.train_tiny --run-dir "
            f"runs/tiny` trains it again (docs/training.md); --random-weights runs without one")


def _load(path: str, dtype):
    """The checkpoint at ``path``, or ``_Refused`` naming the file and the problem."""
    from impl.model.checkpoint import CheckpointError, load_checkpoint
    if Path(path).is_dir():
        raise _Refused(f"--checkpoint {path}: is a directory; --checkpoint takes a checkpoint file "
                       f"(format: docs/checkpoint.md), such as {TINY_CHECKPOINT}")
    try:
        return load_checkpoint(path, dtype=dtype)
    except FileNotFoundError:
        raise _Refused(_missing_checkpoint(path)) from None
    except CheckpointError as err:
        raise _Refused(f"{err}\n--checkpoint takes a Flash-Next checkpoint (format: docs/checkpoint.md), "
                       f"such as {TINY_CHECKPOINT}") from None
    except OSError as err:
        raise _Refused(f"--checkpoint {path}: cannot be read: {err.strerror or err}") from None


def _check_preset(preset: str, cfg, path: str) -> None:
    """A checkpoint whose geometry is another preset's is refused: the rules would judge the
    preset's geometry while the engine runs the checkpoint's."""
    from typing import get_args

    from impl.model.engine_config import ModelPreset
    same = [p for p in get_args(ModelPreset) if EngineConfig(model=p).model_geometry() == cfg]
    if same and preset not in same:
        raise _Refused(f"--preset {preset}: checkpoint {path} holds the {same[0]} geometry; pass "
                       f"--preset {same[0]} (generate's default is tiny)")


def _byte_vocab(cfg) -> bool:
    """Whether the model's vocabulary is the tasks' byte tokenizer (impl/tasks/tokenizer.py)."""
    from impl.tasks import tokenizer
    return cfg.vocab_size == tokenizer.VOCAB_SIZE


def _prompt_ids(texts: list[str], tasks: bool) -> list[tuple[int, ...]]:
    """Each ``--prompt`` as token ids: for a checkpoint of the tasks' tokenizer (``tasks``) BOS and
    the text's bytes, the way the tiny checkpoint was trained; otherwise the UTF-8 bytes."""
    if not tasks:
        return [tuple(text.encode()) for text in texts]
    from impl.tasks.tokenizer import BOS, encode
    out = []
    for text in texts:
        bad = next((c for c in text if not (32 <= ord(c) < 127 or c == "\n")), None)
        if bad is not None:
            raise _Refused(f"--prompt {text!r}: the tiny model's tokenizer (impl/tasks/tokenizer.py) "
                           f"reads printable ASCII and newline only, and {bad!r} is neither")
        out.append((BOS, *encode(text)))
    return out


def _stop_ids(args, cfg, tasks: bool) -> tuple[int, ...]:
    """The stop tokens: ``--stop-token`` where given, else the tokenizer's END for a checkpoint of
    the tasks' tokenizer (random weights were trained on nothing: no default stop)."""
    if args.no_stop_token:
        return ()
    if args.stop_token is not None:
        bad = [t for t in args.stop_token if t >= cfg.vocab_size]
        if bad:
            raise _Refused(f"--stop-token {bad[0]}: not a token id of this model (0..{cfg.vocab_size - 1})")
        return tuple(args.stop_token)
    if tasks:
        from impl.tasks.tokenizer import END
        return (END,)
    return ()


def _check_video(args, config: EngineConfig) -> None:
    """``--frames`` and ``--vision`` against ``--multimodal`` and the model's tower, before anything
    loads (a preset without a tower is left to rule multimodal_model_has_a_vision_tower)."""
    from impl.model.vision import vision_geometry
    for flag, given in (("--frames", args.frames), ("--vision", args.vision)):
        if given and not config.multimodal:
            raise _Refused(f"{flag} {given}: needs --multimodal (video input, "
                           f"EngineConfig.multimodal; the tiny model only)")
    geo = vision_geometry(config.model)
    if not args.frames or geo is None:
        return
    if args.frames > geo.max_frames or args.frames % geo.group:
        *most, last = [str(n) for n in range(geo.group, geo.max_frames + 1, geo.group)]
        counts = f"{', '.join(most)} or {last}" if most else last
        raise _Refused(f"--frames {args.frames}: the {config.model} model's vision tower takes "
                       f"{counts} frames a request (whole groups of {geo.group}, at most "
                       f"{geo.max_frames})")


def _vision_weights(args, config: EngineConfig, dtype):
    """The tower's weights of a multimodal run (None otherwise): ``--vision``, else the checkpoint's
    file beside it, else (``--random-weights``) seeded random ones; ``_Refused`` names the file."""
    if not config.multimodal:
        return None
    import torch
    from safetensors import SafetensorError

    from impl.model.vision import load_vision, vision_geometry
    geo = vision_geometry(config.model)
    if args.vision is None and args.random_weights:
        from spec.ops.vision import init_vision_weights
        return init_vision_weights(geo, torch.Generator().manual_seed(args.seed), dtype=dtype,
                                   device=config.device)
    if args.vision is not None:
        path = Path(args.vision)
        if not path.is_file():
            raise _Refused(f"--vision {args.vision}: no such file; the tiny checkpoint's tower is "
                           f"{_TINY_VISION} (python -m impl.train.train_frames trains it again)")
    else:
        ckpt = Path(args.checkpoint)
        path = ckpt.with_name(f"{ckpt.stem}-vision.safetensors")
        if not path.is_file():
            raise _Refused(f"--multimodal: no vision tower beside --checkpoint {args.checkpoint} "
                           f"({path} is absent); pass --vision FILE, such as {_TINY_VISION}")
    try:
        return load_vision(path, geo, dtype, config.device)
    except (ValueError, OSError, SafetensorError) as err:
        text = str(err) if isinstance(err, ValueError) else f"{path}: not a readable file ({err})"
        raise _Refused(f"{text}\n--vision takes a vision tower file (impl/model/vision.py's "
                       f"save_vision), such as {_TINY_VISION}") from None


def _frame_samples(args, count: int) -> list:
    """``count`` samples of the frame task (impl/tasks/frames.py) with ``--frames`` frames each, drawn
    in request order from ``--seed``: each holds its pixels and the frame with the bright square."""
    from impl.tasks.frames import FrameParams, Frames
    rng = random.Random(args.seed)
    params = FrameParams(frames=args.frames)
    return [Frames().generate(rng, params, i) for i in range(count)]


def _token_name(token: int, cfg) -> str:
    if _byte_vocab(cfg):
        from impl.tasks.tokenizer import END
        if token == END:
            return f"END ({END})"
    return f"token {token}"


def _generate(args, config: EngineConfig) -> int:
    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from impl.model.admission import Request
    from impl.model.engine import Engine
    from impl.model.engine_config import ConfigRefused, route
    from impl.model.placement import to_device
    from impl.model.vision import vision_geometry
    from spec.ops.vision import FRAME_TOKEN

    if not args.prompt and not args.random_prompts:
        raise _Refused("no prompt: give --prompt TEXT or --random-prompts N")
    _check_video(args, config)
    if args.random_weights and config.model != "tiny":
        raise _Refused("--random-weights builds the tiny model only (the target's weights do not fit)")
    try:
        route(config)  # the refusal rules, before any weight is read or moved
    except ConfigRefused as err:
        raise _Refused(str(err)) from None
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[config.model_dtype]
    if args.checkpoint:
        ckpt = _load(args.checkpoint, dtype)
        weights, cfg = ckpt.weights, ckpt.cfg
        _check_preset(config.model, cfg, args.checkpoint)
    else:
        from spec.model import init_weights
        cfg = config.model_geometry()
        weights = init_weights(cfg, seed=args.seed, dtype=dtype)
    tasks = bool(args.checkpoint) and _byte_vocab(cfg)   # trained on impl/tasks/ prompts and END
    prompts = _prompt_ids(args.prompt, tasks)
    stops = _stop_ids(args, cfg, tasks)
    vision = _vision_weights(args, config, dtype)
    gen = torch.Generator().manual_seed(args.seed)
    # A multimodal engine refuses the placeholder id outside a frame run: random ids skip it.
    skip = FRAME_TOKEN if config.multimodal else cfg.vocab_size
    randoms = [torch.randint(0, cfg.vocab_size - (skip < cfg.vocab_size), (args.prompt_len,),
                             generator=gen) for _ in range(args.random_prompts)]
    prompts += [tuple((ids + (ids >= skip).long()).tolist()) for ids in randoms]
    samples = _frame_samples(args, len(prompts)) if args.frames else []
    if samples:   # the run after BOS (a prompt of the tasks' tokenizer starts with it) or first
        run = (FRAME_TOKEN,) * (args.frames * vision_geometry(config.model).tokens_per_frame)
        heads = [1 if tasks else 0] * len(args.prompt) + [0] * args.random_prompts
        prompts = [p[:h] + run + p[h:] for p, h in zip(prompts, heads)]
    requests = [Request(request_id=f"req{i}", prompt=p, max_new_tokens=args.max_new_tokens,
                        stop_token_ids=stops, frames=samples[i].frames if samples else None)
                for i, p in enumerate(prompts)]
    try:
        if config.device != "cpu":
            weights = to_device(weights, config.device)
        # the rules again, on the checkpoint's geometry
        engine = Engine(config, weights, cfg=cfg, vision=vision)
    except ConfigRefused as err:
        raise _Refused(str(err)) from None
    columns = (TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=True, disable=not sys.stdout.isatty()) as bar:
        task = bar.add_task("tokens", total=None)
        report = engine.generate(requests, progress=lambda done, total: bar.update(
            task, completed=done, total=total))
    rejected = 0
    for rid, res in report.results.items():
        if res.error:
            rejected += 1
            print(f"{rid}: REJECTED: {res.error}")
            continue
        ended = bool(res.tokens) and res.tokens[-1] in stops
        shown = res.tokens[:-1] if ended else res.tokens   # the text leaves the stop token out
        end = (f" ended at {_token_name(res.tokens[-1], cfg)}" if ended else
               f" ended at --max-new-tokens {args.max_new_tokens}"
               if len(res.tokens) >= args.max_new_tokens else "")
        # One character a byte; ascii() escapes the ids that are not printable ASCII (\x01, \xcf).
        text = f"  {ascii(bytes(shown).decode('latin-1'))}" if _byte_vocab(cfg) else ""
        al = f" acceptance length {res.acceptance_length:.2f}" if res.acceptance_length else ""
        shot = ""
        if samples:
            meta = samples[int(rid[3:])].meta
            shot = f"  ({meta['frames']} frames, the bright square in frame {meta['target']:02d})"
        print(f"{rid}: {res.tokens}{end}{al}{text}{shot}")
    print(f"{report.generated_tokens} tokens in {report.seconds:.2f} s: "
          f"{report.tokens_per_second:.1f} tokens/s over {report.steps} steps {report.step_kinds}")
    if report.acceptance_length is not None:
        print(f"acceptance length {report.acceptance_length:.3f} "
              f"(draft length {config.speculative.draft_length})")
    print("variants ran: " + ", ".join(f"{op}={'/'.join(v)}" for op, v in report.variants.items()))
    return 2 if rejected else 0


def _explain(args, config: EngineConfig) -> int:
    ctx = default_context(config, arch=args.arch)
    if args.arch:
        known = sorted({a for op in ctx.catalog.ops.values() for v in op.variants for a in v.archs})
        if args.arch not in known:
            raise _Refused(f"--arch {args.arch}: no variant runs there; the catalog's archs are {known}")
    print(explain(config, ctx))
    return 2 if check(config, ctx) else 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        try:
            config = _config(args)
        except ValidationError as err:
            return _refused_fields(err)
        return _generate(args, config) if args.command == "generate" else _explain(args, config)
    except _Refused as err:
        print(err)
        return 2


if __name__ == "__main__":
    sys.exit(main())
