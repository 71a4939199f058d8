"""Input builders of the logits cast and the MTP / speculative-decoding ops (docs/spec.md,
"Norms and embeddings" and "MTP draft layer and speculative decoding"), and thin adapters that give
the spec functions whose signatures do not fit the harness (a NamedTuple or float result, a dict of records)
the calling convention of a cell: keyword tensors in, a dict of named tensors out.
"""

from __future__ import annotations

import math

import torch

from certify.harness.target import Case, OutSpec
from spec.cases.common import DTYPES, randn
from spec.ops.mtp import acceptance_length, greedy_verify, rollback_commit

TOKENS_PER_BLOCK = 32


# ---------------------------------------------------------------------------------------------------
# Adapters
# ---------------------------------------------------------------------------------------------------

def greedy_verify_op(logits: torch.Tensor, drafts: torch.Tensor, draft_lens: torch.Tensor
                     ) -> dict[str, torch.Tensor]:
    """``greedy_verify`` with its VerifyResult as a dict of the three outputs."""
    res = greedy_verify(logits, drafts, draft_lens)
    return {"predictions": res.predictions, "num_accepted": res.num_accepted, "emitted": res.emitted}


def acceptance_length_op(num_accepted: torch.Tensor) -> dict[str, torch.Tensor]:
    """``acceptance_length`` (a Python float, averaged in float64) as a 0-dim float64 tensor."""
    return {"acceptance_length": torch.tensor(acceptance_length(num_accepted), dtype=torch.float64)}


def rollback_commit_op(gdn_states: torch.Tensor, conv_windows: torch.Tensor,
                       ngram_histories: torch.Tensor, plane_lens: torch.Tensor,
                       num_accepted: torch.Tensor) -> dict[str, torch.Tensor]:
    """``rollback_commit`` over the four side-state records a verify step keeps for one layer of each
    kind: GDN state, conv window, PLE n-gram history and the QSA plane length."""
    committed = rollback_commit({"gdn_state": gdn_states, "conv_window": conv_windows,
                                 "ngram_history": ngram_histories, "plane_len": plane_lens},
                                num_accepted, length_key="plane_len")
    return {name: committed[name] for name in
            ("gdn_state", "conv_window", "ngram_history", "plane_len", "blocks_complete")}


# ---------------------------------------------------------------------------------------------------
# logits_cast
# ---------------------------------------------------------------------------------------------------

def _lm_logits(gen: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    """LM-head-like logits (fp32): a broad body, a few strong candidates per row, one row-level shift."""
    x = randn(gen, rows, vocab, scale=2.5) + randn(gen, rows, 1, scale=3.0)
    top = torch.randint(0, vocab, (rows, 8), generator=gen)
    x.scatter_(1, top, 12.0 + 6.0 * torch.rand(rows, 8, generator=gen))
    return x


def every_bf16_pattern(gen: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    """Rows of bf16 values holding every non-NaN bit pattern (normals, subnormals, +-0, +-inf) at
    least once, shuffled."""
    bits = torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32)
    magnitude = bits & 0x7FFF
    bits = bits[magnitude <= 0x7F80]  # drop the NaN patterns (exponent all ones, mantissa != 0)
    need = rows * vocab
    rest = bits[torch.randint(0, bits.numel(), (need - bits.numel(),), generator=gen)]
    pool = torch.cat([bits, rest])[torch.randperm(need, generator=gen)]
    return pool.to(torch.int16).view(torch.bfloat16).reshape(rows, vocab)


def logits_cast_case(axes: dict, gen: torch.Generator, device) -> Case:
    rows, vocab = axes["rows"], axes["vocab"]
    dtype = DTYPES[axes["logits_dtype"]]
    if axes["value_set"] == "every_pattern":
        if rows * vocab < 65282:
            raise ValueError("every_pattern needs rows * vocab >= 65282 (the non-NaN bf16 patterns)")
        logits = every_bf16_pattern(gen, rows, vocab)
    else:
        logits = _lm_logits(gen, rows, vocab).to(dtype)
    return Case(inputs={"logits": logits.to(device)},
                outputs={"logits_fp32": OutSpec((rows, vocab), torch.float32)})


# ---------------------------------------------------------------------------------------------------
# mtp_draft_input
# ---------------------------------------------------------------------------------------------------

def draft_input_case(axes: dict, gen: torch.Generator, device) -> Case:
    T, C, V = axes["rows"], axes["hidden"], axes["embed_rows"]
    act = DTYPES[axes["act_dtype"]]
    # The trunk's final hidden state (mean of the HC streams, before the final norm): a residual
    # stream with a few outlier channels two orders above the rest.
    h_prev = randn(gen, T, C, scale=0.8)
    h_prev[:, torch.randperm(C, generator=gen)[:4]] *= 60.0
    # Token embeddings are small (std ~0.02) and rmsnorm brings them to unit scale.
    embed = randn(gen, V, C, scale=0.02)
    next_token = torch.randint(0, V, (T,), generator=gen)
    w_e = randn(gen, C, scale=0.1)
    w_h = randn(gen, C, scale=0.1)
    fc_w = randn(gen, C, 2 * C, scale=1.0 / math.sqrt(2 * C))
    inputs = {"next_token": next_token, "h_prev": h_prev.to(act), "embed": embed.to(act),
              "norm_emb_w": w_e.to(act), "norm_h_w": w_h.to(act), "fc_w": fc_w.to(act)}
    return Case(inputs={n: t.to(device) for n, t in inputs.items()},
                outputs={"h_draft": OutSpec((T, C), act)})


# ---------------------------------------------------------------------------------------------------
# greedy_verify
# ---------------------------------------------------------------------------------------------------

def _argmax_lowest(x: torch.Tensor) -> torch.Tensor:
    """Lowest index among the maxima of each row (inputs here have no NaN)."""
    is_max = x == x.amax(dim=-1, keepdim=True)
    idx = torch.arange(x.shape[-1]).expand_as(x)
    return torch.where(is_max, idx, x.shape[-1]).amin(dim=-1)


def verify_case(axes: dict, gen: torch.Generator, device) -> Case:
    R, K, V = axes["batch"], axes["draft"], axes["vocab"]
    rows = K + 1
    # Logits as the verify step reads them: the bf16 LM head widened to fp32 (logits_cast), so equal
    # values are common near the top.
    logits = _lm_logits(gen, R * rows, V).to(torch.bfloat16).float().reshape(R, rows, V)
    if axes["ties"]:
        # Tied maxima in a third of the rows: the row's max repeated at 1-2 higher indices, so the
        # lowest index must win (a draft naming a higher tied index is rejected).
        for r in range(R):
            for i in range(rows):
                if torch.rand(1, generator=gen) < 1 / 3:
                    row = logits[r, i]
                    top = int(_argmax_lowest(row[None])[0])
                    others = torch.randint(top + 1, V, (2,), generator=gen) if top + 1 < V else []
                    for o in others[: 1 + int(torch.rand(1, generator=gen) < 0.5)]:
                        row[int(o)] = row[top]
    pred = _argmax_lowest(logits.reshape(R * rows, V)).reshape(R, rows)
    if axes["ragged"]:
        lens = torch.randint(0, K + 1, (R,), generator=gen)
        lens[0] = K
    else:
        lens = torch.full((R,), K)
    drafts = torch.randint(0, V, (R, K), generator=gen)
    # Acceptance patterns: request 0 all accepted (the bonus token), request 1 all rejected, the
    # rest a drawn a in 0..K_r; the first mismatch is a plausible near-miss (the row's second best, or
    # a higher tied index when the row has ties), never the argmax.
    for r in range(R):
        k = int(lens[r])
        a = k if r == 0 else 0 if r == 1 else int(torch.randint(0, k + 1, (1,), generator=gen))
        drafts[r, :a] = pred[r, :a]
        if a < k:
            row = logits[r, a]
            tied = (row == row[pred[r, a]]).nonzero().flatten()
            if tied.numel() > 1:
                miss = int(tied[-1])
            else:
                second = row.clone()
                second[pred[r, a]] = float("-inf")
                miss = int(_argmax_lowest(second[None])[0])
            drafts[r, a] = miss
    # Drafts past K_r are padding the op must ignore (logits rows past K_r + 1 hold finite values of
    # other rows, as a reused buffer would).
    for r in range(R):
        drafts[r, int(lens[r]):] = -1
    inputs = {"logits": logits, "drafts": drafts, "draft_lens": lens}
    return Case(inputs={n: t.to(device) for n, t in inputs.items()},
                outputs={"predictions": OutSpec((R, rows), torch.int64),
                         "num_accepted": OutSpec((R,), torch.int64),
                         "emitted": OutSpec((R, rows), torch.int64)})


# ---------------------------------------------------------------------------------------------------
# acceptance_length
# ---------------------------------------------------------------------------------------------------

def acceptance_case(axes: dict, gen: torch.Generator, device) -> Case:
    steps, R, K = axes["steps"], axes["batch"], axes["draft"]
    # Each draft is accepted with probability alpha while all before it were: num_accepted = a + 1
    # with a truncated-geometric a in 0..K; alpha varies by request (easy and hard prompts).
    alpha = torch.empty(R).uniform_(0.5, 0.95, generator=gen)
    u = torch.rand(steps, R, K, generator=gen)
    accepted = (u < alpha[None, :, None]).to(torch.int64).cumprod(dim=-1).sum(dim=-1)
    num_accepted = (accepted + 1).flatten()
    return Case(inputs={"num_accepted": num_accepted.to(device)},
                outputs={"acceptance_length": OutSpec((), torch.float64)})


# ---------------------------------------------------------------------------------------------------
# rollback_commit
# ---------------------------------------------------------------------------------------------------

def rollback_case(axes: dict, gen: torch.Generator, device) -> Case:
    R, K = axes["batch"], axes["draft"]
    hv, d, ch = axes["value_heads"], axes["head_dim"], axes["conv_channels"]
    sdt = DTYPES[axes["state_dtype"]]
    rows = K + 1
    # GDN state after each verify row: the recorded states of one layer, distinct per row.
    gdn = randn(gen, R, 1, hv, d, d, scale=0.5)
    gdn = (0.9 * gdn + 0.1 * randn(gen, R, rows, hv, d, d)).to(sdt)
    # Conv window after row i: the last 3 conv inputs, a shift register over the rows' inputs.
    x = randn(gen, R, rows + 2, ch).to(torch.bfloat16)
    conv = torch.stack([x[:, i:i + 3].transpose(1, 2) for i in range(rows)], dim=1)  # [R, rows, ch, 3]
    # n-gram history after row i: the last two token ids.
    toks = torch.randint(0, 151936, (R, rows + 1), generator=gen)
    ngram = torch.stack([toks[:, i:i + 2] for i in range(rows)], dim=1)
    # Plane length after row i: start + i + 1; some requests start just below a block boundary so
    # that rolling back removes a block key the rejected rows completed.
    start = torch.randint(1, 131072 - rows, (R,), generator=gen)
    start[: R // 2] = (start[: R // 2] // TOKENS_PER_BLOCK + 1) * TOKENS_PER_BLOCK - \
        torch.randint(1, rows, (R // 2,), generator=gen)
    plane = (start[:, None] + torch.arange(1, rows + 1)[None]).to(torch.int32)
    num_accepted = torch.randint(1, rows + 1, (R,), generator=gen)
    num_accepted[0] = 1          # all rejected
    if R > 1:
        num_accepted[1] = rows   # all accepted
    inputs = {"gdn_states": gdn, "conv_windows": conv, "ngram_histories": ngram, "plane_lens": plane,
              "num_accepted": num_accepted}
    return Case(inputs={n: t.to(device) for n, t in inputs.items()},
                outputs={"gdn_state": OutSpec((R, hv, d, d), sdt),
                         "conv_window": OutSpec((R, ch, 3), torch.bfloat16),
                         "ngram_history": OutSpec((R, 2), torch.int64),
                         "plane_len": OutSpec((R,), torch.int32),
                         "blocks_complete": OutSpec((R,), torch.int32)})
