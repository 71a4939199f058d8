"""The second copy of the routed experts: the weights in the layout a MoE variant's large launch
reads, kept beside the checkpoint's.

A MoE variant may run its largest launches (a prompt chunk of many rows) in a regime of its own,
whose kernels could read the experts in another layout than the checkpoint's; an engine serving such
launches then keeps every layer's routed experts twice. ``expert_copy`` decides, from the
configuration alone, whether the engine keeps that copy: only when

- the moe variant the configuration runs (``moe_backend``, or the dispatch rules' choice) has a large
  launch (``LARGE_LAUNCHES``) that reads a layout other than the checkpoint's,
- ``max_num_tokens`` reaches it (a step can hold that launch's first row count), and
- ``EngineConfig.moe_expert_copy`` is on (off drops it: a deployment short of memory gives it to the
  KV pages).

Its bytes count in the engine's memory beside the KV pages (impl/model/memory.py).

What this project has. The moe variants triton, torch and spec_lowp all read the checkpoint's layout
(``CHECKPOINT_LAYOUT``: spec.ops.moe.NvFp4Experts, e2m1 codes two a byte, one e4m3 scale a block of
16, fp32 global scales). triton's large launch is its ``bm64`` regime (impl/kernels/moe/triton_moe.py:
expert blocks of 64 rows once a step's (token, slot) pairs average ``ROWS_PER_EXPERT_FOR_BM64`` an
expert, from 410 rows at the target's 512 experts and top-10); its kernels decode the same packed codes
in the tile loop as the 16-row regimes do, so the large launch needs no second layout and no
configuration keeps a copy. A copy would pay for its memory only with a kernel that reads another
layout faster than the in-kernel decode; none exists here, so none is declared.
"""

from __future__ import annotations

from dataclasses import dataclass

from spec.config import ModelConfig

CHECKPOINT_LAYOUT = "nvfp4_packed"   # the layout of spec.ops.moe.NvFp4Experts, as loaded


@dataclass(frozen=True)
class LargeLaunch:
    """A moe variant's large-launch regime: from ``pairs_per_expert`` (token, slot) pairs an expert
    on average, it reads the routed experts in ``layout`` at ``bytes_per_weight`` bytes a weight."""

    variant: str
    pairs_per_expert: int
    layout: str
    bytes_per_weight: float

    def first_rows(self, model: ModelConfig) -> int:
        """The fewest rows of a launch in this regime: rows * top_k >= pairs_per_expert * experts."""
        return -(-self.pairs_per_expert * model.num_experts // model.moe_top_k)


# triton's bm64 regime (triton_moe.ROWS_PER_EXPERT_FOR_BM64; tests/engine/test_memory.py holds the
# two equal): the checkpoint's codes and block scales, 0.5 + 1/16 bytes a weight.
LARGE_LAUNCHES: tuple[LargeLaunch, ...] = (
    LargeLaunch("triton", 8, CHECKPOINT_LAYOUT, 0.5 + 1 / 16),
)


@dataclass(frozen=True)
class ExpertCopy:
    """Whether the engine keeps the second copy, its bytes (0 when not kept) and why."""

    kept: bool
    bytes: int
    reason: str


def expert_copy(moe_variant: str | None, max_num_tokens: int, keep: bool, model: ModelConfig,
                launches: tuple[LargeLaunch, ...] = LARGE_LAUNCHES) -> ExpertCopy:
    """The copy the engine keeps when moe runs ``moe_variant`` with steps of up to
    ``max_num_tokens`` rows and ``EngineConfig.moe_expert_copy`` = ``keep``."""
    launch = next((ll for ll in launches if ll.variant == moe_variant), None)
    if launch is None:
        return ExpertCopy(False, 0, f"moe runs {moe_variant}, which has no large launch of its own")
    rows = launch.first_rows(model)
    where = f"{moe_variant}'s large launch (from {rows} rows a step)"
    if launch.layout == CHECKPOINT_LAYOUT:
        return ExpertCopy(False, 0, f"{where} reads the checkpoint's layout: no second copy")
    if max_num_tokens < rows:
        return ExpertCopy(False, 0, f"max_num_tokens {max_num_tokens} never reaches {where}")
    if not keep:
        return ExpertCopy(False, 0, f"moe_expert_copy is off: the {launch.layout} copy {where} "
                                    f"reads is dropped for memory")
    size = round(model.routed_expert_params() * launch.bytes_per_weight)
    return ExpertCopy(True, size, f"{where} reads the routed experts in {launch.layout}")
