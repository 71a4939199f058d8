"""pytest plugin: every (op, variant, cell, arch) of the cell files becomes a test item.

- Items are marked with their tier (``premerge`` / ``postmerge`` / ``ondemand``) and ``arch(name)``,
  and skipped with a reason where their arch is not on this machine.
- A malformed cell file becomes one failing item whose message names the file, the line and the field;
  every other file's items still run.
- Any other test without a tier marker is pre-merge by default, so ``pytest -m premerge`` runs the
  framework's own tests, the spec's property tests and guards, and the pre-merge cells.
- ``--certify-receipts DIR`` appends a receipt per certified item to DIR (one file per worker).
- A certified item whose committed receipt is fresh re-checks it (``certify.receipts.verify``): where the run
  is comparable with the receipt's (same versions, CPU dispatch or GPU), it fails unless the digests,
  metrics and status reproduce.
- Generated test lists (``certify.lists``): when the pre-merge list (``[tool.certify] lists``, default
  ``test_lists/premerge.yml``) exists, an item's tier is the list that holds it (pre-merge iff its id is
  in ``premerge.yml``), so ``pytest -m premerge`` runs exactly the pre-merge list; an item in no list
  keeps its declared tier (and the lists' staleness test fails until they are regenerated).
- ``--certify-items FILE`` writes the item universe (every item id with its declared tier, arch, guard
  and property ops, cell or gate) as JSON; ``--record-durations [FILE]`` records each item's measured
  duration (setup + call + teardown; skipped items are not measured) into the durations file.
- Items run file by file, the file holding the longest measured item first, so that under
  pytest-xdist the long items start early instead of running alone at the end.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from certify.harness.archs import choose_triton_mode, present_archs
from certify.files.problem import FileProblem
from certify.catalog.load import load_op_file
from certify.harness.verified import certify_verifying, standing_verdicts
from certify.harness.target import certifying_problem
from certify.files.paths import project_paths
from certify.catalog.plan import Target, targets
from certify.receipts.codehash import content_hash
from certify.receipts.store import (
    library_versions,
    load_receipts,
    make_receipt,
    write_receipts,
)
from certify.harness.requirements import versions as required_versions
from certify.harness.requirements import why_skipped
from certify.receipts.verify import compare
from certify.catalog.schema import TIERS

UNIVERSE = pytest.StashKey[list]()  # the item records of a session that collected the whole suite


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--certify-receipts", default=None,
                     help="directory to write receipts of the certified items into")
    parser.addoption("--certify-items", default=None, metavar="FILE",
                     help="write every collected item (id, declared tier, arch, guard/property ops, "
                          "cell, gate) as JSON to FILE (the universe of `certify lists`)")
    parser.addoption("--record-durations", nargs="?", const="", default=None, metavar="FILE",
                     help="record the measured duration of every item that ran (not skipped) into "
                          "the durations file (default: the lists folder's durations.json)")


def pytest_configure(config: pytest.Config) -> None:
    choose_triton_mode()
    for tier in TIERS:
        config.addinivalue_line("markers", f"{tier}: certification tier {tier}")
    config.addinivalue_line("markers", "arch(name): the architecture an item needs")
    config.addinivalue_line("markers", "certify_guard(op): the hand-checkable single case of an op")
    config.addinivalue_line("markers", "certify_property(op): the hypothesis property test of an op")
    config.pluginmanager.register(_RunOrder(), "certify-run-order")


def pytest_collect_file(file_path: Path, parent: pytest.Collector):
    cells = project_paths(str(parent.config.rootpath)).cells.resolve()
    if file_path.suffix == ".yaml" and file_path.parent.resolve() == cells:
        return CellFile.from_parent(parent, path=file_path)
    return None


class CertificationFailure(Exception):
    pass


class CellFile(pytest.File):
    def collect(self):
        try:
            op = load_op_file(self.path)
        except FileProblem as e:
            yield CatalogErrorItem.from_parent(self, name="load", error=e)
            return
        for t in targets(op):
            yield CertifyItem.from_parent(self, name=t.item_name,
                                          target=t)


class CatalogErrorItem(pytest.Item):
    def __init__(self, *, error: FileProblem, **kw):
        super().__init__(**kw)
        self.error = error
        self.add_marker(pytest.mark.premerge)

    def runtest(self) -> None:
        raise CertificationFailure(str(self.error))

    def repr_failure(self, excinfo, style=None):
        return str(excinfo.value) if excinfo.errisinstance(CertificationFailure) else \
            super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, self.error.line - 1, f"cell file {self.path.name}"


_COMMITTED = pytest.StashKey[dict]()


def _committed_receipts(config: pytest.Config) -> dict:
    """The project's committed receipts, loaded once a session."""
    if _COMMITTED not in config.stash:
        config.stash[_COMMITTED] = load_receipts(project_paths(str(config.rootpath)).receipts)
    return config.stash[_COMMITTED]


class CertifyItem(pytest.Item):
    def __init__(self, *, target: Target, **kw):
        super().__init__(**kw)
        self.target = target
        self.add_marker(getattr(pytest.mark, target.cell.tier))
        self.add_marker(pytest.mark.arch(target.arch))
        declared = target.cell.expected_failure(target.variant.name, target.arch)
        if declared is not None:  # strict: a pass fails the item until the declaration goes
            self.add_marker(pytest.mark.xfail(strict=True, raises=CertificationFailure,
                                              reason=declared.why))

    def runtest(self) -> None:
        t = self.target
        if t.arch not in present_archs():
            pytest.skip(f"arch {t.arch} is not on this machine (have {', '.join(present_archs())})")
        reason = why_skipped(t.variant)
        if reason:
            pytest.skip(reason)
        committed = _committed_receipts(self.config).get(t.arch, {}).get(
            (t.op.op, t.variant.name, t.cell.id))
        fresh = committed is not None and committed.hash == content_hash(t.op, t.variant.name,
                                                                         t.cell)
        now = library_versions() | required_versions(t.variant)
        outcome, harness = certify_verifying(
            t.op, t.variant.name, t.cell, t.arch,
            standing_verdicts(committed, t.op, t.arch, now) if fresh else None)
        receipts_dir = self.config.getoption("--certify-receipts")
        if receipts_dir:
            worker = getattr(self.config, "workerinput", {}).get("workerid", "main")
            r = make_receipt(t.op, t.variant.name, t.cell, t.arch, outcome, harness)
            write_receipts(Path(receipts_dir) / worker, [r])
        if outcome.status != "passed":
            raise CertificationFailure(f"{t.name}: {outcome.status}\n{outcome.message}")
        # A certifying check: the variant, the spec (or its named stand-in) and the oracle all ran.
        problem = certifying_problem(t.name, outcome)
        if problem:
            raise CertificationFailure(problem)
        # The run is a verification of the committed receipt (certify.receipts.verify), where comparable.
        if fresh:
            mismatches, _ = compare(committed, outcome, now)
            if mismatches:
                raise CertificationFailure(
                    f"{t.name}: the run does not reproduce its committed receipt (re-certify with "
                    f"`certify run --op {t.op.op}` if the change is meant):\n  " + "\n  ".join(mismatches))

    def repr_failure(self, excinfo, style=None):
        return str(excinfo.value) if excinfo.errisinstance(CertificationFailure) else \
            super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, 0, self.target.name


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from certify.lists import item_record, list_tiers  # noqa: PLC0415 (keeps plugin import light)

    declared = {}
    for item in items:
        tier = next((m.name for m in item.iter_markers() if m.name in TIERS), "premerge")
        declared[item.nodeid] = tier
        if not item.get_closest_marker(tier):
            item.add_marker(getattr(pytest.mark, tier))
    records = [item_record(item, declared[item.nodeid]) for item in items]
    if config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.getoption("keyword"):
        config.stash[UNIVERSE] = records
    out = config.getoption("--certify-items")
    if out and not hasattr(config, "workerinput"):
        from certify.lists import write_items  # noqa: PLC0415
        write_items(Path(out), records)
    listed = list_tiers(project_paths(str(config.rootpath)).lists)
    if listed is None:
        return
    # The lists decide: strip every tier marker from the items and their parents, then give each
    # item exactly one, the tier of the list that holds it (or its declared tier when in none).
    for item in items:
        for node in item.listchain():
            if any(m.name in TIERS for m in node.own_markers):
                node.own_markers[:] = [m for m in node.own_markers if m.name not in TIERS]
    for item in items:
        item.add_marker(getattr(pytest.mark, listed.get(item.nodeid, declared[item.nodeid])))


class _RunOrder:
    """Orders the items that remain once ``-m`` and ``-k`` have deselected (hence trylast)."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        _longest_files_first(items, project_paths(str(config.rootpath)).lists / "durations.json")


def _longest_files_first(items: list[pytest.Item], durations_file: Path) -> None:
    """Reorder the items file by file, the file holding the longest measured item first (items of a
    file keep their order, so module fixtures are set up once). pytest-xdist hands items out in this
    order, so a long item starts while the short ones fill the other workers instead of running
    alone at the end."""
    from certify.lists import load_durations  # noqa: PLC0415

    try:
        seconds = load_durations(durations_file) if durations_file.is_file() else {}
    except Exception:  # noqa: BLE001  (a damaged durations file is the lists' error to report)
        return
    file_of = {id(i): i.nodeid.split("::", 1)[0] for i in items}
    longest: dict[str, float] = {}
    for item in items:
        f = file_of[id(item)]
        longest[f] = max(longest.get(f, 0.0), seconds.get(item.nodeid, 0.0))
    first_seen = {f: n for n, f in enumerate(dict.fromkeys(file_of.values()))}
    items.sort(key=lambda i: (-longest[file_of[id(i)]], first_seen[file_of[id(i)]]))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.outcome == "skipped":
        _DURATIONS.setdefault("skipped", set()).add(report.nodeid)
    _DURATIONS.setdefault("seconds", {})
    _DURATIONS["seconds"][report.nodeid] = _DURATIONS["seconds"].get(report.nodeid, 0.0) + \
        report.duration


_DURATIONS: dict = {}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    target = config.getoption("--record-durations")
    if target is None or hasattr(config, "workerinput"):
        return
    from certify.lists import record_durations  # noqa: PLC0415
    skipped = _DURATIONS.get("skipped", set())
    measured = {k: v for k, v in _DURATIONS.get("seconds", {}).items() if k not in skipped}
    path = Path(target) if target else project_paths(str(config.rootpath)).lists / "durations.json"
    record_durations(path, measured)
