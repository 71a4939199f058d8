"""The model geometry (spec/config.py) and the report lines computed from it (spec/report.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from spec.config import ModelConfig, largest_primes_below
from spec.report import summary

TARGET = ModelConfig.target()
TINY = ModelConfig.tiny()


def _with(base: ModelConfig, **changes) -> ModelConfig:
    return ModelConfig(**{**base.model_dump(), **changes})


def _refused_fields(exc: ValidationError) -> set[str]:
    return {err["loc"][0] for err in exc.errors()}


# ---------------------------------------------------------------- presets


def test_target_matches_math_geometry() -> None:
    t = TARGET
    assert (t.hidden, t.num_layers, t.vocab_size) == (3072, 48, 151936)
    assert (t.num_q_heads, t.num_kv_heads, t.head_dim, t.rotary_dim, t.rope_theta) == (24, 2, 256, 64, 1e7)
    assert (t.index_heads, t.index_dim, t.tokens_per_block, t.top_k_blocks) == (16, 128, 32, 64)
    assert (t.sink_blocks, t.local_blocks) == (1, 2)
    assert (t.gdn_key_heads, t.gdn_value_heads, t.gdn_d_k, t.gdn_d_v) == (16, 48, 128, 128)
    assert t.gdn_conv_kernel == 4
    assert (t.num_experts, t.moe_top_k, t.expert_inter, t.shared_inter) == (512, 10, 512, 512)
    assert (t.hc_streams, t.sinkhorn_iters) == (4, 20)
    assert (t.ple_dim, t.ple_ngram_orders, t.ple_hash_heads) == (256, (2, 3), 8)
    assert (t.mtp_layers, t.max_draft_len, t.eps) == (1, 7, 1e-6)


def test_layer_pattern() -> None:
    kinds = TARGET.layer_kinds()
    assert [i for i, k in enumerate(kinds) if k == "qsa"] == list(range(3, 48, 4))
    assert (TARGET.num_qsa_layers, TARGET.num_gdn_layers) == (12, 36)
    assert TINY.layer_kinds() == ["gdn", "gdn", "gdn", "qsa"]


def test_tiny_keeps_the_rules() -> None:
    t = TINY
    assert t.param_count() <= 10_000_000
    assert t.num_qsa_layers >= 1
    assert t.gdn_value_heads // t.gdn_key_heads == 3
    assert t.num_q_heads // t.num_kv_heads == TARGET.num_q_heads // TARGET.num_kv_heads  # 12
    assert t.tokens_per_block == 32
    assert t.num_experts >= 8 and t.moe_top_k == 2
    assert t.hc_streams == 4 and t.sinkhorn_iters == 20
    assert t.vocab_size == 256  # a byte tokenizer fits


def test_config_is_frozen_and_strict() -> None:
    with pytest.raises(ValidationError):
        TINY.hidden = 256  # type: ignore[misc]
    with pytest.raises(ValidationError) as e:
        _with(TINY, not_a_field=1)
    assert "not_a_field" in str(e.value)


# ---------------------------------------------------------------- refusals


REFUSALS = [
    ({"num_kv_heads": 5}, "num_q_heads"),
    ({"gdn_value_heads": 7}, "gdn_value_heads"),
    ({"rotary_dim": 66}, "rotary_dim"),
    ({"rotary_dim": 15}, "rotary_dim"),
    ({"rotary_dim": 0}, "rotary_dim"),
    ({"tokens_per_block": 64}, "tokens_per_block"),
    ({"max_draft_len": 0}, "max_draft_len"),
    ({"max_draft_len": 8}, "max_draft_len"),
    ({"moe_top_k": 9}, "moe_top_k"),
    ({"moe_top_k": 0}, "moe_top_k"),
    ({"hidden": 120}, "hidden"),
    ({"head_dim": 56, "rotary_dim": 16}, "head_dim"),
    ({"expert_inter": 40}, "expert_inter"),
    ({"ple_dim": 6}, "ple_dim"),
    ({"num_layers": 3}, "num_layers"),
    ({"gdn_conv_kernel": 3}, "gdn_conv_kernel"),
    ({"mtp_layers": 2}, "mtp_layers"),
    ({"pad_id": 256}, "pad_id"),
    ({"ple_ngram_orders": (2, 4)}, "ple_ngram_orders"),
    ({"ple_ngram_rows": 20}, "ple_ngram_rows"),
    ({"eps": 1e-5}, "eps"),
    ({"local_blocks": 0}, "local_blocks"),
    ({"num_experts": 0}, "num_experts"),
]


@pytest.mark.parametrize("changes,field", REFUSALS, ids=[f for _, f in REFUSALS])
def test_refusal_names_the_field(changes: dict, field: str) -> None:
    with pytest.raises(ValidationError) as e:
        _with(TINY, **changes)
    assert field in _refused_fields(e.value)
    assert any(err["msg"].startswith(field) for err in e.value.errors())
    assert field in str(e.value)


def test_all_broken_rules_are_reported_together() -> None:
    with pytest.raises(ValidationError) as e:
        _with(TINY, num_kv_heads=5, max_draft_len=9, tokens_per_block=16)
    assert _refused_fields(e.value) == {"num_q_heads", "max_draft_len", "tokens_per_block"}


@settings(max_examples=40)
@given(q=st.integers(1, 48), kv=st.integers(1, 12))
def test_gqa_divisibility(q: int, kv: int) -> None:
    if q % kv == 0:
        assert _with(TINY, num_q_heads=q, num_kv_heads=kv).num_q_heads == q
    else:
        with pytest.raises(ValidationError) as e:
            _with(TINY, num_q_heads=q, num_kv_heads=kv)
        assert _refused_fields(e.value) == {"num_q_heads"}


@settings(max_examples=40)
@given(rot=st.integers(-2, 80))
def test_rotary_dim_rule(rot: int) -> None:
    ok = rot > 0 and rot % 2 == 0 and rot <= TINY.head_dim
    if ok:
        assert _with(TINY, rotary_dim=rot).rotary_dim == rot
    else:
        with pytest.raises(ValidationError) as e:
            _with(TINY, rotary_dim=rot)
        assert _refused_fields(e.value) == {"rotary_dim"}


@settings(max_examples=30)
@given(k=st.integers(-1, 10), top=st.integers(0, 12))
def test_draft_length_and_top_k_rules(k: int, top: int) -> None:
    expected = set()
    if not 1 <= k <= 7:
        expected.add("max_draft_len")
    if not 1 <= top <= TINY.num_experts:
        expected.add("moe_top_k")
    if expected:
        with pytest.raises(ValidationError) as e:
            _with(TINY, max_draft_len=k, moe_top_k=top)
        assert _refused_fields(e.value) == expected
    else:
        _with(TINY, max_draft_len=k, moe_top_k=top)


# ---------------------------------------------------------------- parameter counts


def test_target_param_count_by_hand() -> None:
    C, V, L = 3072, 151936, 48
    gdn = (C * (2 * 16 * 128 + 2 * 48 * 128) + C * 2 * 48 + (2 * 16 * 128 + 48 * 128) * 4 + 2 * 48
           + 128 + 48 * 128 * C)
    qsa = (2 * C * 24 * 256 + 2 * C * 2 * 256 + 2 * 256 + C * 16 * 128 + C * 128 + 128 + C * 16
           + 24 * 256 * C)
    moe = 512 * C + 512 * 3 * 512 * C + 3 * 512 * C + C
    hc_site = 4 * C * 24 + 24
    layer_common = 2 * hc_site + 2 * C + moe
    primes = TARGET.ple_hash_primes()
    flat = [p for order in primes for p in order]
    assert len(flat) == 16 and len(set(flat)) == 16
    assert all(p < 65536 and all(p % d for d in range(2, int(p ** 0.5) + 1)) for p in flat)
    ple = V * L * 256 + sum(flat) * (L * 256 // 16) + C * L * 256 + 256 + L * (2 * 256 * C + C)
    mtp = 2 * C + 2 * C * C + qsa + layer_common
    total = 2 * V * C + C + 36 * gdn + 12 * qsa + L * layer_common + ple + mtp
    assert TARGET.param_count() == total == 125_822_486_576
    assert TARGET.routed_expert_params() == 49 * 512 * 3 * 512 * C


def test_tiny_param_count() -> None:
    assert TINY.param_count() == 2_987_604
    assert sum(TINY.param_breakdown().values()) == TINY.param_count()


def test_tied_embeddings_drop_the_head() -> None:
    tied = _with(TINY, tie_embeddings=True)
    assert TINY.param_count() - tied.param_count() == TINY.vocab_size * TINY.hidden


def test_ngram_primes() -> None:
    assert largest_primes_below(20, 3) == (19, 17, 13)
    assert largest_primes_below(10, 5) == ()
    primes = TINY.ple_hash_primes()
    assert len(primes) == 2 and all(len(p) == 8 for p in primes)
    assert primes[0][0] == 61  # the largest prime below 64 goes to order 2's head 0


# ---------------------------------------------------------------- footprints


def test_gdn_state_is_maths_113_mb() -> None:
    assert TARGET.gdn_state_bytes_per_slot("fp32") == 48 * 128 * 128 * 4 * 36 == 113_246_208
    assert TARGET.gdn_state_bytes_per_slot("bf16") == 113_246_208 // 2
    assert TARGET.conv_state_bytes_per_slot() == (2 * 16 * 128 + 48 * 128) * 3 * 2 * 36
    with pytest.raises(ValueError):
        TARGET.gdn_state_bytes_per_slot("fp8")  # type: ignore[arg-type]


@pytest.mark.parametrize("kv,per_layer", [("bf16", 2048), ("fp8", 1024), ("nvfp4", 576)])
def test_kv_bytes_per_token(kv: str, per_layer: int) -> None:
    assert TARGET.kv_bytes_per_token_per_layer(kv) == per_layer
    assert TARGET.kv_bytes_per_token(kv) == 12 * per_layer
    assert TARGET.kv_bytes_per_token(kv, include_mtp=True) == 13 * per_layer
    # tiny: one QSA layer, 2 KV heads x 64
    assert TINY.kv_bytes_per_token(kv) == {"bf16": 512, "fp8": 256, "nvfp4": 144}[kv]


def test_side_planes() -> None:
    assert TARGET.qsa_side_plane_bytes_per_token() == 128 * 2 + 4 + 128 * 2 / 32


def test_report_summary() -> None:
    text = "\n".join(summary())
    for figure in ("125,822,486,576", "2,987,604", "2,048 B", "24,576 B", "1,024 B", "12,288 B",
                   "576 B", "6,912 B", "113,246,208 B", "56,623,104 B", "matches"):
        assert figure in text, figure
    assert all(isinstance(line, str) for line in summary())
