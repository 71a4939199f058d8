"""The training loop at a reduced size on the CPU: the loss falls, a run split in two (stop, save,
resume in a new process state) ends bit for bit where an unbroken run ends, through both phases, and
the export writes a checkpoint the engine loads."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from impl.train.data import DataConfig, make_batch
from impl.train.train_tiny import Run, TrainConfig, greedy_prefix

SMALL = TrainConfig(seed=1, trunk_steps=6, mtp_steps=2, lr=3e-3, mtp_lr=3e-3, warmup=1,
                    dense_frac=0.34, qat_frac=0.5, unroll=2,
                    data=DataConfig(tokens=1200, retrieval_lengths=(256,), max_batch=8))


@pytest.fixture(scope="module", autouse=True)
def _threads():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: CPU scatter-adds (the embedding backward) are then ordered
    yield
    torch.set_num_threads(before)


def _answer_loss(run: Run, batch) -> float:
    run.model.eval()
    with torch.no_grad():
        logits, _ = run.model(batch.ids)
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, 256), batch.ids[:, 1:].reshape(-1),
                         reduction="none").view(batch.ids.shape[0], -1)
    m = batch.taught[:, 1:]
    return float((ce * m).sum() / m.sum())


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory):
    run = Run(tmp_path_factory.mktemp("a"), SMALL, "cpu")
    probe = make_batch(99, "probe", 0, SMALL.data)
    before = _answer_loss(run, probe)
    losses = []
    assert run.train(math.inf, on_step=lambda r, e: losses.append(e)) is True
    return run, before, _answer_loss(run, probe), losses


def test_loss_falls(unbroken):
    run, before, after, losses = unbroken
    assert [e["phase"] for e in losses] == ["trunk"] * 6 + ["mtp"] * 2
    assert after < before - 0.5, (before, after)
    assert run.state["phase"] == "export"


def test_resume_continues_identically(unbroken, tmp_path):
    run, *_ = unbroken
    first = Run(tmp_path, SMALL, "cpu")
    assert first.train(math.inf, max_steps=4) is False          # stops mid-trunk and saves
    second = Run(tmp_path, None, "cpu")                         # a fresh process's view
    assert (second.state["phase"], second.state["step"]) == ("trunk", 4)
    assert second.train(math.inf, max_steps=3) is False         # through the phase change
    assert (second.state["phase"], second.state["step"]) == ("mtp", 1)
    third = Run(tmp_path, None, "cpu")
    assert third.train(math.inf) is True
    a, b = run.model.state_dict(), third.model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_different_configuration_is_refused(tmp_path):
    Run(tmp_path, SMALL, "cpu").save()
    with pytest.raises(SystemExit):
        Run(tmp_path, SMALL.model_copy(update={"seed": 2}), "cpu")


def test_greedy_prefix_stops_after_the_first_wrong_answer_token():
    batch = make_batch(0, "probe", 3, SMALL.data)
    V = 256
    logits = F.one_hot(torch.cat([batch.ids[:, 1:], batch.ids[:, :1]], 1), V).float()
    tokens, valid = greedy_prefix(logits, batch)                 # a perfect trunk: all of it
    assert torch.equal(tokens, batch.ids)
    b, t = 0, int(batch.prompt_lens[0]) + 1                      # now wrong at answer token t
    logits[b, t - 1] = F.one_hot(torch.tensor((int(batch.ids[b, t]) + 1) % V), V).float()
    tokens, valid = greedy_prefix(logits, batch)
    assert int(tokens[b, t]) != int(batch.ids[b, t]) and bool(valid[b, t]) and not bool(valid[b, t + 1])


def test_export_writes_a_checkpoint_and_card_the_gate_target_runs(unbroken, tmp_path):
    from impl.gates.target import FlashNextGates
    from impl.train.export import export

    run, *_ = unbroken
    out = tmp_path / "tiny.safetensors"
    export(run, out, counts={"mqar": 2}, ablation={"mqar": 2})
    assert out.stat().st_size < 16 * 2**20
    card = out.with_suffix(".md").read_text()
    assert "| seed | 1 |" in card and "`mqar`" in card
    target = FlashNextGates(checkpoint=out, device="cpu")
    assert target.unavailable() is None
    res = target.evaluate({}, "mqar", 2)
    assert len(res.scores) == 2 and res.accepted == []


def test_complete_adds_what_the_export_left_out_and_keeps_the_file(unbroken, tmp_path):
    """``complete_card`` measures the sets an export's budget left out on the same weights and
    rewrites only the card; the export's own figures win where both exist."""
    from impl.train.export import complete_card, export

    run, *_ = unbroken
    out = tmp_path / "tiny.safetensors"
    export(run, out, counts={"mqar": 2}, ablation={}, status="interim")
    exported = out.read_bytes()
    gained = complete_card(run, out, {"mqar": 1, "retrieval_512": 1}, {"mqar": 2})
    assert out.read_bytes() == exported
    assert gained == {"mqar": ["accuracy_without_index_selection"],
                      "retrieval_512": ["samples", "accuracy", "acceptance_length_k3",
                                        "acceptance_length_k7"]}
    card = out.with_suffix(".md").read_text()
    assert "**Status: interim**" in card                    # kept from the card it rewrites
    assert "| `mqar` | 2 |" in card and "| `retrieval_512` | 1 |" in card
    assert "Measured after the export" in card and "`retrieval_512`: n, accuracy" in card


def test_card_rows_follow_the_evaluation_sets_order():
    from pathlib import Path

    from impl.train.export import model_card
    card = model_card(Path("x.safetensors"), SMALL, {"elapsed": 60.0},
                      {"retrieval_2k": {"accuracy_without_index_selection": 20.0},
                       "mqar": {"samples": 4, "accuracy": 75.0}, "arithmetic": {"samples": 2}})
    rows = [line.split("`")[1] for line in card.splitlines() if line.startswith("| `")]
    assert rows == ["arithmetic", "mqar", "retrieval_2k"]


def test_complete_refuses_a_checkpoint_of_other_weights(unbroken, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from impl.train.export import complete_card, export

    run, *_ = unbroken
    out = tmp_path / "tiny.safetensors"
    export(run, out, counts={}, ablation={})
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (a safetensors handle)
    name = min(k for k, t in tensors.items() if t.is_floating_point())
    tensors[name] = tensors[name] + 1
    save_file(tensors, str(out), metadata=meta)
    card = out.with_suffix(".md").read_text()
    with pytest.raises(ValueError, match=f"not exported from the training state.*{name}"):
        complete_card(run, out, {"mqar": 1}, {})
    assert out.with_suffix(".md").read_text() == card


def test_an_extension_restarts_the_schedule_and_reruns_mtp(unbroken, tmp_path):
    from impl.train.train_tiny import Extension, _lr
    run, *_ = unbroken
    torch.save(run.state | {"model": run.model.state_dict()}, tmp_path / "state.pt")
    resumed = Run(tmp_path, SMALL, "cpu")               # the first --config is accepted again
    ext = Extension(steps=3, lr=1e-3, warmup=1, attention="dense", weights={"mqar": 1.0})
    resumed.extend(ext)
    assert (resumed.state["phase"], resumed.state["step"]) == ("trunk", 6)
    with pytest.raises(SystemExit, match="still in its trunk phase"):
        resumed.extend(ext)                            # a repeated --extend is refused
    tc = resumed.tc
    assert tc.total_trunk_steps == 9 and tc.extension_at(5) is None and tc.extension_at(7) == (6, ext)
    assert _lr(tc, 6, 9, SMALL.lr) == pytest.approx(1e-3)           # warm restart at the new peak
    assert _lr(tc, 7, 9, SMALL.lr) == pytest.approx(1e-3)           # the cosine from its peak
    assert _lr(tc, 8, 9, SMALL.lr) == pytest.approx(0.55e-3)        # halfway to 10 % of it
    assert _lr(tc, 5, 9, SMALL.lr) == pytest.approx(_lr(SMALL, 5, 6, SMALL.lr))
    assert tc.data_at("trunk", 7).weights == {"mqar": 1.0} and tc.data_at("mtp", 7) == SMALL.data
    seen = []
    assert resumed.train(math.inf, on_step=lambda r, e: seen.append((e["phase"], e["task"]))) is True
    assert seen == [("trunk", "mqar")] * 3 + [("mtp", t) for t in [s for p, s in seen[3:]]]
    assert [p for p, _ in seen] == ["trunk"] * 3 + ["mtp"] * 2
    again = Run(tmp_path, None, "cpu")
    assert again.tc.extensions == (ext,) and again.state["phase"] == "export"


def test_two_extensions_at_once_with_their_own_data_and_mtp_length(unbroken, tmp_path):
    from impl.train.train_tiny import Extension
    run, *_ = unbroken
    torch.save(run.state | {"model": run.model.state_dict()}, tmp_path / "state.pt")
    resumed = Run(tmp_path, SMALL, "cpu")
    dense = Extension(steps=2, lr=1e-3, warmup=1, attention="dense", weights={"mqar": 1.0})
    sparse = Extension(steps=2, lr=5e-4, warmup=1, weights={"retrieval": 1.0},
                       retrieval_lengths=(256,), retrieval_queries=8, mtp_steps=1)
    resumed.extend(dense, sparse)
    tc = resumed.tc
    assert (resumed.state["phase"], resumed.state["step"]) == ("trunk", 6)
    assert tc.extension_at(7) == (6, dense) and tc.extension_at(8) == (8, sparse)
    assert tc.data_at("trunk", 9).retrieval_lengths == (256,)
    assert tc.data_at("trunk", 9).retrieval_queries == 8
    assert tc.data_at("trunk", 7).retrieval_lengths == SMALL.data.retrieval_lengths
    assert tc.current_mtp_steps == 1 and SMALL.mtp_steps != 1
    seen = []
    assert resumed.train(math.inf, on_step=lambda r, e: seen.append((e["phase"], e["task"]))) is True
    assert seen[:4] == [("trunk", "mqar")] * 2 + [("trunk", "retrieval")] * 2
    assert [p for p, _ in seen[4:]] == ["mtp"]


def test_answer_weighted_index_loss_moves_the_index_loss():
    """An extension's ``index_answer_weight`` weights the answer rows of the index loss: the same
    batch at the same weights reads another index loss than with the plain mean."""
    from impl.train.data import make_batch
    from impl.train.model import TrainModel
    from impl.train.train_tiny import Extension, trunk_loss
    from spec.config import ModelConfig
    model = TrainModel(ModelConfig.tiny(), seed=SMALL.seed)
    base = SMALL.model_copy(update={"extensions": (
        Extension(steps=1, lr=1e-3, weights={"retrieval": 1.0}, retrieval_lengths=(512,)),)})
    weighted = SMALL.model_copy(update={"extensions": (
        Extension(steps=1, lr=1e-3, weights={"retrieval": 1.0}, retrieval_lengths=(512,),
                  index_answer_weight=100.0),)})
    step = SMALL.trunk_steps
    batch = make_batch(SMALL.seed, "trunk", step, base.data_at("trunk", step))
    assert batch.task == "retrieval"
    model.train()
    _, plain = trunk_loss(model, batch, None, base, step)
    _, answered = trunk_loss(model, batch, None, weighted, step)
    assert plain["ce"] == answered["ce"]
    assert plain["index"] > 0 and answered["index"] > 0 and plain["index"] != answered["index"]


def test_an_index_only_extension_moves_only_the_index_then_the_trunk_learns_again(unbroken, tmp_path):
    """``learn="index"``: the steps of that extension change the trunk's QSA index weights and
    nothing else of the trunk (every other weight and calibration buffer bit for bit); a run resumed
    inside it still trains the index alone; the extension after it, in the same call, trains the
    whole trunk again."""
    from impl.train.train_tiny import Extension
    run, *_ = unbroken
    torch.save(run.state | {"model": run.model.state_dict()}, tmp_path / "state.pt")
    resumed = Run(tmp_path, SMALL, "cpu")
    index_only = Extension(steps=2, lr=1e-2, warmup=0, weights={"retrieval": 1.0},
                           retrieval_lengths=(256,), index_answer_weight=10.0, learn="index",
                           mtp_steps=0)
    whole = Extension(steps=1, lr=1e-3, warmup=0, weights={"mqar": 1.0}, mtp_steps=0)
    resumed.extend(index_only, whole)
    names = {id(p): n for n, p in resumed.model.named_parameters()}
    index = {names[id(p)] for p in resumed.model.index_parameters()}
    assert index and all(".mixer." in n and not n.startswith("mtp_") for n in index)
    before = {n: t.clone() for n, t in resumed.model.state_dict().items()}

    assert resumed.train(math.inf, max_steps=1) is False            # stops inside the extension
    again = Run(tmp_path, None, "cpu")                              # and resumes there
    assert again.learner == "index"
    assert again.train(math.inf, max_steps=1) is False
    after = again.model.state_dict()
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert moved == index                                           # the index learned, alone

    middle = {n: t.clone() for n, t in after.items()}
    assert again.train(math.inf) is True                            # the switch inside one call
    final = again.model.state_dict()
    moved = {n for n in middle if not torch.equal(middle[n], final[n])}
    trunk = {n for n, _ in again.model.named_parameters() if not n.startswith("mtp_")}
    assert trunk - index <= moved                                  # every trunk weight learns again


def test_an_index_only_step_without_candidate_blocks_is_a_no_op(unbroken, tmp_path, monkeypatch):
    """A batch on which no row has more candidate blocks than it selects (short contexts: MQAR and
    arithmetic at the tiny geometry) gives a constant index loss, hence no gradient: an index-only
    step over it passes without moving a weight instead of failing in the backward."""
    import impl.train.model as train_model
    from impl.train.train_tiny import Extension
    run, *_ = unbroken
    torch.save(run.state | {"model": run.model.state_dict()}, tmp_path / "state.pt")
    resumed = Run(tmp_path, SMALL, "cpu")
    resumed.extend(Extension(steps=1, lr=1e-2, warmup=0, weights={"mqar": 1.0}, learn="index",
                             mtp_steps=0))
    # what index_kl returns when no row chooses (this small config's contexts do choose)
    monkeypatch.setattr(train_model, "index_kl", lambda q, k, scores, *a, **kw: scores.new_zeros(()))
    before = {n: t.clone() for n, t in resumed.model.state_dict().items()}
    seen = []
    assert resumed.train(math.inf, on_step=lambda r, e: seen.append(e)) is True
    assert [e["phase"] for e in seen] == ["trunk"] and seen[0]["index"] == 0.0
    after = resumed.model.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_an_extensions_index_margin_reaches_the_index_loss():
    """``index_margin`` adds the ranking hinge on the answer rows: the same batch at the same weights
    reads a larger index loss with it, and the same cross-entropy."""
    from impl.train.model import TrainModel
    from impl.train.train_tiny import Extension, trunk_loss
    from spec.config import ModelConfig
    model = TrainModel(ModelConfig.tiny(), seed=SMALL.seed)
    ext = dict(steps=1, lr=1e-3, weights={"retrieval": 1.0}, retrieval_lengths=(512,))
    base = SMALL.model_copy(update={"extensions": (Extension(**ext),)})
    hinged = SMALL.model_copy(update={"extensions": (Extension(**ext, index_margin=100.0),)})
    step = SMALL.trunk_steps
    batch = make_batch(SMALL.seed, "trunk", step, base.data_at("trunk", step))
    model.train()
    _, plain = trunk_loss(model, batch, None, base, step)
    _, with_margin = trunk_loss(model, batch, None, hinged, step)
    assert plain["ce"] == with_margin["ce"]
    assert with_margin["index"] > plain["index"] + 1.0     # a 100-wide margin is far from met
