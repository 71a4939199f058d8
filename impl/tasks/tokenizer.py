"""The tasks' tokenizer: one token per byte of ASCII text, the tiny model's vocabulary of 256.

Reserved ids (none of them is printable, so no task text contains them):
- ``PAD = 0``: the config's ``pad_id``. The PLE n-gram history starts at ``[PAD, PAD]`` and training
  batches are right-padded with it; no prompt or answer ever contains it.
- ``BOS = 1``: starts every prompt, so position 0 (inside the QSA sink block) is always the same token.
- ``END = 3``: ends every answer. Scoring reads a generation up to its first ``END`` (the gates
  generate ``max_new_tokens``; a request may also stop at it, ``Request.stop_token_ids``). Training targets repeat ``END`` after the answer
  (``END_REPEAT`` times), so a generation past its answer keeps emitting ``END`` and the draft layer
  learns to predict it: a verify step that straddles the end of an answer is not penalised for it.

Everything else is the byte of a printable ASCII character or ``\\n``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

PAD = 0
BOS = 1
END = 3
END_REPEAT = 8  # max draft length 7 + the bonus token: a verify step never sees past the repeats
VOCAB_SIZE = 256

_ALLOWED = frozenset(range(32, 127)) | {ord("\n")}


def encode(text: str) -> list[int]:
    """The token ids of ``text`` (its bytes); refuses anything outside printable ASCII and newline."""
    ids = list(text.encode("ascii", errors="strict"))
    bad = [chr(i) for i in ids if i not in _ALLOWED]
    if bad:
        raise ValueError(f"task text may hold printable ASCII and newline only, got {bad[0]!r}")
    return ids


def decode(ids: Iterable[int]) -> str:
    """Text of token ids, stopping at the first ``END``; reserved and non-ASCII ids show as ``?``."""
    out = []
    for i in ids:
        if i == END:
            break
        out.append(chr(i) if i in _ALLOWED else "?")
    return "".join(out)


def until_end(ids: Sequence[int]) -> list[int]:
    """The ids before the first ``END`` (all of them when there is none)."""
    ids = list(ids)
    return ids[:ids.index(END)] if END in ids else ids


__all__ = ["PAD", "BOS", "END", "END_REPEAT", "VOCAB_SIZE", "encode", "decode", "until_end"]
