"""The memory an engine holds beside the weights, from its configuration and the geometry alone.

Its parts, in bytes:

- ``kv_pages``: the page pool (impl/model/cache.py): every slot's pages at ``max_seq_len``, each page
  holding, for every QSA layer (and the MTP draft layer with speculation), its K and V (bf16, fp8, or
  nvfp4 codes and e4m3 scales), index keys, positions, block key and block-key flag;
- ``state_pools``: the GDN state (fp32 or bf16) and conv window (activation dtype) of every slot and
  GDN layer, and the PLE n-gram histories;
- ``expert_copy``: the second copy of the routed experts (impl/model/expert_copy.py), 0 where none is
  kept;
- ``verify_states``: with speculation and the cached GDN commit, each GDN layer's verify buffer: the
  state after each of the K + 1 rows a slot verifies in a step, in the state's dtype (shared by eager
  steps and every captured verify graph);
- ``prefill_breaks``: with the breakable prefill graph (impl/model/prefill_graphs.py), the static
  buffers of its breaks, inputs and outputs, at the largest token bucket (every bucket uses the
  first rows of the same buffers): the PLE embedding's, and one GDN and one QSA mixer's (a layer's
  are read only around its break, so the layers of a kind share them). The graph pieces' own
  memory pool is not counted here (bench/prefill_graph.py measures it on the device).

The engine sizes its page pool from ``max_seq_len``, not from the device's free memory, so the copy
does not shrink it here; it is counted in the same sum as the pages (``total``), the memory a
deployment sizing the KV pool from what is free gives up to it. tests/engine/test_memory.py holds
``kv_pages`` and ``state_pools`` to the bytes ``EngineCache.allocate`` allocates.
"""

from __future__ import annotations

from dataclasses import dataclass

from impl.model.cache import PAGE
from impl.model.expert_copy import ExpertCopy
from spec.config import ModelConfig

_STATE_BYTES = {"fp32": 4, "bf16": 2}
_ACT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_INT32, _INT64, _BOOL = 4, 8, 1


def page_bytes(model: ModelConfig, kv_dtype: str, act_bytes: int) -> int:
    """One page of one QSA layer: K and V, the index plane, the position plane, its block key and
    the block key's valid flag."""
    return (PAGE * (model.kv_bytes_per_token_per_layer(kv_dtype) + model.index_dim * act_bytes
                    + _INT32) + model.index_dim * act_bytes + _BOOL)


@dataclass(frozen=True)
class MemoryPlan:
    pages: int
    kv_pages: int
    state_pools: int
    expert_copy: ExpertCopy
    prefill_breaks: int = 0
    verify_states: int = 0

    @property
    def total(self) -> int:
        return (self.kv_pages + self.state_pools + self.expert_copy.bytes + self.prefill_breaks
                + self.verify_states)

    def lines(self) -> list[str]:
        gib = lambda n: f"{n / 2**30:.3f} GiB"  # noqa: E731
        copy = self.expert_copy
        return [f"  KV pages: {self.pages} pages, {gib(self.kv_pages)}",
                f"  GDN state and conv pools, PLE histories: {gib(self.state_pools)}",
                f"  second expert copy: {gib(copy.bytes)} ({'kept' if copy.kept else 'none'}: "
                f"{copy.reason})",
                *([f"  prefill graph break buffers: {gib(self.prefill_breaks)}"]
                  if self.prefill_breaks else []),
                *([f"  GDN verify states (cached commit): {gib(self.verify_states)}"]
                  if self.verify_states else []),
                f"  total: {gib(self.total)}"]


def prefill_break_bytes(model: ModelConfig, rows: int, act_bytes: int) -> int:
    """The static buffers of a breakable prefill graph's breaks at ``rows`` rows, inputs and
    output: the PLE embedding's (ids int64, x_emb [C]; e [L, ple_dim]), a GDN mixer's (the conv
    input [2 HK K + HV V], a and b [HV], z [HV, V]; out [HV, V]) and a QSA mixer's (q and the gate
    [HQ, D], k and v [HKV, D], the index query [HI, DI], key [DI] and weights [HI]; out [HQ, D])."""
    m = model
    hk, hv, dk, dv = m.gdn_key_heads, m.gdn_value_heads, m.gdn_d_k, m.gdn_d_v
    hq, hkv, dh, hi, di = m.num_q_heads, m.num_kv_heads, m.head_dim, m.index_heads, m.index_dim
    ple = _INT64 + (m.hidden + m.num_layers * m.ple_dim) * act_bytes
    gdn = (2 * hk * dk + hv * dv + 2 * hv + 2 * hv * dv) * act_bytes if m.num_gdn_layers else 0
    qsa = ((3 * hq + 2 * hkv) * dh + hi * di + di + hi) * act_bytes if m.num_qsa_layers else 0
    return rows * (ple + gdn + qsa)


def memory_plan(model: ModelConfig, *, slots: int, max_seq_len: int, kv_dtype: str,
                state_dtype: str, model_dtype: str, with_mtp: bool,
                expert_copy: ExpertCopy, prefill_rows: int = 0,
                verify_rows: int = 0) -> MemoryPlan:
    """The plan of an engine with ``slots`` slots (``EngineCache.allocate``'s arguments, with its
    ``verify_rows``), and with a breakable prefill graph whose largest bucket holds
    ``prefill_rows`` rows (0: none)."""
    act = _ACT_BYTES[model_dtype]
    pages = slots * -(-max_seq_len // PAGE)
    layers = model.num_qsa_layers + (model.mtp_layers if with_mtp else 0)
    kv = pages * layers * page_bytes(model, kv_dtype, act)
    state = model.gdn_value_heads * model.gdn_d_k * model.gdn_d_v * _STATE_BYTES[state_dtype]
    gdn = model.num_gdn_layers * slots * (
        state + model.gdn_conv_channels * (model.gdn_conv_kernel - 1) * act)
    ple = slots * 2 * _INT64
    breaks = prefill_break_bytes(model, prefill_rows, act) if prefill_rows else 0
    verify = model.num_gdn_layers * slots * verify_rows * state
    return MemoryPlan(pages, kv, gdn + ple, expert_copy, breaks, verify)


FITS_RULE = "memory_fits_the_device"
FITS_STATEMENT = ("what the engine holds beside the weights (its memory plan) fits the device "
                  "memory free once the weights are there")


def memory_shortfall(plan: MemoryPlan, free_bytes: int) -> str | None:
    """None when ``plan`` fits ``free_bytes``; else why not, with the plan's parts. The plan does not
    count activations or graph pools, so a plan that fits may still run short; one that does not
    fit is refused before anything is allocated."""
    if plan.total <= free_bytes:
        return None
    hint = (f"\n  gdn_commit 'recompute' keeps no verify states "
            f"({plan.verify_states / 2**30:.3f} GiB less)" if plan.verify_states else "")
    return (f"the plan needs {plan.total / 2**30:.2f} GiB and {free_bytes / 2**30:.2f} GiB are free "
            "on the device:\n" + "\n".join(plan.lines()) + hint)
