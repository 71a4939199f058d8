"""The gate target: the trained tiny checkpoint, run by ``impl.model.engine.Engine`` on the fixed
evaluation sets (impl/tasks/evalsets.py). certify/gating/files.py's ``GateTarget`` is the contract.

Engine configuration. A gate's ``engine`` mapping is ``GateEngine``: the engine's storage and
speculation choices and its batch shape; every field left out takes its identity value (bf16 KV, fp32
GDN state, no speculation, 8 requests at a time, chunks of 64 tokens). The chunk budget is small on
purpose: every prompt of the sets (77 to 8192 tokens) is read in several context chunks, so the
recurrent state and the QSA planes must carry over chunk boundaries, as they do in long-prompt
serving; 64 rows still hold a verify step of 8 requests at draft 7. The resolved mapping (every field)
is the configuration a reference is keyed by; ``max_seq_len`` is derived from the set's longest prompt
and is not part of it (it sizes the page pool and changes no result).

Video input. A gate whose engine sets ``multimodal: true`` runs the engine with the vision tower's
weights (``VISION``, the tiny checkpoint's second file, trained by impl/train/train_frames.py) and
gives every sample of a frame set its frames. Its resolved mapping adds ``vision_weights``, that
file's sha256, so its references are keyed by the tower that produced them; a gate without
``multimodal`` resolves exactly as before, and its references keep their keys.

Acceptance length. The engine does not stop at ``END`` (it generates ``max_new_tokens``), so a
request's verify steps run on past its answer. Only the verify steps that start inside the answer
count (the first token of a generation comes from the context step, then verify step j emits
``num_accepted[j]`` tokens): what is measured is the drafting of answers, not of what follows them.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from certify.harness.archs import runtime_arch
from certify.gating.files import EvalSetInfo, TaskResult
from impl.model.admission import Request
from impl.model.engine_config import EngineConfig, SpeculativeConfig, check
from impl.tasks import TASKS
from impl.tasks.evalsets import EVAL_SETS, samples as eval_samples
from impl.tasks.tokenizer import END

ROOT = Path(__file__).resolve().parents[2]
CHECKPOINT = ROOT / "checkpoints" / "flashnext-tiny.safetensors"
MODEL_CARD = ROOT / "checkpoints" / "flashnext-tiny.md"
VISION = ROOT / "checkpoints" / "flashnext-tiny-vision.safetensors"


class GateEngine(BaseModel):
    """The engine mapping a gate may give; omitted fields are the identity configuration's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kv_cache_dtype: Literal["bf16", "fp8", "nvfp4"] = "bf16"
    state_dtype: Literal["fp32", "bf16"] = "fp32"
    speculative: SpeculativeConfig | None = None
    max_batch_size: int = Field(8, ge=1, le=128)
    max_num_tokens: int = Field(64, ge=1)
    batch_invariant: bool = False
    numerics: dict[str, str] = Field(default_factory=dict, description=(
        "op -> numerics tier (EngineConfig.numerics); left out of the resolved mapping when empty, "
        "so the references of the exact tiers keep their keys"))
    multimodal: bool = Field(False, description=(
        "video input (EngineConfig.multimodal) with the tower of VISION; left out of the resolved "
        "mapping when off, so the text gates' references keep their keys"))

    def engine_config(self, max_seq_len: int) -> EngineConfig:
        return EngineConfig(model="tiny", model_dtype="bf16", kv_cache_dtype=self.kv_cache_dtype,
                            state_dtype=self.state_dtype, max_batch_size=self.max_batch_size,
                            max_num_tokens=self.max_num_tokens, max_seq_len=max_seq_len,
                            speculative=self.speculative, batch_invariant=self.batch_invariant,
                            numerics=self.numerics, multimodal=self.multimodal)


def answer_steps(tokens: list[int], num_accepted: list[int]) -> list[int]:
    """The tokens of the verify steps that start inside the answer (up to and including its first
    END; the whole generation when there is none). tokens[0] came from the context step."""
    end = tokens.index(END) if END in tokens else len(tokens) - 1
    out, first = [], 1
    for n in num_accepted:
        if first > end:
            break
        out.append(n)
        first += n
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class FlashNextGates:
    """``GateTarget`` for the trained tiny checkpoint (``checkpoint`` defaults to the shipped one)."""

    def __init__(self, checkpoint: str | Path | None = None, card: str | Path | None = None,
                 device: str | None = None, vision: str | Path | None = None):
        self.checkpoint = Path(checkpoint) if checkpoint else CHECKPOINT
        self.vision = Path(vision) if vision else VISION
        self.card = Path(card) if card else MODEL_CARD
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))

    # ------------------------------------------------------------------ GateTarget

    def unavailable(self) -> str | None:
        if self.checkpoint.is_file():
            return None
        return f"no trained checkpoint at {_rel(self.checkpoint)}; see {_rel(self.card)}"

    def identity(self) -> dict[str, str]:
        return {"checkpoint": self._checkpoint_hash}

    def arch(self) -> str:
        return runtime_arch() if self.device.type == "cuda" else "cpu"

    def eval_sets(self) -> dict[str, EvalSetInfo]:
        return {n: EvalSetInfo(s.size, s.sha256) for n, s in EVAL_SETS.items()}

    def resolve_engine(self, engine: Mapping[str, Any]) -> dict[str, Any]:
        cfg = GateEngine.model_validate(dict(engine))
        refusals = check(cfg.engine_config(max_seq_len=8192 + 64))
        if refusals:
            raise ValueError("; ".join(str(r) for r in refusals))
        left_out = {n for n in ("numerics", "multimodal") if not getattr(cfg, n)}
        out = cfg.model_dump(mode="json", exclude=left_out or None)
        if cfg.multimodal:
            if not self.vision.is_file():
                raise ValueError(f"multimodal: no vision tower weights at {_rel(self.vision)} "
                                 f"(python -m impl.train.train_frames writes them)")
            out["vision_weights"] = self._vision_hash
        return out

    def speculative(self, engine: Mapping[str, Any]) -> bool:
        return GateEngine.model_validate(dict(engine)).speculative is not None

    def evaluate(self, engine: Mapping[str, Any], eval_set: str, samples: int,
                 progress: Callable[[int, int], None] | None = None) -> TaskResult:
        from impl.model.engine import Engine

        spec = EVAL_SETS[eval_set]
        items = eval_samples(eval_set)[:samples]
        new = spec.max_new_tokens()
        gate_engine = GateEngine.model_validate(dict(engine))
        longest = max(len(s.prompt_ids()) for s in items)
        # Admission keeps K positions free for a speculative engine's verify and draft rows.
        k = gate_engine.speculative.draft_length if gate_engine.speculative else 0
        config = gate_engine.engine_config(max_seq_len=longest + new + k).model_copy(
            update={"device": self.device.type})
        weights, cfg = self._weights
        requests = [Request(request_id=str(i), prompt=tuple(s.prompt_ids()), max_new_tokens=new,
                            frames=getattr(s, "frames", None))
                    for i, s in enumerate(items)]
        vision = self._vision if gate_engine.multimodal else None
        t0 = time.perf_counter()
        report = Engine(config, weights, cfg=cfg, vision=vision).generate(requests,
                                                                          progress=progress)
        seconds = time.perf_counter() - t0
        task = TASKS[spec.task]
        scores, accepted = [], []
        for i, s in enumerate(items):
            res = report.results[str(i)]
            if res.error:
                raise RuntimeError(f"{eval_set} sample {i} was rejected: {res.error}")
            scores.append(task.score(s, res.tokens))
            if gate_engine.speculative is not None:
                accepted.append(answer_steps(res.tokens, res.num_accepted))
        return TaskResult(scores, accepted, seconds)

    # ------------------------------------------------------------------ the checkpoint

    @cached_property
    def _checkpoint_hash(self) -> str:
        return _sha256(self.checkpoint)

    @cached_property
    def _vision_hash(self) -> str:
        return _sha256(self.vision)

    @cached_property
    def _vision(self):
        from impl.model.vision import load_vision, vision_geometry

        return load_vision(self.vision, vision_geometry("tiny"), torch.bfloat16, self.device)

    @cached_property
    def _weights(self):
        from impl.model.checkpoint import load_checkpoint
        from impl.model.placement import to_device

        ckpt = load_checkpoint(self.checkpoint, dtype=torch.bfloat16)
        weights = ckpt.weights
        if self.device.type != "cpu":
            weights = to_device(weights, self.device)
        return weights, ckpt.cfg


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


TARGET = FlashNextGates()
