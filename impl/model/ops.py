"""The engine's op bindings: one method per op of the catalog the forward calls.

Each method asks the ``Dispatcher`` for the call's variant and runs it in the engine's convention.
A reference variant (``impl: spec``) runs the spec function the op's cell file names (its model-level
form in spec/ops/); any other variant runs in the variant calling convention of impl/kernels/ (inputs,
then output buffers as keywords, written in place). An op whose only bindable variants are references
refuses any other variant with a clear error rather than guessing its calling convention.

Shape-only mode (``Ops(dispatcher, shape_only=True)``, the reach tracer over meta weights): every op is
dispatched exactly as in a real run (the trace records the same calls), but an op whose spec reads
values with Python branches runs a stand-in with the spec's output shapes and dtypes: the canonical
block selection (the window plus the lowest candidate blocks, on the host as the engine keeps it), the
token expansion, the routed experts (the same GEMM shapes on empty dense weights), the KV codecs'
quantisers and dequantisers, and greedy verification. Spec functions whose loops only cost time have
their own ``# meta:`` fast paths in spec/.

Storage conventions (the engine's state, updated here in place):
- ``state_pool`` [slots, HV, d_k, d_v] in the storage dtype; decode writes the rows at ``slots``.
- ``conv`` [slots, channels, 3] in the activation dtype.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Callable

import torch

from impl.model.dispatch import DispatchError, Dispatcher
from spec.ops import gdn as spec_gdn
from spec.ops import hc as spec_hc
from spec.ops import kv_storage as spec_kv
from spec.ops import linear as spec_linear
from spec.ops import moe as spec_moe
from spec.ops import mtp as spec_mtp
from spec.ops import norms as spec_norms
from spec.ops import ple as spec_ple
from spec.ops import qsa as spec_qsa
from spec.ops import rope as spec_rope
from spec.ops import vision as spec_vision
from spec.ops.kv_storage import FP8_DTYPE, NVFP4_BLOCK
from spec.ops.qsa import TOKENS_PER_BLOCK, selection_width

# Every op the forward dispatches (its bindings below), by when it runs. The configuration rule
# ``ops_run_on_the_arch`` reads these; a test checks a traced forward calls no other op.
FORWARD_OPS: tuple[str, ...] = (
    "linear", "rmsnorm", "hc_inject_norm", "hc_first_projection", "hc_pre", "hc_up_projection", "ple_embed",
    "ple_apply", "moe", "logits_cast", "qk_norm_rope", "qsa_kv_append", "qsa_index_store",
    "qsa_index_scores", "qsa_topk_expand", "qsa_select", "qsa_expand", "qsa_sparse_gqa",
    "gdn_conv_prefill",
    "gdn_conv_update", "gdn_decode", "gdn_prefill")
# Dispatched by IndexShare passes only: every row expands the shared selection (qsa_expand), and
# rows handed -2 (no shared selection) score their own (qsa_select; the engine hands none today: its
# speculative draft rows run passes without sharing). Other passes select and expand in
# qsa_topk_expand.
INDEX_SHARE_OPS: tuple[str, ...] = ("qsa_select", "qsa_expand")
SPECULATION_OPS: tuple[str, ...] = ("gdn_verify", "greedy_verify", "rollback_commit",
                                    "mtp_draft_input")
KV_CODEC_OPS: dict[str, str] = {"fp8": "kv_fp8", "nvfp4": "kv_nvfp4"}
# Dispatched only by an engine with multimodal input (EngineConfig.multimodal), once per request.
MULTIMODAL_OPS: tuple[str, ...] = ("vision_tower",)

# Ops whose binding calls the spec function of a non-exact tier's reference variant (same signature).
TIER_REFERENCE_BINDINGS: tuple[str, ...] = ("gdn_prefill",)

DTYPE_NAME = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float64: "float64",
              torch.float16: "float16"}


class Ops:
    """The ops the forward calls, each dispatched through ``dispatcher``."""

    def __init__(self, dispatcher: Dispatcher, *, shape_only: bool = False):
        self.d = dispatcher
        self.shape_only = shape_only
        self._host_values: dict[int, tuple[torch.Tensor, float]] = {}

    def _host_value(self, t: torch.Tensor) -> float:
        """A weight scalar's value, read from the device once (a captured step reads none)."""
        held = self._host_values.get(id(t))
        if held is None or held[0] is not t:
            held = self._host_values[id(t)] = (t, float(t))
        return held[1]

    # ------------------------------------------------------------------ helpers

    def _reference(self, op: str, **axes: Any) -> None:
        """Dispatch an op the engine binds only through its reference variant."""
        variant = self.d.choose(op, **axes)
        if variant.impl != "spec":
            raise DispatchError(f"{op}: variant {variant.name!r} was chosen, but the engine binds "
                                f"only the op's reference variant; add its binding in {__name__}")

    def _choose(self, op: str, **axes: Any) -> tuple[bool, Callable | None]:
        """(True, None) for the exact tier's reference (the binding calls its spec), (True, the
        tier's spec function) for another tier's reference, (False, impl) for a kernel variant."""
        variant = self.d.choose(op, **axes)
        if variant.impl == "spec":
            tier_spec = self.d.tier_spec(op, variant)
            if tier_spec is not None and op not in TIER_REFERENCE_BINDINGS:
                raise DispatchError(f"{op}: the reference of tier {variant.numerics!r} was chosen, "
                                    f"and {__name__} binds only the exact spec of this op")
            return True, tier_spec
        return False, self.d.impl(op, variant)

    # ------------------------------------------------------------------ norms, HC, PLE, MoE

    def _kernel_outputs(self, impl: Callable, inputs: dict[str, Any], outputs: dict[str, Any],
                        **kw: Any) -> None:
        """Run a kernel variant into its output buffers (shape-only mode: buffers only)."""
        if not self.shape_only:
            impl(**inputs, **outputs, **kw)

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ref, impl = self._choose("linear", rows=x.shape[0], in_features=x.shape[-1],
                                 out_features=w.shape[0], act_dtype=DTYPE_NAME[x.dtype])
        if ref:
            return spec_linear.linear(x, w)
        out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
        self._kernel_outputs(impl, {"x": x.contiguous(), "w": w}, {"out": out})
        return out

    def rmsnorm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        ref, impl = self._choose("rmsnorm", rows=x.shape[0], hidden=x.shape[-1],
                                 act_dtype=DTYPE_NAME[x.dtype])
        if ref:
            return spec_norms.rmsnorm(x, w, eps)
        out = torch.empty_like(x)
        self._kernel_outputs(impl, {"x": x.contiguous(), "w": w}, {"out": out}, eps=eps)
        return out

    def hc_inject_norm(self, X: torch.Tensor, eps: float):
        ref, impl = self._choose("hc_inject_norm", tokens=X.shape[0], streams=X.shape[1],
                                 hidden=X.shape[2])
        if ref:
            return spec_hc.hc_inject_norm(X, eps)
        T, n, C = X.shape
        v = torch.empty(T, n * C, dtype=torch.float32, device=X.device)
        r = torch.empty(T, dtype=torch.float32, device=X.device)
        self._kernel_outputs(impl, {"X": X.contiguous(), "eps": eps}, {"v": v, "r": r})
        return v, r

    def hc_first_projection(self, v, r, phi, bias, n: int, iters: int, hidden: int):
        ref, impl = self._choose("hc_first_projection", tokens=v.shape[0], streams=n,
                                 hidden=hidden)
        if ref:
            return spec_hc.hc_first_projection(v, r, phi, bias, n, iters)
        if iters != spec_hc.SINKHORN_ITERS:
            raise DispatchError(f"hc_first_projection: the kernel variants run "
                                f"{spec_hc.SINKHORN_ITERS} Sinkhorn rounds, the model asks {iters}")
        T, f32 = v.shape[0], torch.float32
        coef = spec_hc.HCCoefficients(torch.empty(T, n, dtype=f32, device=v.device),
                                      torch.empty(T, n, dtype=f32, device=v.device),
                                      torch.empty(T, n, n, dtype=f32, device=v.device))
        self._kernel_outputs(impl, {"v": v, "r": r, "phi": phi, "bias": bias},
                             {"h_pre": coef.h_pre, "h_post": coef.h_post, "h_res": coef.h_res})
        return coef

    def hc_pre(self, X: torch.Tensor, h_pre: torch.Tensor, act: torch.dtype) -> torch.Tensor:
        ref, impl = self._choose("hc_pre", tokens=X.shape[0], streams=X.shape[1],
                                 hidden=X.shape[2])
        if ref:
            return spec_hc.hc_pre(X, h_pre, act)
        x_in = torch.empty(X.shape[0], X.shape[2], dtype=act, device=X.device)
        self._kernel_outputs(impl, {"X": X.contiguous(), "h_pre": h_pre, "act_dtype": act},
                             {"x_in": x_in})
        return x_in

    def hc_up_projection(self, X, y, h_res, h_post):
        ref, impl = self._choose("hc_up_projection", tokens=X.shape[0], streams=X.shape[1],
                                 hidden=X.shape[2])
        if ref:
            return spec_hc.hc_up_projection(X, y, h_res, h_post)
        X_new, m = torch.empty_like(X), torch.empty(X.shape[0], X.shape[2], dtype=torch.float32,
                                                     device=X.device)
        self._kernel_outputs(impl, {"X": X.contiguous(), "y": y, "h_res": h_res,
                                    "h_post": h_post}, {"X_new": X_new, "m": m})
        return X_new, m

    def ple_embed(self, ids, history, x_emb, pw, act: torch.dtype, start: str, layers: int):
        ref, impl = self._choose("ple_embed", tokens=ids.shape[0], start=start, layers=layers,
                                 ple_dim=pw.norm_w.shape[0], hidden=x_emb.shape[-1],
                                 vocab=pw.table.shape[0])
        if ref:
            return spec_ple.ple_embed(ids, history, x_emb, pw.table, pw.ngram_table, pw.w_ple,
                                      pw.norm_w, pw.hash_cfg, act)
        P = pw.norm_w.shape[0]
        e = torch.empty(ids.shape[0], pw.table.shape[1] // P, P, dtype=act, device=x_emb.device)
        mult2, mult3, primes = _hash_constants(pw.hash_cfg, x_emb.device)
        self._kernel_outputs(impl, {"ids": ids, "history": history, "x_emb": x_emb,
                                    "table": pw.table, "ngram_table": pw.ngram_table,
                                    "w_ple": pw.w_ple, "norm_w": pw.norm_w, "mult2": mult2,
                                    "mult3": mult3, "primes": primes}, {"e": e})
        return e

    def ple_apply(self, y, e_l, w_gate, w_out, norm_w, act: torch.dtype) -> torch.Tensor:
        ref, impl = self._choose("ple_apply", tokens=y.shape[0], x_dtype=DTYPE_NAME[y.dtype],
                                 hidden=y.shape[-1], ple_dim=e_l.shape[-1])
        if ref:
            return spec_ple.ple_apply(y, e_l, w_gate, w_out, norm_w, act)
        out = torch.empty_like(y)
        self._kernel_outputs(impl, {"x": y, "e_l": e_l, "w_gate": w_gate, "w_out": w_out,
                                    "norm_w": norm_w}, {"out": out})
        return out

    def moe(self, u: torch.Tensor, w, top_k: int) -> torch.Tensor:
        e = w.experts
        ref, impl = self._choose("moe", tokens=u.shape[0], experts=w.router.shape[0],
                                 hidden=u.shape[-1], expert_inter=e.intermediate,
                                 shared_inter=w.shared.w_gate.shape[0], top_k=top_k)
        if not ref:
            out = torch.empty_like(u)
            sh = w.shared
            self._kernel_outputs(impl, {
                "x": u, "w_router": w.router, "top_k": top_k,
                "gate_packed": e.gate.packed, "gate_sf": e.gate.sf, "gate_gs": e.gate.gs,
                "up_packed": e.up.packed, "up_sf": e.up.sf, "up_gs": e.up.gs,
                "down_packed": e.down.packed, "down_sf": e.down.sf, "down_gs": e.down.gs,
                "x_gs": e.x_gs, "h_gs": e.h_gs, "w_gate": sh.w_gate, "w_up": sh.w_up,
                "w_down": sh.w_down, "w_sg": sh.w_sg}, {"out": out})
            return out
        if self.shape_only:
            return _moe_shape_only(u, w, top_k)
        return spec_moe.moe(u, w.router, w.experts, w.shared, top_k)

    def logits_cast(self, logits: torch.Tensor) -> torch.Tensor:
        ref, impl = self._choose("logits_cast", rows=logits.shape[0], vocab=logits.shape[-1],
                                 logits_dtype=DTYPE_NAME[logits.dtype])
        if ref:
            return spec_mtp.logits_cast(logits)
        out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        self._kernel_outputs(impl, {"logits": logits.contiguous()}, {"logits_fp32": out})
        return out

    def mtp_draft_input(self, ids, h, embed, norm_emb, norm_h, fc, act: torch.dtype):
        ref, impl = self._choose("mtp_draft_input", rows=ids.shape[0], hidden=h.shape[-1],
                                 embed_rows=embed.shape[0], act_dtype=DTYPE_NAME[act])
        if ref:
            return spec_mtp.mtp_draft_input(ids, h, embed, norm_emb, norm_h, fc, act)
        out = torch.empty(ids.shape[0], h.shape[-1], dtype=act, device=h.device)
        self._kernel_outputs(impl, {"next_token": ids, "h_prev": h, "embed": embed,
                                    "norm_emb_w": norm_emb, "norm_h_w": norm_h, "fc_w": fc},
                             {"h_draft": out})
        return out

    # ------------------------------------------------------------------ speculative decoding

    def greedy_verify(self, logits: torch.Tensor, drafts: torch.Tensor, draft_lens: torch.Tensor):
        self._reference("greedy_verify", batch=logits.shape[0], draft=drafts.shape[1],
                        vocab=logits.shape[-1],
                        ragged=bool((draft_lens != drafts.shape[1]).any()))
        if self.shape_only:  # no logits to compare: every draft accepted (the caller may override)
            emitted = torch.cat([drafts, torch.zeros(drafts.shape[0], 1, dtype=torch.int64)], dim=1)
            return spec_mtp.VerifyResult(emitted.clone(), draft_lens + 1, emitted)
        return spec_mtp.greedy_verify(logits, drafts, draft_lens)

    def rollback_commit(self, records: dict[str, torch.Tensor], num_accepted: torch.Tensor,
                        **axes: Any) -> dict[str, torch.Tensor]:
        first = next(iter(records.values()))
        self._reference("rollback_commit", batch=first.shape[0], draft=first.shape[1] - 1, **axes)
        return spec_mtp.rollback_commit(records, num_accepted)

    # ------------------------------------------------------------------ KV storage codecs

    def kv_codec(self, kv_dtype: str | None, k_gs: torch.Tensor, v_gs: torch.Tensor,
                 head_dim: int, kv_heads: int, act: torch.dtype):
        """(store_k, store_v, load_k, load_v) for qsa_kv_append / qsa_sparse_gqa; None = a cast."""
        if kv_dtype in (None, "bf16"):
            return None, None, None, None
        op = "kv_fp8" if kv_dtype == "fp8" else "kv_nvfp4"
        axes = dict(kv_heads=kv_heads, head_dim=head_dim, act_dtype=DTYPE_NAME[act])

        if self.shape_only:  # the quantisers check values: store and load shapes only
            def store_shape(x):
                self._reference(op, tokens=x.shape[0], **axes)
                lead, dev = x.shape[:-1], x.device
                if kv_dtype == "fp8":
                    return (torch.empty(x.shape, dtype=FP8_DTYPE, device=dev),)
                return (torch.empty(*lead, head_dim // 2, dtype=torch.uint8, device=dev),
                        torch.empty(*lead, head_dim // NVFP4_BLOCK, dtype=FP8_DTYPE, device=dev))

            def load_shape(parts, dtype):
                return torch.empty(*parts[0].shape[:-1], head_dim, dtype=dtype,
                                   device=parts[0].device)
            return store_shape, store_shape, load_shape, load_shape

        if kv_dtype == "fp8":
            def store(x):
                self._reference(op, tokens=x.shape[0], **axes)
                return (spec_kv.fp8_quantize(x),)

            # The named loads of spec/ops/kv_storage.py: a kernel recognises the format by them
            return store, store, spec_kv.fp8_load, spec_kv.fp8_load

        def store_with(gs):
            def store(x):
                self._reference(op, tokens=x.shape[0], **axes)
                return spec_kv.nvfp4_quantize(x, gs)
            return store

        return (store_with(k_gs), store_with(v_gs), partial(spec_kv.nvfp4_load, gs=k_gs),
                partial(spec_kv.nvfp4_load, gs=v_gs))

    # ------------------------------------------------------------------ QSA

    def qk_norm_rope(self, q, k, q_norm, k_norm, positions, rotary_dim, theta, eps, *, step: str,
                     context: int):
        """``positions`` [N] (plain RoPE) or [3, N] (a step holding a frame prompt: interleaved
        mRoPE with the sections of ``spec.ops.vision.mrope_sections(rotary_dim)``)."""
        mrope = positions.dim() == 2
        ref, impl = self._choose("qk_norm_rope", step="decode" if step == "decode" else "prefill",
                                 rows=q.shape[0], context=context,
                                 rope="mrope" if mrope else "plain",
                                 act_dtype=DTYPE_NAME[q.dtype], q_heads=q.shape[1],
                                 kv_heads=k.shape[1], head_dim=q.shape[2])
        kw = {"sections": spec_vision.mrope_sections(rotary_dim)} if mrope else {}
        if ref:
            return spec_rope.qk_norm_rope(q, k, q_norm, k_norm, positions, rotary_dim, theta, eps,
                                          **kw)
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        self._kernel_outputs(impl, {"q": q, "k": k, "w_q": q_norm, "w_k": k_norm,
                                    "positions": positions}, {"q_out": q_out, "k_out": k_out},
                             rotary_dim=rotary_dim, theta=theta, eps=eps, **kw)
        return q_out, k_out

    def vision_tower(self, frames: torch.Tensor, vw, heads: int) -> torch.Tensor:
        """A request's frames [F, C, H, W] through the tower (``vw``: spec.ops.vision's
        VisionWeights) -> [F gh gw, out_width] in the frames' dtype."""
        ref, impl = self._choose("vision_tower", frames=frames.shape[0],
                                 frame_size=frames.shape[-1], act_dtype=DTYPE_NAME[frames.dtype])
        if ref:
            return spec_vision.vision_tower(frames, **vw.as_dict(), heads=heads)
        patch = math.isqrt(vw.patch_w.shape[1] // frames.shape[1])
        per_frame = (frames.shape[-2] // patch) * (frames.shape[-1] // patch)
        out = torch.empty(frames.shape[0] * per_frame, vw.w_out.shape[0], dtype=frames.dtype,
                          device=frames.device)
        self._kernel_outputs(impl, {"frames": frames.contiguous(), **vw.as_dict(),
                                    "heads": heads}, {"out": out})
        return out

    def qsa_kv_append(self, planes, block_table, seq_ids, positions, k, v, store_k, store_v,
                      gs: tuple[torch.Tensor, torch.Tensor], *, axes: dict) -> None:
        """The step's K / V rows and positions written into ``planes``, in place (the spec's
        ``qsa_kv_append_into``, or a kernel's in-place core): a step writes its rows, not the pools.
        ``gs``: nvfp4's (K, V) global scales, read by a kernel that quantises inside."""
        ref, impl = self._choose("qsa_kv_append", **axes)
        if self.shape_only and not ref:
            # A kernel quantises inside (no codec op runs): only the host-side positions are kept.
            pages, offsets = spec_qsa.slot_of(block_table, seq_ids, positions)
            planes.pos_plane[pages, offsets] = positions.to(planes.pos_plane.dtype)
            return
        if ref:
            spec_qsa.qsa_kv_append_into(planes.k_cache, planes.v_cache, planes.pos_plane,
                                        block_table, seq_ids, positions, k, v, store_k, store_v)
            return
        dev = k.device
        pools = lambda c: (c,) if isinstance(c, torch.Tensor) else tuple(c)  # noqa: E731
        kv_format = {"bfloat16": "bf16"}.get(axes["kv_dtype"], axes["kv_dtype"])
        k_gs, v_gs = (self._host_value(g) for g in gs) if kv_format == "nvfp4" else (1.0, 1.0)
        self.d.core(impl)(pools(planes.k_cache), pools(planes.v_cache), planes.pos_plane,
                          block_table.to(dev), seq_ids.to(dev), positions.to(dev), k, v, kv_format,
                          k_gs, v_gs)

    def qsa_index_store(self, planes, block_table, seq_ids, positions, k_index, *,
                        axes: dict) -> None:
        """The step's index keys written into ``planes`` and the blocks they complete compressed, in
        place (the spec's ``qsa_index_store_into``, or a kernel's in-place core)."""
        ref, impl = self._choose("qsa_index_store", **axes)
        if ref or self.shape_only:
            spec_qsa.qsa_index_store_into(planes.index_plane, planes.block_keys,
                                          planes.block_key_valid, block_table, seq_ids, positions,
                                          k_index)
            return
        dev = k_index.device
        self.d.core(impl)(planes.index_plane, planes.block_keys, planes.block_key_valid,
                          block_table.to(dev), seq_ids.to(dev), positions.to(dev), k_index)

    def qsa_index_scores(self, q_index, w_index, seq_ids, positions, block_table, planes, *,
                         axes: dict):
        ref, impl = self._choose("qsa_index_scores", **axes)
        if ref or self.shape_only:
            return spec_qsa.qsa_index_scores(q_index, w_index, seq_ids, positions, block_table,
                                             planes.block_keys, planes.block_key_valid)
        dev = q_index.device
        scores = torch.empty(q_index.shape[0], block_table.shape[1], dtype=torch.float32,
                             device=dev)
        impl(q_index, w_index, seq_ids.to(dev), positions.to(dev), block_table.to(dev),
             planes.block_keys, planes.block_key_valid, scores=scores)
        return scores

    def qsa_topk_expand(self, scores, positions, context_lens, top_k, sink, local, *, axes: dict):
        """Rows that score their own blocks: the selection and its tokens in one op (block ids
        [N, W], tokens [N, 32 W]). A kernel variant gets every index on the scores' device."""
        ref, impl = self._choose("qsa_topk_expand", **axes)
        if self.shape_only:
            selected = _select_shape_only(positions, top_k, sink, local)
            return selected, torch.empty(selected.shape[0], TOKENS_PER_BLOCK * selected.shape[1],
                                         dtype=torch.int64, device="meta")
        if ref:
            return spec_qsa.qsa_topk_expand(scores, positions, context_lens, top_k, sink, local)
        dev, width = scores.device, selection_width(top_k, sink, local)
        selected = torch.empty(scores.shape[0], width, dtype=torch.int64, device=dev)
        tokens = torch.empty(scores.shape[0], TOKENS_PER_BLOCK * width, dtype=torch.int64,
                             device=dev)
        lens = None if context_lens is None else context_lens.to(dev)
        self._kernel_outputs(impl, {"scores": scores.contiguous(), "positions": positions.to(dev),
                                    "context_lens": lens},
                             {"selected": selected, "tokens": tokens},
                             k=top_k, sink_blocks=sink, local_blocks=local)
        return selected, tokens

    def qsa_select(self, scores, positions, top_k, sink, local, *, axes: dict):
        self._reference("qsa_select", **axes)
        if self.shape_only:
            return _select_shape_only(positions, top_k, sink, local)
        return spec_qsa.qsa_select(scores, positions, top_k, sink, local)

    def qsa_expand(self, selected, positions, context_lens, *, axes: dict):
        self._reference("qsa_expand", **axes)
        if self.shape_only:  # [N, 32 W] token ids; qsa_sparse_gqa's meta path reads no values
            return torch.empty(selected.shape[0], TOKENS_PER_BLOCK * selected.shape[1],
                               dtype=torch.int64, device="meta")
        return spec_qsa.qsa_expand(selected, positions, context_lens)

    def qsa_sparse_gqa(self, q, gate, tokens, seq_ids, block_table, planes, load_k, load_v, *,
                       axes: dict):
        ref, impl = self._choose("qsa_sparse_gqa", **axes)
        if ref or self.shape_only:
            return spec_qsa.qsa_sparse_gqa(q, gate, tokens, seq_ids, block_table, planes.k_cache,
                                           planes.v_cache, load_k, load_v)
        dev = q.device
        q, gate = q.contiguous(), gate.contiguous()
        out = torch.empty_like(q)
        impl(q, gate, tokens.to(dev).contiguous(), seq_ids.to(dev).contiguous(),
             block_table.to(dev).contiguous(), planes.k_cache,
             planes.v_cache, load_k, load_v, out=out)
        return out

    # ------------------------------------------------------------------ GDN

    def _gdn_axes(self, q: torch.Tensor, v: torch.Tensor) -> dict[str, int]:
        return dict(key_heads=q.shape[-2], value_heads=v.shape[-2], head_dim=q.shape[-1])

    def conv_prefill(self, x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                     *, geometry: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, ch], conv_state [B, ch, 3] -> (y [B, T, ch], new state [B, ch, 3])."""
        ref, fn = self._choose("gdn_conv_prefill", batch=x.shape[0], seq_len=x.shape[1], **geometry)
        if ref:
            return spec_gdn.causal_conv1d(x, weight, conv_state)
        y, new_state = torch.empty_like(x), torch.empty_like(conv_state)
        fn(x, weight, conv_state, y=y, new_conv_state=new_state)
        return y, new_state

    def conv_update(self, x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                    *, geometry: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, ch], conv_state [B, ch, 3] -> (y [B, ch], new state [B, ch, 3])."""
        ref, fn = self._choose("gdn_conv_update", batch=x.shape[0], **geometry)
        if ref:
            return spec_gdn.causal_conv1d_update(x, weight, conv_state)
        y, state = torch.empty_like(x), conv_state.clone()
        fn(x, weight, state, y=y)
        return y, state

    def gdn_decode(self, q, k, v, a, b, A_log, dt_bias, z, norm_w, state_pool: torch.Tensor,
                   slots: torch.Tensor) -> torch.Tensor:
        """One row per request; ``state_pool`` rows at ``slots`` updated in place. Returns out."""
        ref, fn = self._choose("gdn_decode", batch=q.shape[0],
                               state_dtype=DTYPE_NAME[state_pool.dtype], **self._gdn_axes(q, v))
        if ref:
            res = spec_gdn.gdn_decode(q, k, v, a, b, A_log, dt_bias, z, norm_w, state_pool, slots)
            state_pool[slots] = res["state_pool"][slots].to(state_pool.dtype)
            return res["out"]
        q, k, v, a, b, z = (t.contiguous() for t in (q, k, v, a, b, z))
        out = torch.empty_like(z)
        slots = slots.to(state_pool.device).contiguous()   # the row kernels read it by offset
        fn(q, k, v, a, b, A_log, dt_bias, z, norm_w, state_pool, slots,
           out=out)
        return out

    def gdn_verify(self, q, k, v, a, b, A_log, dt_bias, z, norm_w, state_pool: torch.Tensor,
                   slots: torch.Tensor, states: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """T rows a request from the pool (not written). Returns (out, states after every row);
        ``states``: where a fast variant writes them ([B, T, HV, K, V] in the pool's dtype,
        contiguous; default a new tensor)."""
        ref, fn = self._choose("gdn_verify", batch=q.shape[0], rows=q.shape[1],
                               state_dtype=DTYPE_NAME[state_pool.dtype], **self._gdn_axes(q, v))
        if ref:
            res = spec_gdn.gdn_verify(q, k, v, a, b, A_log, dt_bias, z, norm_w, state_pool, slots)
            return res["out"], res["states"]
        q, k, v, a, b, z = (t.contiguous() for t in (q, k, v, a, b, z))
        B, T, HV, V = v.shape
        out = torch.empty_like(z)
        want = (B, T, HV, q.shape[-1], V)
        if states is None:
            states = torch.empty(want, dtype=state_pool.dtype, device=v.device)
        elif (tuple(states.shape) != want or states.dtype != state_pool.dtype
              or not states.is_contiguous()):
            raise ValueError(f"gdn_verify: states is {list(states.shape)} {states.dtype}; the "
                             f"step writes a contiguous {list(want)} {state_pool.dtype}")
        slots = slots.to(state_pool.device).contiguous()   # a verify step's slots are a view
        fn(q, k, v, a, b, A_log, dt_bias, z, norm_w, state_pool, slots,
           out=out, states=states)
        return out, states

    def gdn_prefill(self, q, k, v, a, b, A_log, dt_bias, z, norm_w, state: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One or more whole chunks from an fp32 (float64 in reference mode) state. Returns (out,
        final state in the state's dtype)."""
        ref, fn = self._choose("gdn_prefill", batch=q.shape[0], seq_len=q.shape[1],
                               **self._gdn_axes(q, v))
        if ref:
            res = (fn or spec_gdn.gdn_prefill)(q, k, v, a, b, A_log, dt_bias, z, norm_w, state)
            return res["out"], res["final_state"]
        # kernels read whole contiguous tensors; the projections' splits are views
        q, k, v, a, b, z, state = (t.contiguous() for t in (q, k, v, a, b, z, state))
        out = torch.empty_like(z)
        final = torch.empty_like(state)
        fn(q, k, v, a, b, A_log, dt_bias, z, norm_w, state, out=out, final_state=final)
        return out, final


# ---------------------------------------------------------------------- shape-only stand-ins


def _select_shape_only(positions: torch.Tensor, k: int, sink: int, local: int) -> torch.Tensor:
    """``qsa_select``'s shape and per-row count without scores to rank, on the host (int64 [N, W]):
    the window plus the lowest min(k, candidates) candidate blocks, ascending, -1 padded. Vectorised:
    a prefill chunk has thousands of rows."""
    t = positions.long().cpu()
    own, done = t // TOKENS_PER_BLOCK, (t + 1) // TOKENS_PER_BLOCK
    sink_end = torch.minimum(torch.full_like(own, sink), own + 1)       # sink blocks [0, sink_end)
    local_lo = (own - local + 1).clamp(min=0)                          # local blocks [local_lo, own]
    cand_end = torch.minimum(torch.minimum(sink_end + k, local_lo.clamp(min=sink_end)), done)
    cand_end = torch.maximum(cand_end, sink_end)                       # candidates [sink_end, cand_end)
    width = selection_width(k, sink, local)
    col = torch.arange(width)[None, :]
    n_low = cand_end[:, None]                                          # blocks 0 .. cand_end - 1
    n_local = (own + 1 - torch.maximum(local_lo, cand_end))[:, None]   # then local_lo' .. own
    low = torch.where(col < n_low, col, -1)
    high = torch.maximum(local_lo, cand_end)[:, None] + (col - n_low)
    return torch.where(col < n_low, low, torch.where(col < n_low + n_local, high, -1))


_HASH_CONSTANTS: dict[tuple[spec_ple.NgramHashConfig, str], tuple[torch.Tensor, ...]] = {}


def _hash_constants(cfg: spec_ple.NgramHashConfig, device: torch.device
                    ) -> tuple[torch.Tensor, ...]:
    """The n-gram hash constants in the kernels' form, on ``device`` (made once, so a step copies
    nothing from the host): multipliers as int64 bits [heads, order] for orders 2 and 3, primes
    int64 [orders, heads]."""
    key = (cfg, str(device))
    if key not in _HASH_CONSTANTS:
        signed = lambda u: u - (1 << 64) if u >= 1 << 63 else u  # noqa: E731
        mults = [torch.tensor([[signed(m) for m in head] for head in order], dtype=torch.int64)
                 for order in cfg.multipliers]
        _HASH_CONSTANTS[key] = tuple(t.to(device) for t in (
            mults[0], mults[1], torch.tensor(cfg.primes, dtype=torch.int64)))
    return _HASH_CONSTANTS[key]


def _moe_shape_only(u: torch.Tensor, w, top_k: int) -> torch.Tensor:
    """``moe``'s shapes without expert ids to branch on: the routing as is, the k routed experts as
    dense GEMMs of the experts' shapes on empty weights, the shared expert as is."""
    acc = torch.float64 if u.dtype == torch.float64 else torch.float32
    ids, weights = spec_moe.moe_route(u, w.router, top_k)
    E = w.experts
    gate_w, up_w = (torch.empty(E.intermediate, E.hidden, dtype=acc, device=u.device) for _ in "gu")
    down_w = torch.empty(E.hidden, E.intermediate, dtype=acc, device=u.device)
    # One expert's GEMMs stand for all k: with no ids, the k slots differ in nothing but time.
    h = torch.nn.functional.silu(u.to(acc) @ gate_w.T) * (u.to(acc) @ up_w.T)
    routed = weights.sum(dim=-1, keepdim=True) * (h @ down_w.T)
    s = w.shared
    shared = spec_moe.moe_shared_expert(u, s.w_gate, s.w_up, s.w_down, s.w_sg)
    return (routed + shared.to(acc)).to(u.dtype)
