"""Train the tiny checkpoint: ``python -m impl.train.train_tiny --run-dir runs/tiny`` (repeat until it
prints ``done``). docs/training.md describes the method; this file is the loop.

Every invocation resumes from ``<run-dir>/state.pt`` (model, optimiser, phase, step, elapsed time; the
batches are a function of the step) and stops after ``--max-minutes`` of training, saving its state,
so each run fits a 10-minute device slot. Phases, in order:

1. ``trunk``: the trunk on the task mixture, loss on the answers (and the END repeats) plus the QSA
   index's KL loss and the MoE balance loss. Dense attention for the first ``dense_frac`` of the steps
   (the index learns where dense attention looks), sparse after; the NVFP4 experts are trained
   quantisation-aware from ``qat_frac`` on (calibration restarts there).
2. ``mtp``: the trunk frozen; the draft layer learns the trunk's own greedy continuation (each example
   up to the first position where the trunk's greedy token leaves the reference answer, that token
   included), unrolled over ``unroll`` draft steps exactly as the engine chains them
   (``model.attend_chain``); half of the batches give the draft layer the trunk's selection
   (IndexShare).
3. ``export``: the checkpoint (bf16 dense weights, NVFP4 experts, calibrated scales) and its model
   card with the final scores measured on the evaluation sets by this model.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import signal
import sys
import time
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from impl.train.data import Batch, DataConfig, make_batch, ngram_rows
from impl.train.model import TrainModel
from spec.config import ModelConfig

STATE = "state.pt"


class Extension(BaseModel):
    """Trunk steps added after a run's schedule: a warm restart of the cosine (``warmup`` steps up to
    ``lr``, down to 10 % of it), with its own attention mode and task mixture. Batches stay a function
    of (seed, phase, step): an extension's steps continue the trunk's step count, so they read new
    batches. ``--extend`` appends one to a saved run; the MTP phase runs again after it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: int = Field(ge=1)
    lr: float = Field(gt=0)
    warmup: int = Field(100, ge=0)
    attention: Literal["dense", "sparse"] = "sparse"
    weights: dict[str, float] | None = Field(None, description="task mixture (default: the run's)")
    retrieval_lengths: tuple[int, ...] | None = Field(None, description="default: the run's")
    retrieval_queries: int | None = Field(None, ge=1, le=8, description="default: the run's")
    mtp_steps: int | None = Field(None, ge=0, description="the MTP phase after this extension "
                                  "(default: the run's); the draft layer continues from its weights")
    index_answer_weight: float = Field(0.0, ge=0, description="extra weight of the answer rows "
                                       "(rows whose next token is taught) in the index loss: row "
                                       "weight 1 + this; 0 keeps the plain mean over rows")
    index_margin: float = Field(0.0, ge=0, description="a ranking hinge added to the index loss on "
                                "the answer rows: relu(margin - (s_peak - s_kth)), s_peak the index "
                                "score of the dense attention's peak block, s_kth the top_k-th best "
                                "other candidate's (impl.train.model.selection_hinge); 0: off")
    learn: Literal["trunk", "index"] = Field(
        "trunk", description="what learns: the whole trunk, or only the QSA index (its projections "
        "and norm, from the index loss alone; every other trunk weight stays as it is, so the model "
        "changes only through which blocks the index selects)")

    def data(self, base: DataConfig) -> DataConfig:
        fields = ("weights", "retrieval_lengths", "retrieval_queries")
        return base.model_copy(update={f: getattr(self, f) for f in fields
                                       if getattr(self, f) is not None})


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = 0
    trunk_steps: int = Field(6000, ge=1)
    mtp_steps: int = Field(1500, ge=0)
    lr: float = 2e-3
    mtp_lr: float = 1e-3
    warmup: int = 200
    weight_decay: float = 0.01
    dense_frac: float = Field(0.15, ge=0, le=1)
    qat_frac: float = Field(0.6, ge=0, le=1)
    index_weight: float = 0.1
    aux_weight: float = 0.01
    unroll: int = Field(3, ge=1, le=7)
    grad_clip: float = 1.0
    data: DataConfig = DataConfig()
    extensions: tuple[Extension, ...] = ()

    @property
    def total_trunk_steps(self) -> int:
        return self.trunk_steps + sum(e.steps for e in self.extensions)

    def extension_at(self, step: int) -> tuple[int, Extension] | None:
        """(first step, extension) of the extension holding trunk step ``step``; None in the base
        schedule."""
        start = self.trunk_steps
        for ext in self.extensions:
            if step < start + ext.steps:
                return (start, ext) if step >= start else None
            start += ext.steps
        return None

    @property
    def current_mtp_steps(self) -> int:
        """The MTP phase's length: the last extension's ``mtp_steps`` where it sets one."""
        if self.extensions and self.extensions[-1].mtp_steps is not None:
            return self.extensions[-1].mtp_steps
        return self.mtp_steps

    def data_at(self, phase: str, step: int) -> DataConfig:
        seg = self.extension_at(step) if phase == "trunk" else None
        return self.data if seg is None else seg[1].data(self.data)


# ------------------------------------------------------------------------------ one step


def _cosine(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def _lr(cfg: TrainConfig, step: int, total: int, peak: float, phase: str = "trunk") -> float:
    seg = cfg.extension_at(step) if phase == "trunk" else None
    if seg is not None:
        start, ext = seg
        return _cosine(step - start, ext.steps, ext.lr, ext.warmup)
    if phase == "trunk":
        total = min(total, cfg.trunk_steps)
    return _cosine(step, total, peak, cfg.warmup)


def trunk_loss(model: TrainModel, batch: Batch, rows: torch.Tensor, tc: TrainConfig, step: int
               ) -> tuple[torch.Tensor, dict[str, float]]:
    seg = tc.extension_at(step)
    if seg is not None:
        attention = seg[1].attention
    else:
        attention = "dense" if step < tc.dense_frac * tc.trunk_steps else "sparse"
    index_rows = index_margin = None
    answers = F.pad(batch.taught[:, 1:], (0, 1))      # row t answers when token t + 1 is taught
    if seg is not None and seg[1].index_answer_weight > 0:
        index_rows = 1.0 + seg[1].index_answer_weight * answers.float()
    if seg is not None and seg[1].index_margin > 0:
        index_margin = (answers, seg[1].index_margin)
    logits, _ = model(batch.ids, rows, attention=attention, index_loss=True, index_rows=index_rows,
                      index_margin=index_margin)
    target = batch.ids[:, 1:]
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), target.reshape(-1),
                         reduction="none").view_as(target)
    mask = batch.taught[:, 1:]
    ce = (ce * mask).sum() / mask.sum()
    idx = torch.stack([q.index_loss for q in model.qsa_layers()]).mean()
    if seg is not None and seg[1].learn == "index":
        loss = tc.index_weight * idx   # the cross-entropy has no gradient into the index anyway
    else:
        loss = ce + tc.index_weight * idx + tc.aux_weight * model.aux_losses()
    return loss, {"ce": float(ce.detach()), "index": float(idx.detach())}


@torch.no_grad()
def greedy_prefix(logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The trunk's greedy continuation of each prompt, as far as one forward over the reference
    sequence determines it: the reference tokens up to the first answer position the trunk gets
    wrong, then the trunk's token there. Returns (tokens [B, T], valid [B, T])."""
    pred = torch.cat([batch.ids[:, :1], logits[:, :-1].argmax(-1)], 1)
    wrong = batch.taught & (pred != batch.ids)
    T = batch.ids.shape[1]
    first = torch.where(wrong.any(1), wrong.float().argmax(1), torch.full_like(batch.prompt_lens, T))
    pos = torch.arange(T, device=batch.ids.device)[None]
    ends = torch.where(batch.taught, pos, -1).amax(1)
    last = torch.minimum(first, ends)
    tokens = torch.where(pos == first[:, None], pred, batch.ids)
    return tokens, pos <= last[:, None]


def mtp_loss(model: TrainModel, batch: Batch, rows: torch.Tensor, tc: TrainConfig, step: int
             ) -> tuple[torch.Tensor, dict[str, float]]:
    with torch.no_grad():
        logits, hidden = model(batch.ids, rows)
        share = model.qsa_layers()[-1].selection
    tokens, valid = greedy_prefix(logits, batch)
    B, T = tokens.shape
    nxt = torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], 1)      # row t reads x_{t+1}
    tgt = torch.cat([tokens[:, 2:], torch.zeros_like(tokens[:, :2])], 1)      # and predicts x_{t+2}
    tgt_ok = torch.cat([valid[:, 2:], torch.zeros_like(valid[:, :2])], 1)
    pos = torch.arange(T, device=tokens.device)[None]
    shared = share if random.Random(f"share:{tc.seed}:{step}").random() < 0.5 else None
    h_prev, chain, losses, stats = hidden, None, [], {}
    for j in range(1, tc.unroll + 1):
        d_logits, m = model.draft(h_prev, nxt, shared=shared if j == 1 else None,
                                  index_loss=(j == 1), chain=chain)
        kv = model.mtp_layer.mixer.kv
        if j == 1:
            idx = model.mtp_layer.mixer.index_loss
        chain = [kv] if chain is None else chain + [kv]
        # row p of step j belongs to the chain started at n = p - j + 2 >= prompt length
        rows_ok = tgt_ok & (pos >= batch.prompt_lens[:, None] + j - 2)
        ce = F.cross_entropy(d_logits.reshape(-1, d_logits.shape[-1]), tgt.reshape(-1),
                             reduction="none").view(B, T)
        losses.append((ce * rows_ok).sum() / rows_ok.sum().clamp_min(1))
        with torch.no_grad():
            acc = ((d_logits.argmax(-1) == tgt) & rows_ok).sum() / rows_ok.sum().clamp_min(1)
        stats[f"acc{j}"] = float(acc)
        h_prev = torch.cat([torch.zeros_like(m[:, :1]), m[:, :-1]], 1)       # next step's h_prev
    loss = torch.stack(losses).mean() + tc.index_weight * idx + tc.aux_weight * model.aux_losses()
    stats.update(ce=float(torch.stack(losses).mean().detach()), index=float(idx.detach()))
    return loss, stats


# ------------------------------------------------------------------------------ the run


class Run:
    def __init__(self, run_dir: Path, tc: TrainConfig | None, device: str):
        self.dir = run_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.device = torch.device(device)
        path = self.dir / STATE
        if path.is_file():
            st = torch.load(path, map_location="cpu", weights_only=False)
            saved = TrainConfig.model_validate(st["config"])
            if tc is not None and tc.model_copy(update={"extensions": saved.extensions}) != saved:
                raise SystemExit(f"{path} was started with another configuration; use a new run dir")
            self.tc, self.state = saved, st
        else:
            self.tc = tc or TrainConfig()
            self.state = {"config": self.tc.model_dump(mode="json"), "phase": "trunk", "step": 0,
                          "elapsed": 0.0, "log": []}
        torch.manual_seed(self.tc.seed)
        self.model = TrainModel(ModelConfig.tiny(), seed=self.tc.seed).to(self.device)
        if "model" in self.state:
            self.model.load_state_dict(self.state["model"])
        self.opt = self._optimizer()
        if "optim" in self.state and self._saved_learner() == self.learner:
            self.opt.load_state_dict(self.state["optim"])

    def _learner_now(self) -> str:
        """What the optimiser trains at the current step: 'trunk', 'index' or 'mtp'."""
        if self.state["phase"] != "trunk":
            return "mtp"
        seg = self.tc.extension_at(self.state["step"])
        return seg[1].learn if seg is not None else "trunk"

    def _saved_learner(self) -> str:
        # states saved before extensions could train the index alone name only their phase
        return self.state.get("optim_learner", {"trunk": "trunk"}.get(self.state.get("optim_phase"),
                                                                       "mtp"))

    def _optimizer(self):
        tc = self.tc
        self.learner = self._learner_now()
        if self.learner == "mtp":
            params = self.model.mtp_parameters()
        else:
            params = (self.model.index_parameters() if self.learner == "index"
                      else self.model.trunk_parameters())
            # frozen weights take no gradient, so the index loss's backward stops at the index
            chosen = {id(p) for p in params}
            for p in self.model.trunk_parameters():
                p.requires_grad_(id(p) in chosen)
        return torch.optim.AdamW(params, lr=tc.lr, betas=(0.9, 0.95), weight_decay=tc.weight_decay)

    def save(self) -> None:
        self.state.update(model=self.model.state_dict(), optim=self.opt.state_dict(),
                          optim_phase=self.state["phase"], optim_learner=self.learner)
        tmp = self.dir / (STATE + ".tmp")
        torch.save(self.state, tmp)
        tmp.replace(self.dir / STATE)

    def _batches(self, phase: str, start: int, total: int, workers: int):
        tc, hash_cfg = self.tc, self.model.hash_cfg

        class Steps(torch.utils.data.Dataset):
            def __len__(self):
                return total - start

            def __getitem__(self, i):
                b = make_batch(tc.seed, phase, start + i, tc.data_at(phase, start + i))
                return b, ngram_rows(b.ids, hash_cfg)

        return torch.utils.data.DataLoader(Steps(), batch_size=None, shuffle=False,
                                           num_workers=workers, prefetch_factor=4 if workers else None,
                                           persistent_workers=False)

    def train(self, max_seconds: float, workers: int = 0, max_steps: int | None = None,
              on_step=None) -> bool:
        """Train until the time budget (or ``max_steps`` steps this call); True when all phases are
        done."""
        t_start = time.perf_counter()
        stop = {"now": False}
        signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
        done_here = 0
        while self.state["phase"] in ("trunk", "mtp"):
            phase, tc = self.state["phase"], self.tc
            total = tc.total_trunk_steps if phase == "trunk" else tc.current_mtp_steps
            if self.state["step"] >= total:
                self._next_phase()
                continue
            if phase == "trunk":
                # training mode updates the quantisers' calibration maxima: not the index's to move
                self.model.train(self._learner_now() != "index")
            else:
                self.model.eval()
                self.model.mtp_layer.train()
            qat_from = int(tc.qat_frac * tc.trunk_steps)
            self.model.set_qat(phase == "mtp" or self.state["step"] >= qat_from)
            if max_steps is not None and done_here >= max_steps:
                self.save()
                return False
            for batch, rows in self._batches(phase, self.state["step"], total, workers):
                step = self.state["step"]
                if self._learner_now() != self.learner:   # an extension that trains another part
                    self.opt = self._optimizer()
                    self.model.train(self.learner != "index")
                if phase == "trunk" and step == qat_from and qat_from > 0:
                    self.model.reset_calibration()
                    self.model.set_qat(True)
                batch = Batch(batch.task, batch.ids.to(self.device), batch.taught.to(self.device),
                              batch.prompt_lens.to(self.device))
                rows = rows.to(self.device)
                peak = tc.lr if phase == "trunk" else tc.mtp_lr
                for g in self.opt.param_groups:
                    g["lr"] = _lr(tc, step, total, peak, phase)
                fn = trunk_loss if phase == "trunk" else mtp_loss
                loss, stats = fn(self.model, batch, rows, tc, step)
                # an index-only step over short contexts has no candidate block to learn from
                if loss.requires_grad:
                    self.opt.zero_grad(set_to_none=True)
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_([p for g in self.opt.param_groups
                                                    for p in g["params"]], tc.grad_clip)
                    self.opt.step()
                self.state["step"] = step + 1
                done_here += 1
                entry = {"phase": phase, "step": step, "task": batch.task, "loss": float(loss.detach()),
                         **stats}
                if step % 50 == 0 or on_step:
                    self.state["log"].append(entry)
                    print(json.dumps(entry), flush=True)
                if on_step:
                    on_step(self, entry)
                elapsed = time.perf_counter() - t_start
                if (elapsed > max_seconds or stop["now"]
                        or (max_steps is not None and done_here >= max_steps)
                        or self.state["step"] >= total):
                    break
            self.state["elapsed"] += time.perf_counter() - t_start
            max_seconds -= time.perf_counter() - t_start  # the budget is this call's wall time
            t_start = time.perf_counter()
            if self.state["step"] < total:
                self.save()
                return False
        self.save()
        return True

    def extend(self, *exts: Extension) -> None:
        """Append ``exts`` (run one after the other) to a run whose trunk schedule has ended: the trunk
        resumes at its next step with a fresh optimiser, then the MTP phase and the export run
        again."""
        st = self.state
        if st["phase"] == "trunk":
            raise SystemExit(f"{self.dir / STATE} is still in its trunk phase (step {st['step']} of "
                             f"{self.tc.total_trunk_steps}); resume it without --extend")
        first = self.tc.total_trunk_steps
        self.tc = self.tc.model_copy(update={"extensions": (*self.tc.extensions, *exts)})
        st.update(config=self.tc.model_dump(mode="json"), phase="trunk", step=first)
        st.pop("optim", None)
        self.opt = self._optimizer()
        self.save()

    def _next_phase(self) -> None:
        self.state["phase"] = {"trunk": "mtp", "mtp": "export"}[self.state["phase"]]
        self.state["step"] = 0
        self.opt = self._optimizer()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m impl.train.train_tiny", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", default="runs/tiny")
    p.add_argument("--max-minutes", type=float, default=8.0,
                   help="training time of this invocation (the device allows 10 minutes a run)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--workers", type=int, default=8, help="data loader processes")
    p.add_argument("--config", help="JSON of TrainConfig fields (first invocation only)")
    p.add_argument("--extend", help="JSON of an Extension, or a list of them run in turn: more trunk "
                   "steps after the schedule ended (then MTP and export again); once, then resume "
                   "without it")
    p.add_argument("--out", default="checkpoints/flashnext-tiny.safetensors")
    p.add_argument("--no-export", action="store_true",
                   help="stop when training is done (phase export is saved); a later invocation "
                   "without this flag exports, e.g. on another machine")
    args = p.parse_args(argv)
    tc = TrainConfig.model_validate(json.loads(args.config)) if args.config else None
    if args.device.startswith("cuda"):
        # Training numerics only (the checkpoint is exported in bf16 / NVFP4 and certified as that):
        # TF32 products keep fp32 range and cut the matmul time.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    run = Run(Path(args.run_dir), tc, args.device)
    if args.extend:
        spec = json.loads(args.extend)
        run.extend(*(Extension.model_validate(e) for e in (spec if isinstance(spec, list) else [spec])))
    t0 = time.perf_counter()
    finished = run.train(args.max_minutes * 60, workers=args.workers)
    st = run.state
    print(f"phase {st['phase']} step {st['step']}; {st['elapsed'] / 60:.1f} min trained in all",
          flush=True)
    if not finished:
        print("not done: run the same command again to resume")
        return 0
    if args.no_export:
        print("training done; export skipped (--no-export): run again without it to export")
        return 0
    from impl.train.export import export
    left = args.max_minutes * 60 - (time.perf_counter() - t0)
    export(run, Path(args.out), budget_s=max(left, 60.0))
    print("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
