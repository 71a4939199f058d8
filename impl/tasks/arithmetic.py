"""GSM8K-style arithmetic word problems with a worked answer ending in ``#### N``.

A problem is a start quantity and one to three events, each one sentence; the question asks for the
quantity at the end. The worked answer states one equation per arithmetic step and ends, as GSM8K's
answers do, with ``#### N``. Scoring is GSM8K's: the number after ``####`` must equal N exactly (the
worked steps are not graded).

    Q: Mia has 14 pens. She buys 3 boxes of 6 pens each. She gives 9 pens to Leo. How many pens
    does Mia have now?
    A: 3*6=18. 14+18=32. 32-9=23.
    #### 23

Numbers stay small (operands up to 60, products of one-digit factors by at most 12, every
intermediate in 0..999) so that a byte-level model of a few million parameters can learn the digits;
what the task needs from the model is reading numbers back from earlier sentences (the sparse
attention window holds the last two blocks, the sink and two chosen blocks; the recurrent state the
rest) and carrying a running value through the steps.
"""

from __future__ import annotations

import random
import re

from pydantic import Field

from impl.tasks.base import Params, Sample
from impl.tasks.tokenizer import END, decode

NAMES = ("Mia", "Leo", "Ava", "Noah", "Emma", "Liam", "Zoe", "Omar", "Ivy", "Sam", "Nora", "Ben",
         "Lily", "Max", "Ella", "Finn", "Ruby", "Theo", "Iris", "Hugo")
ITEMS = ("pens", "apples", "stickers", "marbles", "cards", "books", "coins", "shells", "stamps",
         "beads", "cookies", "pencils", "buttons", "candles", "rocks")
PACKS = ("boxes", "bags", "packs", "crates", "jars")
PRONOUN = {n: ("She" if n in {"Mia", "Ava", "Emma", "Zoe", "Ivy", "Nora", "Lily", "Ella", "Ruby",
                              "Iris"} else "He") for n in NAMES}
MAX_VALUE = 999
_ANSWER = re.compile(r"####\s*(-?\d+)\s*$")


class ArithmeticParams(Params):
    min_events: int = Field(1, ge=1, le=3)
    max_events: int = Field(3, ge=1, le=3)
    max_start: int = Field(60, ge=5, le=200)


def _event(rng: random.Random, name: str, item: str, cur: int) -> tuple[str, list[str], int]:
    """One sentence, its worked steps and the new quantity; kinds that would leave 0..999 are
    redrawn."""
    pron = PRONOUN[name]
    while True:
        kind = rng.choice(("add", "sub", "buy", "sell", "double"))
        if kind == "add":
            x = rng.randint(2, 30)
            r = cur + x
            text, steps = f"{pron} finds {x} more {item}.", [f"{cur}+{x}={r}."]
        elif kind == "sub":
            if cur < 3:
                continue
            x = rng.randint(1, min(30, cur - 1))
            friend = rng.choice([n for n in NAMES if n != name])
            r = cur - x
            text, steps = f"{pron} gives {x} {item} to {friend}.", [f"{cur}-{x}={r}."]
        elif kind == "buy":
            k, m, pack = rng.randint(2, 9), rng.randint(2, 12), rng.choice(PACKS)
            r = cur + k * m
            text = f"{pron} buys {k} {pack} of {m} {item} each."
            steps = [f"{k}*{m}={k * m}.", f"{cur}+{k * m}={r}."]
        elif kind == "sell":
            k, m, pack = rng.randint(2, 9), rng.randint(2, 12), rng.choice(PACKS)
            if k * m > cur:
                continue
            r = cur - k * m
            text = f"{pron} sells {k} {pack} of {m} {item}."
            steps = [f"{k}*{m}={k * m}.", f"{cur}-{k * m}={r}."]
        else:
            if cur > 200:
                continue
            r = 2 * cur
            text, steps = f"{pron} doubles the {item}.", [f"{cur}*2={r}."]
        if 0 <= r <= MAX_VALUE:
            return text, steps, r


class Arithmetic:
    name = "arithmetic"
    params_model = ArithmeticParams

    def generate(self, rng: random.Random, params: ArithmeticParams, index: int) -> Sample:
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        cur = rng.randint(5, params.max_start)
        sentences, steps = [f"{name} has {cur} {item}."], []
        for _ in range(rng.randint(params.min_events, params.max_events)):
            text, worked, cur = _event(rng, name, item, cur)
            sentences.append(text)
            steps += worked
        question = f"How many {item} does {name} have now?"
        prompt = f"Q: {' '.join(sentences)} {question}\nA:"
        answer = f" {' '.join(steps)}\n#### {cur}"
        return Sample(self.name, prompt, answer, meta={"result": cur, "steps": len(steps)})

    def score(self, sample: Sample, generated: list[int]) -> float:
        if END not in generated:
            return 0.0
        got = _ANSWER.search(decode(generated))
        return 1.0 if got is not None and int(got.group(1)) == int(sample.meta["result"]) else 0.0

    def max_new_tokens(self, params: ArithmeticParams) -> int:
        # " " + up to 6 steps of "999+999=999. " (13) + "\n#### 999" (9) + END
        return 1 + 6 * 13 + 9 + 1
