"""The LM-head logits cast, the MTP draft input, greedy verification and rollback / commit
(docs/spec.md, "Norms and embeddings" (logits_cast) and "MTP draft layer and speculative decoding").

Public definitions followed:
- Multi-token prediction: DeepSeek-AI, "DeepSeek-V3 Technical Report" (2024), section 2.2: the MTP
  module combines the RMSNorm'd previous hidden state and the RMSNorm'd embedding of the next token with
  a linear projection of their concatenation, then one transformer block, sharing the embedding and the
  output head with the trunk. The order of the concatenation here is that of docs/spec.md (embedding
  first, as in Qwen3-Next's MTP layer); the projection ``fc`` has no bias.
- Speculative decoding with greedy verification: Leviathan, Kalman & Matias, "Fast Inference from
  Transformers via Speculative Decoding" (ICML 2023); Chen et al., "Accelerating Large Language Model
  Decoding with Speculative Sampling" (2023). At temperature 0 their acceptance rule reduces to: accept
  a draft token while it equals the target's argmax, and emit the target's argmax at the first mismatch
  (or after the last draft, the bonus token).

Decisions left to the spec by docs/spec.md (pinned in tests/spec/test_mtp.py):
- argmax: ties go to the lowest vocabulary index; NaN counts as -inf; -0.0 == +0.0. A row that is all
  NaN / -inf predicts token 0.
- ``logits_cast`` accepts the bf16 LM-head output (widened bit by bit), an fp32 LM-head accumulator
  (rounded to bf16 first: the rounding point, then widened), and float64 (reference mode: identity).
- Batched verify uses padded tensors with lengths: logits [R, K_max + 1, V], drafts [R, K_max],
  draft_lens [R] (K_r in 0..K_max; K_r = 0 is a plain decode step). Entries past a request's own rows
  are ignored; outputs are padded with -1.
- ``rollback_commit`` is generic: a dict of named per-row records [R, K_max + 1, ...], entry i being
  the side state after row i (GDN state, conv window, PLE n-gram history, plane lengths, ...).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from spec.numerics import acc_dtype, is_reference_mode, out_cast, round_to, rowwise_matmul
from spec.ops.norms import rmsnorm

TOKENS_PER_BLOCK = 32
PAD_TOKEN = -1  # padding of the emitted-token and prediction tensors


# ---------------------------------------------------------------- logits


def logits_cast(logits: torch.Tensor) -> torch.Tensor:
    """The LM-head output in bf16 widened to fp32, element by element, bitwise (exact).

    logits [..., V]: bf16 (the LM-head output), fp32 (an LM-head accumulator: rounded to bf16 first,
    the rounding point of docs/spec.md) or float64 (reference mode: returned unchanged). Returns fp32 (float64
    in reference mode).

    The widening is written on the bits: a bf16 value is the top 16 bits of the fp32 with the same
    value, so the fp32 pattern is the bf16 pattern times 2^16. The signed 16-bit pattern times 65536
    stays inside int32 (|x| <= 2^31), so no shift of a negative number and no overflow is involved.
    """
    if logits.dtype == torch.float64:
        return logits
    if logits.dtype == torch.float32:
        logits = logits.to(torch.bfloat16)
    if logits.dtype != torch.bfloat16:
        raise TypeError(f"logits_cast takes bf16, fp32 or float64 logits, not {logits.dtype}")
    bits = logits.contiguous().view(torch.int16).to(torch.int32) * 65536
    return bits.view(torch.float32)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim with the spec's tie rule: the lowest index among the maxima.

    NaN counts as -inf, -0.0 equals +0.0 (a float comparison). logits [..., V] any float dtype.
    Returns int64 [...].
    """
    x = logits.to(acc_dtype(logits))
    x = torch.where(torch.isnan(x), float("-inf"), x)  # +inf stays +inf
    is_max = x == x.amax(dim=-1, keepdim=True)
    index = torch.arange(x.shape[-1], device=x.device).expand_as(x)
    # Non-maxima get the index V, so the minimum is the lowest index that attains the max.
    return torch.where(is_max, index, x.shape[-1]).amin(dim=-1)


# ---------------------------------------------------------------- draft input


def mtp_draft_input(next_token: torch.Tensor, h_prev: torch.Tensor, embed: torch.Tensor,
                    norm_emb_w: torch.Tensor, norm_h_w: torch.Tensor, fc_w: torch.Tensor,
                    act_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``h' = fc(cat[rmsnorm(embed(next_token)), rmsnorm(h_prev)])``, the input of the draft layer.

    next_token [T] int64 (the token after the row h_prev belongs to); h_prev [T, C] (the hidden state
    of the trunk or of the previous draft step at that row); embed [V, C] (shared with the trunk);
    norm_emb_w, norm_h_w [C] (zero-centred rmsnorm weights); fc_w [C, 2C] (``fc(u) = u @ fc_w.T``,
    no bias). Rounding points: each rmsnorm output is rounded to ``act_dtype`` (the norm's own cast,
    the GEMM's input), and h' is cast to ``act_dtype`` once; the GEMM accumulates in the acc dtype.
    Returns h' [T, C] in ``act_dtype`` (float64 in reference mode).
    """
    reference = is_reference_mode(h_prev, embed, norm_emb_w, norm_h_w, fc_w)
    acc = acc_dtype(h_prev, embed, norm_emb_w, norm_h_w, fc_w)
    e = round_to(rmsnorm(embed[next_token].to(acc), norm_emb_w.to(acc)), act_dtype, reference)
    h = round_to(rmsnorm(h_prev.to(acc), norm_h_w.to(acc)), act_dtype, reference)
    h_new = rowwise_matmul(torch.cat([e, h], dim=-1), fc_w.to(acc).T)  # batch-invariant rows
    return out_cast(h_new, act_dtype, reference)


# ---------------------------------------------------------------- verify


class VerifyResult(NamedTuple):
    """The outcome of one greedy verify step over R requests (int64 tensors, -1 padded)."""

    predictions: torch.Tensor   # [R, K_max + 1]: p_i = argmax of row i, for i <= K_r
    num_accepted: torch.Tensor  # [R]: a + 1, in 1..K_r + 1
    emitted: torch.Tensor       # [R, K_max + 1]: d_1..d_a, p_a, then -1


def greedy_verify(logits: torch.Tensor, drafts: torch.Tensor, draft_lens: torch.Tensor) -> VerifyResult:
    """Greedy verification of the drafts of R requests.

    The trunk ran K_r + 1 rows for request r: [t0, d_1 .. d_K]; row i's logits predict the token after
    it, ``p_i = greedy_argmax(logits[r, i])``. Accepted:
    ``a = max{j : d_i == p_{i-1} for all 1 <= i <= j}`` (a = 0 when d_1 already differs).
    The step emits d_1..d_a and then p_a (the correction, or the bonus token when a = K_r):
    ``num_accepted = a + 1`` tokens.

    logits [R, K_max + 1, V] float; drafts [R, K_max] int64; draft_lens [R] int64 (K_r <= K_max).
    Rows past K_r + 1 and drafts past K_r are ignored.
    """
    R, rows, _ = logits.shape
    k_max = rows - 1
    if drafts.shape != (R, k_max) or draft_lens.shape != (R,):
        raise ValueError("drafts must be [R, K_max] and draft_lens [R] for logits [R, K_max + 1, V]")
    predictions = torch.full((R, rows), PAD_TOKEN, dtype=torch.int64)
    emitted = torch.full((R, rows), PAD_TOKEN, dtype=torch.int64)
    num_accepted = torch.empty(R, dtype=torch.int64)
    for r in range(R):
        k = int(draft_lens[r])
        if not 0 <= k <= k_max:
            raise ValueError(f"request {r}: draft length {k} outside 0..{k_max}")
        p = greedy_argmax(logits[r, :k + 1])
        a = 0
        while a < k and int(drafts[r, a]) == int(p[a]):  # d_{a+1} == p_a
            a += 1
        predictions[r, :k + 1] = p
        emitted[r, :a] = drafts[r, :a]
        emitted[r, a] = p[a]
        num_accepted[r] = a + 1
    return VerifyResult(predictions, num_accepted, emitted)


def acceptance_length(num_accepted: torch.Tensor | Sequence[int]) -> float:
    """Mean tokens emitted per request and verify step: mean of num_accepted (1 <= AL <= K + 1).

    num_accepted: the num_accepted of every (request, verify step), flattened. Averaged in float64.
    """
    values = torch.as_tensor(num_accepted, dtype=torch.float64).flatten()
    if values.numel() == 0:
        raise ValueError("acceptance length of no verify step is undefined")
    return float(values.mean())


# ---------------------------------------------------------------- rollback / commit


def blocks_complete(length: torch.Tensor, tokens_per_block: int = TOKENS_PER_BLOCK) -> torch.Tensor:
    """How many block keys a plane of ``length`` tokens holds: ``length // 32`` (integer lengths).

    Block key b exists iff block b is complete (b < length // 32), so a key is valid exactly while
    its 32 tokens are all kept: truncating into or below block b removes key b.
    """
    return torch.div(length, tokens_per_block, rounding_mode="floor")


def rollback_commit(records: Mapping[str, torch.Tensor], num_accepted: torch.Tensor,
                    length_key: str = "plane_len", tokens_per_block: int = TOKENS_PER_BLOCK
                    ) -> dict[str, torch.Tensor]:
    """Commit a verify step: keep, for each request, the side state recorded after its last accepted row.

    records: name -> [R, K_max + 1, ...], where ``records[name][r, i]`` is request r's state of that
    kind after verify row i (GDN state, conv window, PLE n-gram history, plane lengths, ...).
    num_accepted: [R] int64 in 1..K_r + 1 (``greedy_verify``). Returns name -> [R, ...], the entry
    ``num_accepted - 1`` of each record: the state after row a, as if only rows 0..a had run.

    ``records[length_key]`` (when present) holds the QSA plane lengths (KV pages, index plane, positions)
    after each row; its committed entry is the accepted length, to which the planes are truncated: slots
    past it are free again. Block keys are derived from that length: the result gets
    ``"blocks_complete" = accepted_len // 32`` (``blocks_complete``), so a block key whose block lost
    tokens in the rollback is removed.
    """
    R = num_accepted.shape[0]
    index = num_accepted.to(torch.int64) - 1
    committed: dict[str, torch.Tensor] = {}
    for name, record in records.items():
        if record.shape[0] != R:
            raise ValueError(f"record {name!r} has {record.shape[0]} requests, expected {R}")
        if torch.any(index < 0) or torch.any(index >= record.shape[1]):
            raise ValueError(f"num_accepted outside 1..{record.shape[1]} for record {name!r}")
        committed[name] = record[torch.arange(R), index].clone()
    if length_key in committed:
        committed["blocks_complete"] = blocks_complete(committed[length_key], tokens_per_block)
    return committed
