"""The tasks: generators, token layout, scoring, and the pinned evaluation sets."""

from __future__ import annotations

import random

import pytest

from impl.tasks import TASKS
from impl.tasks.evalsets import EVAL_SETS, content_hash, eval_prompts, generate, samples
from impl.tasks.mqar import MqarParams
from impl.tasks.retrieval import BLOCK, RetrievalParams
from impl.tasks.tokenizer import BOS, END, END_REPEAT, PAD, decode, encode
from spec.config import ModelConfig


@pytest.mark.parametrize("name", sorted(EVAL_SETS))
def test_every_evaluation_set_has_its_pinned_content_hash(name):
    spec = EVAL_SETS[name]
    got = content_hash(samples(name))
    assert got == spec.sha256, (f"evaluation set {name!r} changed (sha256 {got}); the gates' "
                                "references of the old content no longer apply")
    assert len(samples(name)) == spec.size


def test_the_first_samples_do_not_depend_on_the_set_size():
    spec = EVAL_SETS["mqar"]
    assert generate(spec, 5) == list(samples("mqar")[:5])


def test_reserved_ids_match_the_tiny_config_and_never_occur_in_text():
    assert PAD == ModelConfig.tiny().pad_id
    for name in EVAL_SETS:
        for s in samples(name)[:20]:
            ids = s.prompt_ids() + s.answer_ids()
            assert ids[0] == BOS and ids[-1] == END
            assert PAD not in ids and BOS not in ids[1:] and END not in ids[:-1]
            assert max(ids) < ModelConfig.tiny().vocab_size
    with pytest.raises(ValueError):
        encode("caf\u00e9")
    with pytest.raises(ValueError):
        encode("a\x00b")


def test_training_example_teaches_answers_and_the_end_repeats_only():
    s = TASKS["retrieval"].generate(random.Random(1), RetrievalParams(length=512, queries=3), 0)
    ids, mask = s.training_example()
    assert len(ids) == len(mask) and ids[:len(s.prompt_ids())] == s.prompt_ids()
    taught = "".join(chr(i) if i != END else "$" for i, m in zip(ids, mask) if m)
    assert taught == s.answer + "".join(a for _, a in s.more) + "$" * END_REPEAT
    assert len(s.more) == 2


def test_arithmetic_scoring_reads_the_number_after_the_marks():
    task = TASKS["arithmetic"]
    s = samples("arithmetic")[0]
    right = encode(s.answer) + [END, 65, 66]
    assert task.score(s, right) == 1.0
    assert task.score(s, encode(" 1+1=2.\n#### " + str(s.meta["result"])) + [END]) == 1.0
    assert task.score(s, encode(s.answer)) == 0.0          # no END: the answer never finished
    assert task.score(s, encode(" #### 1000000") + [END]) == 0.0
    for smp in samples("arithmetic")[:50]:
        assert task.score(smp, smp.answer_ids()) == 1.0
        assert len(smp.answer_ids()) <= task.max_new_tokens(EVAL_SETS["arithmetic"].task_params())


def test_mqar_answer_is_the_queried_value():
    s = samples("mqar")[3]
    listed, asked = s.prompt.split("\n")
    pairs = dict(p.split("=") for p in listed.split(" "))
    assert asked.startswith("?") and asked.endswith("=")
    assert s.answer == pairs[asked[1:-1]] and not s.more
    assert TASKS["mqar"].score(s, s.answer_ids()) == 1.0
    assert TASKS["mqar"].score(s, s.answer_ids()[:-2] + [END]) == 0.0


def test_mqar_training_turns_follow_their_queries():
    s = TASKS["mqar"].generate(random.Random(5), MqarParams(pairs=12, queries=4), 0)
    pairs = dict(p.split("=") for p in s.prompt.split("\n")[0].split(" "))
    assert len(s.more) == 3
    asked = [s.prompt.split("\n")[1], *(q.strip("\n") for q, _ in s.more)]
    assert len(set(asked)) == 4
    assert [s.answer, *(a for _, a in s.more)] == [pairs[q[1:-1]] for q in asked]
    ids, taught = s.training_example()
    assert sum(taught) == 4 * 2 + END_REPEAT  # the four 2-digit answers and the closing END repeats


@pytest.mark.parametrize("name", ["retrieval_512", "retrieval_2k", "retrieval_8k"])
def test_retrieval_layout(name):
    spec = EVAL_SETS[name]
    params = spec.task_params()
    for i, s in enumerate(samples(name)[:10]):
        ids = s.prompt_ids()
        assert len(ids) == params.length
        text = decode(ids[1:])
        key = text.rsplit("?", 1)[1][:-1]
        record = f"{key}={s.answer};"
        pos = 1 + text.index(record)                 # token position of the record
        assert pos // BLOCK == (pos + len(record) - 1) // BLOCK  # inside one block
        assert s.meta["position"] == pos
        assert text.count(record) == 1
        # depth (i mod 5) / 4 of the record list: depth 0 is the record in the sink block 0
        assert s.meta["depth_index"] == round((i % 5) / 4 * (params.num_records - 1))
        if i % 5 == 0:
            assert s.meta["block"] == 0


def test_training_never_sees_an_evaluation_prompt():
    prompts = eval_prompts("arithmetic")
    assert samples("arithmetic")[7].prompt in prompts and len(prompts) >= 390
