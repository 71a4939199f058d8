"""Multi-query associative recall (MQAR, as in the Zoology benchmark and the Gated DeltaNet paper),
in a generated form: the prompt lists key=value pairs, then the queried keys; the answer is their
values, in order.

    AB=12 QX=08 MD=77 ... KE=40
    ? QX KE AB
    ->  08 40 12

Keys are two distinct capital letters, values two digits (repeats allowed, so a value says nothing
about its key). With 32 pairs and 8 queries a prompt is about 230 tokens, seven 32-token blocks: more
than the sparse attention's fixed window (the sink block and the last two blocks) holds, so each value
comes back through the gated delta rule's key-value state (what MQAR measures in the GDN literature)
or through an index-selected block. The prompts are also longer than the gates' chunk budget, so the
recurrent state must cross prefill chunk boundaries intact.
"""

from __future__ import annotations

import random
import string

from pydantic import Field

from impl.tasks.base import Params, Sample, exact_match


class MqarParams(Params):
    pairs: int = Field(32, ge=2, le=200)
    queries: int = Field(8, ge=1, le=32)


class Mqar:
    name = "mqar"
    params_model = MqarParams

    def generate(self, rng: random.Random, params: MqarParams, index: int) -> Sample:
        if params.queries > params.pairs:
            raise ValueError("mqar: queries must not exceed pairs")
        letters = string.ascii_uppercase
        keys = rng.sample([a + b for a in letters for b in letters], params.pairs)
        values = [f"{rng.randint(0, 99):02d}" for _ in keys]
        asked = rng.sample(range(params.pairs), params.queries)
        pairs = " ".join(f"{k}={v}" for k, v in zip(keys, values))
        prompt = f"{pairs}\n? {' '.join(keys[i] for i in asked)}\n"
        answer = " ".join(values[i] for i in asked)
        return Sample(self.name, prompt, answer, meta={"pairs": params.pairs,
                                                       "queries": params.queries})

    score = staticmethod(exact_match)

    def max_new_tokens(self, params: MqarParams) -> int:
        return 3 * params.queries + 1
