"""``certify verify``: a receipt is re-run and must reproduce its status, digests and metrics."""

from pathlib import Path

import pytest
import torch

from certify.catalog.load import load_catalog
from certify.cli import main
from certify.harness.target import certify_cell
from certify.files.paths import project_paths
from certify.catalog.plan import targets
from certify.receipts.store import library_versions, make_receipt, write_receipts
from certify.receipts.verify import (
    CONFIRMED,
    CONFIRMED_BAND,
    MISMATCH,
    not_comparable,
    select_receipts,
    verify_target,
)

OP = "gated_rmsnorm"


@pytest.fixture(scope="module")
def target():
    catalog = load_catalog(project_paths().cells)
    return next(t for t in targets(catalog.ops[OP])
                if t.variant.name == "torch" and t.arch == "cpu" and t.cell.oracle.kind == "tolerance")


@pytest.fixture(scope="module")
def receipt(target):
    outcome = certify_cell(target.op, target.variant.name, target.cell, target.arch)
    assert outcome.status == "passed", outcome.message
    return make_receipt(target.op, target.variant.name, target.cell, target.arch, outcome)


def test_an_honest_receipt_is_confirmed(target, receipt):
    v = verify_target(target, receipt)
    assert v.verdict == CONFIRMED, v


def test_changed_code_under_a_recomputed_hash_is_caught(target, receipt, monkeypatch):
    """The variant now writes other bytes (still inside the band, so its status stays passed), and
    the receipt's hash was recomputed over the changed code: only the digests tell."""
    import impl.kernels.gdn.torch_ops as mod

    real = mod.gated_rmsnorm

    def drifted(**kw):
        real(**kw)
        kw["out"].view(-1)[:1].view(torch.int16).add_(1)  # one element one bf16 ulp away

    monkeypatch.setattr(mod, "gated_rmsnorm", drifted)
    v = verify_target(target, receipt)
    assert v.verdict == MISMATCH and "digest" in v.detail and "status" not in v.detail, v


def test_a_forged_status_is_caught(target, receipt):
    forged = receipt.model_copy(update={"status": "failed"})
    v = verify_target(target, forged)
    assert v.verdict == MISMATCH and "status passed now, failed recorded" in v.detail, v


def test_another_cpu_dispatch_rechecks_status_and_band_only(target, receipt):
    other = {**receipt.versions, "cpu_capability": "NOT_THIS_ONE"}
    assert "cpu_capability NOT_THIS_ONE here" in not_comparable(other, library_versions())
    edited = receipt.model_copy(update={"versions": other,
                                        "digests": {k: "0" * 32 for k in receipt.digests}})
    v = verify_target(target, edited)
    assert v.verdict == CONFIRMED_BAND and "NOT_THIS_ONE" in v.detail, v


def test_another_processor_rechecks_status_and_band_only(target, receipt):
    """Receipts name the processor (vendor, family, model): MKL picks its GEMM kernels by it, so a
    receipt of another processor with the same instruction set is checked for status and band, and
    one without the key (recorded before it existed) likewise."""
    from certify.receipts.store import cpu_model

    here = library_versions()
    if cpu_model() is None:
        pytest.skip("no /proc/cpuinfo: the processor is not recorded on this system")
    assert here["cpu_model"] == cpu_model()
    for other in ({**receipt.versions, "cpu_model": "GenuineIntel 6/143"},
                  {k: v for k, v in receipt.versions.items() if k != "cpu_model"}):
        if other.get("cpu_model") == here["cpu_model"]:
            continue
        assert "cpu_model" in not_comparable(other, here)
        edited = receipt.model_copy(update={"versions": other,
                                            "digests": {k: "0" * 32 for k in receipt.digests}})
        v = verify_target(target, edited)
        assert v.verdict == CONFIRMED_BAND and "cpu_model" in v.detail, v


def test_the_budget_takes_the_cheapest_receipts(target, receipt, tmp_path: Path):
    cheap = receipt.model_copy(update={"seconds": 0.5})
    dear = receipt.model_copy(update={"cell": "elsewhere", "seconds": 50.0})
    write_receipts(tmp_path, [cheap, dear])
    catalog = load_catalog(project_paths().cells)
    chosen, left = select_receipts(catalog, tmp_path, ops=[OP], archs=["cpu"], budget_s=1.0)
    assert [r.seconds for _, r in chosen] == [0.5]
    assert not any("elsewhere" in v.target for v in left)  # a receipt of no target is never run


def test_the_command_exits_1_on_a_mismatch(target, receipt, tmp_path: Path, monkeypatch, capsys):
    from certify import cli

    paths = project_paths()
    monkeypatch.setattr(cli, "project_paths",
                        lambda: type(paths)(**{**paths.__dict__, "receipts": tmp_path}))
    write_receipts(tmp_path, [receipt])
    assert main(["verify", "--op", OP, "--arch", "cpu"]) == 0
    assert "1 confirmed" in capsys.readouterr().out
    write_receipts(tmp_path, [receipt.model_copy(update={"status": "failed"})])
    assert main(["verify", "--op", OP, "--arch", "cpu"]) == 1
    assert MISMATCH in capsys.readouterr().out


_BLAS_PROBE = """
import hashlib, json, numpy as np
from certify.receipts.store import library_versions
a = np.random.default_rng(0).standard_normal((64, 512), dtype=np.float32)
print(json.dumps({"versions": library_versions(), "bits": hashlib.md5((a @ a.T).tobytes()).hexdigest()}))
"""


@pytest.mark.parametrize("family", ["Sandybridge", "Haswell"])
def test_numpy_blas_kernel_family_decides_comparability(family):
    """Triton's interpreter computes its dots with numpy's BLAS, whose kernel family (picked from the
    CPU at load) orders the sums: a run under another family is not digest-comparable, and the
    versions say why. Each family here runs on any x86-64 CPU with AVX2."""
    import json
    import os
    import subprocess
    import sys

    def probe(env_extra):
        env = {**os.environ, **env_extra}
        out = subprocess.run([sys.executable, "-c", _BLAS_PROBE], env=env, capture_output=True,
                             text=True, check=True, cwd=project_paths().root).stdout
        return json.loads(out.strip().splitlines()[-1])

    here, there = probe({}), probe({"OPENBLAS_CORETYPE": family})
    assert there["versions"]["numpy_blas"].endswith(family), there["versions"]
    if there["bits"] != here["bits"]:
        assert not_comparable(here["versions"], there["versions"]) is not None
    same_family = here["versions"]["numpy_blas"] == there["versions"]["numpy_blas"]
    assert same_family == (not_comparable(here["versions"], there["versions"]) is None)


def test_the_report_says_what_it_certified(tmp_path: Path, monkeypatch, capsys):
    """``certify report`` states what it did: the targets it certified, or that nothing was
    outdated (here on one op, into scratch receipts and reports)."""
    from certify import cli

    paths = project_paths()
    monkeypatch.setattr(cli, "project_paths", lambda: type(paths)(**{
        **paths.__dict__, "receipts": tmp_path / "receipts", "reports": tmp_path / "reports"}))
    monkeypatch.setattr(cli, "present_archs", lambda: ["cpu"])
    assert main(["report", "--op", OP]) == 0
    first = capsys.readouterr().out
    n = sum(1 for t in targets(load_catalog(paths.cells).ops[OP]) if t.arch == "cpu")
    assert f"certified {n} outdated or missing target(s) on cpu: {n} passed, 0 not passed" in first
    assert main(["report", "--op", OP]) == 0
    assert "nothing outdated on cpu: every receipt here is fresh" in capsys.readouterr().out
