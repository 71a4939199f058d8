"""The engine's configuration and the routing check that refuses, before anything is built, every
combination the model cannot run (DESIGN.md, "The engine").

``EngineConfig`` is a frozen pydantic model (unknown fields refused). Field-level checks (types, ranges)
are pydantic's; every *combination* the model cannot run is a named ``Rule`` in ``RULES``. ``check``
runs every rule (it does not stop at the first) and returns one ``Refusal`` per broken rule; ``route``
(also ``EngineConfig.build_plan``) raises ``ConfigRefused`` listing every refusal with its rule's name,
or returns the ``RoutePlan``: the variant each op of the catalog will run on the runtime arch.
``explain`` prints why a configuration was accepted or refused.

Rules that read the catalog (``certify/cells``) read it as it is: a dtype is supported when the cells'
axes name it, a verify width when a cell certifies it. The rules run against a ``RuleContext`` (model
geometry, catalog, arch); tests pass a modified catalog to exercise a rule the real one satisfies.

Decisions:
- ``kv_cache_dtype`` accepts 'fp16' and 'int8' besides the three storage formats of docs/spec.md, and
  ``state_dtype`` accepts 'fp16', so that their rules refuse them with their own message rather than a
  type error. ``model_dtype`` accepts 'bf16' | 'fp16' | 'fp32'; only bf16 (every ``act_dtype`` axis of
  the catalog) is supported.
- ``moe_backend`` names the variant of the op ``moe`` the engine runs (the catalog's variants: triton,
  the grouped GEMMs of impl/kernels/moe/triton_moe.py; torch, the composition of torch_moe.py;
  spec_lowp, the reference), or 'auto': the variant the dispatch rules choose, in file order. A named
  variant is the only candidate of every moe call (``pinned_variants``, read by the ``Dispatcher``); rule
  ``moe_backend_supported`` refuses a name that is not a variant of moe, or whose variant cannot run on
  the arch in the configured mode (batch-invariant mode runs references only, torch_only torch
  compositions only). 'trtllm' and 'cutedsl', the backends of the engine this target comes from, are
  accepted by the type and refused by the rule: no such kernels exist here.
- ``moe_expert_copy`` (default on) keeps the second copy of the routed experts where the moe variant's
  large launch reads another weight layout and ``max_num_tokens`` reaches it (impl/model/expert_copy.py;
  no variant here reads one, so no copy is kept); off drops it. ``explain`` prints the memory the engine
  holds beside the weights (impl/model/memory.py), the copy counted with the KV pages.
- ``gdn_commit``: 'cached' (default) commits a verify step's GDN state from the states it recorded
  after every row; 'recompute' records the rows' recurrence inputs only and re-runs the accepted rows
  from the pre-verify state at commit (impl/model/model.py), at draft lengths up to
  ``RECOMPUTE_MAX_DRAFT`` (3), where its replay tests certify it; rule
  ``gdn_recompute_commit_up_to_draft_3`` refuses it deeper and without speculation.
- Speculation (``speculative``) is MTP with a fixed draft length K in 1..7; ``dynamic_draft_length``
  is accepted by the type and refused by ``static_draft_length``.
- **Certified for the draft length** (rule ``verify_width_certified``). The ops whose width is the
  draft length are ``VERIFY_WIDTH_OPS``: gdn_verify (axis ``rows``, needs K + 1), greedy_verify and
  rollback_commit (axis ``draft``, needs K). Other ops with a ``rows`` axis (norms, QSA) count every row
  of a step, not one request's verify width, so they are not width ops. For each width op, K is
  certified when (a) the needed width lies inside the reach of the width axis, (b) the dispatch on the
  runtime arch chooses a variant (the first variant in file order whose archs include the arch and whose
  rule accepts the axes the config fixes: batch = max_batch_size, the width, state_dtype) and (c) the
  catalog has a cell that certifies that variant on that arch (``variants_of_cell``; the cell's archs,
  if given, include the arch) whose width is >= the needed width and whose ``state_dtype`` (when the op
  has that axis) equals the configured one. The nearest such cell is the one reported. The rule reads
  the cells the catalog *declares*; whether their receipts are fresh is what ``explain`` reports, not a
  routing condition (a receipt goes stale on every code edit until the certification is re-run).
  With today's catalog: K = 7 needs an 8-row gdn_verify cell and a draft-7 rollback_commit cell of
  the configured state dtype; both exist for fp32 and bf16 states (r8_b2_fp32, r8_b2_bf16; k7_b4_fp32,
  k7_b2_bf16).
- The nvfp4 rule follows the change description: nvfp4 KV needs chunked prefill, block reuse or
  speculation (at least one of them), and is refused with none.
- ``max_batch_size`` must lie in the reach of every catalog ``batch`` axis, ``max_seq_len`` in every
  ``context`` axis, and ``max_num_tokens`` must hold one full verify step (max_batch_size x (K + 1)
  rows) and one decode step.
- Disaggregated serving (``role``, ``peer``, ``transfer_backend``; impl/model/disagg/): a context
  engine reads prompts and hands each request's state to a generation engine. The transfer copies
  pages and states byte for byte, so the peers store them alike (rule
  ``disaggregated_peers_store_state_alike``); their draft layers agree, or only the generation engine
  drafts (rule ``disaggregated_draft_layers_agree``); the backend moves the device's tensors: gloo the
  CPU's, NCCL CUDA's (rule ``transfer_backend_serves_the_device``).
- ``prefill_graph``: 'eager' (default) or 'breakable': context and mixed steps replay a graph per
  token bucket whose breaks run the parts that read the step's spans eagerly
  (impl/model/prefill_graphs.py). Rule ``breakable_prefill_graph_on_cuda`` refuses it off cuda, in
  batch-invariant or torch-only mode, and where a piece between breaks would dispatch a variant that
  reads the host, at any bucket. Steps with frame rows or verify rows run eagerly beside it.
  ``prefill_graph_max_tokens`` caps the buckets (steps of more tokens run eagerly), for the graphs'
  memory; the same rule refuses it without ``prefill_graph: breakable``.
- Video input (``multimodal``, off by default; impl/model/vision.py): requests may carry frames. It
  needs a model whose preset has a vision tower read out to its width (rule
  ``multimodal_model_has_a_vision_tower``: tiny has one, the target none yet); frame prompts rotate by
  mRoPE positions, which the MTP verify and draft rows, a disaggregated hand-off and a captured decode
  graph do not carry, so speculation, a context or generation role and cuda_graphs are refused with it
  (rules ``multimodal_without_speculation``, ``multimodal_aggregated_only``,
  ``multimodal_without_cuda_graphs``). The op ``vision_tower`` runs only with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

from certify.harness.archs import cuda_arch
from certify.catalog.load import Catalog, load_catalog
from certify.files.paths import project_paths
from certify.catalog.plan import variants_of_cell
from certify.catalog.rules import RuleError, evaluate
from certify.catalog.schema import EXACT, Cell, OpFile, Variant
from impl.model.expert_copy import expert_copy
from impl.model.memory import MemoryPlan, memory_plan
from spec.config import ModelConfig
from spec.ops.qsa import TOKENS_PER_BLOCK

ModelPreset = Literal["target", "tiny"]
PleTables = Literal["device", "host"]
ModelDtype = Literal["bf16", "fp16", "fp32"]
KvCacheDtype = Literal["bf16", "fp8", "nvfp4", "fp16", "int8"]
StateDtype = Literal["fp32", "bf16", "fp16"]
# 'auto' (the dispatch rules' choice), a variant of the op moe, or a backend this project lacks
MoeBackend = Literal["auto", "triton", "torch", "spec_lowp", "trtllm", "cutedsl"]
Device = Literal["cpu", "cuda"]
GdnCommit = Literal["cached", "recompute"]
Role = Literal["aggregated", "context", "generation"]
TransferBackend = Literal["gloo", "nccl"]
PrefillGraph = Literal["eager", "breakable"]

# the torch.distributed backend that moves a device's tensors between the peers
TRANSFER_BACKEND_OF_DEVICE: dict[str, str] = {"cpu": "gloo", "cuda": "nccl"}

# gdn_commit 'recompute' runs at draft lengths up to this: the depth its replay tests certify
# (tests/engine/test_rollback_replay.py, tests/engine/test_engine.py run it at every K up to it)
RECOMPUTE_MAX_DRAFT = 3

MOE_OP = "moe"   # the op whose variant ``moe_backend`` names

# config dtype name -> the catalog's axis value
_CATALOG_DTYPE = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16", "fp8": "fp8",
                  "nvfp4": "nvfp4", "int8": "int8"}

# op -> (width axis, offset): the width a request needs is draft_length + offset
VERIFY_WIDTH_OPS: dict[str, tuple[str, int]] = {
    "gdn_verify": ("rows", 1),
    "greedy_verify": ("draft", 0),
    "rollback_commit": ("draft", 0),
}


class SpeculativeConfig(BaseModel):
    """MTP speculation: K draft tokens a step, verified as K + 1 rows a request."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    draft_length: int = Field(ge=1, le=7)
    dynamic_draft_length: bool = False
    index_share: bool = False


class PeerConfig(BaseModel):
    """The other engine of a disaggregated pair, as far as the transfer reads it: how it stores a
    request's state and whether it drafts."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelPreset = "target"
    model_dtype: ModelDtype = "bf16"
    kv_cache_dtype: KvCacheDtype = "bf16"
    state_dtype: StateDtype = "fp32"
    tokens_per_block: int = Field(TOKENS_PER_BLOCK, ge=1)
    speculative: SpeculativeConfig | None = None

    @classmethod
    def of(cls, config: EngineConfig) -> PeerConfig:
        """What ``config``'s engine is, seen from its peer."""
        return cls(**{name: getattr(config, name) for name in cls.model_fields})


class EngineConfig(BaseModel):
    """What the engine is asked to build. Combinations are checked by ``RULES`` (see ``route``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelPreset = "target"
    device: Device = "cpu"
    model_dtype: ModelDtype = "bf16"
    kv_cache_dtype: KvCacheDtype = "bf16"
    state_dtype: StateDtype = "fp32"
    moe_backend: MoeBackend = "auto"   # rule moe_backend_supported
    max_batch_size: int = Field(8, ge=1)
    max_num_tokens: int = Field(8192, ge=1)
    max_seq_len: int = Field(131072, ge=1)
    tokens_per_block: int = Field(TOKENS_PER_BLOCK, ge=1)   # a KV page; rule tokens_per_block_is_the_specs
    enable_chunked_prefill: bool = True
    enable_block_reuse: bool = False
    speculative: SpeculativeConfig | None = None
    batch_invariant: bool = False
    cuda_graphs: bool = False     # decode and verify trunks replay captured graphs (impl/model/graphs.py)
    # context and mixed steps replay a graph of their token bucket, broken around the parts that
    # read the step's spans (impl/model/prefill_graphs.py); rule breakable_prefill_graph_on_cuda
    prefill_graph: PrefillGraph = "eager"
    # the largest step, in tokens, a prefill graph is captured for (None: max_num_tokens); larger
    # context steps run eagerly. Each bucket's graph holds device memory, and above a few thousand
    # tokens the step is GPU-bound (reports/bench/prefill_graph.md); rule breakable_prefill_graph_on_cuda
    prefill_graph_max_tokens: int | None = Field(default=None, ge=16)
    torch_only: bool = False      # dispatch only variants written in torch (the benchmarks' peer)
    # where the PLE tables E and G live: device memory, or host memory registered with the CUDA
    # runtime and mapped into the device's address space (impl/model/placement.py); rule
    # ple_host_tables_on_cuda
    ple_tables: PleTables = "device"
    # keep the second copy of the routed experts where the moe variant's large launch reads another
    # layout and max_num_tokens reaches it (impl/model/expert_copy.py); off drops it for memory
    moe_expert_copy: bool = True
    # how a verify step's GDN state is committed (impl/model/model.py): from the states the verify
    # step recorded after each row, or by re-running the accepted rows from the pre-verify state;
    # rule gdn_recompute_commit_up_to_draft_3
    gdn_commit: GdnCommit = "cached"
    # op -> numerics tier its variants are chosen from (default 'exact'); rule numerics_tier_runs
    numerics: dict[str, str] = Field(default_factory=dict)
    # disaggregated serving (impl/model/disagg/): 'context' reads prompts and hands each request to
    # its peer, 'generation' continues requests handed to it; rules disaggregation_role_has_a_peer,
    # disaggregated_peers_store_state_alike, disaggregated_draft_layers_agree,
    # transfer_backend_serves_the_device
    role: Role = "aggregated"
    peer: PeerConfig | None = None
    transfer_backend: TransferBackend | None = None   # None: the device's (gloo on cpu, nccl on cuda)
    # video input (impl/model/vision.py): requests may carry frames, run through the vision tower
    # and spliced into their prompts with mRoPE positions; rules multimodal_model_has_a_vision_tower,
    # multimodal_without_speculation, multimodal_aggregated_only, multimodal_without_cuda_graphs
    multimodal: bool = False

    def tier_of(self, op: str) -> str:
        return self.numerics.get(op, EXACT)

    def pinned_variants(self) -> dict[str, str]:
        """op -> the variant the configuration names for it (``moe_backend``); every other op's
        variant is its dispatch rules' choice."""
        return {} if self.moe_backend == "auto" else {MOE_OP: self.moe_backend}

    def model_geometry(self) -> ModelConfig:
        return ModelConfig.tiny() if self.model == "tiny" else ModelConfig.target()

    @property
    def cache_slots(self) -> int:
        """The slots the engine's cache holds: one a request, and with captured graphs a spare one
        that pads decode graphs (impl/model/graphs.py) and runs the capture of prefill graphs
        (impl/model/prefill_graphs.py), and no request is given."""
        return self.max_batch_size + (1 if self.cuda_graphs or self.captures_prefill else 0)

    @property
    def captures_prefill(self) -> bool:
        return self.prefill_graph == "breakable"

    @property
    def prefill_graph_tokens(self) -> int:
        """The token count of the largest prefill bucket's step: ``max_num_tokens``, or
        ``prefill_graph_max_tokens`` where that is smaller."""
        cap = self.prefill_graph_max_tokens
        return self.max_num_tokens if cap is None else min(cap, self.max_num_tokens)

    def build_plan(self, ctx: RuleContext | None = None) -> RoutePlan:
        """``route(self)``: the plan, or ``ConfigRefused`` before anything is built."""
        return route(self, ctx)


# ---------------------------------------------------------------------------- rules


@dataclass(frozen=True)
class RuleContext:
    """What the rules read besides the config: the model geometry, the catalog and the arch."""

    model: ModelConfig
    catalog: Catalog
    arch: str


@lru_cache(maxsize=1)
def _project_catalog() -> Catalog:
    return load_catalog(project_paths().cells)


def default_context(config: EngineConfig, model: ModelConfig | None = None,
                    arch: str | None = None) -> RuleContext:
    """The rules' context: the geometry served (``model``, a checkpoint's, or the preset's), and
    ``arch``, by default this machine's for the configured device (a CUDA device's compute
    capability, ``cpu`` for the CPU, and ``cpu`` for cuda on a machine without a GPU, which the rule
    ``device_present`` refuses); a given arch asks what that machine would do."""
    if arch is None:
        arch = (cuda_arch() or "cpu") if config.device == "cuda" else "cpu"
    return RuleContext(model or config.model_geometry(), _project_catalog(), arch)


@dataclass(frozen=True)
class Rule:
    name: str
    statement: str  # one sentence: what a runnable config satisfies
    check: Callable[[EngineConfig, RuleContext], str | None]  # None, or why the config breaks it


@dataclass(frozen=True)
class Refusal:
    rule: str
    statement: str
    reason: str

    def __str__(self) -> str:
        return f"{self.rule}: {self.reason}"


class ConfigRefused(ValueError):
    def __init__(self, refusals: list[Refusal]):
        self.refusals = list(refusals)
        lines = "\n".join(f"  - {r}" for r in self.refusals)
        super().__init__(f"engine configuration refused by {len(self.refusals)} rule(s):\n{lines}")


def _axis_values(cat: Catalog, axis: str) -> dict[str, tuple]:
    """op -> the values of its choice axis ``axis`` (ops without it left out)."""
    return {n: tuple(op.axes[axis].values) for n, op in cat.ops.items()
            if axis in op.axes and op.axes[axis].kind == "choice"}


def _unsupported_dtype(value: str, axis: str, ctx: RuleContext) -> str | None:
    want = _CATALOG_DTYPE[value]
    missing = {n: v for n, v in _axis_values(ctx.catalog, axis).items() if want not in v}
    if not missing:
        return None
    n, v = sorted(missing.items())[0]
    more = f" (and {len(missing) - 1} more op(s))" if len(missing) > 1 else ""
    return f"{value} is not a value of the {axis} axis of {n}, which allows {list(v)}{more}"


def _kv_dtype(c: EngineConfig, ctx: RuleContext) -> str | None:
    return _unsupported_dtype(c.kv_cache_dtype, "kv_dtype", ctx)


def _model_dtype(c: EngineConfig, ctx: RuleContext) -> str | None:
    return _unsupported_dtype(c.model_dtype, "act_dtype", ctx)


def _moe_backend(c: EngineConfig, ctx: RuleContext) -> str | None:
    from certify.harness.archs import runtime_arch
    from certify.harness.requirements import missing

    name = c.pinned_variants().get(MOE_OP)
    op = ctx.catalog.ops.get(MOE_OP)
    if name is None or op is None:   # 'auto'; a catalog without moe fails ops_run_on_the_arch
        return None
    names = [v.name for v in op.variants]
    if name not in names:
        return (f"moe_backend {name!r} is not a variant of {MOE_OP} (its variants: "
                f"{', '.join(names)}; 'auto' lets their dispatch rules choose)")
    variant = op.variant(name)
    why = why_not_runnable(c, variant, ctx.arch, c.tier_of(MOE_OP))
    if why is not None:
        return f"moe_backend {name!r}: {MOE_OP}'s variant {name!r} cannot run: {why}"
    if ctx.arch == runtime_arch() and missing(variant):
        return (f"moe_backend {name!r}: {MOE_OP}'s variant {name!r} needs "
                f"{', '.join(missing(variant))}, not installed")
    return None


def _state_dtype(c: EngineConfig, ctx: RuleContext) -> str | None:
    if c.state_dtype == "fp16":
        return ("fp16 recurrent state is refused: the GDN state is stored in fp32 or bf16 only "
                "(docs/spec.md, \"GDN layer\"), and no cell certifies an fp16 state pool")
    return _unsupported_dtype(c.state_dtype, "state_dtype", ctx)


def _static_draft(c: EngineConfig, ctx: RuleContext) -> str | None:
    if c.speculative is not None and c.speculative.dynamic_draft_length:
        return ("dynamic_draft_length is refused: the draft length is fixed when the engine is built "
                "(state pools, verify widths and the certified cells depend on it)")
    return None


def _draft_layer(c: EngineConfig, ctx: RuleContext) -> str | None:
    if c.speculative is None:
        return None
    m = ctx.model
    if m.mtp_layers < 1:
        return f"speculation needs an MTP draft layer; the {c.model} model has mtp_layers=0"
    if c.speculative.draft_length > m.max_draft_len:
        return (f"draft_length {c.speculative.draft_length} exceeds the {c.model} model's "
                f"max_draft_len {m.max_draft_len}")
    return None


def _config_axes(c: EngineConfig, op: OpFile) -> dict[str, object]:
    """The axis values of ``op`` this config fixes (plus the single-choice axes)."""
    axes: dict[str, object] = {n: a.values[0] for n, a in op.axes.items()
                               if a.kind == "choice" and len(a.values) == 1}
    known: dict[str, object] = {
        "batch": c.max_batch_size,
        "state_dtype": _CATALOG_DTYPE[c.state_dtype],
        "kv_dtype": _CATALOG_DTYPE[c.kv_cache_dtype],
        "act_dtype": _CATALOG_DTYPE[c.model_dtype],
    }
    if op.op in VERIFY_WIDTH_OPS and c.speculative is not None:
        axis, offset = VERIFY_WIDTH_OPS[op.op]
        known[axis] = c.speculative.draft_length + offset
    axes.update({k: v for k, v in known.items() if k in op.axes})
    return axes


@dataclass(frozen=True)
class Choice:
    """The variant an op runs on an arch, and how it was chosen."""

    op: str
    variant: str | None
    axes: dict[str, object]
    how: str  # "dispatch" | "first runnable" | "none"
    note: str = ""


def why_not_runnable(c: EngineConfig, v: Variant, arch: str, tier: str) -> str | None:
    """Why the configuration may not run variant ``v`` on ``arch`` at numerics ``tier`` (None: it
    may): another tier, another arch, a kernel in batch-invariant mode, a kernel not written in
    torch with torch_only."""
    from impl.model.dispatch import is_torch_variant

    if v.numerics != tier:
        return f"it claims the {v.numerics} numerics tier, the configuration asks {tier}"
    if arch not in v.archs:
        return f"it runs on {', '.join(v.archs)}, not on {arch}"
    if c.batch_invariant and v.impl != "spec":
        return "batch-invariant mode runs reference variants (impl: spec) only"
    if c.torch_only and not is_torch_variant(v):
        return "torch_only runs the variants written in torch only"
    return None


def runnable_variants(c: EngineConfig, op: OpFile, arch: str, tier: str) -> list[Variant]:
    """The variants of ``op``'s ``tier`` the configuration may run on ``arch``, in file order: in
    batch-invariant mode its references only; with torch_only those written in torch only, the
    torch compositions before the references (``Dispatcher.candidates``); an op the configuration
    names a variant of (``pinned_variants``) that variant only."""
    pinned = c.pinned_variants().get(op.op)
    runnable = [v for v in op.variants if why_not_runnable(c, v, arch, tier) is None
                and (pinned is None or v.name == pinned)]
    return sorted(runnable, key=lambda v: c.torch_only and v.impl == "spec")


def choose_variant(c: EngineConfig, op: OpFile, arch: str) -> Choice:
    """First variant in file order that runs on ``arch`` and whose rule accepts the config's axes. A
    rule that reads an axis the config does not fix (e.g. seq_len) is decided per step: then the first
    variant runnable on the arch is listed, with the axes that decide."""
    axes = _config_axes(c, op)
    runnable = runnable_variants(c, op, arch, c.tier_of(op.op))
    if not runnable:
        return Choice(op.op, None, axes, "none", f"no variant runs on {arch}")
    for v in runnable:
        try:
            if evaluate(v.dispatch, axes):
                return Choice(op.op, v.name, axes, "dispatch")
        except RuleError:
            return Choice(op.op, runnable[0].name, axes, "first runnable",
                          f"dispatch reads per-step axes ({v.dispatch!r})")
    return Choice(op.op, None, axes, "none", f"no variant's rule accepts {axes} on {arch}")


def _cell_serves(op: OpFile, cell: Cell, variant: str, arch: str) -> bool:
    return (any(v.name == variant for v in variants_of_cell(op, cell))
            and (cell.archs is None or arch in cell.archs))


def certifying_cell(c: EngineConfig, op: OpFile, arch: str) -> tuple[Cell | None, str]:
    """For a width op and a config with speculation: the nearest certified cell (or None) and why."""
    axis_name, offset = VERIFY_WIDTH_OPS[op.op]
    k = c.speculative.draft_length
    need = k + offset
    axis = op.axes[axis_name]
    if not axis.contains(need):
        return None, (f"{op.op} needs {axis_name}={need} for draft length {k}, outside the axis "
                      f"reach {list(axis.reach)}")
    choice = choose_variant(c, op, arch)
    if choice.variant is None:
        return None, f"{op.op}: {choice.note}"
    state = _CATALOG_DTYPE[c.state_dtype]
    fits = [cell for cell in op.cells
            if _cell_serves(op, cell, choice.variant, arch)
            and op.axes_of(cell).get(axis_name, 0) >= need
            and ("state_dtype" not in op.axes or op.axes_of(cell).get("state_dtype") == state)]
    if not fits:
        st = f" with state_dtype {state}" if "state_dtype" in op.axes else ""
        return None, (f"draft length {k} needs a cell of {op.op}'s variant {choice.variant!r} on "
                      f"{arch} with {axis_name} >= {need}{st}; none is certified")
    best = min(fits, key=lambda cell: op.axes_of(cell)[axis_name])
    return best, f"{op.op}::{choice.variant}::{best.id} ({axis_name}={op.axes_of(best)[axis_name]})"


def _verify_width(c: EngineConfig, ctx: RuleContext) -> str | None:
    if c.speculative is None:
        return None
    problems = []
    for name in VERIFY_WIDTH_OPS:
        op = ctx.catalog.ops.get(name)
        if op is None:
            problems.append(f"the catalog has no {name} op, so no verify width is certified")
            continue
        cell, why = certifying_cell(c, op, ctx.arch)
        if cell is None:
            problems.append(why)
    return "; ".join(problems) or None


def _gdn_commit(c: EngineConfig, ctx: RuleContext) -> str | None:
    if c.gdn_commit != "recompute":
        return None
    if c.speculative is None:
        return ("gdn_commit 'recompute' re-runs the accepted rows of a verify step at its commit; "
                "speculation is off, so no step verifies")
    k = c.speculative.draft_length
    if k > RECOMPUTE_MAX_DRAFT:
        return (f"gdn_commit 'recompute' runs at draft length <= {RECOMPUTE_MAX_DRAFT}, the depth "
                f"its replay tests certify; draft length {k} runs gdn_commit 'cached'")
    return None


def _tokens_per_block(c: EngineConfig, ctx: RuleContext) -> str | None:
    if c.tokens_per_block == TOKENS_PER_BLOCK:
        return None
    return (f"tokens_per_block {c.tokens_per_block}: a KV page is the QSA block, which the spec "
            f"(spec/ops/qsa.py) and every certified cell define at {TOKENS_PER_BLOCK} tokens (its "
            f"block keys, its sink and local windows, the top-k over blocks); another page size has "
            f"no spec and no cell")


def _nvfp4_kv(c: EngineConfig, ctx: RuleContext) -> str | None:
    if c.kv_cache_dtype != "nvfp4":
        return None
    if c.enable_chunked_prefill or c.enable_block_reuse or c.speculative is not None:
        return None
    return ("nvfp4 KV needs chunked prefill, block reuse or speculation; all three are off")


def _reach_of(cat: Catalog, axis: str) -> tuple[str, int] | None:
    """The tightest upper reach of int axis ``axis`` over the catalog: (op, hi)."""
    reaches = sorted((op.axes[axis].reach[1], n) for n, op in cat.ops.items()
                     if axis in op.axes and op.axes[axis].kind == "int")
    return (reaches[0][1], reaches[0][0]) if reaches else None


def _batch_reach(c: EngineConfig, ctx: RuleContext) -> str | None:
    r = _reach_of(ctx.catalog, "batch")
    if r is None or c.max_batch_size <= r[1]:
        return None
    return f"max_batch_size {c.max_batch_size} exceeds the batch reach of {r[0]} ({r[1]})"


def _context_reach(c: EngineConfig, ctx: RuleContext) -> str | None:
    r = _reach_of(ctx.catalog, "context")
    if r is None or c.max_seq_len <= r[1]:
        return None
    return f"max_seq_len {c.max_seq_len} exceeds the context reach of {r[0]} ({r[1]})"


def _device_present(c: EngineConfig, ctx: RuleContext) -> str | None:
    if c.device == "cuda" and not ctx.arch.startswith("sm_"):
        return "device 'cuda' was asked for, and this machine has no CUDA device"
    return None


def _forward_op_names(c: EngineConfig) -> list[str]:
    """The ops the configuration's forward calls, less the verify-width ops (their own rule) and
    the pinned ones (moe_backend_supported's)."""
    from impl.model.ops import (FORWARD_OPS, INDEX_SHARE_OPS, KV_CODEC_OPS, MULTIMODAL_OPS,
                                SPECULATION_OPS)

    sharing = c.speculative is not None and c.speculative.index_share
    names = [n for n in FORWARD_OPS if sharing or n not in INDEX_SHARE_OPS]
    names += [KV_CODEC_OPS[c.kv_cache_dtype]] if c.kv_cache_dtype in KV_CODEC_OPS else []
    if c.speculative is not None:
        names += [n for n in SPECULATION_OPS if n not in VERIFY_WIDTH_OPS]
    if c.multimodal:
        names += list(MULTIMODAL_OPS)
    return [n for n in names if n not in c.pinned_variants()]


def _batch_invariant_references(c: EngineConfig, ctx: RuleContext) -> str | None:
    """Batch-invariant mode promises a row's result independent of the other rows: every reference
    variant it runs must claim batch invariance on the arch (``batch_invariant``, which the
    harness's metamorphic checks test there)."""
    if not c.batch_invariant:
        return None
    problems = []
    widths = [n for n in VERIFY_WIDTH_OPS if c.speculative is not None]
    for name in _forward_op_names(c) + widths:
        op = ctx.catalog.ops.get(name)
        chosen = choose_variant(c, op, ctx.arch).variant if op is not None else None
        if chosen is None:
            continue   # ops_run_on_the_arch names it
        if not op.variant(chosen).invariant_on(ctx.arch):
            problems.append(f"{name}'s {chosen} claims no batch invariance on {ctx.arch}")
    return "; ".join(problems) or None


def _ops_run_on_the_arch(c: EngineConfig, ctx: RuleContext) -> str | None:
    names = _forward_op_names(c)
    missing = [n for n in names if n in ctx.catalog.ops
               and choose_variant(c, ctx.catalog.ops[n], ctx.arch).variant is None]
    missing += [n for n in names if n not in ctx.catalog.ops]
    if not missing:
        return None
    more = f" (and {len(missing) - 1} more: {', '.join(missing[1:])})" if len(missing) > 1 else ""
    kind = "reference variant (impl: spec, batch-invariant mode)" if c.batch_invariant else "variant"
    return f"no {kind} of {missing[0]} runs on {ctx.arch}{more}"


def _numerics_tiers(c: EngineConfig, ctx: RuleContext) -> str | None:
    from certify.harness.archs import runtime_arch
    from certify.harness.requirements import missing

    problems = []
    for name, tier in sorted(c.numerics.items()):
        op = ctx.catalog.ops.get(name)
        if op is None:
            problems.append(f"{name} is not an op of the catalog")
            continue
        if tier not in op.tiers():
            problems.append(f"{name} has no numerics tier {tier!r} (its tiers: "
                            f"{', '.join(op.tiers())})")
            continue
        runs = [v.name for v in runnable_variants(c, op, ctx.arch, tier)]
        if not runs:
            kind = "reference variant" if c.batch_invariant else "variant"
            problems.append(f"no {kind} of {name}'s {tier} tier runs on {ctx.arch}")
            continue
        if ctx.arch == runtime_arch() and all(missing(op.variant(v)) for v in runs):
            problems.append(f"{name}'s {tier} tier runs on {ctx.arch} only through "
                            f"{', '.join(runs)}, whose packages are not installed")
    return "; ".join(problems) or None


def _cuda_graphs(c: EngineConfig, ctx: RuleContext) -> str | None:
    if not c.cuda_graphs:
        return None
    if c.device != "cuda":
        return f"cuda_graphs needs device 'cuda' (the configuration's device is {c.device!r})"
    if c.batch_invariant or c.torch_only:
        what = "batch-invariant mode" if c.batch_invariant else "torch_only"
        return (f"cuda_graphs is captured over the fast variants, not checked with {what}: turn "
                "one of them off")
    from impl.model.graphs import uncapturable_calls

    bad = uncapturable_calls(c, ctx)
    if bad:
        step = "a verify" if c.speculative is not None else "a decode"
        return (f"{step} step of this geometry dispatches {', '.join(bad)}: variants that read "
                "values on the host (references, HOST_READING_KERNELS), which a CUDA graph cannot "
                "capture")
    return None


def _prefill_graph(c: EngineConfig, ctx: RuleContext) -> str | None:
    if not c.captures_prefill:
        if c.prefill_graph_max_tokens is not None:
            return ("prefill_graph_max_tokens caps the buckets of the breakable prefill graph, and "
                    "prefill_graph is 'eager': set prefill_graph 'breakable' or drop the cap")
        return None
    if c.device != "cuda":
        return (f"prefill_graph 'breakable' needs device 'cuda' (the configuration's device is "
                f"{c.device!r})")
    if c.batch_invariant or c.torch_only:
        what = "batch-invariant mode" if c.batch_invariant else "torch_only"
        return (f"prefill_graph 'breakable' is captured over the fast variants, not checked with "
                f"{what}: turn one of them off")
    from impl.model.prefill_graphs import uncapturable_piece_calls

    bad = uncapturable_piece_calls(c, ctx)
    if bad:
        return (f"a prefill graph of this geometry captures {', '.join(bad)} between its breaks: "
                "variants that read values on the host (references, HOST_READING_KERNELS), which "
                "a CUDA graph cannot capture")
    return None


def _ple_tables(c: EngineConfig, ctx: RuleContext) -> str | None:
    if c.ple_tables == "host" and c.device != "cuda":
        return (f"ple_tables 'host' maps host memory into a CUDA device's address space; the "
                f"configuration's device is {c.device!r} (its tables are host memory already)")
    return None


def _token_budget(c: EngineConfig, ctx: RuleContext) -> str | None:
    rows = c.speculative.draft_length + 1 if c.speculative is not None else 1
    need = c.max_batch_size * rows
    if c.max_num_tokens >= need:
        return None
    return (f"max_num_tokens {c.max_num_tokens} cannot hold one full generation step: "
            f"max_batch_size {c.max_batch_size} x {rows} row(s) = {need}")


def _disaggregation_role(c: EngineConfig, ctx: RuleContext) -> str | None:
    if c.role == "aggregated":
        set_ = [n for n in ("peer", "transfer_backend") if getattr(c, n) is not None]
        if set_:
            return (f"role 'aggregated' serves its requests alone; {' and '.join(set_)} "
                    f"{'is' if len(set_) == 1 else 'are'} read only by a context or generation engine")
        return None
    if c.peer is None:
        side = "hands requests to" if c.role == "context" else "continues requests from"
        return (f"role {c.role!r} {side} a peer engine; peer (how it stores a request's state and "
                f"whether it drafts) is not set")
    return None


# the EngineConfig fields that fix the bytes a transfer copies
PEER_STORAGE_FIELDS = ("model", "model_dtype", "kv_cache_dtype", "state_dtype", "tokens_per_block")


def _peer_storage(c: EngineConfig, ctx: RuleContext) -> str | None:
    if c.role == "aggregated" or c.peer is None:
        return None
    diff = [f"{f} is {getattr(c, f)!r} here and {getattr(c.peer, f)!r} at the peer"
            for f in PEER_STORAGE_FIELDS if getattr(c, f) != getattr(c.peer, f)]
    if not diff:
        return None
    return ("the transfer copies pages and states byte for byte, so both engines must store them "
            "alike: " + "; ".join(diff))


def _peer_draft_layers(c: EngineConfig, ctx: RuleContext) -> str | None:
    if c.role == "aggregated" or c.peer is None:
        return None
    drafting = (c.speculative, c.peer.speculative)
    context, generation = drafting if c.role == "context" else drafting[::-1]
    if context is None:   # no draft layer, or the generation engine's only: it reads the prompt rows
        return None
    if generation is None:
        return ("the context engine drafts (MTP) and the generation engine does not: the drafts and "
                "the draft layer's planes would be handed to an engine that cannot verify them; "
                "turn speculation off at the context engine or on at the generation engine")
    if (context.draft_length, context.index_share) != (generation.draft_length,
                                                        generation.index_share):
        return (f"the context engine drafts with draft_length {context.draft_length} and "
                f"index_share {context.index_share}, the generation engine with draft_length "
                f"{generation.draft_length} and index_share {generation.index_share}: the handed "
                f"drafts and draft-layer planes are the context engine's, so both must agree")
    return None


def transfer_backend(c: EngineConfig) -> str:
    """The torch.distributed backend of ``c``'s transfers: the configured one, else the device's."""
    return c.transfer_backend or TRANSFER_BACKEND_OF_DEVICE[c.device]


def _transfer_backend(c: EngineConfig, ctx: RuleContext) -> str | None:
    if c.role == "aggregated":
        return None
    backend = transfer_backend(c)
    serves = TRANSFER_BACKEND_OF_DEVICE[c.device]
    if backend != serves:
        return (f"transfer_backend {backend!r} does not move {c.device} tensors between processes "
                f"(gloo moves CPU tensors, nccl CUDA tensors); the device {c.device!r} needs "
                f"{serves!r}")
    import torch.distributed as dist

    available = dist.is_available() and (dist.is_gloo_available() if backend == "gloo"
                                         else dist.is_nccl_available())
    if not available:
        return f"this torch build has no {backend} backend for torch.distributed"
    return None


def _multimodal_tower(c: EngineConfig, ctx: RuleContext) -> str | None:
    from impl.model.vision import vision_geometry

    if not c.multimodal:
        return None
    vision = vision_geometry(c.model)
    if vision is None:
        return f"multimodal needs a vision tower, and the {c.model} model has none"
    if vision.out_width != ctx.model.hidden:
        return (f"the {c.model} vision tower reads out {vision.out_width} wide rows; the model's "
                f"hidden width is {ctx.model.hidden}")
    return None


def _multimodal_speculation(c: EngineConfig, ctx: RuleContext) -> str | None:
    if c.multimodal and c.speculative is not None:
        return ("multimodal gives frame prompts mRoPE positions that verify and draft rows do not "
                "carry (no mRoPE delta in the MTP path): turn speculation or multimodal off")
    return None


def _multimodal_aggregated(c: EngineConfig, ctx: RuleContext) -> str | None:
    if c.multimodal and c.role != "aggregated":
        return (f"a {c.role} engine hands requests over without their frame positions: "
                "multimodal runs on an aggregated engine only")
    return None


def _multimodal_graphs(c: EngineConfig, ctx: RuleContext) -> str | None:
    if c.multimodal and c.cuda_graphs:
        return ("decode graphs are captured over plain positions; a frame request's decode rows "
                "rotate by mRoPE positions: turn cuda_graphs or multimodal off")
    return None


RULES: list[Rule] = [
    Rule("device_present",
         "The configured device is on this machine (cuda needs a CUDA device).",
         _device_present),
    Rule("kv_cache_dtype_supported",
         "The KV cache dtype is a value of every kv_dtype axis in the catalog.", _kv_dtype),
    Rule("model_dtype_supported",
         "The model dtype is a value of every act_dtype axis in the catalog.", _model_dtype),
    Rule("moe_backend_supported",
         "The MoE backend is 'auto' or a variant of the op moe that runs on the arch in the "
         "configured mode.", _moe_backend),
    Rule("state_dtype_supported",
         "The recurrent-state dtype is fp32 or bf16 and a value of every state_dtype axis; fp16 is "
         "refused.", _state_dtype),
    Rule("static_draft_length",
         "The draft length is fixed for the engine's lifetime (no dynamic draft length).",
         _static_draft),
    Rule("draft_length_within_model",
         "Speculation needs the model's MTP layer and a draft length <= its max_draft_len.",
         _draft_layer),
    Rule("verify_width_certified",
         "Every verify-width op's dispatched variant has a certified cell at least as wide as the "
         "draft length needs, with the configured state dtype.", _verify_width),
    Rule("gdn_recompute_commit_up_to_draft_3",
         f"gdn_commit 'recompute' (the accepted rows re-run from the pre-verify state at commit) "
         f"runs with speculation at draft length <= {RECOMPUTE_MAX_DRAFT}.", _gdn_commit),
    Rule("tokens_per_block_is_the_specs",
         f"A KV page holds {TOKENS_PER_BLOCK} tokens, the QSA block of the spec and of every "
         "certified cell.", _tokens_per_block),
    Rule("nvfp4_kv_needs_chunked_prefill_block_reuse_or_speculation",
         "nvfp4 KV runs only with chunked prefill, block reuse or speculation enabled.", _nvfp4_kv),
    Rule("max_batch_size_within_reach",
         "max_batch_size lies within every batch axis reach of the catalog.", _batch_reach),
    Rule("max_seq_len_within_reach",
         "max_seq_len lies within every context axis reach of the catalog.", _context_reach),
    Rule("ops_run_on_the_arch",
         "Every op the forward runs has a variant on the arch (in batch-invariant mode, a reference "
         "variant).", _ops_run_on_the_arch),
    Rule("batch_invariant_references_hold",
         "In batch-invariant mode, every reference variant the forward runs claims batch "
         "invariance on the arch.", _batch_invariant_references),
    Rule("numerics_tier_runs_on_the_arch",
         "Every op given a numerics tier declares that tier, and a variant of the tier runs on the "
         "arch (in batch-invariant mode, a reference variant of it).", _numerics_tiers),
    Rule("cuda_graphs_capture_on_cuda",
         "CUDA graphs run on cuda, for decode and verify steps whose variants read no value on "
         "the host, outside batch-invariant mode and torch_only.", _cuda_graphs),
    Rule("breakable_prefill_graph_on_cuda",
         "The breakable prefill graph runs on cuda, outside batch-invariant mode and torch_only, "
         "and captures no variant that reads values on the host; prefill_graph_max_tokens needs "
         "it.", _prefill_graph),
    Rule("ple_host_tables_on_cuda",
         "Host-resident PLE tables (ple_tables 'host') are mapped into a cuda device.", _ple_tables),
    Rule("token_budget_holds_a_step",
         "max_num_tokens holds one generation step of max_batch_size requests (K + 1 rows each with "
         "speculation).", _token_budget),
    Rule("disaggregation_role_has_a_peer",
         "A context or generation engine names its peer; an aggregated engine names none.",
         _disaggregation_role),
    Rule("disaggregated_peers_store_state_alike",
         "A disaggregated engine and its peer have the same model, model dtype, KV cache dtype, "
         "state dtype and page size.", _peer_storage),
    Rule("disaggregated_draft_layers_agree",
         "Both peers draft with the same draft length and IndexShare setting, or only the "
         "generation engine drafts.", _peer_draft_layers),
    Rule("transfer_backend_serves_the_device",
         "The transfer backend moves the device's tensors (gloo on cpu, nccl on cuda) and this torch "
         "build has it.", _transfer_backend),
    Rule("multimodal_model_has_a_vision_tower",
         "Multimodal input needs a model with a vision tower read out to its hidden width.",
         _multimodal_tower),
    Rule("multimodal_without_speculation",
         "Multimodal input runs without speculation.", _multimodal_speculation),
    Rule("multimodal_aggregated_only",
         "Multimodal input runs on an aggregated engine (no disaggregated role).",
         _multimodal_aggregated),
    Rule("multimodal_without_cuda_graphs",
         "Multimodal input runs without CUDA graphs.", _multimodal_graphs),
]


def evaluate_rules(config: EngineConfig, ctx: RuleContext | None = None
                   ) -> list[tuple[Rule, str | None]]:
    """Every rule with its outcome (None = passed), in RULES order."""
    ctx = ctx or default_context(config)
    return [(rule, rule.check(config, ctx)) for rule in RULES]


def check(config: EngineConfig, ctx: RuleContext | None = None) -> list[Refusal]:
    """Every broken rule, in RULES order (all rules run; none stops the others)."""
    return [Refusal(rule.name, rule.statement, reason)
            for rule, reason in evaluate_rules(config, ctx) if reason is not None]


# ---------------------------------------------------------------------------- routing


@dataclass(frozen=True)
class RoutePlan:
    config: EngineConfig
    arch: str
    choices: dict[str, Choice] = field(default_factory=dict)


def _op_runs(config: EngineConfig, name: str) -> bool:
    """Verify-width ops run only with speculation, the multimodal ops only with multimodal."""
    from impl.model.ops import MULTIMODAL_OPS

    if name in MULTIMODAL_OPS:
        return config.multimodal
    return name not in VERIFY_WIDTH_OPS or config.speculative is not None


def route(config: EngineConfig, ctx: RuleContext | None = None) -> RoutePlan:
    """Refuse (``ConfigRefused``, every refusal listed) or return the variant plan; nothing is built."""
    ctx = ctx or default_context(config)
    refusals = check(config, ctx)
    if refusals:
        raise ConfigRefused(refusals)
    choices = {n: choose_variant(config, op, ctx.arch)
               for n, op in sorted(ctx.catalog.ops.items()) if _op_runs(config, n)}
    return RoutePlan(config, ctx.arch, choices)


# ---------------------------------------------------------------------------- memory


def verify_rows(config: EngineConfig) -> int:
    """The rows a request verifies in a step (K + 1) where the cached GDN commit keeps each row's
    state (a verify buffer a GDN layer, impl/model/cache.py); 0 otherwise."""
    spec = config.speculative
    return spec.draft_length + 1 if spec is not None and config.gdn_commit == "cached" else 0


def engine_memory(config: EngineConfig, ctx: RuleContext) -> MemoryPlan:
    """The memory the engine holds beside the weights (impl/model/memory.py), with the second expert
    copy the configured moe variant needs (impl/model/expert_copy.py)."""
    moe = ctx.catalog.ops.get(MOE_OP)
    variant = choose_variant(config, moe, ctx.arch).variant if moe is not None else None
    copy = expert_copy(variant, config.max_num_tokens, config.moe_expert_copy, ctx.model)
    rows = 0
    if config.captures_prefill:
        from impl.model.prefill_graphs import token_buckets

        rows = token_buckets(config.prefill_graph_tokens, config.max_seq_len)[-1]
    return memory_plan(ctx.model, slots=config.cache_slots, max_seq_len=config.max_seq_len,
                       kv_dtype=config.kv_cache_dtype, state_dtype=config.state_dtype,
                       model_dtype=config.model_dtype, with_mtp=config.speculative is not None,
                       expert_copy=copy, prefill_rows=rows, verify_rows=verify_rows(config))


# ---------------------------------------------------------------------------- explain


def _multimodal_ops() -> tuple[str, ...]:
    from impl.model.ops import MULTIMODAL_OPS

    return MULTIMODAL_OPS


def _receipt_summary(op: OpFile, variant: str, arch: str, book: dict) -> str:
    from certify.receipts.store import freshness

    cells = [cell for cell in op.cells if _cell_serves(op, cell, variant, arch)]
    if not cells:
        return f"no cell certifies it on {arch}"
    states = [freshness(book.get((op.op, variant, cell.id)), op, variant, cell, arch)
              for cell in cells]
    n = states.count("certified")
    return f"{'certified' if n else 'NOT certified'} receipt at {n}/{len(cells)} cell(s) on {arch}"


def _fmt_config(c: EngineConfig) -> str:
    spec = ("off" if c.speculative is None else
            f"K={c.speculative.draft_length} dynamic={c.speculative.dynamic_draft_length} "
            f"index_share={c.speculative.index_share}")
    return (f"model={c.model} model_dtype={c.model_dtype} kv_cache_dtype={c.kv_cache_dtype} "
            f"state_dtype={c.state_dtype} moe_backend={c.moe_backend} "
            f"max_batch_size={c.max_batch_size} max_num_tokens={c.max_num_tokens} "
            f"max_seq_len={c.max_seq_len} chunked_prefill={c.enable_chunked_prefill} "
            f"block_reuse={c.enable_block_reuse} speculative={spec} "
            f"batch_invariant={c.batch_invariant} moe_expert_copy={c.moe_expert_copy} "
            f"gdn_commit={c.gdn_commit}"
            + (f" role={c.role} transfer_backend={transfer_backend(c)}" if c.role != "aggregated"
               else "")
            + (" multimodal=True" if c.multimodal else "")
            + "".join(f" numerics[{op}]={tier}" for op, tier in sorted(c.numerics.items())))


def explain(config: EngineConfig, ctx: RuleContext | None = None,
            receipts: dict | None = None) -> str:
    """Accepted or refused; every rule with PASS/FAIL and its reason; for an accepted config, the variant
    each op runs on the arch and whether that variant holds a fresh passing receipt at any cell.
    ``receipts`` is ``load_receipts``'s arch -> book (default: the project's receipts directory)."""
    ctx = ctx or default_context(config)
    outcomes = evaluate_rules(config, ctx)
    failed = [r for r, why in outcomes if why is not None]
    lines = [f"config: {_fmt_config(config)}", f"arch: {ctx.arch}",
             "ACCEPTED" if not failed else
             f"REFUSED by {len(failed)} rule(s): {', '.join(r.name for r in failed)}", "rules:"]
    for rule, why in outcomes:
        lines.append(f"  [{'PASS' if why is None else 'FAIL'}] {rule.name}: {rule.statement}")
        if why is not None:
            lines.append(f"         reason: {why}")
    if failed:
        return "\n".join(lines)
    if config.speculative is not None:
        lines.append("verify widths:")
        for name in VERIFY_WIDTH_OPS:
            _, why = certifying_cell(config, ctx.catalog.ops[name], ctx.arch)
            lines.append(f"  {name}: certified by {why}")
    if receipts is None:
        from certify.receipts.store import load_receipts
        receipts = load_receipts(project_paths().receipts)
    book = receipts.get(ctx.arch, {})
    plan = route(config, ctx)
    lines.append(f"variants on {ctx.arch}:")
    for name, op in sorted(ctx.catalog.ops.items()):
        if name not in plan.choices:
            off = "multimodal" if name in _multimodal_ops() else "speculation"
            lines.append(f"  {name}: not run ({off} off)")
            continue
        ch = plan.choices[name]
        if ch.variant is None:
            lines.append(f"  {name}: none ({ch.note})")
            continue
        fixed = {k: v for k, v in ch.axes.items()
                 if not (op.axes[k].kind == "choice" and len(op.axes[k].values) == 1)}
        how = (f"dispatch at {fixed}" if ch.how == "dispatch" else f"{ch.how}: {ch.note}")
        lines.append(f"  {name}: {ch.variant} ({how}); "
                     f"{_receipt_summary(op, ch.variant, ctx.arch, book)}")
    lines.append("memory beside the weights:")
    lines += engine_memory(config, ctx).lines()
    return "\n".join(lines)
