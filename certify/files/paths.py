"""Where the framework finds a target's data: the ``[tool.certify]`` table of the project's pyproject."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path


@dataclass(frozen=True)
class ProjectPaths:
    root: Path
    cells: Path
    gates: Path
    reports: Path
    receipts: Path
    schema: Path
    extras: str | None  # "module:function" returning extra markdown lines for the report
    scenarios: Path     # the scenarios the reach tracer runs (data)
    tracer: str | None  # "module:object" of the target's tracer (see certify.reach.Tracer)
    reach: Path         # the generated reach file (``certify trace``)
    budgets: Path       # the test lists' budgets and risk weights (``certify lists``)
    lists: Path         # the generated test lists, the item universe and the durations file


def _find_root(start: Path) -> Path:
    for d in [start, *start.parents]:
        py = d / "pyproject.toml"
        if py.is_file() and "[tool.certify]" in py.read_text():
            return d
    # Installed without a checkout: fall back to the package's parent directory.
    return Path(__file__).resolve().parents[2]


@lru_cache(maxsize=None)
def project_paths(start: str | None = None) -> ProjectPaths:
    root = _find_root(Path(start or Path.cwd()).resolve())
    cfg: dict = {}
    py = root / "pyproject.toml"
    if py.is_file():
        cfg = tomllib.loads(py.read_text()).get("tool", {}).get("certify", {})
    get = lambda key, default: root / cfg.get(key, default)  # noqa: E731
    return ProjectPaths(
        root=root,
        cells=get("cells", "certify/cells"),
        gates=get("gates", "certify/gates"),
        reports=get("reports", "reports"),
        receipts=get("receipts", "reports/receipts"),
        schema=get("schema", "certify/schema"),
        extras=cfg.get("report_extras"),
        scenarios=get("scenarios", "certify/scenarios.yaml"),
        tracer=cfg.get("tracer"),
        reach=get("reach", "reports/reach.json"),
        budgets=get("budgets", "certify/budgets.yaml"),
        lists=get("lists", "test_lists"),
    )
