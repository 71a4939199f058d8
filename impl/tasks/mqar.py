"""Multi-query associative recall (MQAR, as in the Zoology benchmark and the Gated DeltaNet paper),
in a generated form: the prompt lists key=value pairs, then asks for one key's value; training
examples ask further keys in turns after the answer, each query followed by its value (Zoology's
interleaved form).

    AB=12 QX=08 MD=77 ... KE=40
    ?QX=
    ->  08                      (training turns: ``\n?KE=`` -> ``40``, ``\n?AB=`` -> ``12``, ...)

Keys are two distinct capital letters, values two digits (repeats allowed, so a value says nothing
about its key; a guess is right 1 time in 100). Each query sits right before its answer: the recall
is one hop (key -> value), the hop the GDN literature's MQAR measures. Listing the queries first and
the values after adds a second hop (the i-th answer -> the i-th listed key), which the tiny model's
single attention layer cannot chain to the first. With 32 pairs a prompt is about 200 tokens, seven
32-token blocks: more than the sparse attention's fixed window (the sink block and the last two
blocks) holds, so a value comes back through the gated delta rule's key-value state or through an
index-selected block. The prompts are also longer than the gates' chunk budget, so the recurrent
state must cross prefill chunk boundaries intact.
"""

from __future__ import annotations

import random
import string

from pydantic import Field

from impl.tasks.base import Params, Sample, exact_match


class MqarParams(Params):
    pairs: int = Field(32, ge=2, le=200)
    queries: int = Field(1, ge=1, le=32, description="training: further queries after the first")


def _query(key: str) -> str:
    return f"\n?{key}="


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
        first, *more = asked
        prompt = f"{pairs}{_query(keys[first])}"
        return Sample(self.name, prompt, values[first],
                      more=tuple((_query(keys[i]), values[i]) for i in more),
                      meta={"pairs": params.pairs, "queries": params.queries, "depth_index": first})

    score = staticmethod(exact_match)

    def max_new_tokens(self, params: MqarParams) -> int:
        return 3  # two digits and END
