"""Where long-context retrieval fails: the index, or what it was taught.

For each retrieval evaluation sample, one teacher-forced forward of the training model over prompt and
answer tells, on every answer row (the rows that predict the value's tokens and the closing END):

- ``correct``: the greedy token is the reference token on every answer row, which is exactly when
  greedy generation reproduces the answer;
- ``selected``: the QSA selection holds the record's block on the row (per QSA layer);
- ``target_peak``: among the row's candidate blocks, the dense attention's block mass (the index
  loss's target, ``dense_block_mass``) is largest at the record's block.

A sample whose record lies in an always-attended block (the sink) has no candidate to choose: its
target-peak column reads "(in the window)".

    python -m impl.train.diagnose --run-dir runs/tiny --sets retrieval_2k retrieval_8k -n 10
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from impl.tasks.base import Sample
from impl.tasks.evalsets import samples
from impl.train.model import BLOCK, TrainModel, dense_block_mass, window_and_candidates


@dataclass(frozen=True)
class SampleDiagnosis:
    block: int
    correct: bool
    selected: tuple[tuple[bool, ...], ...]   # [QSA layer][answer row]
    target_peak: tuple[bool, ...]            # [answer row], first QSA layer; () in the window

    def line(self) -> str:
        def marks(xs):
            return "".join("x" if x else "." for x in xs)
        sel = " ".join(marks(s) for s in self.selected)
        peak = marks(self.target_peak) if self.target_peak else "(in the window)"
        return f"block {self.block:4d}  {'ok  ' if self.correct else 'FAIL'}  selected {sel}  " \
               f"target peak {peak}"


@torch.no_grad()
def diagnose(model: TrainModel, sample: Sample) -> SampleDiagnosis:
    prompt, answer = sample.prompt_ids(), sample.answer_ids()
    ids = torch.tensor([prompt + answer])
    P, T = len(prompt), ids.shape[1]
    logits, _ = model(ids)
    rows = torch.arange(P - 1, P - 1 + len(answer))
    correct = bool((logits[0, rows].argmax(-1) == ids[0, rows + 1]).all())
    block = int(sample.meta["block"])
    layers = model.qsa_layers()
    selected = tuple(tuple(bool(q.selection[0, r, block]) for r in rows) for q in layers)
    peak: tuple[bool, ...] = ()
    _, cand = window_and_candidates(torch.arange(T), T, model.cfg)
    if bool(cand[rows, block].all()):
        q0 = layers[0]
        mass = dense_block_mass(q0.q[:, P - 1:P - 1 + len(answer)], q0.kv[0], -(-T // BLOCK),
                                first=P - 1)[0]
        mass = mass.masked_fill(~cand[rows], -1.0)
        peak = tuple(bool(x) for x in (mass.argmax(-1) == block))
    return SampleDiagnosis(block, correct, selected, peak)


def main(argv: list[str] | None = None) -> int:
    from impl.train.train_tiny import Run
    p = argparse.ArgumentParser(prog="python -m impl.train.diagnose", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", default="runs/tiny")
    p.add_argument("--sets", nargs="+", default=["retrieval_2k", "retrieval_4k", "retrieval_8k"])
    p.add_argument("-n", type=int, default=10, help="first n samples of each set")
    args = p.parse_args(argv)
    model = Run(Path(args.run_dir), None, "cpu").model
    model.eval()
    model.set_qat(True)
    for name in args.sets:
        rows = [diagnose(model, s) for s in samples(name)[:args.n]]
        for r in rows:
            print(f"{name}  {r.line()}", flush=True)
        held = sum(all(all(s) for s in r.selected) for r in rows)
        print(f"{name}: {sum(r.correct for r in rows)}/{len(rows)} correct; selection holds the "
              f"record block on every answer row in {held}/{len(rows)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
