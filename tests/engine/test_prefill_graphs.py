"""The breakable prefill graph's host side on the CPU: buckets, breaks over the step's own rows,
padding rows, the hand-over of the last QSA selection, and its configuration rule.

``PrefillGraphs`` with ``EagerPieces`` runs a captured step's forward again at each replay, its
breaks (the spanwise parts, ``Model.spanwise``) recorded at capture and re-run over the step's own
rows into the static tensors the next piece reads (impl/model/prefill_graphs.py). What it exercises
without a GPU is everything but the capture itself: the token ids filled into the static buffer,
padding rows that never reach a break, the breaks' static outputs (rows past the step's zero), the
eager read-out of the rows that need logits, and the draft layer reading the graph's hidden rows.
In batch-invariant mode every pass of a graphed run equals the spec's forward bit for bit
(tests/engine/spec_replay.py); in the default mode a full bucket equals the eager step bit for bit.
The CUDA capture is tested on the GPU (tests/engine/test_engine_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

from certify.catalog.load import load_catalog
from certify.files.paths import project_paths
from impl.model.engine_config import EngineConfig, RuleContext, check, engine_memory
from impl.model.memory import prefill_break_bytes
from impl.model.model import Span, StepRows
from impl.model.prefill_graphs import Breaks, EagerPieces, PrefillGraphs, token_buckets
from impl.model.trace import Chunk, Scenario, piece_calls
from spec.config import ModelConfig
from tests.engine import test_engine as cpu_tests
from tests.engine.spec_replay import first_mismatch

TINY = ModelConfig.tiny()

SPANWISE_OPS = {"ple_embed", "conv_prefill", "conv_update", "gdn_prefill", "gdn_decode",
                "qk_norm_rope", "qsa_kv_append", "qsa_index_store", "qsa_index_scores",
                "qsa_topk_expand", "qsa_sparse_gqa"}


def _graphed(e):
    """Prefill graphs over the engine's last slot as the scratch one (the tests submit fewer
    requests than ``max_batch_size``), recording the rows of every step they serve."""
    e.prefill_graphs = PrefillGraphs(e.model, e.cache, e.config.max_num_tokens,
                                     capture=EagerPieces(), scratch=e.config.max_batch_size - 1,
                                     max_seq_len=e.config.max_seq_len)
    served: list[tuple[int, int]] = []
    step = e.prefill_graphs.step

    def logged(spans, ids, logit_rows):
        served.append((sum(sp.rows for sp in spans), e.prefill_graphs.bucket(len(ids))))
        return step(spans, ids, logit_rows)
    e.prefill_graphs.step = logged
    e.served = served
    return e


def same_trunk_passes(runs) -> int:
    """Assert that an eager and a prefill-graphed engine (``runs``) ran the same trunk passes with
    the same logits and hidden rows, bit for bit; returns how many held prompt rows."""
    trunk = [[c for c in e.calls if c.kind == "trunk"] for e in runs]
    assert runs[1].prefill_graphs.replays > 0
    assert [c.spans for c in trunk[0]] == [c.spans for c in trunk[1]]
    compared = 0
    for i, (a, b) in enumerate(zip(*trunk)):
        assert torch.equal(a.logits, b.logits), f"trunk pass {i}: logits differ from eager"
        assert torch.equal(a.hidden, b.hidden), f"trunk pass {i}: hidden rows differ from eager"
        compared += any(mode == "prefill" for *_, mode in a.spans)
    return compared


def test_token_buckets():
    assert token_buckets(8192, 131072) == (16, 32, 64, 128, 256, 512, 1024, 2048, 3072, 4096,
                                           6144, 8192)
    assert token_buckets(40, 131072) == (16, 32, 40)
    assert token_buckets(8192, 100) == (16, 32, 64, 100)   # a step is one request at most
    assert token_buckets(10, 64) == (10,)


@pytest.mark.parametrize("kv,state,k,budget", [("bf16", "fp32", None, 40),
                                               ("nvfp4", "bf16", None, 40),
                                               ("fp8", "fp32", 3, 36)])
def test_graphed_prefill_matches_spec_bitwise(weights, kv, state, k, budget):
    # prompts of 37, 5 and 70 tokens: context and mixed steps of up to ``budget`` rows in buckets
    # 16, 32 and the budget, some of them padded
    e = _graphed(cpu_tests._engine(weights, kv=kv, state=state, k=k, budget=budget))
    if k:
        e.force_accept = lambda rid, a: 1 + (e.steps + int(rid[1:])) % (k + 1)
    rep = e.generate(cpu_tests._requests(cpu_tests.LENGTHS))
    served = e.served
    assert e.prefill_graphs.replays == len(served) == rep.step_kinds.get("context", 0) + \
        rep.step_kinds.get("mixed", 0) > 0, (served, rep.step_kinds)
    assert any(n < b for n, b in served), served          # a padded step
    if not k:
        assert rep.step_kinds.get("mixed"), rep.step_kinds
    passes = cpu_tests._replay(e, weights)
    assert first_mismatch(passes) is None, first_mismatch(passes)


def test_index_share_takes_the_selection_a_graphed_step_hands_over(weights):
    """With IndexShare the draft layer reads the trunk's last QSA selection for the prompt rows: a
    graphed context step hands over the one its break computed at this replay. Batch-invariant
    runs with padded buckets give every pass the eager run's bits."""
    from impl.model.engine import Engine
    from impl.model.engine_config import SpeculativeConfig

    runs = []
    for graphed in (False, True):
        config = EngineConfig(model="tiny", max_batch_size=4, max_num_tokens=36,
                              max_seq_len=cpu_tests.MAX_LEN, batch_invariant=True,
                              speculative=SpeculativeConfig(draft_length=3, index_share=True))
        e = Engine(config, weights, log_calls=True)
        if graphed:
            _graphed(e)
        e.force_accept = lambda rid, a, e=e: 1 + (e.steps + int(rid[1:])) % 4
        runs.append((e, e.generate(cpu_tests._requests(cpu_tests.LENGTHS, new=6))))
    (eager, rep_e), (graph, rep_g) = runs
    assert any(n < b for n, b in graph.served), graph.served
    assert {k: r.tokens for k, r in rep_e.results.items()} == \
        {k: r.tokens for k, r in rep_g.results.items()}
    assert [(c.kind, c.spans) for c in eager.calls] == [(c.kind, c.spans) for c in graph.calls]
    for i, (a, b) in enumerate(zip(eager.calls, graph.calls)):
        assert a.logits is None or torch.equal(a.logits, b.logits), f"pass {i} ({a.kind})"
        assert a.hidden is None or torch.equal(a.hidden, b.hidden), f"pass {i} ({a.kind})"


def test_a_full_bucket_gives_the_eager_steps_bits(weights):
    # default mode; prompts of 64 and 15 tokens under a 32-token budget: two context steps of 32
    # rows (bucket 32), then a mixed step of the first request's decode row and the 15-token
    # prompt (bucket 16): every bucket full
    runs = []
    for graphed in (False, True):
        e = cpu_tests._engine(weights, invariant=False, budget=32)
        if graphed:
            _graphed(e)
        e.generate(cpu_tests._requests([64, 15], new=3))
        runs.append(e)
    assert runs[1].served and all(n == b for n, b in runs[1].served), runs[1].served
    assert same_trunk_passes(runs) >= 3


def test_a_padded_prompt_emits_the_eager_tokens(weights):
    # default mode: prompts of 37 and 11 tokens under a 40-token budget, in context and mixed
    # steps, one of them padded at least; padding rows never reach a break, so the requests' caches
    # are the eager run's, and the greedy tokens agree
    reps = []
    for graphed in (False, True):
        e = cpu_tests._engine(weights, invariant=False)
        if graphed:
            _graphed(e)
        reps.append(e.generate(cpu_tests._requests([37, 11], new=6)))
    assert any(n < b for n, b in e.served), e.served
    tokens = [{rid: r.tokens for rid, r in rep.results.items()} for rep in reps]
    assert tokens[0] == tokens[1] and all(tokens[0].values()), tokens


def test_a_break_sees_the_steps_rows_and_leaves_the_padding_rows_zero():
    seen = []

    def fn(rows, x):
        seen.append((rows.rows, x.shape[0]))
        return x * 2
    breaks = Breaks(rows=StepRows.build([Span(0, 0, 8, 0, "prefill")]))
    out = breaks.run(fn, torch.ones(8, 3))               # recorded: the static output of 8 rows
    breaks.mode = "replay"
    breaks.rows = StepRows.build([Span(2, 0, 5, 9, "prefill")])
    call = breaks.calls[0]
    call.inputs = (torch.full((8, 3), float("nan")),)   # a padded replay: rows 5..7 are padding
    call.inputs[0][:5] = 3.0
    breaks.replay(call)
    assert seen == [(8, 8), (5, 5)]
    assert call.out is out
    assert torch.equal(out[:5], torch.full((5, 3), 6.0)) and not out[5:].any()


def test_steps_the_graphs_do_not_serve(weights):
    e = _graphed(cpu_tests._engine(weights, invariant=False))
    g = e.prefill_graphs
    ctx = [Span(0, 0, 20, 0, "prefill")]
    assert g.serves(ctx, {"prefill"}, frames=False)
    assert g.serves(ctx + [Span(1, 20, 21, 7, "decode")], {"prefill", "decode"}, frames=False)
    assert not g.serves([Span(0, 0, 1, 7, "decode")], {"decode"}, frames=False)
    assert not g.serves([Span(0, 0, 4, 7, "verify")], {"verify"}, frames=False)
    assert not g.serves(ctx, {"prefill"}, frames=True)
    assert not g.serves([Span(0, 0, 41, 0, "prefill")], {"prefill"}, frames=False)
    with pytest.raises(ValueError, match="exceed the largest prefill bucket 40"):
        g.bucket(41)


def test_the_pieces_hold_no_spanwise_op():
    cat = load_catalog(project_paths().cells)
    sc = Scenario(name="prefill_graph", why="a context step a prefill graph captures",
                  prefill=(Chunk(chunk=64, context=64),), max_num_tokens=64)
    ops = {c.op for c in piece_calls(sc, cat)}
    assert not ops & SPANWISE_OPS, ops & SPANWISE_OPS
    assert {"linear", "rmsnorm", "moe", "ple_apply", "hc_inject_norm", "hc_first_projection",
            "hc_pre", "hc_up_projection"} <= ops, ops
    assert "logits_cast" not in ops    # the read-out runs after the replay


def _ctx(config: EngineConfig, arch: str) -> RuleContext:
    return RuleContext(config.model_geometry(), load_catalog(project_paths().cells), arch)


def _refusals(config: EngineConfig, arch: str) -> dict[str, str]:
    return {r.rule: r.reason for r in check(config, _ctx(config, arch))}


def test_the_rule_admits_the_target_on_sm90_and_refuses_what_it_cannot_capture():
    base = dict(model="target", device="cuda", prefill_graph="breakable")
    assert "breakable_prefill_graph_on_cuda" not in _refusals(EngineConfig(**base), "sm_90")
    cpu = _refusals(EngineConfig(**dict(base, device="cpu")), "cpu")
    assert "needs device 'cuda'" in cpu["breakable_prefill_graph_on_cuda"]
    for extra, why in [({"batch_invariant": True}, "batch-invariant mode"),
                       ({"torch_only": True}, "torch_only"),
                       ({"moe_backend": "torch"}, "moe::torch")]:
        got = _refusals(EngineConfig(**dict(base, **extra)), "sm_90")
        assert why in got.get("breakable_prefill_graph_on_cuda", ""), (extra, got)


def test_the_spare_slot_is_held_for_the_capture():
    assert EngineConfig(max_batch_size=4, prefill_graph="breakable").cache_slots == 5
    assert EngineConfig(max_batch_size=4).cache_slots == 4


def test_every_bucket_writes_the_largest_buckets_break_outputs(weights):
    """The breaks' static buffers are those of three breaks at the largest bucket's rows, whatever
    the buckets captured: the PLE embedding's, and one set each for the GDN and the QSA mixers,
    which every layer of the kind uses; a break holds no tensor of the piece before it; the memory
    plan counts exactly those bytes."""
    e = _graphed(cpu_tests._engine(weights, invariant=False))
    g = e.prefill_graphs
    g.capture_all()
    assert sorted(g.graphs) == [16, 32, 40]
    kinds = {key[1] for key in g.store}
    assert len(kinds) == 3 and {"gdn", "qsa"} < kinds, sorted(g.store, key=str)
    assert all(t.shape[0] == 40 for t in g.store.values())
    held_ptrs = {t.data_ptr() for t in g.store.values()}
    for graph in g.graphs.values():
        for call in graph.breaks.calls:
            assert {call.out.data_ptr(), *(t.data_ptr() for t in call.inputs)} <= held_ptrs
    held = sum(t.numel() * t.element_size() for t in g.store.values())
    assert held == prefill_break_bytes(TINY, 40, 2)
    config = EngineConfig(model="tiny", device="cuda", max_num_tokens=40, max_seq_len=64,
                          prefill_graph="breakable")
    plan = engine_memory(config, _ctx(config, "sm_90"))
    assert plan.prefill_breaks == held
    assert engine_memory(config.model_copy(update={"prefill_graph": "eager"}),
                         _ctx(config, "sm_90")).prefill_breaks == 0


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph: records when each piece's capture begins (with its pool
    and the stream it runs on) and ends, and when it replays, so the capture protocol of
    ``CudaPieces`` is checked without a GPU."""

    events: list[tuple[str, int]] = []
    begun: list[tuple[object, object]] = []     # (pool, stream) of each capture_begin
    active: list[object] = []                   # the streams entered, innermost last
    made = 0

    def __init__(self):
        self.id = _FakeGraph.made
        _FakeGraph.made += 1

    def capture_begin(self, pool=None):
        self.events.append(("begin", self.id))
        self.begun.append((pool, self.active[-1] if self.active else None))

    def capture_end(self):
        self.events.append(("end", self.id))

    def replay(self):
        self.events.append(("replay", self.id))


class _FakeStream:
    def wait_stream(self, other):
        pass


def test_cuda_pieces_capture_a_piece_around_every_break(monkeypatch):
    import contextlib

    from impl.model import prefill_graphs

    @contextlib.contextmanager
    def entered(stream):
        _FakeGraph.active.append(stream)
        yield
        _FakeGraph.active.pop()

    side = _FakeStream()
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: side)
    monkeypatch.setattr(torch.cuda, "stream", entered)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    _FakeGraph.events, _FakeGraph.begun, _FakeGraph.active, _FakeGraph.made = [], [], [], 0
    events = _FakeGraph.events
    breaks = Breaks(rows=StepRows.build([Span(0, 0, 4, 0, "prefill")]))

    def spanwise(tag):
        def fn(rows, x):
            events.append(("break", tag))
            return x + 1
        return fn

    def forward():
        x = torch.zeros(4, 2)
        for tag in range(3):
            x = breaks.run(spanwise(tag), x)
        events.append(("forward done", -1))
        return x

    replay = prefill_graphs.CudaPieces(torch.device("cpu")).capture(forward, breaks)
    warm, capture = events[:events.index(("begin", 0))], events[events.index(("begin", 0)):]
    assert warm == 2 * [("break", 0), ("break", 1), ("break", 2), ("forward done", -1)]
    assert capture == [("begin", 0), ("end", 0), ("begin", 1), ("end", 1), ("begin", 2),
                       ("end", 2), ("begin", 3), ("forward done", -1), ("end", 3)]
    assert _FakeGraph.begun == [("pool", side)] * 4       # every piece: the shared pool, side stream
    assert breaks.mode == "replay" and breaks.on_break is None and len(breaks.calls) == 3
    assert all(c.out is p for c, p in zip(breaks.calls, breaks.planned, strict=True))
    del events[:]
    breaks.rows = StepRows.build([Span(1, 0, 3, 5, "prefill")])
    replay()
    assert events == [("replay", 0), ("break", 0), ("replay", 1), ("break", 1), ("replay", 2),
                      ("break", 2), ("replay", 3)]


def test_a_bucket_cap_graphs_the_small_steps_and_runs_the_larger_eagerly(weights):
    """``prefill_graph_max_tokens`` caps the buckets: the graphs stop at the cap, a context step of
    more tokens runs eagerly, one within it replays, both emit the eager engine's tokens, and the
    memory plan counts the break buffers of the capped bucket's rows."""
    def capped():
        e = cpu_tests._engine(weights, invariant=False)
        e.config = e.config.model_copy(update={"prefill_graph_max_tokens": 24})
        assert e.config.prefill_graph_tokens == 24
        e.prefill_graphs = PrefillGraphs(e.model, e.cache, e.config.prefill_graph_tokens,
                                         capture=EagerPieces(), scratch=e.config.max_batch_size - 1,
                                         max_seq_len=e.config.max_seq_len)
        return e

    g = capped().prefill_graphs
    assert g.buckets == (16, 24)
    assert g.serves([Span(0, 0, 24, 0, "prefill")], {"prefill"}, frames=False)
    assert not g.serves([Span(0, 0, 25, 0, "prefill")], {"prefill"}, frames=False)
    for length, replayed in ((30, False), (20, True)):
        e = capped()
        got = e.generate(cpu_tests._requests([length], new=3))
        want = cpu_tests._engine(weights, invariant=False).generate(
            cpu_tests._requests([length], new=3))
        tokens = [{rid: r.tokens for rid, r in rep.results.items()} for rep in (got, want)]
        assert tokens[0] == tokens[1] and all(tokens[0].values()), (length, tokens)
        assert (e.prefill_graphs.replays > 0) == replayed, (length, e.prefill_graphs.replays)
    wide = EngineConfig(model="tiny", max_num_tokens=40, prefill_graph_max_tokens=4096)
    assert wide.prefill_graph_tokens == 40
    cuda = EngineConfig(model="tiny", device="cuda", max_num_tokens=40, max_seq_len=64,
                        prefill_graph="breakable", prefill_graph_max_tokens=24)
    assert engine_memory(cuda, _ctx(cuda, "sm_90")).prefill_breaks == prefill_break_bytes(TINY, 24, 2)


def test_the_rule_checks_the_buckets_the_cap_keeps(monkeypatch):
    """The capture rule dispatches the pieces at the buckets the engine captures, the cap's."""
    import impl.model.prefill_graphs as pg

    seen = []
    real = pg.token_buckets
    monkeypatch.setattr(pg, "token_buckets", lambda n, s: seen.append(n) or real(n, s))
    config = EngineConfig(model="tiny", device="cuda", max_num_tokens=40, max_seq_len=64,
                          prefill_graph="breakable", prefill_graph_max_tokens=24)
    assert "breakable_prefill_graph_on_cuda" not in _refusals(config, "sm_90")
    assert seen == [24]


def test_a_bucket_cap_without_the_breakable_graph_is_refused():
    config = EngineConfig(model="tiny", device="cuda", prefill_graph_max_tokens=512)
    assert "prefill_graph is 'eager'" in _refusals(config, "sm_90")["breakable_prefill_graph_on_cuda"]
    with pytest.raises(ValueError, match="prefill_graph_max_tokens"):
        EngineConfig(prefill_graph="breakable", prefill_graph_max_tokens=8)
