"""Generated files are part of the product: each is checked against what its command would write."""

import re
import shlex
import tomllib

from certify.harness.archs import present_archs
from certify.catalog.load import load_catalog
from certify.cli import schema_text
from certify.files.paths import project_paths
from certify.catalog.plan import targets
from certify.reach import load_reach
from certify.receipts.store import UP_TO_DATE, freshness, load_receipts
from certify.report import project_guards, project_mutants, project_rows, render_all, report_extras

PATHS = project_paths()
REGENERATE = ("run `certify trace`, `certify report` (and `certify schema`) and commit reports/ and "
              "certify/schema/")


def test_the_cell_schema_export_is_current():
    committed = (PATHS.schema / "cells.schema.json").read_text()
    assert committed == schema_text(), f"certify/schema/cells.schema.json is stale: {REGENERATE}"


def test_cpu_receipts_are_fresh_and_passing():
    """Every certification on a CPU arch has a receipt for the code as it is, and it passed (or failed
    where its cell declares it to)."""
    cat = load_catalog(PATHS.cells)
    books = load_receipts(PATHS.receipts)
    cpu_archs = {"cpu", "cpu-interpret"} & set(present_archs())
    bad = []
    for op in cat.ops.values():
        for t in targets(op):
            if t.arch in cpu_archs:
                r = books.get(t.arch, {}).get((op.op, t.variant.name, t.cell.id))
                s = freshness(r, op, t.variant.name, t.cell, t.arch)
                if s not in UP_TO_DATE:
                    bad.append(f"{t.name}: {s}")
    assert not bad, f"{len(bad)} CPU certification(s) not current ({REGENERATE}):\n" + "\n".join(bad)


def test_the_reports_are_current():
    cat = load_catalog(PATHS.cells)
    rows = project_rows(PATHS, cat)
    rendered = render_all(cat, rows, report_extras(PATHS.extras), load_reach(PATHS.reach),
                          project_guards(PATHS), project_mutants(PATHS))
    stale = [rel for rel, text in rendered.items()
             if not (PATHS.reports / rel).is_file() or (PATHS.reports / rel).read_text() != text]
    extra = [p.name for p in (PATHS.reports / "ops").glob("*.md") if f"ops/{p.name}" not in rendered]
    assert not stale and not extra, f"stale: {stale}, orphaned: {extra}; {REGENERATE}"


def test_ci_runs_exactly_the_readme_test_command():
    readme = (PATHS.root / "README.md").read_text()
    ci = (PATHS.root / ".ci" / "run").read_text()
    command = re.search(r"^python3 -m (pytest .*)$", ci, re.M).group(1)
    assert f"\n{command}\n" in readme, f"README must show the CI test command: {command}"


def _pip_installs(text: str) -> list[list[str]]:
    """Each ``pip install`` of a shell text as its arguments, quotes removed, ``-q`` left out: what it
    installs and under which constraints, however it is spelled (``python3 -m pip`` or ``pip``)."""
    out = []
    for line in text.splitlines():
        if line.lstrip().startswith("#") or "pip install" not in line:
            continue
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        command: list[str] = []
        for word in [*lexer, ";"]:
            if word not in ("&&", ";", "||"):
                command.append(word)
                continue
            at = next((i for i in range(len(command) - 1)
                       if command[i:i + 2] == ["pip", "install"]), None)
            if at is not None:
                out.append([w for w in command[at + 2:] if w != "-q"])
            command = []
    return out


def test_the_readme_installs_exactly_what_ci_installs():
    """The README's install line is CI's: the same packages, extras and constraints, in order."""
    readme = (PATHS.root / "README.md").read_text()
    block = re.search(r"## Two commands\n.*?```bash\n(.*?)```", readme, re.S).group(1)
    ci = _pip_installs((PATHS.root / ".ci" / "run").read_text())
    assert len(ci) >= 2, ci
    assert _pip_installs(block) == ci, (
        f"README's install line installs {_pip_installs(block)}, CI's .ci/run {ci}: make them one")
    extras = {e for args in ci for w in args for group in re.findall(r"\[(.*)\]", w)
              for e in group.split(",")}
    declared = tomllib.loads((PATHS.root / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert extras and extras <= set(declared), f"extras {extras} not all in pyproject: {declared}"
