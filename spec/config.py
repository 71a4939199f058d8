"""The model's geometry as one validated object (docs/spec.md, "Geometry").

``ModelConfig`` holds every shape the spec model (spec/model.py) is built from. Two presets:

- ``ModelConfig.target()``: the target column of docs/spec.md, the deployment geometry the cells are
  certified at. The vocabulary size is a spec decision: Qwen3-Next's, **151936**, with pad id 151643
  (Qwen's ``<|endoftext|>``).
- ``ModelConfig.tiny()``: the trained-checkpoint geometry (<= 10M parameters): hidden 128, 4 layers
  (layer 3 is the one QSA layer), vocab 256 so a byte tokenizer fits, GQA ratio 12 (24 q heads on 2 KV
  heads), GVA ratio 3 (2 key heads, 6 value heads), block 32, 8 experts top-2, 4 HC streams.

A combination the spec cannot run is refused when the config is built, never mid-forward: every
violated rule becomes one error of a pydantic ``ValidationError`` whose ``loc`` is the field at fault and
whose message starts with that field's name (see ``_violations``).

Decisions left to the spec by docs/spec.md (pinned in tests/spec/test_config.py):
- The n-gram table's size. Each hash head's modulus is a distinct prime; head k (order 2's heads first,
  then order 3's) takes the k-th largest prime below ``ple_ngram_rows`` (``ple_hash_primes``). Target:
  ``ple_ngram_rows = 65536``, so G has 16 x ~65.5K rows of L*P/16 = 768 values.
- ``eps`` is a field but must equal 1e-6: gdn.py's gated RMSNorm and l2norm, and hc.py's defaults, fix
  it, so any other value could not be honoured everywhere.
- ``gdn_conv_kernel`` must be 4 and ``tokens_per_block`` must be 32: spec/ops/gdn.py and spec/ops/qsa.py
  hard-code them.
- ``mtp_layers`` is 0 (no draft layer) or 1 (the one draft layer of docs/spec.md, reused by every
  draft step).
- Parameter counts (``param_count``) count logical weight elements: an NVFP4 expert matrix [out, in]
  counts out*in, its block and global scales are storage, not parameters. The KV-cache global scales are
  not counted either. The LM head is untied from the embedding (``tie_embeddings = False``, as in
  Qwen3-Next).
- ``kv_bytes_per_token`` counts the trunk's QSA layers only (12 at the target); the MTP draft layer's own
  KV is ``kv_bytes_per_token_per_layer`` more when ``include_mtp``. The QSA side planes are reported
  separately (``qsa_side_plane_bytes_per_token``): an index key in bf16, an int32 position, and a bf16
  block key shared by 32 tokens.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from spec.ops.kv_storage import NVFP4_BLOCK
from spec.ops.kv_storage import kv_bytes_per_token as _kv_bytes_per_layer
from spec.ops.ple import is_prime

LayerKind = Literal["gdn", "qsa"]
KvDtypeName = Literal["bf16", "fp8", "nvfp4"]
StateDtypeName = Literal["fp32", "bf16"]

_STATE_BYTES = {"fp32": 4, "bf16": 2}
_BF16 = 2
_INT32 = 4


def largest_primes_below(bound: int, count: int) -> tuple[int, ...]:
    """The ``count`` largest primes strictly below ``bound``, descending (empty tuple if too few)."""
    out: list[int] = []
    p = bound - 1
    while p >= 2 and len(out) < count:
        if is_prime(p):
            out.append(p)
        p -= 1
    return tuple(out) if len(out) == count else ()


class ModelConfig(BaseModel):
    """The geometry of the Flash-Next model (field names follow docs/spec.md, "Geometry")."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # trunk
    hidden: int
    num_layers: int
    vocab_size: int
    pad_id: int = 0
    tie_embeddings: bool = False
    eps: float = 1e-6
    # QSA attention
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float = 1e7
    # QSA index
    index_heads: int
    index_dim: int
    tokens_per_block: int = 32
    top_k_blocks: int
    sink_blocks: int = 1
    local_blocks: int = 2
    # GDN
    gdn_key_heads: int
    gdn_value_heads: int
    gdn_d_k: int
    gdn_d_v: int
    gdn_conv_kernel: int = 4
    # MoE
    num_experts: int
    moe_top_k: int
    expert_inter: int
    shared_inter: int
    # hyper-connections
    hc_streams: int = 4
    sinkhorn_iters: int = 20
    # PLE
    ple_dim: int
    ple_ngram_orders: tuple[int, ...] = (2, 3)
    ple_hash_heads: int = 8
    ple_ngram_rows: int
    # MTP
    mtp_layers: int = 1
    max_draft_len: int = 7

    # ------------------------------------------------------------------ presets

    @classmethod
    def target(cls) -> ModelConfig:
        """The target column of docs/spec.md (vocab 151936, Qwen3-Next's; see the module docstring)."""
        return cls(
            hidden=3072, num_layers=48, vocab_size=151936, pad_id=151643,
            num_q_heads=24, num_kv_heads=2, head_dim=256, rotary_dim=64, rope_theta=1e7,
            index_heads=16, index_dim=128, tokens_per_block=32, top_k_blocks=64, sink_blocks=1,
            local_blocks=2,
            gdn_key_heads=16, gdn_value_heads=48, gdn_d_k=128, gdn_d_v=128, gdn_conv_kernel=4,
            num_experts=512, moe_top_k=10, expert_inter=512, shared_inter=512,
            hc_streams=4, sinkhorn_iters=20,
            ple_dim=256, ple_ngram_orders=(2, 3), ple_hash_heads=8, ple_ngram_rows=65536,
            mtp_layers=1, max_draft_len=7,
        )

    @classmethod
    def tiny(cls) -> ModelConfig:
        """The small CPU geometry (<= 10M parameters), same layer rule and ratios where they fit."""
        return cls(
            hidden=128, num_layers=4, vocab_size=256, pad_id=0,
            num_q_heads=24, num_kv_heads=2, head_dim=64, rotary_dim=16, rope_theta=1e7,
            index_heads=4, index_dim=32, tokens_per_block=32, top_k_blocks=2, sink_blocks=1,
            local_blocks=2,
            gdn_key_heads=2, gdn_value_heads=6, gdn_d_k=32, gdn_d_v=32, gdn_conv_kernel=4,
            num_experts=8, moe_top_k=2, expert_inter=64, shared_inter=64,
            hc_streams=4, sinkhorn_iters=20,
            ple_dim=32, ple_ngram_orders=(2, 3), ple_hash_heads=8, ple_ngram_rows=64,
            mtp_layers=1, max_draft_len=7,
        )

    # ------------------------------------------------------------------ validation

    def _violations(self) -> list[tuple[str, str]]:
        """Every broken rule as (field, message); the message starts with the field's name."""
        v: list[tuple[str, str]] = []

        def need(ok: bool, field: str, why: str) -> None:
            if not ok:
                v.append((field, f"{field}={getattr(self, field)!r}: {why}"))

        positive = ("hidden", "num_layers", "vocab_size", "num_q_heads", "num_kv_heads", "head_dim",
                    "index_heads", "index_dim", "gdn_key_heads", "gdn_value_heads", "gdn_d_k",
                    "gdn_d_v", "num_experts", "expert_inter", "shared_inter", "hc_streams",
                    "sinkhorn_iters", "ple_dim", "ple_hash_heads")
        for f in positive:
            need(getattr(self, f) > 0, f, "must be positive")
        if v:  # the rules below divide by these
            return v

        need(self.num_layers >= 4, "num_layers",
             "layer i is QSA iff (i+1) % 4 == 0, so at least 4 layers are needed for one QSA layer")
        need(self.hidden % NVFP4_BLOCK == 0, "hidden",
             f"must be a multiple of {NVFP4_BLOCK}: the routed experts quantize activations to nvfp4 "
             f"in blocks of {NVFP4_BLOCK} along hidden")
        need(0 <= self.pad_id < self.vocab_size, "pad_id", "must be a token id in 0..vocab_size-1")
        need(self.eps == 1e-6, "eps", "must be 1e-6: spec/ops/gdn.py and hc.py fix it")
        need(self.rope_theta > 0, "rope_theta", "must be positive")
        # QSA
        need(self.num_q_heads % self.num_kv_heads == 0, "num_q_heads",
             f"must be a multiple of num_kv_heads={self.num_kv_heads} (GQA groups)")
        need(self.rotary_dim > 0 and self.rotary_dim % 2 == 0, "rotary_dim",
             "must be positive and even (NeoX pairs dim j with j + rotary_dim/2)")
        need(self.rotary_dim <= self.head_dim, "rotary_dim",
             f"must not exceed head_dim={self.head_dim}")
        need(self.head_dim % NVFP4_BLOCK == 0, "head_dim",
             f"must be a multiple of {NVFP4_BLOCK} (nvfp4 KV blocks along head_dim)")
        need(self.tokens_per_block == 32, "tokens_per_block",
             "must be 32: the block (== page) size is fixed by docs/spec.md, \"Geometry\", and "
             "spec/ops/qsa.py")
        need(self.top_k_blocks >= 0, "top_k_blocks", "must be >= 0")
        need(self.sink_blocks >= 0, "sink_blocks", "must be >= 0")
        need(self.local_blocks >= 1, "local_blocks",
             "must be >= 1: the window holds the query's own block")
        # GDN
        need(self.gdn_value_heads % self.gdn_key_heads == 0, "gdn_value_heads",
             f"must be a multiple of gdn_key_heads={self.gdn_key_heads} (grouped value heads)")
        need(self.gdn_conv_kernel == 4, "gdn_conv_kernel", "must be 4: spec/ops/gdn.py fixes it")
        # MoE
        need(1 <= self.moe_top_k <= self.num_experts, "moe_top_k",
             f"must lie in 1..num_experts={self.num_experts}")
        need(self.expert_inter % NVFP4_BLOCK == 0, "expert_inter",
             f"must be a multiple of {NVFP4_BLOCK} (nvfp4 blocks along the down projection's input)")
        # PLE
        orders = self.ple_ngram_orders
        need(len(orders) > 0 and len(set(orders)) == len(orders) and all(o in (2, 3) for o in orders),
             "ple_ngram_orders", "must be distinct orders from {2, 3} (the history holds 2 ids)")
        heads = len(orders) * self.ple_hash_heads
        need((self.num_layers * self.ple_dim) % max(heads, 1) == 0, "ple_dim",
             f"num_layers * ple_dim must be a multiple of the {heads} hash heads "
             "(each head's row of G is L*P/heads wide)")
        need(heads > 0 and self.ple_ngram_rows < 2**31 and bool(largest_primes_below(
            self.ple_ngram_rows, heads)), "ple_ngram_rows",
             f"must leave {heads} distinct primes below it, and be below 2^31")
        # MTP
        need(self.mtp_layers in (0, 1), "mtp_layers", "must be 0 or 1 (one draft layer, reused)")
        need(1 <= self.max_draft_len <= 7, "max_draft_len", "must lie in 1..7 (docs/spec.md, \"Geometry\")")
        return v

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        broken = self._violations()
        if broken:
            raise ValidationError.from_exception_data(
                type(self).__name__,
                [InitErrorDetails(type=PydanticCustomError("model_rule", msg), loc=(field,),
                                  input=getattr(self, field)) for field, msg in broken])
        return self

    # ------------------------------------------------------------------ derived geometry

    def layer_kinds(self) -> list[LayerKind]:
        """'qsa' for layer i iff (i+1) % 4 == 0, else 'gdn'."""
        return ["qsa" if (i + 1) % 4 == 0 else "gdn" for i in range(self.num_layers)]

    @property
    def num_qsa_layers(self) -> int:
        return self.layer_kinds().count("qsa")

    @property
    def num_gdn_layers(self) -> int:
        return self.layer_kinds().count("gdn")

    @property
    def gdn_group(self) -> int:
        """Value heads per key head (the GVA ratio)."""
        return self.gdn_value_heads // self.gdn_key_heads

    @property
    def gdn_conv_channels(self) -> int:
        """Channels of the causal conv: [all q | all k | all v]."""
        return 2 * self.gdn_key_heads * self.gdn_d_k + self.gdn_value_heads * self.gdn_d_v

    @property
    def ple_num_heads(self) -> int:
        return len(self.ple_ngram_orders) * self.ple_hash_heads

    @property
    def ple_width(self) -> int:
        """L * P, the width of one token's per-layer embeddings."""
        return self.num_layers * self.ple_dim

    def ple_hash_primes(self) -> tuple[tuple[int, ...], ...]:
        """The hash heads' moduli per order: head k (in concatenation order) takes the k-th largest
        prime below ``ple_ngram_rows``."""
        flat = largest_primes_below(self.ple_ngram_rows, self.ple_num_heads)
        h = self.ple_hash_heads
        return tuple(flat[i * h:(i + 1) * h] for i in range(len(self.ple_ngram_orders)))

    @property
    def ple_table_rows(self) -> int:
        """Rows of the n-gram table G: the sum of the heads' primes."""
        return sum(sum(p) for p in self.ple_hash_primes())

    # ------------------------------------------------------------------ parameter count

    def _hc_site_params(self) -> int:
        n = self.hc_streams
        width = 2 * n + n * n
        return n * self.hidden * width + width

    def _gdn_params(self) -> int:
        C, hk, hv, dk, dv = (self.hidden, self.gdn_key_heads, self.gdn_value_heads, self.gdn_d_k,
                             self.gdn_d_v)
        return (C * (2 * hk * dk + 2 * hv * dv)      # in_proj_qkvz
                + C * 2 * hv                         # in_proj_ba
                + self.gdn_conv_channels * self.gdn_conv_kernel
                + 2 * hv                             # A_log, dt_bias
                + dv                                 # gated norm weight
                + hv * dv * C)                       # out_proj

    def _qsa_params(self) -> int:
        C, hq, hkv, d, hi, di = (self.hidden, self.num_q_heads, self.num_kv_heads, self.head_dim,
                                 self.index_heads, self.index_dim)
        return (2 * C * hq * d          # q, output gate
                + 2 * C * hkv * d       # k, v
                + 2 * d                 # q norm, k norm
                + C * hi * di           # index queries
                + C * di + di           # index key + its norm
                + C * hi                # index head weights
                + hq * d * C)           # out_proj

    def _moe_params(self) -> int:
        C, E = self.hidden, self.num_experts
        return (E * C                                   # router
                + E * 3 * self.expert_inter * C         # routed experts (logical elements)
                + 3 * self.shared_inter * C + C)        # shared expert + its gate

    def _layer_common_params(self) -> int:
        """Per decoder layer: two HC sites, the two pre-sublayer norms, the MoE."""
        return 2 * self._hc_site_params() + 2 * self.hidden + self._moe_params()

    def param_breakdown(self) -> dict[str, int]:
        """Parameter elements per component, computed from the shapes (no tensor is built)."""
        C, V, L, P = self.hidden, self.vocab_size, self.num_layers, self.ple_dim
        kinds = self.layer_kinds()
        out = {
            "embed": V * C,
            "lm_head": 0 if self.tie_embeddings else V * C,
            "final_norm": C,
            "gdn_mixers": kinds.count("gdn") * self._gdn_params(),
            "qsa_mixers": kinds.count("qsa") * self._qsa_params(),
            "moe": L * self._moe_params(),
            "hc_and_norms": L * (2 * self._hc_site_params() + 2 * C),
            "ple_tables": V * L * P + self.ple_table_rows * (L * P // self.ple_num_heads),
            "ple_projections": C * L * P + P + L * (2 * P * C + C),
            "mtp": self.mtp_layers * (2 * C + 2 * C * C + self._qsa_params()
                                      + self._layer_common_params()),
        }
        return out

    def param_count(self) -> int:
        """Total parameter elements (``param_breakdown`` summed)."""
        return sum(self.param_breakdown().values())

    def routed_expert_params(self) -> int:
        """Elements of all routed expert matrices (trunk and MTP), the NVFP4 part of the model."""
        return (self.num_layers + self.mtp_layers) * self.num_experts * 3 * self.expert_inter * self.hidden

    def active_param_count(self) -> int:
        """Parameters one token's forward reads: all of them except the routed experts, of which it
        reads top_k of num_experts per layer (the embedding / PLE tables count whole, as in
        ``param_count``, although a token gathers only its rows)."""
        routed = self.routed_expert_params()
        return self.param_count() - routed + routed * self.moe_top_k // self.num_experts

    # ------------------------------------------------------------------ cache footprint

    def kv_bytes_per_token_per_layer(self, kv_dtype: KvDtypeName) -> int:
        """K and V bytes one token occupies in one QSA layer (spec.ops.kv_storage.kv_bytes_per_token)."""
        return _kv_bytes_per_layer(self.num_kv_heads, self.head_dim, kv_dtype)

    def kv_bytes_per_token(self, kv_dtype: KvDtypeName, include_mtp: bool = False) -> int:
        """K and V bytes per token over all trunk QSA layers (plus the MTP layer if asked)."""
        layers = self.num_qsa_layers + (self.mtp_layers if include_mtp else 0)
        return layers * self.kv_bytes_per_token_per_layer(kv_dtype)

    def qsa_side_plane_bytes_per_token(self) -> float:
        """Index key (bf16) + position (int32) + the token's share of its block key (bf16 / 32), per
        token and QSA layer."""
        return self.index_dim * _BF16 + _INT32 + self.index_dim * _BF16 / self.tokens_per_block

    def gdn_state_bytes_per_slot(self, state_dtype: StateDtypeName = "fp32") -> int:
        """Recurrent GDN state of one request over all GDN layers: HV x d_k x d_v x bytes x layers.

        Target, fp32: 48 x 128 x 128 x 4 B x 36 = 113,246,208 B (113 MB, docs/spec.md); bf16: half.
        """
        if state_dtype not in _STATE_BYTES:
            raise ValueError(f"state_dtype must be 'fp32' or 'bf16', got {state_dtype!r}")
        return (self.gdn_value_heads * self.gdn_d_k * self.gdn_d_v * _STATE_BYTES[state_dtype]
                * self.num_gdn_layers)

    def conv_state_bytes_per_slot(self, bytes_per_element: int = _BF16) -> int:
        """The conv windows of one request over all GDN layers: channels x (kernel - 1) x bytes x layers
        (the window holds activations: bf16 in deployment)."""
        return (self.gdn_conv_channels * (self.gdn_conv_kernel - 1) * bytes_per_element
                * self.num_gdn_layers)


def format_count(n: float) -> str:
    """A count in the nearest of K / M / B, three significant digits."""
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.3g}{suffix}"
    return f"{n:g}"


__all__ = ["ModelConfig", "LayerKind", "KvDtypeName", "StateDtypeName", "largest_primes_below",
           "format_count"]
