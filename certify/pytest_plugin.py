"""pytest plugin: every (op, variant, cell, arch) of the cell files becomes a test item.

- Items are marked with their tier (``premerge`` / ``postmerge`` / ``ondemand``) and ``arch(name)``,
  and skipped with a reason where their arch is not on this machine.
- A malformed cell file becomes one failing item whose message names the file, the line and the field;
  every other file's items still run.
- Any other test without a tier marker is pre-merge by default, so ``pytest -m premerge`` runs the
  framework's own tests, the spec's property tests and guards, and the pre-merge cells.
- ``--certify-receipts DIR`` appends a receipt per certified item to DIR (one file per worker).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from certify.archs import choose_triton_mode, present_archs
from certify.catalog import CatalogError, load_op_file
from certify.harness import certify_cell, certifying_problem
from certify.paths import project_paths
from certify.plan import Target, targets
from certify.receipts import make_receipt, write_receipts
from certify.schema import TIERS


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--certify-receipts", default=None,
                     help="directory to write receipts of the certified items into")


def pytest_configure(config: pytest.Config) -> None:
    choose_triton_mode()
    for tier in TIERS:
        config.addinivalue_line("markers", f"{tier}: certification tier {tier}")
    config.addinivalue_line("markers", "arch(name): the architecture an item needs")
    config.addinivalue_line("markers", "certify_guard(op): the hand-checkable single case of an op")
    config.addinivalue_line("markers", "certify_property(op): the hypothesis property test of an op")


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
        except CatalogError as e:
            yield CatalogErrorItem.from_parent(self, name="load", error=e)
            return
        for t in targets(op):
            yield CertifyItem.from_parent(self, name=f"{t.variant.name}[{t.cell.id}-{t.arch}]",
                                          target=t)


class CatalogErrorItem(pytest.Item):
    def __init__(self, *, error: CatalogError, **kw):
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


class CertifyItem(pytest.Item):
    def __init__(self, *, target: Target, **kw):
        super().__init__(**kw)
        self.target = target
        self.add_marker(getattr(pytest.mark, target.cell.tier))
        self.add_marker(pytest.mark.arch(target.arch))

    def runtest(self) -> None:
        t = self.target
        if t.arch not in present_archs():
            pytest.skip(f"arch {t.arch} is not on this machine (have {', '.join(present_archs())})")
        outcome = certify_cell(t.op, t.variant.name, t.cell, t.arch)
        receipts_dir = self.config.getoption("--certify-receipts")
        if receipts_dir:
            worker = getattr(self.config, "workerinput", {}).get("workerid", "main")
            r = make_receipt(t.op, t.variant.name, t.cell, t.arch, outcome)
            write_receipts(Path(receipts_dir) / worker, [r])
        if outcome.status != "passed":
            raise CertificationFailure(f"{t.name}: {outcome.status}\n{outcome.message}")
        # A certifying check: the variant, the spec (or its named stand-in) and the oracle all ran.
        problem = certifying_problem(t.name, outcome)
        if problem:
            raise CertificationFailure(problem)

    def repr_failure(self, excinfo, style=None):
        return str(excinfo.value) if excinfo.errisinstance(CertificationFailure) else \
            super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, 0, self.target.name


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if not any(item.get_closest_marker(t) for t in TIERS):
            item.add_marker(pytest.mark.premerge)
