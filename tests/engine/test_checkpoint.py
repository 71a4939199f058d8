"""The checkpoint format (impl/model/checkpoint.py): bitwise round trips, identical logits, the tied
head stored once, the dtype cast against init_weights, and one test per refusal naming the tensor or
metadata field and the file."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from impl.model.checkpoint import (FORMAT, CheckpointError, checkpoint_layout, flatten_weights,
                                   load_checkpoint, save_checkpoint)
from spec.config import ModelConfig
from spec.model import Weights, forward, init_weights, mtp_draft, new_cache

TINY = ModelConfig.tiny()
TensorEdit = Callable[[dict[str, torch.Tensor]], None]
MetaEdit = Callable[[dict[str, str]], None]


def with_fields(cfg: ModelConfig, **update) -> ModelConfig:
    """A validated copy of ``cfg`` (model_copy would skip the validation)."""
    return ModelConfig(**{**cfg.model_dump(), **update})


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor, so that equality is bitwise (NaN payloads, -0.0, fp8 included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_weights_bitwise(a: Weights, b: Weights) -> None:
    fa, fb = flatten_weights(a), flatten_weights(b)
    assert fa.keys() == fb.keys()
    for name in fa:
        assert fa[name].dtype == fb[name].dtype, name
        assert fa[name].shape == fb[name].shape, name
        assert torch.equal(bits(fa[name]), bits(fb[name])), name
    assert a.ple.hash_cfg == b.ple.hash_cfg
    assert [layer.kind for layer in a.layers] == [layer.kind for layer in b.layers]


def rewrite(src: Path, dst: Path, tensors: TensorEdit | None = None,
            meta: MetaEdit | None = None) -> Path:
    """Copy a checkpoint with safetensors directly, editing its tensors and/or metadata."""
    with safe_open(str(src), framework="pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
        m = dict(f.metadata())
    if tensors:
        tensors(t)
    if meta:
        meta(m)
    save_file(t, str(dst), metadata=m)
    return dst


@pytest.fixture(scope="module")
def w32() -> Weights:
    return init_weights(TINY, 0, torch.float32)


@pytest.fixture(scope="module")
def saved32(w32: Weights, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "tiny_fp32.safetensors"
    save_checkpoint(path, w32, TINY, metadata={"step": "100", "note": "unit test"})
    return path


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bitwise(dtype: torch.dtype, tmp_path: Path) -> None:
    w = init_weights(TINY, 0, dtype)
    path = tmp_path / "w.safetensors"
    save_checkpoint(path, w, TINY, metadata={"step": "7"})
    ckpt = load_checkpoint(path)
    assert ckpt.cfg == TINY
    assert ckpt.metadata == {"step": "7"}
    assert ckpt.weights.dtype == dtype
    assert_weights_bitwise(ckpt.weights, w)


def test_file_holds_exactly_the_layout(saved32: Path) -> None:
    """The stored names, shapes and dtypes are the meta build's; spot-check the naming scheme."""
    layout = checkpoint_layout(TINY, torch.float32)
    with safe_open(str(saved32), framework="pt") as f:
        names = set(f.keys())
        meta = f.metadata()
        assert names == set(layout)
        for name in names:
            t = f.get_tensor(name)
            assert (tuple(t.shape), t.dtype) == (layout[name].shape, layout[name].dtype), name
    assert layout["layers.3.mixer.w_q"].shape == (TINY.num_q_heads * TINY.head_dim, TINY.hidden)
    assert layout["layers.0.mixer.in_proj_qkvz"].dtype == torch.float32
    assert layout["layers.0.moe.experts.gate.packed"] == layout["mtp.layer.moe.experts.gate.packed"]
    assert layout["layers.0.moe.experts.gate.packed"].shape == (8, 64, 64)
    assert layout["layers.0.moe.experts.gate.sf"].dtype == torch.float8_e4m3fn
    assert layout["layers.0.moe.experts.gate.gs"].shape == (8,)
    assert layout["mtp.layer.hc_mixer.phi"].dtype == torch.float32
    assert "mtp.layer.ple.w_gate" not in layout and "lm_head" in layout
    assert meta["format"] == FORMAT == "flashnext-checkpoint/1"
    assert ModelConfig.model_validate_json(meta["model_config"]) == TINY
    assert json.loads(meta["layer_kinds"]) == ["gdn", "gdn", "gdn", "qsa"]
    assert meta["dtype"] == "float32"
    assert meta["step"] == "100"


def test_hash_multipliers_are_decimal_strings(saved32: Path, w32: Weights) -> None:
    """Multipliers above 2^53 survive any JSON reader only as strings."""
    with safe_open(str(saved32), framework="pt") as f:
        raw = json.loads(f.metadata()["ngram_hash"])
    flat = [m for order in raw["multipliers"] for head in order for m in head]
    assert all(isinstance(m, str) for m in flat)
    expected = [m for order in w32.ple.hash_cfg.multipliers for head in order for m in head]
    assert [int(m) for m in flat] == expected
    assert max(expected) > 2**53
    assert raw["primes"] == [list(p) for p in TINY.ple_hash_primes()]
    assert raw["pad_id"] == TINY.pad_id and raw["orders"] == list(TINY.ple_ngram_orders)


def test_fp8_bytes_round_trip_in_safetensors(tmp_path: Path) -> None:
    """Every e4m3 byte (NaN 0x7F/0xFF, -0 0x80 included) survives safetensors' F8_E4M3."""
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    save_file({"sf": every}, str(tmp_path / "fp8.safetensors"))
    with safe_open(str(tmp_path / "fp8.safetensors"), framework="pt") as f:
        assert f.get_slice("sf").get_dtype() == "F8_E4M3"
        back = f.get_tensor("sf")
    assert back.dtype == torch.float8_e4m3fn
    assert torch.equal(back.view(torch.uint8), torch.arange(256, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_identical_after_round_trip(dtype: torch.dtype, tmp_path: Path) -> None:
    w = init_weights(TINY, 1, dtype)
    path = tmp_path / "w.safetensors"
    save_checkpoint(path, w, TINY)
    loaded = load_checkpoint(path).weights
    tokens = torch.tensor([[3, 17, 200, 5]])
    nxt = torch.tensor([[17, 200, 5, 9]])

    def run(weights: Weights) -> tuple[torch.Tensor, torch.Tensor]:
        cache = new_cache(TINY, 1, 32, dtype=dtype)
        logits, hidden = forward(weights, TINY, tokens, cache, return_hidden=True)
        draft, _ = mtp_draft(weights, TINY, hidden, nxt, cache)
        return logits, draft

    before, after = run(w), run(loaded)
    assert torch.isfinite(before[0]).all() and torch.isfinite(before[1]).all()
    assert torch.equal(before[0], after[0])
    assert torch.equal(before[1], after[1])


def test_tied_embedding_stored_once(tmp_path: Path) -> None:
    cfg = with_fields(TINY, tie_embeddings=True)
    w = init_weights(cfg, 0, torch.float32)
    assert w.lm_head is w.embed
    path = tmp_path / "tied.safetensors"
    save_checkpoint(path, w, cfg)
    with safe_open(str(path), framework="pt") as f:
        names = set(f.keys())
    assert "lm_head" not in names and "embed" in names
    assert len(names) == len(flatten_weights(w)) - 1
    for dtype in (None, torch.bfloat16):
        ckpt = load_checkpoint(path, dtype=dtype)
        assert ckpt.cfg.tie_embeddings
        assert ckpt.weights.lm_head is ckpt.weights.embed
    assert_weights_bitwise(load_checkpoint(path).weights, w)


def test_no_mtp_layer_round_trip(tmp_path: Path) -> None:
    cfg = with_fields(TINY, mtp_layers=0)
    w = init_weights(cfg, 0, torch.float32)
    path = tmp_path / "nomtp.safetensors"
    save_checkpoint(path, w, cfg)
    with safe_open(str(path), framework="pt") as f:
        assert not any(k.startswith("mtp.") for k in f.keys())
    ckpt = load_checkpoint(path)
    assert ckpt.weights.mtp is None
    assert_weights_bitwise(ckpt.weights, w)


# ---------------------------------------------------------------- dtype on load vs init_weights


def test_torch_casts_float64_to_bf16_through_fp32() -> None:
    """Why an fp32 checkpoint cast to bf16 equals init_weights(bf16): torch rounds float64 -> bf16
    via fp32 (double rounding), on the scalar and the vectorised path. 1 + 2^-8 + 2^-30 lies above
    the bf16 midpoint 1 + 2^-8, so a single rounding gives 1 + 2^-7; through fp32 it becomes the
    midpoint and ties to even, 1.0. If this fails, torch rounds once and the docstring's claim of
    bitwise equality from fp32 checkpoints must be revisited."""
    for n in (1, 4096):
        x = torch.full((n,), 1.0 + 2**-8 + 2**-30, dtype=torch.float64)
        assert torch.all(x.to(torch.bfloat16) == 1.0)
        assert torch.all(x.to(torch.float32).to(torch.bfloat16) == 1.0)


def test_fp32_checkpoint_as_bf16_equals_init_weights_bf16(saved32: Path) -> None:
    ckpt = load_checkpoint(saved32, dtype=torch.bfloat16)
    ref = init_weights(TINY, 0, torch.bfloat16)
    assert_weights_bitwise(ckpt.weights, ref)
    assert ckpt.weights.layers[0].mixer.A_log.dtype == torch.float32
    assert ckpt.weights.layers[0].hc_mixer.phi.dtype == torch.float32


def test_float64_checkpoint_casts_to_init_weights(tmp_path: Path) -> None:
    """One cast of the same float64 draws: bitwise init_weights(cfg, seed, dtype) for every dtype."""
    path = tmp_path / "w64.safetensors"
    save_checkpoint(path, init_weights(TINY, 2, torch.float64), TINY)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        loaded = load_checkpoint(path, dtype=dtype).weights
        assert loaded.dtype == dtype
        assert_weights_bitwise(loaded, init_weights(TINY, 2, dtype))


def test_widening_does_not_restore_float64(saved32: Path, w32: Weights) -> None:
    """fp32 -> float64 widens the fp32 values (exactly), it does not recover init_weights(float64)."""
    wide = load_checkpoint(saved32, dtype=torch.float64).weights
    assert wide.embed.dtype == torch.float64 and wide.layers[0].mixer.A_log.dtype == torch.float64
    assert wide.layers[0].moe.experts.gate.gs.dtype == torch.float32
    assert torch.equal(wide.embed, w32.embed.double())
    assert not torch.equal(wide.embed, init_weights(TINY, 0, torch.float64).embed)


# ---------------------------------------------------------------- load refusals


def _drop(name: str) -> TensorEdit:
    return lambda t: t.pop(name)


def _rename(old: str, new: str) -> TensorEdit:
    return lambda t: t.__setitem__(new, t.pop(old))


def _set_tensor(name: str, value: torch.Tensor) -> TensorEdit:
    return lambda t: t.__setitem__(name, value)


def _set_meta(key: str, value: str) -> MetaEdit:
    return lambda m: m.__setitem__(key, value)


def _del_meta(key: str) -> MetaEdit:
    return lambda m: m.pop(key)


def _edit_json(key: str, edit: Callable[[dict], None]) -> MetaEdit:
    def apply(m: dict[str, str]) -> None:
        obj = json.loads(m[key])
        edit(obj)
        m[key] = json.dumps(obj)
    return apply


_CONV = TINY.gdn_conv_channels
_HASH_PRIMES = [list(p) for p in TINY.ple_hash_primes()]

LOAD_ERRORS: list[tuple[str, TensorEdit | None, MetaEdit | None, list[str]]] = [
    ("missing", _drop("layers.3.mixer.w_q"), None,
     ["missing tensor 'layers.3.mixer.w_q' (expected [1536, 128] float32)"]),
    ("missing_nvfp4_scale", _drop("layers.1.moe.experts.down.sf"), None,
     ["missing tensor 'layers.1.moe.experts.down.sf' (expected [8, 128, 4] float8_e4m3fn)"]),
    ("renamed", _rename("ple.table", "ple.tabel"), None,
     ["missing tensor 'ple.table'", "unexpected tensor 'ple.tabel' (not a weight of this config)"]),
    ("extra", _set_tensor("layers.9.norm_mixer", torch.zeros(128)), None,
     ["unexpected tensor 'layers.9.norm_mixer'"]),
    ("shape", _set_tensor("layers.0.mixer.conv_w", torch.zeros(_CONV, 3)), None,
     [f"tensor 'layers.0.mixer.conv_w' has shape [{_CONV}, 3], the config needs [{_CONV}, 4]"]),
    ("dtype", _set_tensor("final_norm", torch.zeros(128, dtype=torch.float16)), None,
     ["tensor 'final_norm' is float16, a float32 checkpoint stores it as float32"]),
    ("dtype_fp8_as_bytes", _set_tensor("layers.0.moe.experts.gate.sf",
                                       torch.zeros(8, 64, 8, dtype=torch.uint8)), None,
     ["tensor 'layers.0.moe.experts.gate.sf' is uint8", "stores it as float8_e4m3fn"]),
    ("config_mismatch", None, _edit_json("model_config", lambda c: c.update(expert_inter=32)),
     ["tensor 'layers.0.moe.experts.gate.packed' has shape [8, 64, 64], the config needs "
      "[8, 32, 64]"]),
    ("format_missing", None, _del_meta("format"), ["no 'format' key", "flashnext-checkpoint/1"]),
    ("format_version", None, _set_meta("format", "flashnext-checkpoint/2"),
     ["'format' version '2' is not supported", "reads version 1"]),
    ("format_name", None, _set_meta("format", "other-checkpoint/1"),
     ["'format' is 'other-checkpoint/1'"]),
    ("model_config_json", None, _set_meta("model_config", '{"hidden": 128,'),
     ["metadata 'model_config' is not a valid ModelConfig", "Invalid JSON"]),
    ("model_config_field", None, _edit_json("model_config", lambda c: c.update(hidden=-1)),
     ["metadata 'model_config' is not a valid ModelConfig", "hidden", "must be positive"]),
    ("model_config_unknown_field", None, _edit_json("model_config", lambda c: c.update(hiden=1)),
     ["metadata 'model_config'", "hiden", "Extra inputs are not permitted"]),
    ("model_config_missing", None, _del_meta("model_config"),
     ["metadata key 'model_config' is missing"]),
    ("dtype_meta", None, _set_meta("dtype", "int8"), ["metadata 'dtype' is 'int8'"]),
    ("layer_kinds", None, _set_meta("layer_kinds", '["gdn", "gdn", "qsa", "qsa"]'),
     ["metadata 'layer_kinds'", "disagrees"]),
    ("hash_even", None, _edit_json("ngram_hash", lambda h: h["multipliers"][0][0].__setitem__(0, "4")),
     ["metadata 'ngram_hash' is not a valid NgramHashConfig", "odd 64-bit"]),
    ("hash_int", None, _edit_json("ngram_hash", lambda h: h["multipliers"][1][2].__setitem__(0, 7)),
     ["metadata 'ngram_hash' is malformed", "multipliers.1.2.0"]),
    ("hash_primes", None, _edit_json("ngram_hash", lambda h: h["primes"][0].__setitem__(0, 67)),
     [f"ngram_hash.primes [[67, {_HASH_PRIMES[0][1]}"]),
    ("hash_pad", None, _edit_json("ngram_hash", lambda h: h.update(pad_id=1)),
     ["ngram_hash.pad_id 1 != model_config pad_id 0"]),
]


@pytest.mark.parametrize("tensors,meta,expected", [c[1:] for c in LOAD_ERRORS],
                         ids=[c[0] for c in LOAD_ERRORS])
def test_load_refusal_names_field_and_file(saved32: Path, tmp_path: Path, tensors: TensorEdit | None,
                                          meta: MetaEdit | None, expected: list[str]) -> None:
    bad = rewrite(saved32, tmp_path / "bad.safetensors", tensors, meta)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(bad)
    message = str(err.value)
    assert str(bad) in message
    for part in expected:
        assert part in message


def test_unmodified_rewrite_loads(saved32: Path, tmp_path: Path, w32: Weights) -> None:
    """The refusals above come from the edits, not from rewriting the file."""
    same = rewrite(saved32, tmp_path / "same.safetensors")
    assert_weights_bitwise(load_checkpoint(same).weights, w32)


def test_tied_checkpoint_with_lm_head_is_refused(tmp_path: Path) -> None:
    cfg = with_fields(TINY, tie_embeddings=True)
    path = tmp_path / "tied.safetensors"
    save_checkpoint(path, init_weights(cfg, 0), cfg)
    bad = rewrite(path, tmp_path / "bad.safetensors", _set_tensor("lm_head", torch.zeros(256, 128)))
    with pytest.raises(CheckpointError, match="unexpected tensor 'lm_head' .*ties embeddings"):
        load_checkpoint(bad)


def test_not_a_safetensors_file(tmp_path: Path) -> None:
    path = tmp_path / "junk.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    with pytest.raises(CheckpointError, match="not a readable safetensors file") as err:
        load_checkpoint(path)
    assert str(path) in str(err.value)


def test_plain_safetensors_without_format_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "plain.safetensors"
    save_file({"embed": torch.zeros(2, 2)}, str(path))
    with pytest.raises(CheckpointError, match="no 'format' key"):
        load_checkpoint(path)


def test_load_dtype_must_be_a_model_dtype(saved32: Path) -> None:
    with pytest.raises(CheckpointError, match="dtype int32 is not a model dtype"):
        load_checkpoint(saved32, dtype=torch.int32)


# ---------------------------------------------------------------- save refusals


def test_save_refuses_reserved_and_non_string_metadata(w32: Weights, tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    with pytest.raises(CheckpointError, match="metadata key 'format' is reserved"):
        save_checkpoint(path, w32, TINY, metadata={"format": "mine/1"})
    with pytest.raises(CheckpointError, match="metadata 'step': keys and values must be str"):
        save_checkpoint(path, w32, TINY, metadata={"step": 3})  # type: ignore[dict-item]
    assert not path.exists()


def test_save_refuses_weights_that_do_not_fit_the_config(w32: Weights, tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    with pytest.raises(CheckpointError) as err:
        save_checkpoint(path, w32, with_fields(TINY, num_experts=4))
    message = str(err.value)
    assert f"cannot save checkpoint {path}" in message
    assert "tensor 'layers.0.moe.router' has shape [8, 128], the config needs [4, 128]" in message
    assert not path.exists()
    assert not list(tmp_path.iterdir())  # no temporary file left behind


def test_save_refuses_untied_head_under_tied_config(w32: Weights, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="'lm_head' differs from 'embed'"):
        save_checkpoint(tmp_path / "w.safetensors", w32, with_fields(TINY, tie_embeddings=True))


def test_save_refuses_meta_weights(tmp_path: Path) -> None:
    meta = init_weights(TINY, 0, torch.float32, device="meta")
    with pytest.raises(CheckpointError, match="tensor 'embed' is on the meta device"):
        save_checkpoint(tmp_path / "w.safetensors", meta, TINY)


def test_save_refuses_hash_constants_of_another_config(w32: Weights, tmp_path: Path) -> None:
    cfg = with_fields(TINY, pad_id=5)
    with pytest.raises(CheckpointError, match="ngram_hash.pad_id 0 != model_config pad_id 5"):
        save_checkpoint(tmp_path / "w.safetensors", w32, cfg)
