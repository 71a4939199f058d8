"""A trainable form of spec/model.py: the same weights (field for field), batched over [B, T] in fp32.

- Dense projections, HC sites, PLE, GDN (chunked form, ``ops.gdn_chunked``), QSA and the MoE compute
  spec/model.py's functions over whole sequences at once; tests/train/test_train_model.py holds the
  logits to spec.model.forward / mtp_draft on the exported weights.
- QSA selection is spec's canonical top-k (ties to the higher block index) over the same block keys,
  turned into a token mask for one masked softmax attention (``attention="sparse"``); in the dense
  warm-up (``attention="dense"``) every earlier token is attended. Selection is not differentiable, so
  the index (qI, kI, wI) learns from an auxiliary loss, as DeepSeek-V3.2's sparse attention trains
  its indexer: the KL divergence from the block distribution of the layer's dense attention (heads
  averaged, no gradient) to the softmax of the index scores, over the candidate blocks.
- Routed experts are dense fp32 matrices. With ``qat`` on, they and their inputs go through the spec's
  NVFP4 quantiser with a straight-through gradient (``ops.fake_nvfp4``), weights with their per-matrix
  global scale, activations with the layer's calibrated input scale (a running max kept as a
  buffer), so the exported NVFP4 experts compute what was trained. Every expert runs on every token
  (eight small experts: cheaper than gathering), weighted by the top-k routing.
- ``to_weights`` exports ``spec.model.Weights`` (the experts quantised by ``NvFp4Weight.from_dense``,
  the calibrated expert-input and KV global scales); impl/model/checkpoint.py saves it.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from impl.train import ops
from spec.config import ModelConfig
from spec.model import (
    GDNWeights,
    HCSiteWeights,
    LayerWeights,
    MoEWeights,
    MTPWeights,
    PLELayerWeights,
    PLEWeights,
    QSAWeights,
    Weights,
    init_weights,
)
from spec.ops.moe import NvFp4Experts, NvFp4Weight, SharedExpert

BLOCK = 32


def _p(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach().clone().to(torch.float32))


class HC(nn.Module):
    def __init__(self, w: HCSiteWeights):
        super().__init__()
        self.phi, self.bias = _p(w.phi), _p(w.bias)


class GDN(nn.Module):
    def __init__(self, w: GDNWeights):
        super().__init__()
        for name in ("in_proj_qkvz", "in_proj_ba", "conv_w", "A_log", "dt_bias", "out_proj"):
            setattr(self, name, _p(getattr(w, name)))
        self.norm_w = _p(torch.ones_like(w.norm_w))

    def forward(self, u: torch.Tensor, cfg: ModelConfig, **_) -> torch.Tensor:
        B, T, _ = u.shape
        hk, hv, dk, dv, r = (cfg.gdn_key_heads, cfg.gdn_value_heads, cfg.gdn_d_k, cfg.gdn_d_v,
                             cfg.gdn_group)
        qkvz = (u @ self.in_proj_qkvz.T).view(B, T, hk, 2 * dk + 2 * r * dv)
        ba = (u @ self.in_proj_ba.T).view(B, T, hk, 2 * r)
        z = qkvz[..., 2 * dk + r * dv:].reshape(B, T, hv, dv)
        b, a = ba[..., :r].reshape(B, T, hv), ba[..., r:].reshape(B, T, hv)
        mixed = torch.cat([qkvz[..., :dk].reshape(B, T, hk * dk),
                           qkvz[..., dk:2 * dk].reshape(B, T, hk * dk),
                           qkvz[..., 2 * dk:2 * dk + r * dv].reshape(B, T, hv * dv)], dim=-1)
        y = ops.causal_conv(mixed, self.conv_w)
        q = y[..., :hk * dk].view(B, T, hk, dk)
        k = y[..., hk * dk:2 * hk * dk].view(B, T, hk, dk)
        v = y[..., 2 * hk * dk:].view(B, T, hv, dv)
        g, beta = ops.gdn_gates(a, b, self.A_log, self.dt_bias)
        o = ops.gdn_chunked(q, k, v, g, beta)
        return ops.gated_rmsnorm(o, z, self.norm_w).reshape(B, T, hv * dv) @ self.out_proj.T


class QSA(nn.Module):
    """The QSA mixer; ``forward`` leaves the index loss and the selection it used on the module."""

    def __init__(self, w: QSAWeights):
        super().__init__()
        for name in ("w_q", "w_gate", "w_k", "w_v", "w_qI", "w_kI", "w_wI", "w_o"):
            setattr(self, name, _p(getattr(w, name)))
        for name in ("q_norm", "k_norm", "kI_norm"):
            setattr(self, name, _p(torch.zeros_like(getattr(w, name))))
        self.register_buffer("k_amax", torch.zeros(()))
        self.register_buffer("v_amax", torch.zeros(()))
        self.index_loss: torch.Tensor | None = None
        self.selection: torch.Tensor | None = None

    def project(self, u: torch.Tensor, positions: torch.Tensor, cfg: ModelConfig):
        B, T, _ = u.shape
        hq, hkv, dh, hi, di = (cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, cfg.index_heads,
                               cfg.index_dim)
        q = ops.rmsnorm((u @ self.w_q.T).view(B, T, hq, dh), self.q_norm)
        k = ops.rmsnorm((u @ self.w_k.T).view(B, T, hkv, dh), self.k_norm)
        q, k = ops.rope(q, positions, cfg.rotary_dim, cfg.rope_theta), \
            ops.rope(k, positions, cfg.rotary_dim, cfg.rope_theta)
        gate = (u @ self.w_gate.T).view(B, T, hq, dh)
        v = (u @ self.w_v.T).view(B, T, hkv, dh)
        qI = (u @ self.w_qI.T).view(B, T, hi, di)
        kI = ops.rmsnorm(u @ self.w_kI.T, self.kI_norm)
        wI = u @ self.w_wI.T
        if self.training:
            with torch.no_grad():
                self.k_amax.copy_(torch.maximum(self.k_amax, k.abs().max()))
                self.v_amax.copy_(torch.maximum(self.v_amax, v.abs().max()))
        return q, gate, k, v, qI, kI, wI

    def forward(self, u: torch.Tensor, cfg: ModelConfig, *, attention: str = "sparse",
                shared: torch.Tensor | None = None, index_loss: bool = False,
                index_rows: torch.Tensor | None = None,
                index_margin: tuple[torch.Tensor, float] | None = None,
                chain: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
                rope_positions: torch.Tensor | None = None) -> torch.Tensor:
        """``chain``: this is draft step j = len(chain) + 1 >= 2 of every row at once (see
        ``attend_chain``); chain[0] holds step 1's (k, v, block keys), chain[i] step i + 1's.
        ``index_rows``: per-row weights [B, T] of the index loss (``index_kl``); ``index_margin``:
        (rows [B, T] bool, margin) of its ranking hinge. ``rope_positions``: [3, T] mRoPE
        positions of a frame prompt (the rotation only; selection reads the token index)."""
        B, T, _ = u.shape
        pos = torch.arange(T, device=u.device)
        q, gate, k, v, qI, kI, wI = self.project(u, pos if rope_positions is None else rope_positions,
                                                 cfg)
        kbar = block_keys(kI) if not chain else chain[0][2]
        self.kv = (k, v, kbar)
        self.q = q  # for diagnostics (dense_block_mass); autograd keeps it anyway
        scores = index_scores(qI, wI, kbar, pos)
        window, cand = window_and_candidates(pos, T, cfg)
        if shared is not None:
            sel = shared
        else:
            sel = select_blocks(scores, window, cand, cfg.top_k_blocks)
        self.selection = sel
        mask = token_mask(sel, pos) if attention == "sparse" else \
            torch.ones(T, T, dtype=torch.bool, device=u.device).tril()[None].expand(B, T, T)
        if chain:
            o = attend_chain(q, [(c[0], c[1]) for c in chain] + [(k, v)], mask, pos)
        else:
            o = attend(q, k, v, mask)
        self.index_loss = index_kl(q, k, scores, cand, cfg.top_k_blocks, weights=index_rows,
                                   margin=index_margin) if index_loss else None
        o = o * torch.sigmoid(gate)
        return o.reshape(B, T, -1) @ self.w_o.T


def block_keys(kI: torch.Tensor) -> torch.Tensor:
    """kbar_b = mean of block b's 32 index keys, for every complete block of the sequence."""
    B, T, di = kI.shape
    nb = T // BLOCK
    return kI[:, :nb * BLOCK].reshape(B, nb, BLOCK, di).mean(2)


def index_scores(qI: torch.Tensor, wI: torch.Tensor, kbar: torch.Tensor, pos: torch.Tensor
                 ) -> torch.Tensor:
    """s[t, b] = sum_h wI[t, h] relu(qI[t, h] . kbar_b) over complete blocks; -inf elsewhere.
    Columns: ceil(T / 32) blocks."""
    B, T = qI.shape[:2]
    nb_all = -(-T // BLOCK)
    dots = torch.relu(torch.einsum("bthd,bnd->bthn", qI, kbar))
    s = (wI[..., None] * dots).sum(2)
    s = F.pad(s, (0, nb_all - s.shape[-1]), value=float("-inf"))
    complete = torch.arange(nb_all, device=qI.device)[None, :] < ((pos + 1) // BLOCK)[:, None]
    return s.masked_fill(~complete, float("-inf"))


def window_and_candidates(pos: torch.Tensor, T: int, cfg: ModelConfig):
    """[T, nb] masks: the always-selected window (sink blocks and the last ``local_blocks`` blocks up
    to the row's own) and the candidates (complete blocks outside it)."""
    nb_all = -(-T // BLOCK)
    b = torch.arange(nb_all, device=pos.device)[None, :]
    own = (pos // BLOCK)[:, None]
    window = ((b < cfg.sink_blocks) & (b <= own)) | ((b <= own) & (b > own - cfg.local_blocks))
    complete = b < ((pos + 1) // BLOCK)[:, None]
    return window, complete & ~window


def select_blocks(scores: torch.Tensor, window: torch.Tensor, cand: torch.Tensor, k: int
                  ) -> torch.Tensor:
    """spec.ops.qsa.select_row for every row: the window plus the k candidates largest in (score,
    block index), both descending. Returns a bool block mask [B, T, nb]."""
    B, T, nb = scores.shape
    sel = window[None].expand(B, T, nb).clone()
    if k == 0:
        return sel
    s = scores.masked_fill(~cand[None], float("-inf")).detach()
    # A stable sort of the reversed columns ranks equal scores by descending block index.
    order = torch.sort(s.flip(-1), dim=-1, descending=True, stable=True).indices[..., :k]
    chosen = nb - 1 - order
    ok = torch.gather(s, -1, chosen) > float("-inf")
    sel.scatter_(-1, chosen, ok | torch.gather(sel, -1, chosen))
    return sel


def token_mask(sel: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Blocks [B, T, nb] -> tokens [B, T, T]: token j is attended by row t iff j <= t and its block
    is selected."""
    T = pos.shape[0]
    tok = sel.repeat_interleave(BLOCK, dim=-1)[..., :T]
    return tok & (torch.arange(T, device=pos.device)[None, :] <= pos[:, None])[None]


def attend(q, k, v, mask) -> torch.Tensor:
    """Softmax GQA (q head h reads KV head h // group) over the masked tokens; [B, T, Hq, D]."""
    rep = q.shape[2] // k.shape[2]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.repeat_interleave(rep, 2).transpose(1, 2),
                                       v.repeat_interleave(rep, 2).transpose(1, 2),
                                       attn_mask=mask[:, None])
    return o.transpose(1, 2)


def attend_chain(q, passes: list[tuple[torch.Tensor, torch.Tensor]], mask, pos) -> torch.Tensor:
    """Draft step j = len(passes) of every row p at once, as the engine runs it for the chain that
    started at n = p - j + 2: the draft layer's cache holds step 1's rows at positions < n (the rows
    it read from the trunk, within the selected blocks) and the chain's own speculative rows at n .. p,
    the row at n + i - 2 from step i. So position p - (j - i) comes from pass i >= 2, and positions
    before p - j + 2 from pass 1. (A speculative row never completes a candidate block: it lies in the
    query's own block or the one before, both in the window.)"""
    j = len(passes)
    T = pos.shape[0]
    qpos, kpos = pos[:, None], pos[None, :]
    parts = [mask & (kpos < qpos - j + 2)[None]]
    for i in range(2, j + 1):
        parts.append((kpos == qpos - (j - i))[None].expand_as(mask))
    keys = torch.cat([p[0] for p in passes], 1)
    values = torch.cat([p[1] for p in passes], 1)
    return attend_rect(q, keys, values, torch.cat(parts, -1))


def attend_rect(q, k, v, mask) -> torch.Tensor:
    """``attend`` with keys of another length than the queries (mask [B, Tq, Tk])."""
    rep = q.shape[2] // k.shape[2]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.repeat_interleave(rep, 2).transpose(1, 2),
                                       v.repeat_interleave(rep, 2).transpose(1, 2),
                                       attn_mask=mask[:, None])
    return o.transpose(1, 2)


@torch.no_grad()
def dense_block_mass(q, k, nb: int, chunk: int = 512, first: int = 0) -> torch.Tensor:
    """The causal dense attention's probability mass per block, heads averaged: [B, Tq, nb] for the
    query rows ``q`` [B, Tq, H, D] at positions first .. first + Tq - 1 over all of ``k``'s T keys
    (a few rows cost a few rows, not the whole T x T)."""
    B, Tq, hq, dh = q.shape
    T = k.shape[1]
    rep = hq // k.shape[2]
    kk = k.detach().repeat_interleave(rep, 2).transpose(1, 2)         # [B, H, T, D]
    masses = []
    for lo in range(0, Tq, chunk):
        qc = q[:, lo:lo + chunk].detach().transpose(1, 2)
        logits = qc @ kk.transpose(-1, -2) / math.sqrt(dh)
        t = torch.arange(first + lo, first + lo + qc.shape[2], device=q.device)
        logits = logits.masked_fill(torch.arange(T, device=q.device)[None, :] > t[:, None],
                                    float("-inf"))
        p = torch.softmax(logits, -1).mean(1)                          # [B, Tc, T]
        p = F.pad(p, (0, nb * BLOCK - T)).reshape(B, -1, nb, BLOCK).sum(-1)
        masses.append(p)
    return torch.cat(masses, 1)


def index_kl(q, k, scores, cand, top_k: int, chunk: int = 512,
             weights: torch.Tensor | None = None,
             margin: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """KL(dense attention's block mass || softmax of index scores) over candidate blocks, averaged
    over the rows with more than ``top_k`` candidates (the rows where selection chooses); with
    ``weights`` [B, T], their weighted mean. Weights exist because a plain mean is ruled by filler:
    in an 8K retrieval context the rows that answer are about 1 % of the rows, and an index that
    fits the filler rows' diffuse targets can still miss the record block on the rows that read it.

    ``margin`` = (rows [B, T] bool, m) adds, averaged over those rows where selection chooses, the
    ranking hinge ``selection_hinge``: the KL rewards probability mass, while the selection needs only
    the target's peak block among its top_k."""
    nb = scores.shape[-1]
    rows = cand.sum(-1) > top_k
    if not bool(rows.any()):
        # no row chooses (short sequences): nothing to learn. A constant, not scores.sum() * 0, which
        # is NaN where scores holds the -inf of non-candidate blocks
        return scores.new_zeros(())
    with torch.no_grad():
        mass = dense_block_mass(q, k, nb, chunk).masked_fill(~cand[None], 0.0)
        target = mass / mass.sum(-1, keepdim=True).clamp_min(1e-20)
    logq = torch.log_softmax(scores.masked_fill(~cand[None], float("-inf")), -1)
    kl = (target * (torch.log(target.clamp_min(1e-20)) - logq.masked_fill(~cand[None], 0.0))).sum(-1)
    if weights is None:
        loss = kl[:, rows].mean()
    else:
        w = weights * rows[None]
        loss = (kl * w).sum() / w.sum().clamp_min(1e-20)
    if margin is not None:
        hinge_rows, m = margin
        hinge_rows = hinge_rows & rows[None]
        if bool(hinge_rows.any()):
            hinge = selection_hinge(scores, cand, target.argmax(-1), top_k, m)
            loss = loss + hinge[hinge_rows].mean()
    return loss


def selection_hinge(scores, cand, peak, top_k: int, m: float) -> torch.Tensor:
    """relu(m - (s_peak - s_kth)) per row [B, T]: s_kth is the top_k-th largest index score among the
    other candidate blocks, so the hinge is zero exactly when the ``peak`` block [B, T] outranks all
    but top_k - 1 of them by at least m (selected with a margin). Rows with at most top_k candidates
    give 0 (nothing to outrank)."""
    s = scores.masked_fill(~cand[None], float("-inf"))
    s_peak = s.gather(-1, peak[..., None])[..., 0]
    others = s.scatter(-1, peak[..., None], float("-inf"))
    kth = others.topk(top_k, -1).values[..., -1]
    both = torch.isfinite(kth) & torch.isfinite(s_peak)   # a peak outside the candidates: no hinge
    gap = torch.where(both, s_peak - kth, torch.full_like(s_peak, float("inf")))
    return torch.relu(m - gap)


class MoE(nn.Module):
    def __init__(self, w: MoEWeights, cfg: ModelConfig, gen: torch.Generator):
        super().__init__()
        E, I, C = cfg.num_experts, cfg.expert_inter, cfg.hidden
        self.router = _p(w.router)
        draw = lambda *s, fan: torch.randn(*s, generator=gen, dtype=torch.float64) / math.sqrt(fan)  # noqa: E731
        self.gate, self.up = _p(draw(E, I, C, fan=C)), _p(draw(E, I, C, fan=C))
        self.down = _p(draw(E, C, I, fan=I))
        s = w.shared
        self.s_gate, self.s_up, self.s_down, self.s_sg = _p(s.w_gate), _p(s.w_up), _p(s.w_down), \
            _p(s.w_sg)
        self.register_buffer("x_amax", torch.zeros(()))
        self.register_buffer("h_amax", torch.zeros(()))
        self.qat = False
        self.aux_loss: torch.Tensor | None = None

    def forward(self, u: torch.Tensor, cfg: ModelConfig, **_) -> torch.Tensor:
        p = torch.softmax(u @ self.router.T, -1)
        # spec.ops.moe.moe_route: rank by (-p, expert index)
        ids = torch.sort(p.detach(), dim=-1, descending=True, stable=True).indices[..., :cfg.moe_top_k]
        w_sel = torch.gather(p, -1, ids)
        w_sel = w_sel / w_sel.sum(-1, keepdim=True)
        dense = torch.zeros_like(p).scatter(-1, ids, w_sel)                     # [B, T, E]
        self.aux_loss = None
        if self.training:
            with torch.no_grad():
                self.x_amax.copy_(torch.maximum(self.x_amax, u.abs().max()))
            frac = torch.zeros_like(p).scatter(-1, ids, 1.0).mean((0, 1)) / cfg.moe_top_k
            self.aux_loss = cfg.num_experts * (frac * p.mean((0, 1))).sum()
        x = ops.fake_nvfp4(u, ops.global_scale(self.x_amax)) if self.qat else u
        gate, up, down = ((ops.fake_nvfp4_weight(t) for t in (self.gate, self.up, self.down))
                          if self.qat else (self.gate, self.up, self.down))
        h = F.silu(torch.einsum("btc,eic->btei", x, gate)) * torch.einsum("btc,eic->btei", x, up)
        if self.training:
            with torch.no_grad():
                self.h_amax.copy_(torch.maximum(self.h_amax, h.abs().max()))
        if self.qat:
            h = ops.fake_nvfp4(h, ops.global_scale(self.h_amax))
        y = torch.einsum("btei,eci->btec", h, down)
        routed = (dense[..., None] * y).sum(2)
        shared = (F.silu(u @ self.s_gate.T) * (u @ self.s_up.T)) @ self.s_down.T
        return routed + torch.sigmoid(u @ self.s_sg)[..., None] * shared


class Layer(nn.Module):
    def __init__(self, w: LayerWeights, cfg: ModelConfig, gen: torch.Generator):
        super().__init__()
        self.kind = w.kind
        self.norm_mixer, self.norm_moe = _p(torch.zeros_like(w.norm_mixer)), \
            _p(torch.zeros_like(w.norm_moe))
        self.hc_mixer, self.hc_moe = HC(w.hc_mixer), HC(w.hc_moe)
        self.mixer = GDN(w.mixer) if w.kind == "gdn" else QSA(w.mixer)
        self.moe = MoE(w.moe, cfg, gen)
        if w.ple is not None:
            self.ple_gate, self.ple_out = _p(w.ple.w_gate), _p(w.ple.w_out)
            self.ple_norm = _p(torch.zeros_like(w.ple.norm_w))
        self.has_ple = w.ple is not None

    def forward(self, X, e_l, cfg: ModelConfig, **kw):
        def mixer(u):
            y = self.mixer(u, cfg, **kw)
            if self.has_ple:
                upd = (F.gelu(y @ self.ple_gate.T, approximate="tanh") * e_l) @ self.ple_out.T
                y = y + ops.rmsnorm(upd, self.ple_norm)
            return y

        X, _ = ops.hc_site(X, self.hc_mixer.phi, self.hc_mixer.bias, self.norm_mixer, mixer,
                           cfg.sinkhorn_iters)
        return ops.hc_site(X, self.hc_moe.phi, self.hc_moe.bias, self.norm_moe,
                           lambda u: self.moe(u, cfg), cfg.sinkhorn_iters)


class TrainModel(nn.Module):
    """spec/model.py's model with trainable fp32 parameters (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        w = init_weights(cfg, seed=seed, dtype=torch.float32)
        gen = torch.Generator().manual_seed(seed + 1)
        self.embed, self.lm_head = _p(w.embed), _p(w.lm_head)
        self.final_norm = _p(torch.zeros_like(w.final_norm))
        self.layers = nn.ModuleList(Layer(lw, cfg, gen) for lw in w.layers)
        self.ple_table, self.ple_ngram, self.ple_w = _p(w.ple.table), _p(w.ple.ngram_table), \
            _p(w.ple.w_ple)
        self.ple_norm = _p(torch.zeros_like(w.ple.norm_w))
        self.hash_cfg = w.ple.hash_cfg
        m = w.mtp
        self.mtp_norm_emb, self.mtp_norm_h = _p(torch.zeros_like(m.norm_emb)), \
            _p(torch.zeros_like(m.norm_h))
        self.mtp_fc = _p(m.fc)
        self.mtp_layer = Layer(m.layer, cfg, gen)

    # ------------------------------------------------------------------ pieces

    def set_qat(self, on: bool) -> None:
        for mod in self.modules():
            if isinstance(mod, MoE):
                mod.qat = on

    def reset_calibration(self) -> None:
        for name, buf in self.named_buffers():
            if name.endswith("_amax"):
                buf.zero_()

    def trunk_parameters(self):
        return [p for n, p in self.named_parameters() if not n.startswith("mtp_")]

    def index_parameters(self):
        """The trunk's QSA index: its projections (qI, kI, wI) and the kI norm."""
        index = ("w_qI", "w_kI", "w_wI", "kI_norm")
        return [p for n, p in self.named_parameters()
                if not n.startswith("mtp_") and n.rsplit(".", 1)[-1] in index]

    def mtp_parameters(self):
        return [p for n, p in self.named_parameters() if n.startswith("mtp_")]

    def ngram_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The PLE n-gram rows of every token (spec's exact 64-bit hash, on the CPU): [B, T, heads]."""
        from impl.train.data import ngram_rows
        return ngram_rows(ids.cpu(), self.hash_cfg)

    def ple_embed(self, ids, rows, x_emb):
        B, T = ids.shape
        L, P, C = self.cfg.num_layers, self.cfg.ple_dim, self.cfg.hidden
        ngram = self.ple_ngram[rows].reshape(B, T, L * P)
        ctx = ops.rmsnorm(((x_emb @ self.ple_w) / math.sqrt(C)).view(B, T, L, P), self.ple_norm)
        return ((math.sqrt(P) * self.ple_table[ids] + ngram).view(B, T, L, P) + ctx) / math.sqrt(2.0)

    def read_out(self, m):
        return ops.rmsnorm(m, self.final_norm) @ self.lm_head.T

    def streams(self, x):
        return x[:, :, None, :].expand(*x.shape[:2], self.cfg.hc_streams, x.shape[-1])

    # ------------------------------------------------------------------ passes

    def forward(self, ids: torch.Tensor, rows: torch.Tensor | None = None, *,
                attention: str = "sparse", index_loss: bool = False,
                index_rows: torch.Tensor | None = None,
                index_margin: tuple[torch.Tensor, float] | None = None,
                embeds: torch.Tensor | None = None, rope_positions: torch.Tensor | None = None):
        """Trunk over ids [B, T]: (logits [B, T, V], hidden m [B, T, C]); ``index_rows``: the index
        loss's row weights [B, T], ``index_margin``: its ranking hinge's rows and margin (see
        ``index_kl``). ``embeds`` [B, T, C] replaces the token embeddings (a frame prompt's spliced
        rows) and ``rope_positions`` [3, T] the QSA layers' rotary positions."""
        rows = self.ngram_rows(ids).to(ids.device) if rows is None else rows
        x = self.embed[ids] if embeds is None else embeds
        e = self.ple_embed(ids, rows, x)
        X = self.streams(x)
        m = x
        for li, layer in enumerate(self.layers):
            X, m = layer(X, e[:, :, li], self.cfg, attention=attention, index_loss=index_loss,
                         index_rows=index_rows, index_margin=index_margin,
                         **({} if rope_positions is None else {"rope_positions": rope_positions}))
        return self.read_out(m), m

    def draft(self, h_prev: torch.Tensor, next_ids: torch.Tensor, *, attention: str = "sparse",
              shared: torch.Tensor | None = None, index_loss: bool = False, chain=None):
        """The MTP draft layer over rows t = 0..T-1 of (h_t, x_{t+1}) at positions 0..T-1
        (``chain``: a later draft step of every row, see ``attend_chain``). The layer's (k, v, block
        keys) of this pass are left in ``mtp_layer.mixer.kv`` for the next step's chain."""
        e = ops.rmsnorm(self.embed[next_ids], self.mtp_norm_emb)
        h = ops.rmsnorm(h_prev, self.mtp_norm_h)
        h_in = torch.cat([e, h], -1) @ self.mtp_fc.T
        _, m = self.mtp_layer(self.streams(h_in), None, self.cfg, attention=attention,
                              shared=shared, index_loss=index_loss, chain=chain)
        return self.read_out(m), m

    def qsa_layers(self) -> list[QSA]:
        return [l.mixer for l in self.layers if isinstance(l.mixer, QSA)]

    def aux_losses(self) -> torch.Tensor:
        losses = [m.aux_loss for m in self.modules() if isinstance(m, MoE) and m.aux_loss is not None]
        return torch.stack(losses).mean() if losses else torch.zeros(())

    # ------------------------------------------------------------------ export

    @torch.no_grad()
    def to_weights(self, dtype: torch.dtype = torch.float32) -> Weights:
        """``spec.model.Weights`` (dense weights in ``dtype``, fp32 by default; NVFP4 experts; fp32
        calibrated global scales)."""
        cfg = self.cfg
        c = lambda t: t.detach().to(dtype).cpu().clone()  # noqa: E731
        gs = lambda amax: ops.global_scale(amax.detach().cpu() if float(amax) > 0  # noqa: E731
                                           else torch.tensor(16.0))

        def hc(h: HC) -> HCSiteWeights:
            return HCSiteWeights(c(h.phi), c(h.bias))

        def mixer(mod):
            if isinstance(mod, GDN):
                return GDNWeights(c(mod.in_proj_qkvz), c(mod.in_proj_ba), c(mod.conv_w), c(mod.A_log),
                                  c(mod.dt_bias), c(mod.norm_w), c(mod.out_proj))
            return QSAWeights(c(mod.w_q), c(mod.w_gate), c(mod.w_k), c(mod.w_v), c(mod.q_norm),
                              c(mod.k_norm), c(mod.w_qI), c(mod.w_kI), c(mod.kI_norm), c(mod.w_wI),
                              c(mod.w_o), gs(mod.k_amax), gs(mod.v_amax))

        def moe(mod: MoE) -> MoEWeights:
            experts = NvFp4Experts(gate=NvFp4Weight.from_dense(c(mod.gate)),
                                   up=NvFp4Weight.from_dense(c(mod.up)),
                                   down=NvFp4Weight.from_dense(c(mod.down)),
                                   x_gs=gs(mod.x_amax), h_gs=gs(mod.h_amax))
            return MoEWeights(c(mod.router), experts,
                              SharedExpert(c(mod.s_gate), c(mod.s_up), c(mod.s_down), c(mod.s_sg)))

        def layer(l: Layer) -> LayerWeights:
            ple = PLELayerWeights(c(l.ple_gate), c(l.ple_out), c(l.ple_norm)) if l.has_ple else None
            return LayerWeights(l.kind, c(l.norm_mixer), hc(l.hc_mixer), mixer(l.mixer),
                                c(l.norm_moe), hc(l.hc_moe), moe(l.moe), ple)

        ple = PLEWeights(c(self.ple_table), c(self.ple_ngram), c(self.ple_w), c(self.ple_norm),
                         self.hash_cfg)
        mtp = MTPWeights(c(self.mtp_norm_emb), c(self.mtp_norm_h), c(self.mtp_fc),
                         layer(self.mtp_layer))
        return Weights(c(self.embed), [layer(l) for l in self.layers], ple, c(self.final_norm),
                       c(self.lm_head), mtp)
