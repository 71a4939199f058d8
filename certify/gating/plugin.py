"""pytest plugin: every gate file (``[tool.certify] gates``) becomes a test item, so gates appear in the
lists like any other test.

- An item is marked with its gate's tier (``premerge`` / ``postmerge`` / ``ondemand``) and runs the
  gate through the target (``[tool.certify] gate_target``); it fails when a check fails or has no
  reference, listing every check with its verdict. Its statistical checks run at their share of the
  tier's family-wise rate, the family being every gate file of the tier (certify.gating.judge), so an
  item's verdict is the one ``certify gates run`` gives.
- When the target cannot run gates here (e.g. no trained checkpoint), every item is skipped with the
  target's reason: a gate never passes without having run.
- A malformed gate file becomes one failing pre-merge item naming the file, the line and the field;
  the other files' items still run.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pytest

from certify.gating.judge import Family, tier_families
from certify.gating.run import run_gate
from certify.gating.files import (
    FileProblem,
    GateTarget,
    ReferenceStore,
    gate_settings,
    load_gate_file,
    load_gates,
    load_target,
)


@lru_cache(maxsize=None)
def _settings(root: str):
    return gate_settings(root)


@lru_cache(maxsize=None)
def _target(spec: str) -> GateTarget:
    return load_target(spec)


def pytest_collect_file(file_path: Path, parent: pytest.Collector):
    settings = _settings(str(parent.config.rootpath))
    if file_path.suffix == ".yaml" and file_path.parent.resolve() == settings.gates.resolve():
        return GateYaml.from_parent(parent, path=file_path)
    return None


@lru_cache(maxsize=None)
def _families(gates_dir: str) -> dict[str, Family]:
    return tier_families(load_gates(Path(gates_dir)).gates.values())


class GateFailure(Exception):
    pass


class GateYaml(pytest.File):
    def collect(self):
        settings = _settings(str(self.config.rootpath))
        try:
            gate = load_gate_file(self.path, _target(settings.target))
        except FileProblem as e:
            yield GateErrorItem.from_parent(self, name="load", error=e)
            return
        yield GateItem.from_parent(self, name=gate.gate, gate=gate)


class GateErrorItem(pytest.Item):
    def __init__(self, *, error: FileProblem, **kw):
        super().__init__(**kw)
        self.error = error
        self.add_marker(pytest.mark.premerge)

    def runtest(self) -> None:
        raise GateFailure(str(self.error))

    def repr_failure(self, excinfo, style=None):
        return str(excinfo.value) if excinfo.errisinstance(GateFailure) else \
            super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, self.error.line - 1, f"gate file {self.path.name}"


class GateItem(pytest.Item):
    def __init__(self, *, gate, **kw):
        super().__init__(**kw)
        self.gate = gate
        self.add_marker(getattr(pytest.mark, gate.tier))

    def runtest(self) -> None:
        settings = _settings(str(self.config.rootpath))
        target = _target(settings.target)
        reason = target.unavailable()
        if reason:
            pytest.skip(reason)
        result = run_gate(self.gate, target, ReferenceStore(settings.references),
                          family=_families(str(settings.gates)).get(self.gate.tier))
        if result.status != "passed":
            raise GateFailure(result.summary())

    def repr_failure(self, excinfo, style=None):
        return str(excinfo.value) if excinfo.errisinstance(GateFailure) else \
            super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, 0, f"gate {self.gate.gate} ({self.gate.tier})"
