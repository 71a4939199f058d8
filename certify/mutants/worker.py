"""One mutant in its own process: ``python -m certify.mutants.worker JOB.json RESULT.json``.

The job names a module, the file that holds its mutated source (outside the working tree) and the
pytest item ids to run. Before anything of the project is imported, an import finder first on
``sys.meta_path`` serves that module from the mutated file, so every importer (the variant, the spec,
the tests) sees the mutant, and the working tree is only read. The items run in the given order and
the run stops at the first failure (``-x``): that item killed the mutant. With ``"stop": false`` every
item runs (the clean run that confirms a killing test passes without its mutant).

A job with ``"args"`` instead is one plain pytest run of the unmutated code with those arguments; its
result is pytest's exit code.

The result file holds the outcome of every item that ran (``passed``, ``failed``, ``skipped``), the
first that failed, each item's seconds (setup, call and teardown) and the session's seconds.

Hypothesis keeps the loaded profile's examples but neither shrinks nor explains a failing example: a
mutant needs one failing example, not the smallest, and shrinking through Triton's interpreter can take
minutes. A test fails under the same examples either way.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import sys
import time


class _Served(importlib.abc.MetaPathFinder):
    """Serves one module from another file (a package's ``__init__`` keeps its own folder)."""

    def __init__(self, module: str, path: str, package_dir: str | None):
        self.module, self.path, self.package_dir = module, path, package_dir

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.module:
            return None
        locations = [self.package_dir] if self.package_dir else None
        return importlib.util.spec_from_file_location(fullname, self.path,
                                                      submodule_search_locations=locations)


class _Record:
    """A pytest plugin: keeps the given item order and records each item's outcome."""

    def __init__(self, order: list[str], finder: _Served | None):
        self.order = {nodeid: n for n, nodeid in enumerate(order)}
        self.finder = finder
        self.outcomes: dict[str, str] = {}
        self.durations: dict[str, float] = {}
        self.first_failed: str | None = None
        self.message = ""

    def pytest_configure(self, config):
        if self.finder is not None:  # first again, ahead of finders pytest added since
            if self.finder in sys.meta_path:
                sys.meta_path.remove(self.finder)
            sys.meta_path.insert(0, self.finder)
        _no_shrinking()

    def pytest_collection_modifyitems(self, items):
        items.sort(key=lambda i: self.order.get(i.nodeid, len(self.order)))

    def pytest_runtest_logreport(self, report):
        self.durations[report.nodeid] = self.durations.get(report.nodeid, 0.0) + report.duration
        if report.failed:
            self.outcomes[report.nodeid] = "failed"
            if self.first_failed is None:
                self.first_failed = report.nodeid
                self.message = (report.longreprtext or "")[-2000:]
        elif report.skipped:
            self.outcomes.setdefault(report.nodeid, "skipped")
        elif report.when == "call":
            self.outcomes.setdefault(report.nodeid, "passed")

    def pytest_collectreport(self, report):
        if report.failed and self.first_failed is None:
            self.first_failed = report.nodeid or "(collection)"
            self.message = (report.longreprtext or "")[-2000:]


def _no_shrinking() -> None:
    """The loaded hypothesis profile without its shrink and explain phases."""
    try:
        from hypothesis import Phase, settings  # noqa: PLC0415
    except ImportError:
        return
    base = settings.default
    settings.register_profile("certify-mutants", parent=base,
                              phases=[p for p in base.phases if p not in (Phase.shrink, Phase.explain)])
    settings.load_profile("certify-mutants")


def run(job: dict) -> dict:
    if "args" in job:   # a plain pytest run of the unmutated code (the collection of the op's tests)
        import pytest  # noqa: PLC0415

        return {"exit": int(pytest.main(job["args"]))}
    finder = None
    if job.get("module"):
        finder = _Served(job["module"], job["path"], job.get("package_dir"))
        sys.meta_path.insert(0, finder)
    import pytest  # noqa: PLC0415 (after the finder: nothing of the project is imported before it)

    rec = _Record(job["tests"], finder)
    args = [*job["tests"], "-q", "-p", "no:cacheprovider", "-p", "no:certify-run-order",
            "--rootdir", job["root"], "-o", "console_output_style=classic", "--no-header",
            "-W", "ignore"]
    if job.get("stop", True):
        args.append("-x")
    t0 = time.perf_counter()
    code = pytest.main(args, plugins=[rec])
    seconds = time.perf_counter() - t0
    missing = [t for t in job["tests"] if t not in rec.outcomes]
    return {"exit": int(code), "outcomes": rec.outcomes, "first_failed": rec.first_failed,
            "message": rec.message, "seconds": seconds, "durations": rec.durations,
            "not_run": missing if rec.first_failed is None else []}


def main(argv: list[str]) -> int:
    job_file, result_file = argv
    with open(job_file) as f:
        job = json.load(f)
    result = run(job)
    with open(result_file, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
