"""Three planted bugs, each a patch of one engine op binding (impl/model/ops.py ``Ops``), for the
must-show that each fails at least one gate while the unmodified model passes them all."""

from __future__ import annotations

import contextlib

import torch

from impl.model.ops import Ops
from spec.ops.mtp import VerifyResult
from spec.ops import qsa as spec_qsa
from spec.ops.qsa import TOKENS_PER_BLOCK


@contextlib.contextmanager
def _patched(name: str, wrap):
    original = getattr(Ops, name)
    setattr(Ops, name, wrap(original))
    try:
        yield
    finally:
        setattr(Ops, name, original)


def _drop_sink(sel: torch.Tensor, positions: torch.Tensor, local: int) -> torch.Tensor:
    sel = sel.clone()
    far = (positions.to(sel.device) // TOKENS_PER_BLOCK) >= local
    sel[far[:, None].expand_as(sel) & (sel == 0)] = -1
    return sel


@contextlib.contextmanager
def sink_block_dropped():
    """The selection loses the sink block: block 0 leaves every row whose local window does not
    hold it, wherever rows select (qsa_topk_expand, and qsa_select for IndexShare's own rows)."""
    def wrap_fused(orig):
        def qsa_topk_expand(self, scores, positions, context_lens, top_k, sink, local, *, axes):
            sel, _ = orig(self, scores, positions, context_lens, top_k, sink, local, axes=axes)
            sel = _drop_sink(sel, positions, local)
            return sel, spec_qsa.qsa_expand(sel, positions, context_lens)
        return qsa_topk_expand

    def wrap_select(orig):
        def qsa_select(self, scores, positions, top_k, sink, local, *, axes):
            sel = orig(self, scores, positions, top_k, sink, local, axes=axes)
            return _drop_sink(sel, positions, local)
        return qsa_select
    with _patched("qsa_topk_expand", wrap_fused), _patched("qsa_select", wrap_select):
        yield


def gdn_state_reset_at_chunks():
    """Every prefill chunk starts the recurrent state from zero (the state of earlier chunks lost)."""
    def wrap(orig):
        def gdn_prefill(self, q, k, v, a, b, A_log, dt_bias, z, norm_w, state):
            return orig(self, q, k, v, a, b, A_log, dt_bias, z, norm_w, torch.zeros_like(state))
        return gdn_prefill
    return _patched("gdn_prefill", wrap)


def verify_drops_bonus():
    """A verify step whose drafts were all accepted drops the bonus token (emits K, keeps K rows)."""
    def wrap(orig):
        def greedy_verify(self, logits, drafts, draft_lens):
            res = orig(self, logits, drafts, draft_lens)
            full = res.num_accepted == draft_lens + 1
            num = torch.where(full, res.num_accepted - 1, res.num_accepted)
            emitted = res.emitted.clone()
            rows = full.nonzero().flatten()
            emitted[rows, draft_lens[rows]] = -1
            return VerifyResult(res.predictions, num, emitted)
        return greedy_verify
    return _patched("greedy_verify", wrap)


BUGS = {"sink_block_dropped": sink_block_dropped, "gdn_state_reset_at_chunks": gdn_state_reset_at_chunks,
        "verify_drops_bonus": verify_drops_bonus}
