"""Probe (GPU): FlashInfer and fla against gdn_prefill's bf16_operands tier, in oracle units."""
import sys, torch, json
from functools import partial
from certify.catalog.load import load_op_file
from certify.files.paths import project_paths
from certify.harness.target import build_case, run_spec, run_variant, variant_callable
from certify.harness.oracles import tolerance
from spec.ops import gdn

op = load_op_file(project_paths().cells / "gdn_prefill.yaml")
res = {}
def metrics(got, ref, case):
    out = {}
    for n in ("out", "final_state"):
        m = tolerance(n, got[n].cpu(), ref[n].cpu(), 1e12, 1e12).metrics
        out |= {k: round(v, 3) for k, v in m.items()}
    return out
def fla_call(case):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    i = case.inputs
    g, beta = gdn.gdn_gates(i["a"], i["b"], i["A_log"], i["dt_bias"])
    hv, hk = i["v"].shape[2], i["q"].shape[2]
    q, k = (i[n].repeat_interleave(hv // hk, dim=2).contiguous() for n in ("q", "k"))
    o, fin = fla_chunk(q=q, k=k, v=i["v"], g=g, beta=beta, initial_state=i["state"].clone(),
                       output_final_state=True, use_qk_l2norm_in_kernel=True)[:2]
    from impl.kernels.gdn.torch_ops import _gated_norm
    return {"out": _gated_norm(o.float(), i["z"], i["norm_w"]), "final_state": fin}
shapes = [("short_t37", {}), ("points_b2_t64", {"batch": 2, "seq_len": 64}),
          ("b3_t130", {}), ("b2_t2048", {}), ("long_t8192", {})]
for cid, axes in shapes:
    base = op.cell(cid) if not axes else op.cell("short_t37").model_copy(update={"id": cid, "axes": axes})
    case = build_case(op, base, torch.device("cuda"))
    tier = run_spec(gdn.gdn_prefill_bf16_operands, case, True)
    exact = run_spec(gdn.gdn_prefill, case, True)
    lowp = run_variant(variant_callable(op, "spec_bf16_operands"), case)
    r = {"spec_lowp_vs_tier": metrics(lowp, tier, case)}
    for name, fn in (("flashinfer", lambda: run_variant(variant_callable(op, "flashinfer_chunked"), case)),
                     ("fla", lambda: fla_call(case))):
        try:
            got = fn()
            r[f"{name}_vs_tier"] = metrics(got, tier, case)
            if exact is not None:
                r[f"{name}_vs_exact"] = metrics(got, exact, case)
        except Exception as e:
            r[name] = f"{type(e).__name__}: {e}"[:300]
    if exact is not None:
        r["tier_vs_exact"] = metrics({k: v.float() if k == "final_state" else v.to(torch.bfloat16) for k, v in tier.items()}, exact, case)
    res[cid] = r
    print(cid, json.dumps(r), flush=True)
    del case, tier, exact
    torch.cuda.empty_cache()
import os
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "tiers.json"), "w"), indent=1)
