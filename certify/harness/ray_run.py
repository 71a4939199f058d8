"""``certify run --ray ADDRESS``: the targets as Ray tasks on a cluster (``local``: a cluster of this
machine's own, started for the run; ``auto``: the running cluster Ray finds; else its address).

Each target is one task with the resources of its arch: ``cpus`` CPUs (``--ray-cpus``, default 1;
torch runs on that many threads, and a receipt records its thread count), ``cpu-interpret`` tasks in
workers started with ``TRITON_INTERPRET=1`` (``cpu`` tasks alike), and for ``sm_*`` one GPU and one
unit of a custom resource named after the arch (a GPU node offers it: ``ray start --num-gpus 1
--resources '{"sm_90": 1}'``). torch's CPU kernels may split a reduction by thread count, so
receipts made on one thread can differ in their last bits from receipts made on two, and merge calls
that a platform difference: give the tasks the thread count the receipts were made with to
reproduce them. Tasks are submitted longest first (their last receipt's seconds). A task writes its
receipt into a folder of its own worker (``<runs>/<worker>/<arch>.jsonl``) on the shared file
system, and Ray runs a task again when its worker dies (``max_retries``). A task that
still fails (its worker died on every attempt, or it raised) is reported with its target, the
attempts it started (each attempt leaves a marker under ``<runs>/attempts/``) and Ray's reason; the
other tasks run on. At the end ``certify merge`` folds the worker folders into the receipts
directory, so what a distributed run writes is what a one-process run writes, and two workers that
disagree on the same code's bytes are reported, not resolved. An arch no node of the cluster offers
is refused up front.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from certify.catalog.plan import Target

RETRIES = 2
INSTALL_HINT = "Ray is an optional dependency: pip install -e '.[ray]'"


@dataclass(frozen=True)
class Failed:
    """A target whose task failed on every attempt Ray gave it."""
    target: str
    attempts: int   # the attempts that started (their markers)
    why: str

    def __str__(self) -> str:
        return f"{self.target} after {self.attempts} attempt(s): {self.why}"


def _attempts_dir(out: Path, target: str) -> Path:
    return Path(out) / "attempts" / target.replace("::", "__")


def _why(error: Exception) -> str:
    """Ray's reason in one line: the task's own exception where it raised, else Ray's error."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}".splitlines()[0]
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def _resources(arch: str, cpus: int) -> dict:
    """A task's resources. ``cpu`` and ``cpu-interpret`` tasks share one runtime environment, the
    interpreter's (a ``cpu`` variant launches no Triton kernel): workers of two environments would
    take turns under the node's worker limit, each turn starting new ones."""
    if arch.startswith("sm_"):
        return {"num_cpus": cpus, "num_gpus": 1, "resources": {arch: 1}}
    return {"num_cpus": cpus, "runtime_env": {"env_vars": {"TRITON_INTERPRET": "1"}}}


def _offered(arch: str, cluster: dict, cpus: int) -> bool:
    need = {"CPU": cpus} | ({"GPU": 1, arch: 1} if arch.startswith("sm_") else {})
    return all(cluster.get(k, 0) >= v for k, v in need.items())


def certify_remote(root: str, cells: str, op: str, variant: str, cell: str, arch: str,
                   out: str, cpus: int) -> str:
    """One target on a worker: certify it with torch on the ``cpus`` threads the task holds, write
    its receipt under ``out/<worker>``, return it as JSON. Runs in the checkout ``root`` so that its
    hash covers the same modules as the driver's."""
    marks = _attempts_dir(Path(out), f"{op}::{variant}::{cell}::{arch}")
    marks.mkdir(parents=True, exist_ok=True)
    (marks / f"{os.getpid()}-{time.time_ns()}").touch()
    os.chdir(root)
    if root not in sys.path:
        sys.path.insert(0, root)
    import ray  # noqa: PLC0415
    import torch  # noqa: PLC0415

    torch.set_num_threads(cpus)

    from certify.catalog.load import load_op_file  # noqa: PLC0415
    from certify.harness.checks import certify_checked  # noqa: PLC0415
    from certify.receipts.store import make_receipt, write_receipts  # noqa: PLC0415

    spec = load_op_file(Path(cells) / f"{op}.yaml")
    c = spec.cell(cell)
    receipt = make_receipt(spec, variant, c, arch, *certify_checked(spec, variant, c, arch))
    worker = ray.get_runtime_context().get_worker_id()[:12]
    write_receipts(Path(out) / worker, [receipt])
    return receipt.model_dump_json()


def run_on_ray(chosen: list[Target], address: str, paths, out: Path,
               cost: dict[str, float] | None = None, cpus: int = 1
               ) -> tuple[list, list[str], list[Failed]]:
    """Run the targets as tasks of ``cpus`` CPUs each (torch's thread count there), writing the
    workers' receipts under ``out``. Returns (the receipts, the targets refused because no node
    offers their arch, the targets whose task failed on every attempt)."""
    try:
        import ray  # noqa: PLC0415
    except ImportError:
        raise SystemExit(INSTALL_HINT) from None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn  # noqa: PLC0415

    from certify.receipts.store import Receipt  # noqa: PLC0415

    ray.init(address=address, include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    try:
        cluster = ray.cluster_resources()
        refused = [f"{t.name}: no node of the cluster offers {t.arch} with {cpus} CPU(s)"
                   for t in chosen if not _offered(t.arch, cluster, cpus)]
        runnable = [t for t in chosen if _offered(t.arch, cluster, cpus)]
        runnable.sort(key=lambda t: -(cost or {}).get(t.name, 1.0))
        remote = ray.remote(max_retries=RETRIES, retry_exceptions=False)(certify_remote)
        pending = {remote.options(**_resources(t.arch, cpus)).remote(
            str(paths.root), str(paths.cells), t.op.op, t.variant.name, t.cell.id, t.arch,
            str(out), cpus): t for t in runnable}
        receipts, failed = [], []
        disable = os.environ.get("CI") == "true"
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      disable=disable, transient=True) as progress:
            bar = progress.add_task(f"certifying on Ray ({address})", total=len(pending))
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                t = pending.pop(done[0])
                try:
                    receipts.append(Receipt.model_validate_json(ray.get(done[0])))
                except ray.exceptions.RayError as e:
                    marks = _attempts_dir(out, t.name)
                    failed.append(Failed(t.name, len(list(marks.iterdir())) if marks.is_dir()
                                         else 0, _why(e)))
                    progress.update(bar, description=f"certifying on Ray ({address}), "
                                                     f"{len(failed)} failed")
                progress.advance(bar)
    finally:
        ray.shutdown()
    return receipts, refused, failed
