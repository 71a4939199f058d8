"""The model checkpoint: every weight of ``spec.model.Weights`` and the geometry in ONE safetensors file.

``save_checkpoint(path, weights, cfg, metadata=...)`` writes it; ``load_checkpoint(path, dtype=...)``
reads it back as a ``Checkpoint`` (cfg, weights, the caller's metadata). docs/checkpoint.md is the
reviewer-facing description of the same format.

Format ``flashnext-checkpoint/1``
---------------------------------
Tensors. One safetensors tensor per tensor field of the weight dataclasses, named by its field path,
dot-separated, list items by index: ``embed``, ``lm_head``, ``final_norm``, ``layers.3.mixer.w_q``,
``layers.0.hc_mixer.phi``, ``layers.0.moe.experts.gate.packed`` / ``.sf`` / ``.gs``,
``layers.0.moe.experts.x_gs``, ``layers.0.moe.shared.w_down``, ``layers.0.ple.w_gate``, ``ple.table``,
``mtp.fc``, ``mtp.layer.hc_mixer.phi``. A layer's ``mixer`` is a GDN or a QSA mixer as
``layer_kinds`` says; fields that are None (the MTP layer's ``ple``, ``mtp`` with mtp_layers = 0) have
no tensors. Two fields are not tensors: ``LayerWeights.kind`` (rebuilt from the config) and
``PLEWeights.hash_cfg`` (metadata ``ngram_hash``). With ``cfg.tie_embeddings`` the LM head is the
embedding and is stored once, as ``embed``; the loaded ``lm_head`` is then the same tensor object.

The expected set of names, shapes and dtypes is not written down here but derived: it is what
``spec.model.init_weights(cfg, dtype=..., device="meta")`` builds (``checkpoint_layout``). So the format
follows the spec's dataclasses, and a file is checked against exactly what the model needs.

Dtypes. A checkpoint has one model dtype (metadata ``dtype``: float32, bfloat16, float16 or
float64), the dtype of its dense weights. The other tensors keep the dtypes ``init_weights`` gives them:
HC phi / bias, GDN A_log / dt_bias in fp32 (float64 in a float64 checkpoint); NVFP4 ``packed`` uint8,
``sf`` float8_e4m3fn, ``gs`` fp32; the KV and expert-input global scales (``k_gs``, ``v_gs``, ``x_gs``,
``h_gs``) fp32 in every checkpoint. float8_e4m3fn is stored under safetensors' native ``F8_E4M3`` tag,
not as uint8: every byte (NaN 0x7F, -0 0x80 included) round-trips with the pinned safetensors 0.8.0,
which a test pins.

NVFP4 layout (spec.ops.moe.NvFp4Weight, spec.ops.kv_storage). A stack of E matrices [E, out, in]
quantised along ``in``: ``packed`` uint8 [E, out, in/2], two e2m1 codes a byte, element 2i in the low
nibble (bits 0..3) and element 2i+1 in the high nibble (bits 4..7); a code's bit 3 is its sign and bits
0..2 index the magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}. ``sf`` float8_e4m3fn [E, out, in/16], one block
scale per 16 consecutive elements of a row; ``gs`` fp32 [E], one global scale per matrix, on the
dequant side: ``w = code * sf * gs``.

Metadata (safetensors ``__metadata__``, string -> string):
- ``format``: ``flashnext-checkpoint/1``. A reader refuses a missing key, another name, or a version
  it does not know; a change that alters names, dtypes or metadata meaning bumps the version.
- ``model_config``: ``ModelConfig.model_dump_json()``, validated on load by pydantic.
- ``dtype``: the model dtype (above).
- ``layer_kinds``: JSON list, ``cfg.layer_kinds()`` (redundant with the config; checked against it so
  that a reader without the spec still knows each layer's mixer).
- ``ngram_hash``: JSON object ``{"orders": [2, 3], "primes": [[..], [..]], "pad_id": 0,
  "multipliers": [[["<decimal>", ...], ...], ...]}``: the ``NgramHashConfig``. Multipliers are unsigned
  64-bit values, written as decimal strings because JSON readers outside Python round integers above
  2^53. Orders, primes and pad_id must equal the config's (the n-gram table's rows depend on them).
- Any other key is the caller's (``metadata=`` on save, ``Checkpoint.metadata`` on load). The keys above
  are reserved; a caller's key that collides with one is refused.

Loading with ``dtype``: every tensor is cast to the dtype ``init_weights(cfg, seed, dtype)`` gives it
(read off the meta build for that dtype): dense weights to ``dtype``; fp32 parameters stay fp32 unless
``dtype`` is float64; NVFP4 codes, block scales and every global scale never change. Casting from a
float64 checkpoint reproduces ``init_weights(cfg, seed, dtype)`` bit for bit, since both are one torch
cast of the same float64 values. From an fp32 checkpoint to bf16 the result is also bitwise
``init_weights(cfg, seed, bfloat16)``, but only because torch (2.13, CPU) casts float64 to bf16 through
fp32 itself, so ``init_weights`` double-rounds exactly as fp32 -> bf16 does. A correctly rounded
float64 -> bf16 cast would differ wherever the fp32 rounding lands on a bf16 tie (measured: 132 of 2^24
normal draws, ~1 in 2^17); tests/engine/test_checkpoint.py pins both the equality and torch's cast.
Widening (fp32 -> float64) never restores the float64 draws.

Not checked: tensor values (a NaN or a zero global scale loads as written). Tensors load on the CPU.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, fields, is_dataclass
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any

import torch
from pydantic import BaseModel, ConfigDict, StringConstraints, ValidationError
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from spec.config import ModelConfig
from spec.model import LayerWeights, PLEWeights, Weights, init_weights
from spec.ops.ple import NgramHashConfig

FORMAT_NAME = "flashnext-checkpoint"
FORMAT_VERSION = 1
FORMAT = f"{FORMAT_NAME}/{FORMAT_VERSION}"
RESERVED_KEYS = ("format", "model_config", "dtype", "layer_kinds", "ngram_hash")

# The model dtypes a checkpoint may have (its dense weights), by their metadata name.
MODEL_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "float64": torch.float64,
}
# safetensors dtype tags -> torch, for the tags the layout can hold; any other tag is reported as is.
_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "U8": torch.uint8,
    "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
}
# Dataclass fields that are not tensors, and where their value comes from instead.
_NON_TENSOR_FIELDS = {(LayerWeights, "kind"), (PLEWeights, "hash_cfg")}
_MAX_LISTED = 20  # problems listed in one error; a wrong config can break hundreds of tensors


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read; the message names the file and the tensor or
    metadata field at fault."""


@dataclass(frozen=True)
class TensorSpec:
    """What the format expects of one stored tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class Checkpoint:
    """A loaded checkpoint: the geometry, the weights, and the caller's metadata (reserved keys
    removed)."""

    cfg: ModelConfig
    weights: Weights
    metadata: dict[str, str]


# ===================================================================================================
# Naming: field paths <-> tensors
# ===================================================================================================

def _join(prefix: str, name: str | int) -> str:
    return f"{prefix}.{name}" if prefix else str(name)


def _is_non_tensor_field(obj: Any, name: str) -> bool:
    return (type(obj), name) in _NON_TENSOR_FIELDS


def flatten_weights(weights: Weights) -> dict[str, torch.Tensor]:
    """Every tensor of ``weights`` by its dotted field path (``lm_head`` included even when tied).

    Walks the dataclasses generically so a field added to the spec gets a name without a change here;
    a field of a type the walk does not know is an error rather than silently left out of the file.
    """
    out: dict[str, torch.Tensor] = {}

    def walk(obj: Any, prefix: str) -> None:
        if isinstance(obj, torch.Tensor):
            out[prefix] = obj
        elif obj is None:
            return
        elif isinstance(obj, list):
            for i, item in enumerate(obj):
                walk(item, _join(prefix, i))
        elif is_dataclass(obj):
            for f in fields(obj):
                if not _is_non_tensor_field(obj, f.name):
                    walk(getattr(obj, f.name), _join(prefix, f.name))
        else:
            raise TypeError(f"weights field {prefix!r} holds a {type(obj).__name__}, which the "
                            f"checkpoint format cannot store")

    walk(weights, "")
    return out


def _rebuild(template: Any, prefix: str, tensors: Mapping[str, torch.Tensor],
             hash_cfg: NgramHashConfig) -> Any:
    """The structure of ``template`` (a meta build) with each tensor replaced by ``tensors[path]``."""
    if isinstance(template, torch.Tensor):
        return tensors[prefix]
    if template is None:
        return None
    if isinstance(template, list):
        return [_rebuild(t, _join(prefix, i), tensors, hash_cfg) for i, t in enumerate(template)]
    kwargs: dict[str, Any] = {}
    for f in fields(template):
        if (type(template), f.name) == (PLEWeights, "hash_cfg"):
            kwargs[f.name] = hash_cfg
        elif _is_non_tensor_field(template, f.name):
            kwargs[f.name] = getattr(template, f.name)  # the layer kind, fixed by the config
        else:
            kwargs[f.name] = _rebuild(getattr(template, f.name), _join(prefix, f.name), tensors,
                                      hash_cfg)
    return type(template)(**kwargs)


@lru_cache(maxsize=8)
def _template(cfg: ModelConfig, dtype: torch.dtype) -> Weights:
    """The meta build of the model: every tensor's shape and dtype, no values."""
    return init_weights(cfg, 0, dtype, device="meta")


def checkpoint_layout(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, TensorSpec]:
    """Name -> expected shape and dtype of every tensor a ``dtype`` checkpoint of ``cfg`` stores.

    Derived from ``init_weights(cfg, dtype=dtype, device="meta")`` so that the file format and the
    model's own construction cannot drift apart. A tied LM head is not listed (stored as ``embed``).
    """
    _check_model_dtype(dtype, "dtype")
    layout = {name: TensorSpec(tuple(t.shape), t.dtype)
              for name, t in flatten_weights(_template(cfg, dtype)).items()}
    if cfg.tie_embeddings:
        del layout["lm_head"]
    return layout


# ===================================================================================================
# Checks shared by save and load
# ===================================================================================================

def _dtype_name(dtype: torch.dtype | str) -> str:
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def _check_model_dtype(dtype: torch.dtype, what: str) -> None:
    if dtype not in MODEL_DTYPES.values():
        raise CheckpointError(f"{what} {_dtype_name(dtype)} is not a model dtype; expected one of "
                              f"{', '.join(MODEL_DTYPES)}")


def _layout_problems(actual: Mapping[str, tuple[tuple[int, ...], torch.dtype | str]],
                     expected: Mapping[str, TensorSpec], cfg: ModelConfig,
                     model_dtype: torch.dtype) -> list[str]:
    """One line per missing, unexpected, misshapen or mistyped tensor, each naming the tensor."""
    problems: list[str] = []
    for name in sorted(expected.keys() - actual.keys()):
        want = expected[name]
        problems.append(f"missing tensor {name!r} (expected {list(want.shape)} "
                        f"{_dtype_name(want.dtype)})")
    for name in sorted(actual.keys() - expected.keys()):
        why = ("the config ties embeddings, so the LM head is stored once, as 'embed'"
               if name == "lm_head" and cfg.tie_embeddings else "not a weight of this config")
        problems.append(f"unexpected tensor {name!r} ({why})")
    for name in sorted(expected.keys() & actual.keys()):
        shape, dtype = actual[name]
        want = expected[name]
        if tuple(shape) != want.shape:
            problems.append(f"tensor {name!r} has shape {list(shape)}, the config needs "
                            f"{list(want.shape)}")
        if dtype != want.dtype:
            problems.append(f"tensor {name!r} is {_dtype_name(dtype)}, a "
                            f"{_dtype_name(model_dtype)} checkpoint stores it as "
                            f"{_dtype_name(want.dtype)}")
    return problems


def _hash_problems(hash_cfg: NgramHashConfig, cfg: ModelConfig) -> list[str]:
    """The hash constants must fit the config: the n-gram table's row count is the sum of the
    config's primes, and the history pads with the config's pad id."""
    problems = []
    if tuple(hash_cfg.orders) != tuple(cfg.ple_ngram_orders):
        problems.append(f"ngram_hash.orders {list(hash_cfg.orders)} != model_config "
                        f"ple_ngram_orders {list(cfg.ple_ngram_orders)}")
    if tuple(map(tuple, hash_cfg.primes)) != cfg.ple_hash_primes():
        problems.append(f"ngram_hash.primes {[list(p) for p in hash_cfg.primes]} != the config's "
                        f"ple_hash_primes() {[list(p) for p in cfg.ple_hash_primes()]}")
    if hash_cfg.pad_id != cfg.pad_id:
        problems.append(f"ngram_hash.pad_id {hash_cfg.pad_id} != model_config pad_id {cfg.pad_id}")
    return problems


def _raise(where: str, problems: list[str]) -> None:
    if not problems:
        return
    shown = problems[:_MAX_LISTED]
    more = len(problems) - len(shown)
    lines = [f"{where}: {len(problems)} problem(s):"] + [f"  - {p}" for p in shown]
    if more:
        lines.append(f"  ... and {more} more")
    raise CheckpointError("\n".join(lines))


# ===================================================================================================
# Save
# ===================================================================================================

def _hash_to_json(h: NgramHashConfig) -> str:
    """Multipliers as decimal strings: unsigned 64-bit values exceed the integers JSON readers
    outside Python keep exactly (2^53)."""
    return json.dumps({
        "orders": list(h.orders),
        "primes": [list(p) for p in h.primes],
        "pad_id": h.pad_id,
        "multipliers": [[[str(m) for m in head] for head in order] for order in h.multipliers],
    })


def _user_metadata(metadata: Mapping[str, str] | None, path: Path) -> dict[str, str]:
    user = dict(metadata or {})
    problems = []
    for key, value in user.items():
        if not isinstance(key, str) or not isinstance(value, str):
            problems.append(f"metadata {key!r}: keys and values must be str (safetensors metadata "
                            f"is string -> string), got {type(key).__name__} -> "
                            f"{type(value).__name__}")
        elif key in RESERVED_KEYS:
            problems.append(f"metadata key {key!r} is reserved by the format "
                            f"({', '.join(RESERVED_KEYS)})")
    _raise(f"cannot save checkpoint {path}", problems)
    return user


def _stored_tensors(weights: Weights, cfg: ModelConfig, path: Path) -> dict[str, torch.Tensor]:
    """The tensors to write: all of them, minus a tied LM head (which must be the embedding)."""
    tensors = flatten_weights(weights)
    if cfg.tie_embeddings:
        head = tensors.pop("lm_head")
        same = head is weights.embed or (head.shape == weights.embed.shape
                                         and head.dtype == weights.embed.dtype
                                         and torch.equal(head, weights.embed))
        if not same:
            _raise(f"cannot save checkpoint {path}",
                   ["tensor 'lm_head' differs from 'embed' but the config ties embeddings "
                    "(tie_embeddings=True), so only 'embed' would be stored"])
    return tensors


def _host_copies(tensors: Mapping[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """CPU, contiguous, one storage each: safetensors refuses tensors that share memory (an untied
    head that aliases the embedding, views of one buffer)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in tensors.items():
        if t.device.type == "meta":
            _raise(f"cannot save checkpoint {path}",
                   [f"tensor {name!r} is on the meta device (it has a shape but no values)"])
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def _write_atomically(tensors: dict[str, torch.Tensor], header: dict[str, str], path: Path) -> None:
    """Write beside the target and rename, so a crash never leaves a truncated checkpoint. The
    temporary name is not created in advance (mkstemp would make it 0600): safetensors creates it
    with the usual permissions."""
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    try:
        save_file(tensors, str(tmp), metadata=header)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_checkpoint(path: str | os.PathLike[str], weights: Weights, cfg: ModelConfig, *,
                    metadata: dict[str, str] | None = None) -> None:
    """Write ``weights`` (geometry ``cfg``) to the safetensors file ``path``.

    The weights are checked against the config exactly as a load would check them, so a file that
    was written can always be read back. ``metadata`` (str -> str) is stored beside the format's own
    keys, which it must not reuse.
    """
    path = Path(path)
    dtype = weights.dtype
    _check_model_dtype(dtype, f"cannot save checkpoint {path}: the weights' dtype")
    user = _user_metadata(metadata, path)
    tensors = _stored_tensors(weights, cfg, path)
    actual = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
    problems = _layout_problems(actual, checkpoint_layout(cfg, dtype), cfg, dtype)
    problems += _hash_problems(weights.ple.hash_cfg, cfg)
    _raise(f"cannot save checkpoint {path}", problems)
    header = {
        **user,
        "format": FORMAT,
        "model_config": cfg.model_dump_json(),
        "dtype": _dtype_name(dtype),
        "layer_kinds": json.dumps(cfg.layer_kinds()),
        "ngram_hash": _hash_to_json(weights.ple.hash_cfg),
    }
    _write_atomically(_host_copies(tensors, path), header, path)


# ===================================================================================================
# Load
# ===================================================================================================

_U64Decimal = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,20}$")]


class _HashJson(BaseModel):
    """The ``ngram_hash`` metadata as written by ``_hash_to_json`` (strict: one spelling only)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    orders: list[int]
    primes: list[list[int]]
    pad_id: int
    multipliers: list[list[list[_U64Decimal]]]


def _read_format(header: Mapping[str, str], path: Path) -> None:
    where = f"checkpoint {path}"
    if "format" not in header:
        raise CheckpointError(f"{where}: no 'format' key in the safetensors metadata (expected "
                              f"{FORMAT!r}); not a Flash-Next checkpoint")
    name, _, version = header["format"].partition("/")
    if name != FORMAT_NAME or not version:
        raise CheckpointError(f"{where}: metadata 'format' is {header['format']!r}, expected "
                              f"'{FORMAT_NAME}/<version>'")
    if version != str(FORMAT_VERSION):
        raise CheckpointError(f"{where}: metadata 'format' version {version!r} is not supported "
                              f"(this reader reads version {FORMAT_VERSION}: {FORMAT!r})")


def _required(header: Mapping[str, str], key: str, path: Path) -> str:
    if key not in header:
        raise CheckpointError(f"checkpoint {path}: metadata key {key!r} is missing")
    return header[key]


def _read_config(header: Mapping[str, str], path: Path) -> ModelConfig:
    text = _required(header, "model_config", path)
    try:
        return ModelConfig.model_validate_json(text)
    except ValidationError as e:
        raise CheckpointError(f"checkpoint {path}: metadata 'model_config' is not a valid "
                              f"ModelConfig:\n{e}") from e


def _read_dtype(header: Mapping[str, str], path: Path) -> torch.dtype:
    name = _required(header, "dtype", path)
    if name not in MODEL_DTYPES:
        raise CheckpointError(f"checkpoint {path}: metadata 'dtype' is {name!r}, expected one of "
                              f"{', '.join(MODEL_DTYPES)}")
    return MODEL_DTYPES[name]


def _read_layer_kinds(header: Mapping[str, str], cfg: ModelConfig, path: Path) -> None:
    text = _required(header, "layer_kinds", path)
    try:
        kinds = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"checkpoint {path}: metadata 'layer_kinds' is not JSON: {e}") from e
    if kinds != cfg.layer_kinds():
        raise CheckpointError(f"checkpoint {path}: metadata 'layer_kinds' {kinds!r} disagrees with "
                              f"model_config's layer_kinds() {cfg.layer_kinds()!r}")


def _read_hash(header: Mapping[str, str], cfg: ModelConfig, path: Path) -> NgramHashConfig:
    text = _required(header, "ngram_hash", path)
    where = f"checkpoint {path}"
    try:
        raw = _HashJson.model_validate_json(text)
    except ValidationError as e:
        raise CheckpointError(f"{where}: metadata 'ngram_hash' is malformed:\n{e}") from e
    try:
        hash_cfg = NgramHashConfig(
            multipliers=tuple(tuple(tuple(int(m) for m in head) for head in order)
                              for order in raw.multipliers),
            primes=tuple(tuple(p) for p in raw.primes), pad_id=raw.pad_id, orders=tuple(raw.orders))
    except ValueError as e:
        raise CheckpointError(f"{where}: metadata 'ngram_hash' is not a valid NgramHashConfig: "
                              f"{e}") from e
    _raise(where, _hash_problems(hash_cfg, cfg))
    return hash_cfg


@contextmanager
def _open(path: Path) -> Iterator[Any]:
    """safe_open, with a malformed file reported as a CheckpointError naming it (a missing file
    stays a FileNotFoundError)."""
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except SafetensorError as e:
        raise CheckpointError(f"checkpoint {path}: not a readable safetensors file: {e}") from e
    with handle as f:
        yield f


def _stored_layout(f: Any) -> dict[str, tuple[tuple[int, ...], torch.dtype | str]]:
    """Shape and dtype of every tensor in the file, read from the header without loading data."""
    out: dict[str, tuple[tuple[int, ...], torch.dtype | str]] = {}
    for name in f.keys():
        sl = f.get_slice(name)
        tag = sl.get_dtype()
        out[name] = (tuple(sl.get_shape()), _SAFETENSORS_DTYPES.get(tag, tag))
    return out


def _cast(tensors: dict[str, torch.Tensor], cfg: ModelConfig,
          dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Each tensor to the dtype init_weights(cfg, dtype=dtype) gives it (dense -> dtype, fp32
    parameters fp32 or float64, NVFP4 and global scales unchanged)."""
    target = checkpoint_layout(cfg, dtype)
    return {name: t.to(target[name].dtype) for name, t in tensors.items()}


def load_checkpoint(path: str | os.PathLike[str], *, dtype: torch.dtype | None = None) -> Checkpoint:
    """Read a checkpoint written by ``save_checkpoint``; ``dtype`` optionally casts it to another
    model dtype (module docstring, "Loading with dtype").

    Everything is checked before any tensor data is read: format version, config, hash constants,
    and every tensor's name, shape and dtype against the config.
    """
    path = Path(path)
    if dtype is not None:
        _check_model_dtype(dtype, "load_checkpoint: dtype")
    with _open(path) as f:
        header = dict(f.metadata() or {})
        _read_format(header, path)
        cfg = _read_config(header, path)
        stored = _read_dtype(header, path)
        _read_layer_kinds(header, cfg, path)
        hash_cfg = _read_hash(header, cfg, path)
        _raise(f"checkpoint {path}",
               _layout_problems(_stored_layout(f), checkpoint_layout(cfg, stored), cfg, stored))
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    if dtype is not None and dtype != stored:
        tensors = _cast(tensors, cfg, dtype)
    if cfg.tie_embeddings:
        tensors["lm_head"] = tensors["embed"]
    weights = _rebuild(_template(cfg, dtype or stored), "", tensors, hash_cfg)
    user = {k: v for k, v in header.items() if k not in RESERVED_KEYS}
    return Checkpoint(cfg=cfg, weights=weights, metadata=user)
