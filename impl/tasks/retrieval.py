"""Multi-key retrieval in a long context: records ``KEYS=0123456789;`` hidden in random-letter
filler, then a query for one key; the answer is its value.

    <BOS>qhzkd...ABCD=0384729105;...pwme...KXQT=5519023784;...vnoa
    ?KXQT=
    ->  5519023784

Geometry, against the tiny model's QSA (spec/config.py ``tiny``: 32-token blocks, the sink block 0,
the query's own block and the one before it, and ``top_k_blocks = 2`` index-selected blocks):

- A prompt is ``length`` tokens exactly (2048 to 8192 for the long sets: 64 to 256 blocks). Every
  record lies inside one block (never across a block boundary), so one selected block holds a whole
  record; the query sits in the last block, dozens to hundreds of blocks after most records.
- There are ``length / 128`` records (16 at 2K, 64 at 8K; at least 4): far more key-value
  associations than the recurrent layers' state is built for once hundreds of filler tokens a record
  decay it, and every record looks alike, so only the index's block selection reaches the right one.
  The model card records the measured check: retrieval with the index selection switched off
  (``top_k_blocks = 0``) against the trained model.
- One record always lies in block 0, the sink block. Evaluation sets ask for records at evenly spread
  depths (0, 1/4, 1/2, 3/4, 1 of the record list, sample i at depth (i mod 5) / 4), as needle-in-a-
  haystack suites do, so a fifth of every set asks for the record in the sink block: a selection
  that loses the sink fails those samples.
- Values are 10 digits: the draft layer copies them for several tokens a verify step, so the
  acceptance length at draft 7 can approach its bound of 8.
"""

from __future__ import annotations

import random
import string

from pydantic import Field, model_validator

from impl.tasks.base import Params, Sample, exact_match

BLOCK = 32
KEY_LEN = 4
FILLER = string.ascii_lowercase


class RetrievalParams(Params):
    length: int = Field(2048, ge=256, le=131072)
    records: int | None = Field(None, ge=1, description="default: max(4, length // 128)")
    value_digits: int = Field(10, ge=1, le=20)
    queries: int = Field(1, ge=1, le=8, description="training: further queries after the first")
    stratified: bool = Field(True, description="sample i asks depth (i mod 5) / 4; else at random")

    @model_validator(mode="after")
    def _fits(self) -> "RetrievalParams":
        if self.record_len > BLOCK - 1:
            raise ValueError("a record must fit inside one 32-token block")
        if self.num_records + 1 > self.length // BLOCK - 1:
            raise ValueError(f"{self.num_records} records need more blocks than {self.length} tokens")
        return self

    @property
    def record_len(self) -> int:
        return KEY_LEN + 1 + self.value_digits + 1

    @property
    def num_records(self) -> int:
        return self.records if self.records is not None else max(4, self.length // 128)


def _query(key: str) -> str:
    return f"\n?{key}="


class Retrieval:
    name = "retrieval"
    params_model = RetrievalParams

    def generate(self, rng: random.Random, params: RetrievalParams, index: int) -> Sample:
        R, rec_len = params.num_records, params.record_len
        keys = ["".join(rng.choices(string.ascii_uppercase, k=KEY_LEN)) for _ in range(R)]
        while len(set(keys)) < R:  # distinct keys: a query has one right answer
            keys = ["".join(rng.choices(string.ascii_uppercase, k=KEY_LEN)) for _ in range(R)]
        values = ["".join(rng.choices(string.digits, k=params.value_digits)) for _ in range(R)]
        tail = len(_query(keys[0]))
        # Token positions: BOS at 0, filler (with records) at 1 .. hay_end - 1, the query after it.
        hay_end = params.length - tail
        full_blocks = [b for b in range(1, hay_end // BLOCK)]  # blocks wholly inside the filler
        blocks = [0, *sorted(rng.sample(full_blocks, R - 1))]
        starts = []
        for b in blocks:
            lo = max(1, b * BLOCK)
            starts.append(rng.randint(lo, b * BLOCK + BLOCK - rec_len))
        text = rng.choices(FILLER, k=hay_end - 1)
        for s, k, v in zip(starts, keys, values):
            text[s - 1:s - 1 + rec_len] = list(f"{k}={v};")
        # Records are in position order, so the record list's index is its depth.
        if params.stratified:
            first = round((index % 5) / 4 * (R - 1))
        else:
            first = rng.randrange(R)
        others = [j for j in range(R) if j != first]
        more_idx = rng.sample(others, min(params.queries - 1, len(others)))
        prompt = "".join(text) + _query(keys[first])
        more = tuple((_query(keys[j]), values[j]) for j in more_idx)
        return Sample(self.name, prompt, values[first], more=more,
                      meta={"length": params.length, "records": R, "depth_index": first,
                            "position": starts[first], "block": blocks[first]})

    score = staticmethod(exact_match)

    def max_new_tokens(self, params: RetrievalParams) -> int:
        return params.value_digits + 1
