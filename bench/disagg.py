"""Benchmark disaggregated serving: a context engine on one device hands each request to a
generation engine on another; greedy tokens against the aggregated engine's, and the hand-off's
bytes and time against the link's bandwidth.

Run on a machine with two GPUs from the repository root:
    python3 bench/disagg.py [--model target --layers N | --model tiny] [--lengths 32,2048,...]
                            [--kv bf16,nvfp4] [--mtp both,generation] [--out DIR]
    python3 bench/disagg.py --smoke      # the tiny model on the CPU over gloo, nothing written
It writes ``disagg.md`` into DIR (default reports/bench) with the date, the devices and the
versions, and exits non-zero when a request's tokens differ from the aggregated engine's.

``--device cuda`` (the default) runs the context engine (rank 0) on cuda:0 and the generation engine
(rank 1) on cuda:1, hand-offs over NCCL with NVLink multicast off (``NCCL_NVLS_ENABLE=0`` unless
set); ``--device cpu`` runs both on the CPU over gloo (impl/model/disagg/pair.py). Weights:
``--model tiny`` reads the trained tiny checkpoint (retrieval prompts, on which its draft layer is
accepted); ``--model target`` draws seeded random weights on each device (spec.model.init_weights;
the same draws on two cards of one kind, checked by a checksum of the embedding, final norm and LM
head) with random prompts, ``--layers`` keeping the first N layers. The whole target's weights
(nvfp4 experts, bf16 dense weights: about 85 GB) fit one H200 each, not one H100; there ``--layers``
keeps fewer.

The matrix: every prompt length (``--lengths``; the default holds the page and chunk boundaries
2048, 2049, 4096 and 4097) in each KV format (``--kv``) and MTP mode (``--mtp``: ``both``, draft
length 3 on both engines; ``generation``, on the generation engine only, the context engine keeping
the prompt's rows for it; ``none``). One job per format and mode sends all its requests through the
pair. The reference is the aggregated engine on one device (cuda:0, run before the pair; on the CPU
beside it) at the generation engine's draft length. A request passes when its tokens and its
acceptance counts equal the reference's exactly. By default both engines hold one request at a time
(``--batch 1``) with the default dispatch: a request then runs the aggregated engine's passes (the
same prompt chunks, the same decode and verify rows), so its tokens are bit for bit the same.
``--batch N --batch-invariant`` batches instead (reference variants only, slow on CUDA).

Transfer figures, per request (impl/model/disagg/channel.py, ``Transfer``): the bytes handed over
(manifest header and payload), the payload's seconds on the receiving rank from the header's arrival
to the payload's (on CUDA polled for completion every 100 us: a figure may be up to 100 us late),
the payload's rate, and that rate's share of the link: the median one-way rate of ``--link-mib`` MiB
sent from rank 0 to rank 1 and back ``--link-reps`` times before the jobs. On the CPU over gloo a
small payload may already sit in the socket's buffers when its receive starts, so its rate can
exceed the link's; on CUDA an NCCL send waits for its receive.

``--smoke`` runs the tiny model on the CPU over gloo (prompts of 32 and 33 tokens, bf16 KV, MTP on
both engines and on the generation engine only), checks token equality, writes nothing, and exits
non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common  # noqa: E402 (the checkout's root on the import path)
from impl.model.admission import Request  # noqa: E402
from impl.model.disagg.channel import Transfer  # noqa: E402
from impl.model.disagg.pair import (  # noqa: E402
    CheckpointWeights, DrawnWeights, PairJob, PairResult, PairRun, pair_configs, rank_device,
    release, retrieval_prompt, run_pairs, spec, weight_sum)
from impl.model.engine import Engine, GenerationReport  # noqa: E402
from impl.model.engine_config import EngineConfig  # noqa: E402
from spec.config import ModelConfig  # noqa: E402

CHECKPOINT = bench_common.ROOT / "checkpoints" / "flashnext-tiny.safetensors"
# MTP mode -> (context draft length, generation draft length), at draft length k
MTP_MODES = {"none": lambda k: (0, 0), "both": lambda k: (k, k), "generation": lambda k: (0, k)}

SMOKE = {"model": "tiny", "device": "cpu", "layers": None, "lengths": "32,33", "kv": "bf16",
         "mtp": "both,generation", "new_tokens": 4, "link_mib": 4, "link_reps": 3}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--model", choices=("target", "tiny"), default="target")
    ap.add_argument("--layers", type=int, default=None, help="keep the first N layers (target)")
    ap.add_argument("--lengths", default="32,2048,2049,4096,4097,6000", help="prompt tokens")
    ap.add_argument("--kv", default="bf16,nvfp4", help="KV formats, comma-separated")
    ap.add_argument("--mtp", default="both,generation",
                    help="MTP modes, comma-separated: none, both, generation")
    ap.add_argument("--draft-length", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1, help="requests an engine holds at a time")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="reference variants only: tokens independent of the batch (slow on cuda)")
    ap.add_argument("--chunk", type=int, default=2048, help="prompt tokens a step reads")
    ap.add_argument("--link-mib", type=int, default=256, help="MiB a link measurement sends")
    ap.add_argument("--link-reps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="reports/bench")
    ap.add_argument("--smoke", action="store_true",
                    help="the tiny model on the CPU over gloo, 32- and 33-token prompts, bf16 KV, "
                         "both MTP modes; checks token equality, writes nothing")
    args = ap.parse_args(argv)
    if args.smoke:
        for name, value in SMOKE.items():
            setattr(args, name, value)
    return args


def geometry(args) -> ModelConfig:
    cfg = ModelConfig.tiny() if args.model == "tiny" else ModelConfig.target()
    if args.layers:
        cfg = ModelConfig(**{**cfg.model_dump(), "num_layers": args.layers})
    return cfg


def weight_source(args, cfg: ModelConfig):
    if args.model == "tiny":
        return CheckpointWeights(str(CHECKPOINT))
    return DrawnWeights(cfg, args.seed)


def requests(args, cfg: ModelConfig) -> tuple[Request, ...]:
    lengths = [int(n) for n in args.lengths.split(",")]
    gen = torch.Generator().manual_seed(args.seed)

    def prompt(i: int, n: int) -> tuple[int, ...]:
        if args.model == "tiny":
            return retrieval_prompt(n, i)
        return tuple(torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist())

    return tuple(Request(request_id=f"r{i}_{n}", prompt=prompt(i, n),
                         max_new_tokens=args.new_tokens) for i, n in enumerate(lengths))


def base_config(args, kv: str, reqs) -> dict:
    k = args.draft_length
    longest = max(len(r.prompt) for r in reqs)
    return dict(model=args.model, device=args.device, kv_cache_dtype=kv,
                max_batch_size=args.batch,
                max_num_tokens=max(args.chunk, args.batch * (k + 1)),
                max_seq_len=longest + args.new_tokens + 8 + 2 * k,
                batch_invariant=args.batch_invariant)


@dataclass(frozen=True)
class Job:
    kv: str
    mtp: str
    context_k: int
    generation_k: int


def jobs_of(args) -> list[Job]:
    return [Job(kv, mode, *MTP_MODES[mode](args.draft_length))
            for kv in args.kv.split(",") for mode in args.mtp.split(",")]


def references(args, cfg, source, jobs: list[Job], reqs) -> tuple[dict, float]:
    """The aggregated engine's reports by (KV format, draft length), on one device, and the
    checksum of its weights."""
    device = rank_device(args.device, 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    weights = source(device)
    out = {}
    for kv, k in dict.fromkeys((j.kv, j.generation_k) for j in jobs):
        config = EngineConfig(**base_config(args, kv, reqs), speculative=spec(k))
        out[(kv, k)] = Engine(config, weights, cfg=cfg).generate(reqs)
    checksum = weight_sum(weights)
    del weights
    release(device)     # on CUDA rank 0 draws its own copy on this device next
    return out, checksum


@dataclass
class Row:
    job: Job
    request_id: str
    prompt: int
    tokens_equal: bool
    accepted_equal: bool
    error: str | None
    transfer: Transfer | None

    @property
    def passed(self) -> bool:
        return self.tokens_equal and self.accepted_equal and self.error is None


def judge(job: Job, pair: PairResult, reference: GenerationReport, reqs) -> list[Row]:
    """One row per request: its tokens and acceptance counts against the reference's, exactly."""
    rows = []
    for r in reqs:
        rid = r.request_id
        want = reference.results[rid]
        rows.append(Row(job, rid, len(r.prompt), pair.tokens.get(rid) == want.tokens,
                        pair.accepted.get(rid) == want.num_accepted,
                        pair.errors.get(rid) or want.error, pair.transfers.get(rid)))
    return rows


@dataclass
class Outcome:
    rows: list[Row]
    run: PairRun
    reference_sum: float
    seconds: float

    @property
    def weights_agree(self) -> bool:
        return all(s == self.reference_sum for s in self.run.weight_sums)

    @property
    def passed(self) -> bool:
        return bool(self.rows) and self.weights_agree and all(r.passed for r in self.rows)


def run(args) -> Outcome:
    """The reference, then (on the CPU beside it) the pair's jobs; one row per job and request."""
    t0 = time.perf_counter()
    cfg = geometry(args)
    source = weight_source(args, cfg)
    reqs = requests(args, cfg)
    jobs = jobs_of(args)
    pair_jobs = []
    for j in jobs:
        ctx, gen = pair_configs(base_config(args, j.kv, reqs), j.context_k, j.generation_k)
        pair_jobs.append(PairJob(ctx, gen, reqs))
    link_bytes = args.link_mib << 20
    with tempfile.TemporaryDirectory() as store:
        def pair(while_waiting=None) -> PairRun:
            return run_pairs(pair_jobs, Path(store), source, cfg=cfg, while_waiting=while_waiting,
                             timeout_s=3600, link_bytes=link_bytes, link_reps=args.link_reps)

        if args.device == "cuda":    # the pair's devices to themselves while it is timed
            refs, ref_sum = references(args, cfg, source, jobs, reqs)
            pair_run = pair()
        else:
            pair_run = pair(lambda: references(args, cfg, source, jobs, reqs))
            refs, ref_sum = pair_run.waited
    rows = [row for j, result in zip(jobs, pair_run.results)
            for row in judge(j, result, refs[(j.kv, j.generation_k)], reqs)]
    return Outcome(rows, pair_run, ref_sum, time.perf_counter() - t0)


def table(outcome: Outcome) -> list[str]:
    link = outcome.run.link_bytes_per_second
    lines = ["| KV | MTP | prompt | tokens = aggregated | acceptance = aggregated | bytes handed | "
             "payload ms | payload GB/s | % of link |", "|---|---|---|---|---|---|---|---|---|"]
    for r in outcome.rows:
        t = r.transfer
        rate = t.payload_bytes_per_second if t else None
        lines.append(
            f"| {r.job.kv} | {r.job.mtp} | {r.prompt} | "
            f"{'yes' if r.tokens_equal else 'NO'} | {'yes' if r.accepted_equal else 'NO'} | "
            f"{t.bytes if t else '-'} | {f'{t.seconds * 1e3:.3f}' if t else '-'} | "
            f"{f'{rate / 1e9:.2f}' if rate else '-'} | "
            f"{f'{100 * rate / link:.1f} %' if rate and link else '-'} |"
            + (f" {r.error}" if r.error else ""))
    return lines


def verdict(outcome: Outcome) -> str:
    bad = [r for r in outcome.rows if not r.passed]
    if not outcome.weights_agree:
        return (f"FAIL: the ranks' weights differ from the reference's (checksums "
                f"{outcome.run.weight_sums} against {outcome.reference_sum})")
    if bad:
        return (f"FAIL: {len(bad)} of {len(outcome.rows)} requests differ from the aggregated "
                f"engine: " + ", ".join(f"{r.job.kv}/{r.job.mtp}/{r.request_id}" for r in bad))
    return (f"PASS: all {len(outcome.rows)} requests' greedy tokens and acceptance counts equal "
            "the aggregated engine's")


def where(args) -> str:
    if args.device == "cuda":
        import triton  # noqa: PLC0415

        names = ", ".join(f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in (0, 1))
        nccl = torch.cuda.nccl.version()
        nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        return f"{names}; torch {torch.__version__}, NCCL {nccl}, triton {triton.__version__}"
    return f"CPU (gloo); torch {torch.__version__}"


def report(args, cfg: ModelConfig, outcome: Outcome) -> list[str]:
    link = outcome.run.link_bytes_per_second
    link_text = (f"{link / 1e9:.2f} GB/s one way (median of {args.link_reps} round trips of "
                 f"{args.link_mib} MiB)" if link else "not measured")
    return [f"# Disaggregated serving, {args.model} geometry with {cfg.num_layers} layers "
            f"({dt.date.today()})", "", where(args) + ".", "",
            f"Context engine on rank 0, generation engine on rank 1 ({args.device}); the "
            f"aggregated engine on one device for the reference. {args.new_tokens} new tokens a "
            f"request, greedy; batch {args.batch}"
            f"{', batch-invariant' if args.batch_invariant else ''}; "
            f"prompt chunks of {args.chunk} tokens; MTP draft length {args.draft_length} "
            "(both: on both engines; generation: on the generation engine only). Link: "
            f"{link_text}. Payload ms: on the generation rank, from the hand-off's header "
            "to its payload received; bytes handed: header and payload. Run in "
            f"{outcome.seconds:.0f} s.", ""] + table(outcome) + ["", verdict(outcome)]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    cfg = geometry(args)
    outcome = run(args)
    lines = report(args, cfg, outcome)
    print("\n".join(lines), flush=True)
    if args.smoke:
        print(f"smoke {'passed' if outcome.passed else 'FAILED'}; nothing written")
    else:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        bench_common.write_report(out / "disagg.md", lines)
    return 0 if outcome.passed else 1


if __name__ == "__main__":
    sys.exit(main())
