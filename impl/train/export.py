"""The end of a training run: the checkpoint and its model card, with scores measured by the trained
model itself on the evaluation sets (greedy generation, the acceptance length of the draft layer's
chains at draft 3 and 7, and the retrieval ablation with the index selection off).

The gates measure the same sets through the engine (``certify gates run --record`` writes those
numbers into the references); the card's numbers are the training side's account of the same model.

    python -m impl.train.export complete --set retrieval_4k=10 --ablation retrieval_512=20

measures, after the fact, sets an export's evaluation budget left out (``complete_card``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
import sys
import time
from pathlib import Path

import torch

from impl.model.checkpoint import flatten_weights, load_checkpoint, save_checkpoint
from impl.tasks import TASKS
from impl.tasks.evalsets import EVAL_SETS, samples
from impl.tasks.tokenizer import END, PAD
from impl.train.model import TrainModel

CARD_SAMPLES = {"arithmetic": 200, "mqar": 200, "retrieval_512": 100, "retrieval_2k": 50,
                "retrieval_4k": 25, "retrieval_8k": 25}


@torch.no_grad()
def generate(model: TrainModel, prompts: list[list[int]], new: int, device) -> list[list[int]]:
    """Greedy continuation by full recomputation (short answers: a handful of forwards)."""
    out = []
    for lo in range(0, len(prompts), 64):
        group = prompts[lo:lo + 64]
        seqs = [list(p) for p in group]
        for _ in range(new):
            L = max(len(s) for s in seqs)
            ids = torch.full((len(seqs), L), PAD, dtype=torch.int64)
            for b, s in enumerate(seqs):
                ids[b, :len(s)] = torch.tensor(s)
            logits, _ = model(ids.to(device))
            for b, s in enumerate(seqs):
                s.append(int(logits[b, len(s) - 1].argmax()))
        out += [s[len(p):] for s, p in zip(seqs, group)]
    return out


@torch.no_grad()
def acceptance(model: TrainModel, prompt: list[int], answer: list[int], ks: tuple[int, ...], device
               ) -> dict[int, list[int]]:
    """Tokens emitted per verify step at each draft length k of ``ks`` over one greedy answer, the
    engine's way: the first token comes from the context step; a verify step at trunk length n accepts
    the leading drafts that equal the greedy tokens and emits one more. One chain of max(ks) draft
    steps serves every k (draft step j does not depend on k)."""
    seq = prompt + answer
    ids = torch.tensor([seq], device=device)
    _, hidden = model(ids)
    nxt = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1)
    h_prev, chain, preds = hidden, None, []
    for j in range(1, max(ks) + 1):
        d_logits, m = model.draft(h_prev, nxt, chain=chain)
        kv = model.mtp_layer.mixer.kv
        chain = [kv] if chain is None else chain + [kv]
        preds.append(d_logits[0].argmax(-1))            # step j, row p predicts x_{p+2}
        h_prev = torch.cat([torch.zeros_like(m[:, :1]), m[:, :-1]], 1)
    P, end = len(prompt), len(prompt) + (answer.index(END) if END in answer else len(answer) - 1)
    out = {}
    for k in ks:
        steps, n = [], P
        while n <= end and n + 1 < len(seq):
            a = 0
            while a < k and n + a + 1 < len(seq) and int(preds[a][n - 1 + a]) == seq[n + a + 1]:
                a += 1
            steps.append(a + 1)
            n += a + 1
        out[k] = steps
    return out


ABLATION_SAMPLES = {"retrieval_2k": 50, "mqar": 50}


ACCEPTANCE_SAMPLES = 50  # acceptance is measured one sample at a time: the first 50 of each set


def evaluate(model: TrainModel, device, counts: dict[str, int] = CARD_SAMPLES,
             ablation: dict[str, int] = ABLATION_SAMPLES, budget_s: float = float("inf")) -> dict:
    """Scores per set, in order, each printed as it completes. Sets that would start after
    ``budget_s`` seconds are left out (the card then shows fewer rows), so an export fits its run."""
    model.eval()
    out: dict = {}
    t_start = time.perf_counter()
    for name, n in counts.items():
        if time.perf_counter() - t_start > budget_s:
            print(f"evaluation budget spent: {name} left out", flush=True)
            continue
        spec = EVAL_SETS[name]
        items = samples(name)[:n]
        t0 = time.perf_counter()
        gens = generate(model, [s.prompt_ids() for s in items], spec.max_new_tokens(), device)
        scores = [TASKS[spec.task].score(s, g) for s, g in zip(items, gens)]
        row = {"samples": n, "accuracy": 100.0 * sum(scores) / n}
        per = [acceptance(model, s.prompt_ids(), g, (3, 7), device)
               for s, g in zip(items[:ACCEPTANCE_SAMPLES], gens[:ACCEPTANCE_SAMPLES])]
        for k in (3, 7):
            steps = [st for a in per for st in a[k]]
            row[f"acceptance_length_k{k}"] = sum(steps) / max(1, len(steps))
        row["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"evaluated {name}: {json.dumps(row)}", flush=True)
        out[name] = row
    # Ablation: the index's top-k selection off (sink and local window only)
    saved = model.cfg
    model.cfg = saved.model_copy(update={"top_k_blocks": 0})
    for name, n in ablation.items():
        items = samples(name)[:n]
        spec = EVAL_SETS[name]
        gens = generate(model, [s.prompt_ids() for s in items], spec.max_new_tokens(), device)
        out.setdefault(name, {})["accuracy_without_index_selection"] = \
            100.0 * sum(TASKS[spec.task].score(s, g) for s, g in zip(items, gens)) / len(items)
    model.cfg = saved
    return out


def export(run, out: Path, budget_s: float = 600.0, counts: dict[str, int] = CARD_SAMPLES,
           ablation: dict[str, int] = ABLATION_SAMPLES, status: str | None = None) -> None:
    """The checkpoint and its card; ``status`` (e.g. an interim checkpoint's standing) heads the card."""
    model = run.model
    model.eval()
    model.set_qat(True)
    weights = model.to_weights()
    scores = evaluate(model, run.device, counts, ablation, budget_s=budget_s)
    st, tc = run.state, run.tc
    meta = {"seed": str(tc.seed), "trunk_steps": str(tc.total_trunk_steps),
            "mtp_steps": str(tc.current_mtp_steps),
            "train_minutes": f"{st['elapsed'] / 60:.1f}", "scores": json.dumps(scores)}
    out.parent.mkdir(parents=True, exist_ok=True)
    # bf16 dense weights: what the engine runs, and half the file
    bf16 = _cast(weights, model.cfg, torch.bfloat16)
    save_checkpoint(out, bf16, model.cfg, metadata=meta)
    card = out.with_suffix(".md")
    card.write_text(model_card(out, tc, st, scores, status))
    print(f"wrote {out} ({out.stat().st_size / 2**20:.2f} MiB) and {card}")


def _cast(weights, cfg, dtype):
    """The weights as ``load_checkpoint(dtype=...)`` casts them (dense weights to ``dtype``; fp32
    parameters, NVFP4 codes and scales unchanged)."""
    import tempfile

    from impl.model.checkpoint import load_checkpoint
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d) / "w.safetensors"
        save_checkpoint(tmp, weights, cfg)
        return load_checkpoint(tmp, dtype=dtype).weights


def _mtp_history(tc) -> str:
    """An extension's MTP phase continues the draft layer's weights; the base schedule's phase came
    first (extensions appended in one ``--extend`` share one MTP phase, so no more is known here)."""
    if not tc.extensions:
        return ""
    return (f"; continued from the draft layer of earlier MTP phases (the base schedule's: "
            f"{tc.mtp_steps} steps)")


def complete_card(run, checkpoint: Path, counts: dict[str, int], ablation: dict[str, int],
                  status: str | None = None) -> dict[str, list[str]]:
    """Measure on ``run``'s trained model what the checkpoint's export left out (its evaluation
    budget ran out, e.g. on the GPU's short runs) and rewrite the card with it. The checkpoint file
    stays byte for byte as exported: the gates' references are keyed by its hash. Refused unless the
    run's weights, cast as ``export`` casts them, equal the checkpoint's tensor for tensor. Where
    both have a figure the export's wins. Returns the (set -> fields) the card gained."""
    ckpt = load_checkpoint(checkpoint)
    model = run.model
    model.eval()
    model.set_qat(True)
    mine = flatten_weights(_cast(model.to_weights(), model.cfg, torch.bfloat16))
    theirs = flatten_weights(ckpt.weights)
    differ = sorted(set(mine) ^ set(theirs)) + [k for k in sorted(set(mine) & set(theirs))
                                                if not torch.equal(mine[k], theirs[k])]
    if differ:
        raise ValueError(f"{checkpoint} was not exported from the training state in {run.dir}: "
                         f"tensor {differ[0]!r} differs ({len(differ)} in all)")
    scores = json.loads(ckpt.metadata.get("scores", "{}"))
    completed: dict[str, list[str]] = {}
    for name, row in evaluate(model, run.device, counts, ablation).items():
        had = scores.get(name, {})
        gained = [k for k in row if k not in had and k != "seconds"]
        scores[name] = {**row, **had}
        if gained:
            completed[name] = gained
    card = checkpoint.with_suffix(".md")
    if status is None and card.exists():
        m = re.search(r"^\*\*Status: (.*)\*\*$", card.read_text(), re.MULTILINE)
        status = m.group(1) if m else None
    card.write_text(model_card(checkpoint, run.tc, run.state, scores, status, completed))
    return completed


def _completed_text(completed: dict[str, list[str]] | None) -> str:
    if not completed:
        return ""
    names = {"accuracy": "accuracy", "acceptance_length_k3": "AL draft 3",
             "acceptance_length_k7": "AL draft 7", "samples": "n",
             "accuracy_without_index_selection": "accuracy without index selection"}
    parts = "; ".join(f"`{s}`: " + ", ".join(names.get(f, f) for f in fields)
                      for s, fields in completed.items())
    return ("\nMeasured after the export, on the same trained weights (the checkpoint file unchanged; "
            f"`python -m impl.train.export complete`): {parts}.\n")


# the card's rows in the evaluation sets' order, whichever measurement wrote a row first
_SET_ORDER = {name: i for i, name in enumerate(CARD_SAMPLES)}


def model_card(path: Path, tc, state, scores: dict, status: str | None = None,
               completed: dict[str, list[str]] | None = None) -> str:
    def cell(r, key, fmt):
        return format(r[key], fmt) if key in r else "-"

    rows = "\n".join(
        f"| `{n}` | {r.get('samples', '-')} | {cell(r, 'accuracy', '.1f')} | "
        f"{cell(r, 'acceptance_length_k3', '.2f')} | {cell(r, 'acceptance_length_k7', '.2f')} | "
        f"{cell(r, 'accuracy_without_index_selection', '.1f')} |" for n, r in sorted(
            scores.items(), key=lambda kv: _SET_ORDER.get(kv[0], len(_SET_ORDER))))
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    status_text = f"\n**Status: {status}**\n" if status else ""
    return f"""# Model card: `{path.name}`
{status_text}
The tiny Flash-Next checkpoint the accuracy gates run on (certify/gates/). Trained by
`python -m impl.train.train_tiny` (docs/training.md) on the synthetic tasks of impl/tasks/.

| | |
|---|---|
| config | `ModelConfig.tiny()` ({json.dumps(path.name)}; hidden 128, 4 layers, vocab 256 bytes) |
| seed | {tc.seed} |
| steps | trunk {tc.total_trunk_steps}, MTP self-distillation {tc.current_mtp_steps} after the last trunk step (unrolled over {tc.unroll} draft steps){_mtp_history(tc)} |
| wall time | {state['elapsed'] / 60:.1f} min of training |
| training config | `{json.dumps(tc.model_dump(mode='json'), sort_keys=True)}` |
| exported | {date} |

## Scores of the trained model (training side, fp32 activations, NVFP4 experts)

Accuracy in points on the first n samples of each evaluation set; acceptance length at draft 3 and 7
over the verify steps inside the answers (first 50 samples); the last column is the same model with
the QSA index selection switched off (`top_k_blocks = 0`: sink and local window only).

| set | n | accuracy | AL draft 3 | AL draft 7 | accuracy without index selection |
|---|---|---|---|---|---|
{rows}
{_completed_text(completed)}
The engine's numbers on the same sets are the gates' references (certify/gates/references/), recorded
by `certify gates run --record` and shown in reports/gates/.
"""


def _counts(items: list[str]) -> dict[str, int]:
    out = {}
    for item in items:
        name, _, n = item.partition("=")
        if name not in EVAL_SETS or not n.isdigit() or int(n) < 1:
            raise SystemExit(f"expected SET=N with SET one of {sorted(EVAL_SETS)} and N >= 1, got "
                             f"{item!r}")
        out[name] = int(n)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m impl.train.export")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("complete", help="measure the sets an export left out on the same trained "
                       "weights; rewrites the card, never the checkpoint file")
    c.add_argument("--run-dir", default="runs/tiny")
    c.add_argument("--checkpoint", default="checkpoints/flashnext-tiny.safetensors")
    c.add_argument("--set", action="append", default=[], metavar="SET=N",
                   help="evaluate the first N samples of SET (repeatable)")
    c.add_argument("--ablation", action="append", default=[], metavar="SET=N",
                   help="the same with the index selection off (repeatable)")
    c.add_argument("--status", help="the card's status line (default: the card's current one)")
    c.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    counts, ablation = _counts(args.set), _counts(args.ablation)
    from impl.train.train_tiny import Run
    run = Run(Path(args.run_dir), None, args.device)
    if run.state["phase"] != "export":
        raise SystemExit(f"{args.run_dir} is still training (phase {run.state['phase']})")
    done = complete_card(run, Path(args.checkpoint), counts, ablation, args.status)
    print(f"card gained: {json.dumps(done)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
