"""The model-geometry section of the certification report, computed from spec/config.py alone.

``summary()`` returns markdown lines: parameter counts of the target and tiny geometries, KV-cache bytes
per token (per QSA layer and over all QSA layers) for bf16 / fp8 / nvfp4, the QSA side planes, and the
recurrent-state bytes per request slot (fp32 / bf16), with the 113 MB of docs/spec.md checked. Nothing is
instantiated: every number comes from the shapes.
"""

from __future__ import annotations

from spec.config import ModelConfig, format_count

KV_DTYPES = ("bf16", "fp8", "nvfp4")
MATH_STATE_BYTES_FP32 = 48 * 128 * 128 * 4 * 36  # docs/spec.md, "Geometry": 113 MB per slot, 36 layers


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB ({n / 2**20:.1f} MiB)"


def summary(target: ModelConfig | None = None, tiny: ModelConfig | None = None) -> list[str]:
    """Markdown lines of the model-geometry summary (defaults: the two presets)."""
    target = target or ModelConfig.target()
    tiny = tiny or ModelConfig.tiny()
    lines = ["## Model geometry", ""]

    lines += ["| | target | tiny |", "|---|---|---|"]
    for label, fn in (
        ("parameters", lambda c: f"{c.param_count():,} ({format_count(c.param_count())})"),
        ("of which routed NVFP4 experts", lambda c: f"{c.routed_expert_params():,}"),
        ("active per token (top-k of the routed experts)",
         lambda c: f"{c.active_param_count():,} ({format_count(c.active_param_count())})"),
        ("hidden x layers (GDN / QSA)",
         lambda c: f"{c.hidden} x {c.num_layers} ({c.num_gdn_layers} / {c.num_qsa_layers})"),
        ("vocab", lambda c: f"{c.vocab_size:,}"),
        ("experts, top-k", lambda c: f"{c.num_experts}, {c.moe_top_k}"),
    ):
        lines.append(f"| {label} | {fn(target)} | {fn(tiny)} |")
    lines.append("")

    lines += [f"### KV cache bytes per token (target: {target.num_kv_heads} KV heads x "
              f"{target.head_dim}, {target.num_qsa_layers} QSA layers)", "",
              "| KV dtype | per QSA layer | all QSA layers | + MTP layer | tiny, all QSA layers |",
              "|---|---|---|---|---|"]
    for kv in KV_DTYPES:
        lines.append(f"| {kv} | {target.kv_bytes_per_token_per_layer(kv):,} B "
                     f"| {target.kv_bytes_per_token(kv):,} B "
                     f"| {target.kv_bytes_per_token(kv, include_mtp=True):,} B "
                     f"| {tiny.kv_bytes_per_token(kv):,} B |")
    side = target.qsa_side_plane_bytes_per_token()
    lines += ["", f"QSA side planes (index key bf16, int32 position, block key / 32), not in the KV "
              f"figures: {side:g} B per token per layer, {side * target.num_qsa_layers:g} B over the "
              f"QSA layers.", ""]

    fp32 = target.gdn_state_bytes_per_slot("fp32")
    bf16 = target.gdn_state_bytes_per_slot("bf16")
    check = "matches" if fp32 == MATH_STATE_BYTES_FP32 else "DOES NOT MATCH"
    lines += [f"### Recurrent state per request slot ({target.num_gdn_layers} GDN layers)", "",
              "| state dtype | GDN state | conv windows (bf16) |", "|---|---|---|",
              f"| fp32 | {fp32:,} B = {_mb(fp32)} | {target.conv_state_bytes_per_slot():,} B |",
              f"| bf16 | {bf16:,} B = {_mb(bf16)} | {target.conv_state_bytes_per_slot():,} B |",
              "",
              "docs/spec.md's figure (\"Geometry\") 48 x 128 x 128 x 4 B x 36 = "
              f"{MATH_STATE_BYTES_FP32:,} B (113 MB): "
              f"{check} the config's fp32 state."]
    return lines


if __name__ == "__main__":
    print("\n".join(summary()))
