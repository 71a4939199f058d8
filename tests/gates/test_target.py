"""The gate machinery end to end on the real target with a throwaway random-weight checkpoint (the
trained one is not needed to test the plumbing): engine runs, answer-bounded acceptance lengths,
references recorded and read back, a tampered reference failing; and the planted bugs' patches
really change what the engine does (their gate failures need the trained checkpoint:
test_planted_bugs.py)."""

from __future__ import annotations

import pytest
import torch

from certify.gating.report import write_report
from certify.gating.run import run_gate
from certify.gating.files import ReferenceStore
from certify.gating.schema import GateFile
from impl.gates.target import FlashNextGates, answer_steps
from impl.model.admission import Request
from impl.model.checkpoint import save_checkpoint
from impl.model.engine import Engine
from impl.model.engine_config import EngineConfig, SpeculativeConfig
from impl.tasks.tokenizer import END
from spec.config import ModelConfig
from spec.model import init_weights
from tests.gates.planted_bugs import gdn_state_reset_at_chunks, sink_block_dropped, verify_drops_bonus

TINY = ModelConfig.tiny()


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def random_target(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "random.safetensors"
    save_checkpoint(path, init_weights(TINY, seed=0, dtype=torch.bfloat16), TINY)
    return FlashNextGates(checkpoint=path, device="cpu")


def test_answer_steps_count_only_verify_steps_inside_the_answer():
    # tokens: first from the context step, then steps of 3, 2, 4 tokens; END at index 4
    tokens = [5, 6, 7, 8, END, 9, 9, 9, 9, 9]
    assert answer_steps(tokens, [3, 2, 4]) == [3, 2]
    assert answer_steps([5, END], [2, 2]) == [2]
    assert answer_steps([5, 6, 7], [2, 2]) == [2]            # no END: the whole generation


def test_a_gate_runs_end_to_end_records_and_rechecks(random_target, tmp_path):
    gate = GateFile.model_validate({
        "gate": "plumbing", "summary": "mqar at draft 1 against identity", "why": "the machinery",
        "tier": "premerge", "engine": {"speculative": {"draft_length": 1}},
        "tasks": {"mqar": {"eval_set": "mqar", "samples": 2}},
        "checks": [{"kind": "accuracy", "task": "mqar"},
                   {"kind": "acceptance_length", "task": "mqar"},
                   {"kind": "paired_delta", "task": "mqar"}]})
    store = ReferenceStore(tmp_path / "refs")
    first = run_gate(gate, random_target, store, record=True)
    assert first.status == "recorded" and len(first.recorded) == 2
    assert store.save()
    again = run_gate(gate, random_target, ReferenceStore(tmp_path / "refs"))
    assert again.status == "passed", again.summary()
    al = next(c for c in again.checks if c.kind == "acceptance_length")
    assert 1.0 <= al.measured <= 2.0
    write_report(again, tmp_path / "reports")
    # a reference claiming a far longer acceptance than this engine delivers fails the floor
    refs = ReferenceStore(tmp_path / "refs")
    f = refs.files["mqar"]
    for r in f.references:
        if r.engine["speculative"]:
            refs.add("mqar", f.sha256, r.model_copy(update={"acceptance_length": 2.0 * al.measured}),
                     overwrite=True)
    refs.save()
    bad = run_gate(gate, random_target, ReferenceStore(tmp_path / "refs"))
    assert bad.status == "failed"


def _run(weights, prompt, k=0, chunk=64, hook=None):
    spec = SpeculativeConfig(draft_length=k) if k else None
    e = Engine(EngineConfig(model="tiny", max_batch_size=1, max_num_tokens=chunk, max_seq_len=256,
                            speculative=spec), weights)
    if hook:
        e.propose_hook = hook
    return e.generate([Request(request_id="r", prompt=tuple(prompt), max_new_tokens=8)])


def test_the_planted_bugs_change_what_the_engine_does():
    weights = init_weights(TINY, seed=0, dtype=torch.bfloat16)
    prompt = torch.randint(4, 256, (150,), generator=torch.Generator().manual_seed(2)).tolist()
    plain = _run(weights, prompt).results["r"].tokens
    with sink_block_dropped():
        assert _run(weights, prompt).results["r"].tokens != plain
    with gdn_state_reset_at_chunks():
        assert _run(weights, prompt).results["r"].tokens != plain
    # drafts replaced by the true greedy continuation: every verify step accepts everything
    truth = {len(prompt) + i: t for i, t in enumerate(plain)}

    def oracle(rid, first, drafts):
        return [truth.get(first + j, 0) for j in range(len(drafts))]

    good = _run(weights, prompt, k=3, hook=oracle).results["r"]
    with verify_drops_bonus():
        bug = _run(weights, prompt, k=3, hook=oracle).results["r"]
    assert good.tokens == bug.tokens == plain
    assert good.acceptance_length > bug.acceptance_length
