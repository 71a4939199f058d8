"""The reference forward of the whole Flash-Next model: trunk, LM head and the MTP draft layer.

One readable file that composes the spec ops (spec/ops/*) exactly as docs/spec.md assembles them. It
runs the ``tiny`` config on the CPU in seconds (fp32 by default, float64 for the reference) and the ``target``
config on meta tensors (shapes only).

Following one token through ``forward``
---------------------------------------
A token id ``x`` of sequence s arrives at position ``t = cache.lengths[s] + i`` (its index i in this
step's chunk of s).

1. Embedding: ``x_emb = embed[x]`` [C]. PLE: ``e = ple_embed(...)`` [L, P] from the id, the request's
   n-gram history (the 2 ids before it) and ``x_emb``. The HC streams start as n copies of ``x_emb``:
   X [n, C], kept in the accumulation dtype (fp32; float64 in reference mode).
2. For each layer l (``cfg.layer_kinds()``: QSA iff (l+1) % 4 == 0, else GDN), two HC sites:
   a. mixer site: H_pre, H_post, H_res from X (``hc_inject_norm`` + ``hc_first_projection``);
      ``u = rmsnorm(hc_pre(X))``; ``y = mixer(u)``; PLE: ``y = ple_apply(y, e[l])``;
      ``X = hc_up_projection(X, y)``.
      - GDN mixer: in_proj_qkvz / in_proj_ba (grouped per key head), causal conv over [q | k | v]
        (conv state = the last 3 inputs), gated delta rule from the state, gated RMSNorm, out_proj.
      - QSA mixer: q, gate, k, v, index q / key / weights; QK norm + RoPE at position t; k, v go to
        the paged KV cache and kI to the index plane (a completed block gets its block key); index
        scores over complete blocks, canonical top-k + window, expansion to tokens <= t, gated sparse
        GQA, out_proj.
   b. MoE site: the same four HC steps around ``moe(rmsnorm(hc_pre(X)))``.
3. Read-out: ``m = mean of the streams`` (returned by the last up projection), ``rmsnorm(m)``, LM head;
   in bf16 the logits go through ``logits_cast``.

``mtp_draft`` takes ``h_prev`` (the trunk's m at row t, or the previous draft step's m) and
``next_token`` (the token at t+1), builds ``h' = fc(cat[rmsnorm(embed(next)), rmsnorm(h_prev)])``
(``mtp_draft_input``), starts n streams at h', runs one decoder layer (QSA + MoE, with HC, no PLE) with
its own KV cache, and reads out through the shared final norm and LM head.

Decisions left to the spec by docs/spec.md (pinned in tests/spec/test_model.py)
-------------------------------------------------------------------------------
- Activation dtype = the weights' dtype: fp32 weights give an fp32 model (no bf16 rounding point),
  bf16 weights the deployment numerics (bf16 activations, fp32 accumulation), float64 the reference
  (every activation rounding point an identity; the nvfp4 quantisers of the experts still round).
  Small fp32 parameters stay fp32 in bf16 mode: A_log, dt_bias, the HC projections and biases.
- Every dense projection is ``rowwise_matmul`` in the accumulation dtype with its output rounded to
  the activation dtype (the stored GEMM output). Projections are separate matrices (no fused qkv):
  q, output gate, k, v, index queries qI [HI*DI], index key kI [DI] (then rmsnorm with its own
  zero-centred weight), index head weights wI [HI] (the raw projection, no scaling).
- PLE sits inside the mixer's HC site, as part of its sublayer: ``y = ple_apply(mixer(u), e_l)``, so
  H_post gates it like the mixer output; the streams start at the embedding alone, PLE enters in each
  layer (docs/spec.md, "PLE with hashed n-grams" and "Hyper-connections").
- The MTP draft layer has no PLE (the table is per trunk layer), its own rmsnorms before its two HC
  sites, its own index (no IndexShare: the reuse of docs/spec.md, "QSA" item 7 is an optimisation this
  reference does not take), and streams that start as n copies of h'. Its output hidden (for the next
  draft step) is its stream mean m before the final norm, and the trunk's ``h_prev`` is likewise the
  trunk's m (pre-norm). A draft row pairing (h_t, x_{t+1}) sits at position t of the draft layer's
  own cache (DeepSeek-V3 / vLLM convention); ``cache.mtp_lengths`` counts the rows the draft layer has
  stored.
- logits: fp32 and float64 models return the LM-head output unrounded; a bf16 model returns
  ``logits_cast`` of the bf16 LM-head output (fp32).
- Stored planes: KV pools in ``kv_dtype`` ('bf16', 'fp8', 'nvfp4'; None = the activation dtype, no
  storage rounding); in float64 mode 'bf16' storage is an activation rounding point and so stored as
  float64, while fp8 / nvfp4 always quantise. Index keys and block keys are stored in the activation
  dtype (bf16 in deployment, as docs/spec.md states). nvfp4 KV global scales are per layer and K / V, part
  of the weights (``QSAWeights.k_gs`` / ``v_gs``).
- GDN state storage ``state_dtype`` (fp32 or bf16; float64 in reference mode). The GDN path is chosen
  per sequence, never per step, so a sequence's result does not depend on what the others bring: a
  sequence with one new token runs the decode ops (``causal_conv1d_update``, ``gdn_decode`` over the
  state pool, batched over every such sequence); a sequence with more runs ``causal_conv1d`` and
  ``gdn_prefill``. gdn_prefill takes an fp32 state, so a bf16 state is widened, and the final state is
  rounded to bf16 once when stored (the decode op rounds after every row instead). A verify step
  (``forward(..., verify=True)``, the K+1 rows of MTP verification) runs ``causal_conv1d`` and
  ``gdn_verify`` instead: the state is stored after every row in its storage dtype, exactly as K+1
  decode steps store it, so verification and plain decoding compute the same rows.
- Host-side bookkeeping lives on the CPU whatever the model's device: block tables, lengths, the
  position plane and the block-key valid flags (qsa.py reads the flags with Python ``bool``), and the PLE
  histories. Token ids are given on the CPU.
- Pages: sequence s's logical block b lives at page ``P - 1 - (b * B + s)`` (P pages, B sequences):
  interleaved and descending, so no page index equals a block index by accident.
- Batch composition: the model calls each op once for all rows of a step (the shapes an engine and the
  reach tracer see), except where the op is per request (PLE embedding, GDN prefill). Every op is
  row-wise (``rowwise_matmul``, per-row or per-request loops), so a sequence's logits do not depend on
  the batch around it, bit for bit (test_batch_composition_is_bitwise).

Meta tensors (device='meta')
----------------------------
Shapes flow through the same code. Two places need values and get a shape-only branch, marked
``# meta:``: the canonical block selection (``qsa_select`` reads scores as Python floats; the stand-in
selects the window plus the lowest candidate blocks, the same count per row as the real selection), and
the routed experts (``moe_experts`` checks ids and the nvfp4 dequantiser checks its global scale with
Python branches; the stand-in runs the same GEMM shapes on empty dense weights). Quantised KV
storage (fp8 / nvfp4) on meta stores and loads empty tensors of the pool's shape and dtype.
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from spec.config import ModelConfig
from spec.numerics import acc_dtype, is_reference_mode, out_cast
from spec.ops.gdn import causal_conv1d, causal_conv1d_update, gdn_decode, gdn_prefill, gdn_verify
from spec.ops.hc import hc_first_projection, hc_inject_norm, hc_pre, hc_up_projection
from spec.ops.kv_storage import (
    FP8_DTYPE,
    NVFP4_BLOCK,
    fp8_dequantize,
    fp8_quantize,
    nvfp4_dequantize,
    nvfp4_global_scale,
    nvfp4_quantize,
)
from spec.ops.moe import NvFp4Experts, NvFp4Weight, SharedExpert, moe, moe_route, moe_shared_expert
from spec.numerics import rowwise_matmul
from spec.ops.mtp import greedy_argmax, logits_cast, mtp_draft_input
from spec.ops.norms import rmsnorm
from spec.ops.ple import NgramHashConfig, ple_apply, ple_embed, ple_history_advance
from spec.ops.qsa import (
    TOKENS_PER_BLOCK,
    QsaPlanes,
    num_complete_blocks,
    qsa_expand,
    qsa_index_scores,
    qsa_index_store,
    qsa_kv_append,
    qsa_select,
    qsa_sparse_gqa,
    selection_width,
    window_blocks,
)
from spec.ops.rope import qk_norm_rope

KV_GLOBAL_AMAX = 16.0   # the magnitude the default nvfp4 global scales (KV, expert inputs) cover
CPU = torch.device("cpu")


# ===================================================================================================
# Weights
# ===================================================================================================

@dataclass
class HCSiteWeights:
    """One HC site: phi [n*C, 2n + n^2], bias [2n + n^2] (fp32, float64 in reference mode)."""

    phi: torch.Tensor
    bias: torch.Tensor


@dataclass
class GDNWeights:
    """A GDN mixer (Qwen3-Next layout, grouped per key head).

    in_proj_qkvz [HK*(2 d_k + 2 r d_v), C] (per key head: q d_k | k d_k | v r*d_v | z r*d_v);
    in_proj_ba [HK*2r, C] (per key head: b r | a r); conv_w [2 HK d_k + HV d_v, 4]; A_log, dt_bias
    [HV] (fp32); norm_w [d_v] (plain weight); out_proj [C, HV d_v]. r = HV / HK.
    """

    in_proj_qkvz: torch.Tensor
    in_proj_ba: torch.Tensor
    conv_w: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    norm_w: torch.Tensor
    out_proj: torch.Tensor


@dataclass
class QSAWeights:
    """A QSA mixer: w_q, w_gate [Hq*D, C]; w_k, w_v [Hkv*D, C]; q_norm, k_norm [D]; w_qI [HI*DI, C];
    w_kI [DI, C]; kI_norm [DI]; w_wI [HI, C]; w_o [C, Hq*D]; k_gs, v_gs: the nvfp4 KV global scales
    (fp32 [], used only with nvfp4 KV storage)."""

    w_q: torch.Tensor
    w_gate: torch.Tensor
    w_k: torch.Tensor
    w_v: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    w_qI: torch.Tensor
    w_kI: torch.Tensor
    kI_norm: torch.Tensor
    w_wI: torch.Tensor
    w_o: torch.Tensor
    k_gs: torch.Tensor
    v_gs: torch.Tensor


@dataclass
class MoEWeights:
    """router [E, C]; routed experts (NVFP4, spec.ops.moe.NvFp4Experts); the shared expert."""

    router: torch.Tensor
    experts: NvFp4Experts
    shared: SharedExpert


@dataclass
class PLELayerWeights:
    """Layer l's PLE update: w_gate [P, C], w_out [C, P], norm_w [C]."""

    w_gate: torch.Tensor
    w_out: torch.Tensor
    norm_w: torch.Tensor


@dataclass
class LayerWeights:
    """One decoder layer: the mixer (GDN or QSA) and the MoE, each in an HC site with its rmsnorm."""

    kind: str
    norm_mixer: torch.Tensor
    hc_mixer: HCSiteWeights
    mixer: GDNWeights | QSAWeights
    norm_moe: torch.Tensor
    hc_moe: HCSiteWeights
    moe: MoEWeights
    ple: PLELayerWeights | None


@dataclass
class PLEWeights:
    """table E [V, L*P]; ngram_table G [rows, L*P/heads]; w_ple [C, L*P]; norm_w [P]; hash constants."""

    table: torch.Tensor
    ngram_table: torch.Tensor
    w_ple: torch.Tensor
    norm_w: torch.Tensor
    hash_cfg: NgramHashConfig


@dataclass
class MTPWeights:
    """The draft layer: norm_emb, norm_h [C]; fc [C, 2C]; one QSA decoder layer (no PLE)."""

    norm_emb: torch.Tensor
    norm_h: torch.Tensor
    fc: torch.Tensor
    layer: LayerWeights


@dataclass
class Weights:
    """All weights of the model. embed [V, C]; lm_head [V, C] (the embedding itself when tied);
    final_norm [C]; one LayerWeights per layer; PLE; the MTP draft layer (None when mtp_layers = 0)."""

    embed: torch.Tensor
    layers: list[LayerWeights]
    ple: PLEWeights
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    mtp: MTPWeights | None

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype of the model (the dtype of its dense weights)."""
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device


class _Draw:
    """Seeded draws: in float64 on the CPU from one generator (so fp32 and float64 weights of one
    seed are the same model), empty tensors on meta, or, on another device, fp32 draws from that
    device's own generator (another model than the CPU's for the same seed: a benchmark's weights at
    the target's size, drawn where they are used)."""

    def __init__(self, seed: int, device: torch.device):
        self.meta = device.type == "meta"
        self.on_host = device.type == "cpu"
        self.gen = torch.Generator(device if not (self.meta or self.on_host) else "cpu")
        self.gen.manual_seed(seed)
        self.device = device

    def _randn(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.on_host:
            return torch.randn(shape, generator=self.gen, dtype=torch.float64)
        return torch.randn(shape, generator=self.gen, dtype=torch.float32, device=self.device)

    def normal(self, shape: tuple[int, ...], std: float, dtype: torch.dtype, mean: float = 0.0
               ) -> torch.Tensor:
        if self.meta:
            return torch.empty(shape, dtype=dtype, device=self.device)
        x = self._randn(shape) * std + mean
        return x.to(dtype=dtype, device=self.device)

    def uniform(self, shape: tuple[int, ...], lo: float, hi: float) -> torch.Tensor:
        """float64 draws in [lo, hi) (callers transform and cast); zeros on meta."""
        if self.meta:
            return torch.zeros(shape, dtype=torch.float64, device=self.device)
        dev = None if self.on_host else self.device
        return torch.rand(shape, generator=self.gen, dtype=torch.float64, device=dev) * (hi - lo) + lo

    def nvfp4(self, shape: tuple[int, int, int], std: float) -> NvFp4Weight:
        """A stack of NVFP4 matrices [E, out, in], quantised from fp32 draws (the same codes for any
        model dtype); empty containers of the right shapes on meta. On the CPU each matrix has its
        own global scale; on another device the stack shares one (a single quantizer call)."""
        e, out, inp = shape
        if self.meta:
            return NvFp4Weight(torch.empty(e, out, inp // 2, dtype=torch.uint8, device=self.device),
                               torch.empty(e, out, inp // NVFP4_BLOCK, dtype=FP8_DTYPE,
                                           device=self.device),
                               torch.empty(e, dtype=torch.float32, device=self.device))
        dense = (self._randn(shape) * std).to(torch.float32)
        if self.on_host:
            return NvFp4Weight.from_dense(dense)
        gs = nvfp4_global_scale(dense.abs().max().double())
        packed, sf = nvfp4_quantize(dense, gs)
        del dense
        return NvFp4Weight(packed, sf, gs.reshape(1).expand(e).contiguous())

    def scalar_fp32(self, value: float | torch.Tensor) -> torch.Tensor:
        if self.meta:
            return torch.empty((), dtype=torch.float32, device=self.device)
        return torch.as_tensor(value, dtype=torch.float32, device=self.device)


def init_weights(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> Weights:
    """Seeded random weights of the model at ``cfg`` (dense weights in ``dtype``).

    device 'cpu' draws values; device 'meta' builds every tensor with its shape and dtype only; another
    device (cuda) draws there, from its own generator in fp32 (``_Draw``: another model than the CPU's
    for one seed, for benchmarks at the target's size). Scales:
    projections N(0, 1/fan_in); embedding N(0, 1); zero-centred rmsnorm weights N(0, 0.1^2) (docs/spec.md
    initialises them to 0; small noise makes a dropped or swapped weight visible); gated-norm weight
    1 + N(0, 0.1^2); A_log = log U(1, 16); dt_bias = softplus^-1 of a log-uniform dt in [1e-3, 0.1];
    HC: phi N(0, 0.25/(n*C)), biases small noise with 2 on the diagonal of l_res; NVFP4 experts quantised
    from fp32 draws with per-matrix global scales (``NvFp4Weight.from_dense``); expert-input and KV
    global scales cover |x| <= 16 (``nvfp4_global_scale(16)``). The n-gram hash multipliers are odd
    64-bit numbers drawn from ``seed``; the primes come from the config.
    """
    device = torch.device(device)
    d = _Draw(seed, device)
    small = torch.float64 if dtype == torch.float64 else torch.float32  # the fp32 parameters
    C, V, L, P, n = cfg.hidden, cfg.vocab_size, cfg.num_layers, cfg.ple_dim, cfg.hc_streams

    def lin(out: int, inp: int) -> torch.Tensor:
        return d.normal((out, inp), 1.0 / math.sqrt(inp), dtype)

    def znorm(dim: int) -> torch.Tensor:
        return d.normal((dim,), 0.1, dtype)

    def hc_site() -> HCSiteWeights:
        width = 2 * n + n * n
        phi = d.normal((n * C, width), 0.5 / math.sqrt(n * C), small)
        bias = d.normal((width,), 0.1, torch.float64)
        if not d.meta:
            bias[2 * n:] += 2.0 * torch.eye(n, dtype=torch.float64, device=bias.device).flatten()
        return HCSiteWeights(phi, bias.to(small))

    def gdn() -> GDNWeights:
        hk, hv, dk, dv, r = (cfg.gdn_key_heads, cfg.gdn_value_heads, cfg.gdn_d_k, cfg.gdn_d_v,
                             cfg.gdn_group)
        a_log = torch.log(d.uniform((hv,), 1.0, 16.0)).to(small)
        dt = torch.exp(d.uniform((hv,), math.log(1e-3), math.log(0.1)))
        dt_bias = (dt + torch.log(-torch.expm1(-dt))).to(small)  # softplus^-1(dt)
        return GDNWeights(
            in_proj_qkvz=lin(hk * (2 * dk + 2 * r * dv), C),
            in_proj_ba=lin(hk * 2 * r, C),
            conv_w=d.normal((cfg.gdn_conv_channels, cfg.gdn_conv_kernel), 0.5, dtype),
            A_log=a_log, dt_bias=dt_bias,
            norm_w=d.normal((dv,), 0.1, dtype, mean=1.0),
            out_proj=lin(C, hv * dv))

    def qsa() -> QSAWeights:
        hq, hkv, dh, hi, di = (cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, cfg.index_heads,
                               cfg.index_dim)
        gs = d.scalar_fp32(nvfp4_global_scale(KV_GLOBAL_AMAX)) if not d.meta else d.scalar_fp32(0.0)
        return QSAWeights(
            w_q=lin(hq * dh, C), w_gate=lin(hq * dh, C), w_k=lin(hkv * dh, C), w_v=lin(hkv * dh, C),
            q_norm=znorm(dh), k_norm=znorm(dh),
            w_qI=lin(hi * di, C), w_kI=lin(di, C), kI_norm=znorm(di), w_wI=lin(hi, C),
            w_o=lin(C, hq * dh), k_gs=gs, v_gs=gs.clone())

    def moe_weights() -> MoEWeights:
        E, I, Is = cfg.num_experts, cfg.expert_inter, cfg.shared_inter
        router = lin(E, C)
        gs = nvfp4_global_scale(KV_GLOBAL_AMAX) if not d.meta else 0.0
        experts = NvFp4Experts(gate=d.nvfp4((E, I, C), 1 / math.sqrt(C)),
                               up=d.nvfp4((E, I, C), 1 / math.sqrt(C)),
                               down=d.nvfp4((E, C, I), 1 / math.sqrt(I)),
                               x_gs=d.scalar_fp32(gs), h_gs=d.scalar_fp32(gs))
        shared = SharedExpert(w_gate=lin(Is, C), w_up=lin(Is, C), w_down=lin(C, Is),
                              w_sg=d.normal((C,), 1 / math.sqrt(C), dtype))
        return MoEWeights(router, experts, shared)

    def layer(kind: str, with_ple: bool) -> LayerWeights:
        norm_mixer, hc_mixer = znorm(C), hc_site()
        mixer = gdn() if kind == "gdn" else qsa()
        norm_moe, hc_moe = znorm(C), hc_site()
        moe_w = moe_weights()
        ple = (PLELayerWeights(w_gate=lin(P, C), w_out=lin(C, P), norm_w=znorm(C))
               if with_ple else None)
        return LayerWeights(kind, norm_mixer, hc_mixer, mixer, norm_moe, hc_moe, moe_w, ple)

    embed = d.normal((V, C), 1.0, dtype)
    layers = [layer(kind, with_ple=True) for kind in cfg.layer_kinds()]
    rnd = random.Random(seed)
    hash_cfg = NgramHashConfig(
        multipliers=tuple(tuple(tuple(rnd.getrandbits(64) | 1 for _ in range(order))
                                for _ in range(cfg.ple_hash_heads))
                          for order in cfg.ple_ngram_orders),
        primes=cfg.ple_hash_primes(), pad_id=cfg.pad_id, orders=tuple(cfg.ple_ngram_orders))
    ple = PLEWeights(table=d.normal((V, L * P), 1 / math.sqrt(P), dtype),
                     ngram_table=d.normal((cfg.ple_table_rows, L * P // cfg.ple_num_heads), 1.0, dtype),
                     w_ple=d.normal((C, L * P), 1.0, dtype), norm_w=znorm(P), hash_cfg=hash_cfg)
    final_norm = znorm(C)
    lm_head = embed if cfg.tie_embeddings else lin(V, C)
    mtp = None
    if cfg.mtp_layers:
        mtp = MTPWeights(norm_emb=znorm(C), norm_h=znorm(C), fc=lin(C, 2 * C),
                         layer=layer("qsa", with_ple=False))
    return Weights(embed, layers, ple, final_norm, lm_head, mtp)


def weight_elements(weights: Weights) -> int:
    """Parameter elements held by ``weights``, counted the way ``ModelConfig.param_count`` counts them:
    an NVFP4 matrix counts out*in (not its scales), KV and expert-input global scales are not counted,
    a tied LM head is counted once, the hash constants are not tensors."""
    seen: set[int] = set()

    def walk(obj) -> int:
        if isinstance(obj, torch.Tensor):
            if id(obj) in seen:
                return 0
            seen.add(id(obj))
            return obj.numel()
        if isinstance(obj, NvFp4Weight):
            return obj.packed.numel() * 2
        if isinstance(obj, NvFp4Experts):
            return sum(walk(getattr(obj, f)) for f in ("gate", "up", "down"))
        if isinstance(obj, QSAWeights):
            return sum(walk(getattr(obj, f.name)) for f in fields(obj) if f.name not in ("k_gs", "v_gs"))
        if isinstance(obj, list):
            return sum(walk(o) for o in obj)
        if is_dataclass(obj):
            return sum(walk(getattr(obj, f.name)) for f in fields(obj))
        return 0

    return walk(weights)


# ===================================================================================================
# Caches
# ===================================================================================================

@dataclass
class GDNLayerCache:
    """state [B, HV, d_k, d_v] (storage dtype); conv [B, conv channels, 3] (activation dtype)."""

    state: torch.Tensor
    conv: torch.Tensor


@dataclass
class QSALayerCache:
    """The planes of one QSA layer (spec.ops.qsa.QsaPlanes; k_cache / v_cache may be tuples of pools)."""

    planes: QsaPlanes


@dataclass
class ModelCache:
    """Every piece of per-request state of one batch of B sequences.

    block_table int32 [B, pages per sequence] (CPU; one table for all QSA layers and the draft layer:
    the same page index addresses every layer's pool); lengths: tokens the trunk has stored per
    sequence; layers: one GDNLayerCache or QSALayerCache per layer; ple_history int64 [B, 2] (CPU, the
    last 2 ids, oldest first); mtp: the draft layer's planes; mtp_lengths: rows the draft layer stored.
    ``forward`` and ``mtp_draft`` update the cache in place (its fields are reassigned).
    """

    max_len: int
    dtype: torch.dtype
    kv_dtype: str | None
    device: torch.device
    block_table: torch.Tensor
    lengths: list[int]
    layers: list[GDNLayerCache | QSALayerCache]
    ple_history: torch.Tensor
    mtp: QSALayerCache | None
    mtp_lengths: list[int] = field(default_factory=list)

    @property
    def batch(self) -> int:
        return self.block_table.shape[0]

    def clone(self) -> ModelCache:
        """An independent copy (tensors copied)."""
        return copy.deepcopy(self)


def _empty_qsa_planes(cfg: ModelConfig, num_pages: int, dtype: torch.dtype, kv_dtype: str | None,
                      device: torch.device) -> QsaPlanes:
    """Empty planes of one QSA layer: floating slots NaN (an unwritten read poisons), positions -1,
    no valid block key. The position plane and the valid flags are host-side (CPU)."""
    tpb, nkv, dh, di = TOKENS_PER_BLOCK, cfg.num_kv_heads, cfg.head_dim, cfg.index_dim
    nan = float("nan")

    def pool(width: int, pool_dtype: torch.dtype) -> torch.Tensor:
        if pool_dtype == torch.uint8:
            return torch.zeros(num_pages, tpb, nkv, width, dtype=torch.uint8, device=device)
        return torch.full((num_pages, tpb, nkv, width), nan, dtype=torch.float32,
                          device=device).to(pool_dtype)

    if kv_dtype == "nvfp4":
        def kv():
            return (pool(dh // 2, torch.uint8), pool(dh // NVFP4_BLOCK, FP8_DTYPE))
    else:
        store = _kv_pool_dtype(kv_dtype, dtype)

        def kv():
            return pool(dh, store)
    return QsaPlanes(
        k_cache=kv(), v_cache=kv(),
        pos_plane=torch.full((num_pages, tpb), -1, dtype=torch.int32),
        index_plane=torch.full((num_pages, tpb, di), nan, dtype=dtype, device=device),
        block_keys=torch.full((num_pages, di), nan, dtype=dtype, device=device),
        block_key_valid=torch.zeros(num_pages, dtype=torch.bool))


def _kv_pool_dtype(kv_dtype: str | None, act: torch.dtype) -> torch.dtype:
    if kv_dtype is None or (kv_dtype == "bf16" and act == torch.float64):
        return act
    if kv_dtype == "bf16":
        return torch.bfloat16
    if kv_dtype == "fp8":
        return FP8_DTYPE
    raise ValueError(f"kv_dtype must be None, 'bf16', 'fp8' or 'nvfp4', got {kv_dtype!r}")


def new_cache(cfg: ModelConfig, batch: int, max_len: int, *, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu", kv_dtype: str | None = None,
              state_dtype: torch.dtype = torch.float32) -> ModelCache:
    """An empty cache for ``batch`` sequences of at most ``max_len`` tokens each.

    dtype: the model's activation dtype (``weights.dtype``); kv_dtype: None (the activation dtype),
    'bf16', 'fp8' or 'nvfp4'; state_dtype: GDN state storage, fp32 or bf16 (float64 in float64 mode).
    """
    device = torch.device(device)
    if batch < 1 or max_len < 1:
        raise ValueError("batch and max_len must be >= 1")
    if kv_dtype not in (None, "bf16", "fp8", "nvfp4"):
        raise ValueError(f"kv_dtype must be None, 'bf16', 'fp8' or 'nvfp4', got {kv_dtype!r}")
    if state_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"state_dtype must be float32 or bfloat16, got {state_dtype}")
    state_dtype = torch.float64 if dtype == torch.float64 else state_dtype
    pages_per_seq = -(-max_len // TOKENS_PER_BLOCK)
    num_pages = batch * pages_per_seq
    blocks = torch.arange(pages_per_seq)[None, :]
    seqs = torch.arange(batch)[:, None]
    block_table = (num_pages - 1 - (blocks * batch + seqs)).to(torch.int32)

    layers: list[GDNLayerCache | QSALayerCache] = []
    for kind in cfg.layer_kinds():
        if kind == "gdn":
            layers.append(GDNLayerCache(
                state=torch.zeros(batch, cfg.gdn_value_heads, cfg.gdn_d_k, cfg.gdn_d_v,
                                  dtype=state_dtype, device=device),
                conv=torch.zeros(batch, cfg.gdn_conv_channels, cfg.gdn_conv_kernel - 1, dtype=dtype,
                                 device=device)))
        else:
            layers.append(QSALayerCache(_empty_qsa_planes(cfg, num_pages, dtype, kv_dtype, device)))
    mtp = (QSALayerCache(_empty_qsa_planes(cfg, num_pages, dtype, kv_dtype, device))
           if cfg.mtp_layers else None)
    return ModelCache(max_len=max_len, dtype=dtype, kv_dtype=kv_dtype, device=device,
                      block_table=block_table, lengths=[0] * batch, layers=layers,
                      ple_history=torch.full((batch, 2), cfg.pad_id, dtype=torch.int64), mtp=mtp,
                      mtp_lengths=[0] * batch)


# ===================================================================================================
# One step's bookkeeping
# ===================================================================================================

@dataclass
class _Step:
    """Host-side description of one step's rows (all CPU int64 [N]): which sequence each row belongs
    to, its absolute position, and its sequence's length after the step; ``spans`` lists
    (sequence, first row, end row) of the sequences with tokens in this step."""

    seq_ids: torch.Tensor
    positions: torch.Tensor
    context_lens: torch.Tensor
    spans: list[tuple[int, int, int]]
    verify: bool = False

    @property
    def rows(self) -> int:
        return self.seq_ids.shape[0]

    def gdn_groups(self) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]],
                                  list[tuple[int, int, int]]]:
        """The spans split by GDN path: (decode: one row, verify: a verify step's rows, prefill: the
        rest). The choice is per sequence, so it never depends on the other sequences of the step."""
        if self.verify:
            return [], list(self.spans), []
        decode = [sp for sp in self.spans if sp[2] - sp[1] == 1]
        prefill = [sp for sp in self.spans if sp[2] - sp[1] > 1]
        return decode, [], prefill


def _plan(counts: list[int], start: list[int], max_len: int, verify: bool = False) -> _Step:
    seq_ids, positions, ctx, spans, row = [], [], [], [], 0
    for s, (t, l0) in enumerate(zip(counts, start)):
        if t == 0:
            continue
        if l0 + t > max_len:
            raise ValueError(f"sequence {s}: {l0} + {t} tokens exceed the cache's max_len {max_len}")
        seq_ids += [s] * t
        positions += list(range(l0, l0 + t))
        ctx += [l0 + t] * t
        spans.append((s, row, row + t))
        row += t
    as_long = lambda v: torch.tensor(v, dtype=torch.int64, device=CPU)  # noqa: E731
    if verify and len({hi - lo for _, lo, hi in spans}) > 1:
        raise ValueError("a verify step brings the same number of rows (K + 1) for every sequence")
    return _Step(as_long(seq_ids), as_long(positions), as_long(ctx), spans, verify)


def _as_rows(x: torch.Tensor | Sequence[torch.Tensor], batch: int, what: str
             ) -> tuple[list[torch.Tensor], bool]:
    """Per-sequence tensors from a [B, T, ...] tensor or a list of B tensors [T_s, ...]."""
    if isinstance(x, torch.Tensor):
        parts, stacked = list(x.unbind(0)), True
    else:
        parts, stacked = list(x), False
    if len(parts) != batch:
        raise ValueError(f"{what}: {len(parts)} sequences for a cache of batch {batch}")
    return parts, stacked


def _split_rows(x: torch.Tensor, step: _Step, batch: int, stacked: bool):
    """Packed rows [N, ...] -> the caller's form: [B, T, ...] or a list of B tensors [T_s, ...]."""
    out = [x[:0] for _ in range(batch)]
    for s, lo, hi in step.spans:
        out[s] = x[lo:hi]
    return torch.stack(out) if stacked else out


# ===================================================================================================
# Building blocks
# ===================================================================================================

def _linear(x: torch.Tensor, w: torch.Tensor, act: torch.dtype) -> torch.Tensor:
    """``x @ w.T`` row by row in the accumulation dtype, rounded to the activation dtype once."""
    acc = acc_dtype(x, w)
    return out_cast(rowwise_matmul(x.to(acc), w.to(acc).T), act, is_reference_mode(x, w))


def _hc_site(X: torch.Tensor, site: HCSiteWeights, norm_w: torch.Tensor,
             sublayer: Callable[[torch.Tensor], torch.Tensor], cfg: ModelConfig, act: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """One HC site (docs/spec.md, "Hyper-connections" steps 1-4) around ``sublayer``: returns (new
    streams, their mean)."""
    v, r = hc_inject_norm(X, cfg.eps)
    coef = hc_first_projection(v, r, site.phi, site.bias, cfg.hc_streams, cfg.sinkhorn_iters)
    x_in = hc_pre(X, coef.h_pre, act)
    y = sublayer(rmsnorm(x_in, norm_w, cfg.eps))
    return hc_up_projection(X, y, coef.h_res, coef.h_post)


def _gdn_mixer(u: torch.Tensor, w: GDNWeights, lc: GDNLayerCache, cfg: ModelConfig, step: _Step,
               act: torch.dtype) -> torch.Tensor:
    """The GDN mixer on rows u [N, C]; updates the layer's state and conv window in ``lc``."""
    N = u.shape[0]
    hk, hv, dk, dv, r = cfg.gdn_key_heads, cfg.gdn_value_heads, cfg.gdn_d_k, cfg.gdn_d_v, cfg.gdn_group
    qkvz = _linear(u, w.in_proj_qkvz, act).view(N, hk, 2 * dk + 2 * r * dv)
    ba = _linear(u, w.in_proj_ba, act).view(N, hk, 2 * r)
    # Per key head [q | k | v (r heads) | z (r heads)] and [b (r) | a (r)]; value head = kh * r + j.
    z = qkvz[..., 2 * dk + r * dv:].reshape(N, hv, dv)
    b = ba[..., :r].reshape(N, hv)
    a = ba[..., r:].reshape(N, hv)
    mixed = torch.cat([qkvz[..., :dk].reshape(N, hk * dk), qkvz[..., dk:2 * dk].reshape(N, hk * dk),
                       qkvz[..., 2 * dk:2 * dk + r * dv].reshape(N, hv * dv)], dim=-1)

    def split(y: torch.Tensor):  # conv output [M, channels] -> q, k [M, HK, d_k], v [M, HV, d_v]
        M = y.shape[0]
        return (y[:, :hk * dk].view(M, hk, dk), y[:, hk * dk:2 * hk * dk].view(M, hk, dk),
                y[:, 2 * hk * dk:].view(M, hv, dv))

    out = torch.empty(N, hv, dv, dtype=act, device=u.device)
    decode, verify, prefill = step.gdn_groups()
    if decode:
        rows = torch.tensor([lo for _, lo, _ in decode], dtype=torch.int64, device=u.device)
        slots = torch.tensor([s for s, _, _ in decode], dtype=torch.int64, device=CPU)
        y, conv = causal_conv1d_update(mixed[rows], w.conv_w, lc.conv[slots])
        lc.conv = lc.conv.clone()
        lc.conv[slots] = conv
        q, k, v = split(y)
        res = gdn_decode(q, k, v, a[rows], b[rows], w.A_log, w.dt_bias, z[rows], w.norm_w, lc.state,
                         slots)
        lc.state = res["state_pool"].to(lc.state.dtype)
        out[rows] = res["out"]
    if verify:
        T = verify[0][2] - verify[0][1]
        slots = torch.tensor([s for s, _, _ in verify], dtype=torch.int64, device=CPU)
        rows = torch.cat([torch.arange(lo, hi) for _, lo, hi in verify]).to(u.device)
        y, conv = causal_conv1d(mixed[rows].view(len(verify), T, -1), w.conv_w, lc.conv[slots])
        lc.conv = lc.conv.clone()
        lc.conv[slots] = conv
        q, k, v = split(y.reshape(len(verify) * T, -1))
        shape = lambda x: x.reshape(len(verify), T, *x.shape[1:])  # noqa: E731
        res = gdn_verify(shape(q), shape(k), shape(v), shape(a[rows]), shape(b[rows]), w.A_log,
                         w.dt_bias, shape(z[rows]), w.norm_w, lc.state, slots)
        lc.state = lc.state.clone()
        lc.state[slots] = res["states"][:, -1].to(lc.state.dtype)
        out[rows] = res["out"].reshape(len(verify) * T, hv, dv)
    if prefill:
        state, conv_all = lc.state.clone(), lc.conv.clone()
        acc = acc_dtype(u, w.conv_w)
        for s, lo, hi in prefill:
            y, conv = causal_conv1d(mixed[None, lo:hi], w.conv_w, conv_all[s:s + 1])
            conv_all[s] = conv[0]
            q, k, v = split(y[0])
            res = gdn_prefill(q[None], k[None], v[None], a[None, lo:hi], b[None, lo:hi], w.A_log,
                              w.dt_bias, z[None, lo:hi], w.norm_w, state[s:s + 1].to(acc))
            state[s] = res["final_state"][0].to(state.dtype)
            out[lo:hi] = res["out"][0]
        lc.state, lc.conv = state, conv_all
    return _linear(out.reshape(N, hv * dv).to(act), w.out_proj, act)


@dataclass
class _KvCodec:
    store_k: Callable | None = None
    store_v: Callable | None = None
    load_k: Callable | None = None
    load_v: Callable | None = None


def _kv_codec(kv_dtype: str | None, w: QSAWeights, head_dim: int, meta: bool) -> _KvCodec:
    """The storage seam of qsa.py for the cache's KV dtype (None / bf16: plain casts)."""
    if kv_dtype in (None, "bf16"):
        return _KvCodec()
    if meta:  # meta: the quantisers check values; store and load shapes only
        def store(x):
            if kv_dtype == "fp8":
                return (torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device),)
            lead = x.shape[:-1]
            return (torch.empty(*lead, head_dim // 2, dtype=torch.uint8, device=x.device),
                    torch.empty(*lead, head_dim // NVFP4_BLOCK, dtype=FP8_DTYPE, device=x.device))

        def load(parts, dtype):
            return torch.empty(*parts[0].shape[:-1], head_dim, dtype=dtype, device=parts[0].device)

        return _KvCodec(store, store, load, load)
    if kv_dtype == "fp8":
        store = lambda x: (fp8_quantize(x),)  # noqa: E731
        load = lambda parts, dtype: fp8_dequantize(parts[0], dtype)  # noqa: E731
        return _KvCodec(store, store, load, load)
    return _KvCodec(store_k=lambda x: nvfp4_quantize(x, w.k_gs),
                    store_v=lambda x: nvfp4_quantize(x, w.v_gs),
                    load_k=lambda parts, dtype: nvfp4_dequantize(parts[0], parts[1], w.k_gs, dtype),
                    load_v=lambda parts, dtype: nvfp4_dequantize(parts[0], parts[1], w.v_gs, dtype))


def _select_shape_only(positions: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """meta: a stand-in for ``qsa_select`` with its shape and per-row count (the window plus the lowest
    min(k, candidates) candidate blocks); meta scores have no values to rank."""
    out = torch.full((positions.shape[0], selection_width(cfg.top_k_blocks, cfg.sink_blocks,
                                                          cfg.local_blocks)), -1, dtype=torch.int64)
    for row, t in enumerate(positions.tolist()):
        window = window_blocks(t, cfg.sink_blocks, cfg.local_blocks)
        cands = [b for b in range(num_complete_blocks(t)) if b not in window][:cfg.top_k_blocks]
        ids = sorted(set(window) | set(cands))
        out[row, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
    return out


def _qsa_mixer(u: torch.Tensor, w: QSAWeights, lc: QSALayerCache, cfg: ModelConfig, step: _Step,
               block_table: torch.Tensor, kv_dtype: str | None, act: torch.dtype) -> torch.Tensor:
    """The QSA mixer on rows u [N, C] (docs/spec.md, "QSA" items 1-6); updates the layer's planes in
    ``lc``."""
    N, dev = u.shape[0], u.device
    hq, hkv, dh, hi, di = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, cfg.index_heads, cfg.index_dim
    q = _linear(u, w.w_q, act).view(N, hq, dh)
    gate = _linear(u, w.w_gate, act).view(N, hq, dh)
    k = _linear(u, w.w_k, act).view(N, hkv, dh)
    v = _linear(u, w.w_v, act).view(N, hkv, dh)
    q, k = qk_norm_rope(q, k, w.q_norm, w.k_norm, step.positions.to(dev), cfg.rotary_dim,
                        cfg.rope_theta, cfg.eps)
    q_index = _linear(u, w.w_qI, act).view(N, hi, di)
    k_index = rmsnorm(_linear(u, w.w_kI, act), w.kI_norm, cfg.eps)
    w_index = _linear(u, w.w_wI, act)

    codec = _kv_codec(kv_dtype, w, dh, meta=dev.type == "meta")
    p = lc.planes
    seq_ids, positions = step.seq_ids, step.positions
    # 1. KV append; 2. index store and block compression (every new token first, so a row reads the
    # blocks completed by earlier rows of the same chunk: exactly the blocks at or before it).
    k_cache, v_cache, pos_plane = qsa_kv_append(p.k_cache, p.v_cache, p.pos_plane, block_table,
                                                seq_ids, positions, k, v, codec.store_k, codec.store_v)
    index_plane, block_keys, valid = qsa_index_store(p.index_plane, p.block_keys, p.block_key_valid,
                                                     block_table, seq_ids, positions, k_index)
    lc.planes = QsaPlanes(k_cache, v_cache, pos_plane, index_plane, block_keys, valid)
    # 3. index scores; 4. canonical selection; 5. expansion (host-side integers).
    scores = qsa_index_scores(q_index, w_index, seq_ids, positions, block_table, block_keys, valid)
    with torch.device(CPU):
        if dev.type == "meta":
            selected = _select_shape_only(positions, cfg)
        else:
            selected = qsa_select(scores, positions, cfg.top_k_blocks, cfg.sink_blocks,
                                  cfg.local_blocks)
        tokens = qsa_expand(selected, positions, step.context_lens)
    # 6. gated sparse GQA over the selected tokens, then the output projection.
    o = qsa_sparse_gqa(q, gate, tokens, seq_ids, block_table, k_cache, v_cache, codec.load_k,
                       codec.load_v)
    return _linear(o.reshape(N, hq * dh), w.w_o, act)


def _moe_block(u: torch.Tensor, w: MoEWeights, cfg: ModelConfig) -> torch.Tensor:
    """``moe(u)``: routed NVFP4 experts plus the gated shared expert."""
    if u.device.type != "meta":
        return moe(u, w.router, w.experts, w.shared, cfg.moe_top_k)
    # meta: moe_experts validates the expert ids and the nvfp4 dequantiser its global scale with
    # Python branches on values; run the routing as is and the experts' GEMM shapes on empty weights.
    acc = acc_dtype(u, w.router)
    ids, weights = moe_route(u, w.router, cfg.moe_top_k)
    E = w.experts
    gate_w, up_w = (torch.empty(E.intermediate, E.hidden, dtype=acc, device=u.device) for _ in "gu")
    down_w = torch.empty(E.hidden, E.intermediate, dtype=acc, device=u.device)
    routed = torch.zeros(u.shape, dtype=acc, device=u.device)
    for j in range(ids.shape[1]):
        h = F.silu(u.to(acc) @ gate_w.T) * (u.to(acc) @ up_w.T)
        routed = routed + weights[:, j, None] * (h @ down_w.T)
    s = w.shared
    shared = moe_shared_expert(u, s.w_gate, s.w_up, s.w_down, s.w_sg)
    return (routed + shared.to(acc)).to(u.dtype)


def _decoder_layer(X: torch.Tensor, lw: LayerWeights, lc: GDNLayerCache | QSALayerCache,
                   e_l: torch.Tensor | None, cfg: ModelConfig, step: _Step, cache: ModelCache,
                   act: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer: the mixer site (mixer, then PLE, as one sublayer), then the MoE site."""

    def mixer(u: torch.Tensor) -> torch.Tensor:
        if lw.kind == "gdn":
            y = _gdn_mixer(u, lw.mixer, lc, cfg, step, act)
        else:
            y = _qsa_mixer(u, lw.mixer, lc, cfg, step, cache.block_table, cache.kv_dtype, act)
        if lw.ple is not None:
            y = ple_apply(y, e_l, lw.ple.w_gate, lw.ple.w_out, lw.ple.norm_w, act)
        return y

    X, _ = _hc_site(X, lw.hc_mixer, lw.norm_mixer, mixer, cfg, act)
    return _hc_site(X, lw.hc_moe, lw.norm_moe, lambda u: _moe_block(u, lw.moe, cfg), cfg, act)


def _read_out(m: torch.Tensor, weights: Weights, cfg: ModelConfig, act: torch.dtype) -> torch.Tensor:
    """Stream mean -> final rmsnorm -> LM head (-> logits_cast in bf16)."""
    h = out_cast(rmsnorm(m, weights.final_norm, cfg.eps), act, is_reference_mode(m))
    logits = _linear(h, weights.lm_head, act)
    return logits_cast(logits) if act == torch.bfloat16 else logits


def _streams(x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """n copies of x [N, C] in the accumulation dtype: X [N, n, C]."""
    return x.to(acc_dtype(x))[:, None, :].repeat(1, cfg.hc_streams, 1)


def _on(dev: torch.device):
    """meta: make the ops' own allocations (``torch.zeros`` / ``full`` / ``arange`` without a device)
    land on meta, next to the meta activations. On the CPU it is a no-op."""
    return torch.device(dev) if dev.type == "meta" else contextlib.nullcontext()


def _check(weights: Weights, cfg: ModelConfig, cache: ModelCache) -> None:
    if tuple(weights.embed.shape) != (cfg.vocab_size, cfg.hidden):
        raise ValueError("weights do not match the config's vocab_size / hidden")
    if cache.dtype != weights.dtype:
        raise ValueError(f"cache dtype {cache.dtype} != weights dtype {weights.dtype}")


# ===================================================================================================
# The model
# ===================================================================================================

def forward(weights: Weights, cfg: ModelConfig, tokens: torch.Tensor | Sequence[torch.Tensor],
            cache: ModelCache, *, return_hidden: bool = False, verify: bool = False):
    """Run the trunk over one step's new tokens and return their logits; updates ``cache`` in place.

    tokens: int64 on the CPU, either [B, T] (every sequence brings T tokens) or a list of B tensors
    [T_s] (T_s may differ, 0 = the sequence sits this step out): a prefill chunk, one decode token, or a
    mix. Token i of sequence s sits at position ``cache.lengths[s] + i``.
    Returns logits [B, T, V] (or a list of [T_s, V]) in fp32 for a bf16 or fp32 model, float64 for a
    float64 one; with ``return_hidden``, also the final stream mean m [.., C] of every row (the
    ``h_prev`` of ``mtp_draft``), in the accumulation dtype. ``verify``: the step is an MTP verify
    step (every participating sequence brings the same K+1 rows; the GDN layers run ``gdn_verify``,
    see the module docstring); the cache then holds all K+1 rows, as if every draft were accepted.
    """
    _check(weights, cfg, cache)
    seqs, stacked = _as_rows(tokens, cache.batch, "tokens")
    seqs = [t.to(device=CPU, dtype=torch.int64).reshape(-1) for t in seqs]
    step = _plan([t.numel() for t in seqs], cache.lengths, cache.max_len, verify)
    act, dev = weights.dtype, weights.device
    V, N = cfg.vocab_size, step.rows
    if N == 0:
        empty = torch.empty(0, V, dtype=act, device=dev)
        return _split_rows(empty, step, cache.batch, stacked)

    with _on(dev):
        ids = torch.cat(seqs).to(dev)
        x_emb = weights.embed[ids]                                       # [N, C]
        # Per-layer embeddings, per request (the n-gram history is per request).
        e = torch.empty(N, cfg.num_layers, cfg.ple_dim, dtype=act, device=dev)
        for s, lo, hi in step.spans:
            pw = weights.ple
            e[lo:hi] = ple_embed(ids[lo:hi], cache.ple_history[s].to(dev), x_emb[lo:hi], pw.table,
                                 pw.ngram_table, pw.w_ple, pw.norm_w, pw.hash_cfg, act)
        X = _streams(x_emb, cfg)                                         # [N, n, C]
        m = X[:, 0]
        for l, (lw, lc) in enumerate(zip(weights.layers, cache.layers)):
            X, m = _decoder_layer(X, lw, lc, e[:, l], cfg, step, cache, act)
        logits = _read_out(m, weights, cfg, act)

    for s, lo, hi in step.spans:
        cache.ple_history[s] = ple_history_advance(cache.ple_history[s], seqs[s])
        cache.lengths[s] += hi - lo
    out = _split_rows(logits, step, cache.batch, stacked)
    if return_hidden:
        return out, _split_rows(m, step, cache.batch, stacked)
    return out


def mtp_draft(weights: Weights, cfg: ModelConfig, h_prev: torch.Tensor | Sequence[torch.Tensor],
              next_token: torch.Tensor | Sequence[torch.Tensor], cache: ModelCache):
    """One pass of the MTP draft layer over rows (h_prev, next_token); updates the draft layer's cache.

    h_prev: [B, T, C] or a list of [T_s, C] (the trunk's ``return_hidden`` rows, or the previous draft
    step's hidden); next_token: int64 CPU [B, T] or a list of [T_s], the token after each h_prev row.
    Row i of sequence s sits at position ``cache.mtp_lengths[s] + i`` of the draft layer's cache.
    Returns (logits, hidden): logits like ``forward``'s (predicting the token after next_token), hidden
    the draft layer's stream mean (the next draft step's h_prev), in the caller's form.
    """
    if weights.mtp is None or cache.mtp is None:
        raise ValueError("the model has no MTP draft layer (mtp_layers = 0)")
    _check(weights, cfg, cache)
    toks, stacked = _as_rows(next_token, cache.batch, "next_token")
    hs, _ = _as_rows(h_prev, cache.batch, "h_prev")
    toks = [t.to(device=CPU, dtype=torch.int64).reshape(-1) for t in toks]
    for s, (t, h) in enumerate(zip(toks, hs)):
        if h.shape[0] != t.numel():
            raise ValueError(f"sequence {s}: {h.shape[0]} h_prev rows for {t.numel()} tokens")
    step = _plan([t.numel() for t in toks], cache.mtp_lengths, cache.max_len)
    act, dev, mw = weights.dtype, weights.device, weights.mtp
    if step.rows == 0:
        empty = torch.empty(0, cfg.vocab_size, dtype=act, device=dev)
        return (_split_rows(empty, step, cache.batch, stacked),
                _split_rows(torch.empty(0, cfg.hidden, device=dev), step, cache.batch, stacked))

    with _on(dev):
        ids = torch.cat(toks).to(dev)
        h = torch.cat([hs[s] for s, _, _ in step.spans]).to(dev)
        h_in = mtp_draft_input(ids, h, weights.embed, mw.norm_emb, mw.norm_h, mw.fc, act)
        X, m = _decoder_layer(_streams(h_in, cfg), mw.layer, cache.mtp, None, cfg, step, cache, act)
        logits = _read_out(m, weights, cfg, act)
    for s, lo, hi in step.spans:
        cache.mtp_lengths[s] += hi - lo
    return (_split_rows(logits, step, cache.batch, stacked),
            _split_rows(m, step, cache.batch, stacked))


def mtp_propose(weights: Weights, cfg: ModelConfig, h_last: torch.Tensor, next_token: torch.Tensor,
                cache: ModelCache, num_draft: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy drafts d_1..d_K for every sequence (one row each), reusing the one draft layer K times.

    h_last [B, C]: the trunk's hidden at each sequence's last row; next_token [B]: the token after it
    (already emitted). Step 1 drafts from (h_last, next_token); step j+1 from (its hidden, d_j).
    Returns (drafts int64 [B, K], draft logits [B, K, V]). Each step stores one row in the draft
    layer's cache; a speculative engine rolls ``cache.mtp_lengths`` back after verification.
    """
    if not 1 <= num_draft <= cfg.max_draft_len:
        raise ValueError(f"num_draft must lie in 1..{cfg.max_draft_len}, got {num_draft}")
    h, tok = h_last[:, None], next_token.reshape(-1, 1).to(CPU)
    drafts, all_logits = [], []
    for _ in range(num_draft):
        logits, h = mtp_draft(weights, cfg, h, tok, cache)
        if logits.device.type == "meta":  # meta: no values to take the argmax of
            tok = torch.full((logits.shape[0], 1), cfg.pad_id, dtype=torch.int64)
        else:
            tok = greedy_argmax(logits[:, 0]).to(CPU)[:, None]
        drafts.append(tok[:, 0])
        all_logits.append(logits[:, 0])
    return torch.stack(drafts, dim=1), torch.stack(all_logits, dim=1)
