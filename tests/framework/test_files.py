"""Files the framework reads and writes: nothing already written is lost (damaged receipt lines,
concurrent runs, a full disk, an interrupted run), and inputs fail loudly, naming file, line and field
(duplicate keys, bytes that are not UTF-8, a rule that raises, a path that does not resolve, a pin that
pins nothing, a command run in another checkout)."""

from __future__ import annotations

import errno
import functools
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from certify.files import atomic
from certify.files.problem import FileProblem
from certify.lists.budgets import load_budgets, pin_errors
from certify.catalog.callables import callable_errors
from certify.catalog.load import load_catalog, load_op_file
from certify.gating.files import ReferenceStore, load_gate_file
from certify.harness.target import Outcome
from certify.lists import load_inputs, load_items
from certify.files.paths import project_paths
from certify.catalog.plan import targets
from certify.receipts.store import Receipt, load_receipts, make_receipt, prune_receipts, write_receipts
from certify.harness.runner import run_targets
from certify.reach.scenarios import ScenarioBase, load_scenarios
from certify.files.utf8 import NotUtf8Error
from tests.framework.test_catalog_errors import GOOD

ROOT = Path(__file__).resolve().parents[2]
PATHS = project_paths()


@functools.lru_cache(maxsize=None)
def _made_receipt() -> Receipt:
    op = load_op_file(PATHS.cells / "gated_rmsnorm.yaml")
    return make_receipt(op, "torch", op.cells[0], "cpu", Outcome("passed", {"out.ulp": 0.0}))


def _receipt(cell: str, arch: str = "cpu") -> Receipt:
    """A receipt as ``make_receipt`` writes it, for a made-up target (op ``op_a``, cell ``cell``)."""
    return _made_receipt().model_copy(update={"op": "op_a", "cell": cell, "arch": arch})


def _env() -> dict[str, str]:
    """The environment of a child Python that imports this checkout's framework."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}


# ------------------------------------------------------------------------------ damaged receipt lines


@pytest.mark.parametrize("damage, words", [
    (lambda line: line[: len(line) // 2], "Invalid JSON"),                        # a truncated write
    (lambda line: line.replace(b'"status":"passed"', b'"status":17'), "status"),  # a wrong type
    (lambda line: line.replace(b'"hash":', b'"hush":'), "hash"),                  # a missing field
    (lambda line: line.replace(b"op_a", b"op_\xff"), "not UTF-8"),                # bytes, not text
])
def test_a_damaged_receipts_line_is_named_and_skipped_and_the_rest_loads(tmp_path, damage, words):
    write_receipts(tmp_path, [_receipt(c) for c in ("c1", "c2", "c3")])
    path = tmp_path / "cpu.jsonl"
    lines = path.read_bytes().split(b"\n")
    lines[1] = damage(lines[1])
    path.write_bytes(b"\n".join(lines))
    problems: list = []
    books = load_receipts(tmp_path, problems)
    assert sorted(k[2] for k in books["cpu"]) == ["c1", "c3"]
    assert [(p.file, p.line) for p in problems] == [(path, 2)]
    assert words in problems[0].message and str(problems[0]).startswith(f"{path}:2: ")


def test_without_a_problems_list_a_damaged_line_is_said_on_stderr(tmp_path, capsys):
    write_receipts(tmp_path, [_receipt("c1"), _receipt("c2")])
    path = tmp_path / "cpu.jsonl"
    path.write_bytes(path.read_bytes()[:-20])      # the last record cut short
    books = load_receipts(tmp_path)
    assert list(books["cpu"]) == [("op_a", "torch", "c1")]
    assert f"{path}:2: " in capsys.readouterr().err


def test_rewriting_a_damaged_file_keeps_its_other_receipts_and_sets_the_damaged_line_aside(
        tmp_path, capsys):
    write_receipts(tmp_path, [_receipt("c1"), _receipt("c2"), _receipt("c3")])
    path = tmp_path / "cpu.jsonl"
    lines = path.read_bytes().split(b"\n")
    damaged = lines[1][:40]
    lines[1] = damaged
    path.write_bytes(b"\n".join(lines))
    write_receipts(tmp_path, [_receipt("c4")])
    problems: list = []
    books = load_receipts(tmp_path, problems)
    assert problems == []                                             # the file is valid again
    assert sorted(k[2] for k in books["cpu"]) == ["c1", "c3", "c4"]   # nothing else was dropped
    side = tmp_path / "cpu.jsonl.damaged"
    assert side.read_bytes() == damaged + b"\n"                       # and the damaged text is kept
    err = capsys.readouterr().err
    assert f"{path}:2: " in err and str(side) in err


def test_a_damaged_record_that_names_its_target_stays_until_that_target_is_recertified(tmp_path):
    """A record with a bad field (e.g. written under another version of the receipt model) still says
    which target it is about: a run certifying other targets leaves it as it is; a new receipt of its
    own target replaces it, as it would replace any receipt."""
    write_receipts(tmp_path, [_receipt(c) for c in ("c1", "c2", "c3")])
    path = tmp_path / "cpu.jsonl"
    lines = path.read_bytes().split(b"\n")
    assert b'"cell":"c2"' in lines[1]
    damaged = lines[1].replace(b'"status":"passed"', b'"status":17')
    lines[1] = damaged
    path.write_bytes(b"\n".join(lines))
    write_receipts(tmp_path, [_receipt("c4")])
    assert damaged in path.read_bytes().split(b"\n")
    problems: list = []
    assert sorted(k[2] for k in load_receipts(tmp_path, problems)["cpu"]) == ["c1", "c3", "c4"]
    assert [p.line for p in problems] == [2]
    assert prune_receipts(tmp_path, {("cpu", "op_a", "torch", c) for c in ("c1", "c2", "c4")}) != []
    assert damaged in path.read_bytes().split(b"\n")                 # a live target's record stays
    write_receipts(tmp_path, [_receipt("c2")])
    problems = []
    assert sorted(k[2] for k in load_receipts(tmp_path, problems)["cpu"]) == ["c1", "c2", "c4"]
    assert problems == [] and not (tmp_path / "cpu.jsonl.damaged").exists()


# ------------------------------------------------------------------------------ concurrent runs

def _write_one_at_a_time(directory: Path, prefix: str, n: int, start) -> None:
    start.wait(timeout=30)
    for i in range(n):   # one merge a receipt, as run_targets does
        write_receipts(directory, [_receipt(f"{prefix}{i:03d}")])


def test_two_runs_writing_receipts_at_once_each_keep_the_others(tmp_path):
    """Two processes (forked: the framework is already imported) merge receipts for different targets
    into the same file at the same time; each merge is a read, a merge and a rewrite."""
    import multiprocessing

    _made_receipt()  # made once here; the forked writers copy it
    ctx = multiprocessing.get_context("fork")
    start = ctx.Barrier(2)
    n = 60
    procs = [ctx.Process(target=_write_one_at_a_time, args=(tmp_path, prefix, n, start))
             for prefix in "ab"]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    cells = sorted(k[2] for k in load_receipts(tmp_path)["cpu"])
    assert cells == sorted(f"{prefix}{i:03d}" for prefix in "ab" for i in range(n))


# ------------------------------------------------------------------------------ a full disk


def test_a_full_disk_leaves_the_old_receipts_file_intact(tmp_path, monkeypatch):
    write_receipts(tmp_path, [_receipt("c1"), _receipt("c2")])
    path = tmp_path / "cpu.jsonl"
    before = path.read_bytes()

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(OSError) as info:
        write_receipts(tmp_path, [_receipt("c3")])
    assert info.value.errno == errno.ENOSPC
    assert path.read_bytes() == before
    assert not list(tmp_path.glob(f"*{atomic.TEMP_SUFFIX}"))          # no temporary file left


def test_a_file_size_limit_leaves_the_old_file_intact(tmp_path):
    """A real write failure: the kernel refuses to grow a file past RLIMIT_FSIZE (EFBIG)."""
    target = tmp_path / "report.md"
    old = "old line\n" * 400                                             # 3600 bytes, over the limit
    target.write_text(old)
    child = textwrap.dedent("""\
        import resource, sys
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))
        from certify.files.atomic import atomic_write_text
        try:
            atomic_write_text(sys.argv[1], "new line\\n" * 2000)
        except OSError as e:
            print(e.errno)
            sys.exit(3)
        """)
    res = subprocess.run([sys.executable, "-c", child, str(target)], env=_env(),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 3 and res.stdout.strip() == str(errno.EFBIG), res.stdout + res.stderr
    assert target.read_text() == old
    assert [p.name for p in tmp_path.iterdir()] == ["report.md"]


# ------------------------------------------------------------------------------ an interrupted run


def test_an_interrupted_run_keeps_the_receipts_of_the_targets_it_finished(tmp_path, monkeypatch):
    op = load_op_file(PATHS.cells / "gated_rmsnorm.yaml")
    chosen = list(targets(op))
    k = 4
    assert len(chosen) > k
    calls: list[int] = []

    def certify_checked(op, variant, cell, arch):
        calls.append(1)
        books = load_receipts(tmp_path)
        written = sum(len(b) for b in books.values())
        assert written == len(calls) - 1, "a finished target's receipt is written before the next"
        if len(calls) == k:
            raise KeyboardInterrupt
        return Outcome("passed", {"out.ulp": 0.0}), {}

    monkeypatch.setattr("certify.harness.runner.certify_checked", certify_checked)
    with pytest.raises(KeyboardInterrupt):
        run_targets(chosen, tmp_path, show_progress=False)
    books = load_receipts(tmp_path)
    kept = {(arch, *key) for arch, b in books.items() for key in b}
    assert kept == {(t.arch, t.op.op, t.variant.name, t.cell.id) for t in chosen[: k - 1]}


# ------------------------------------------------------------------------------ duplicate keys

DUPLICATE = "a: 1\nb: {c: 2}\na: 3\n"


def _gate_error(path: Path):
    return load_gate_file(path)


def _reference_error(path: Path):
    store = ReferenceStore(path.parent)
    assert store.errors, "the reference store loaded a file with a duplicate key"
    raise store.errors[0]


@pytest.mark.parametrize("load, error", [
    (load_op_file, FileProblem),
    (load_budgets, FileProblem),
    (lambda p: load_scenarios(p, ScenarioBase), FileProblem),
    (_gate_error, Exception),
    (_reference_error, Exception),
], ids=["cell file", "budgets", "scenarios", "gate file", "reference file"])
def test_a_duplicate_key_is_an_error_naming_file_line_and_key(tmp_path, load, error):
    path = tmp_path / "dup.yaml"
    path.write_text(DUPLICATE)
    with pytest.raises(error) as info:
        load(path)
    assert (info.value.file, info.value.line, info.value.field) == (path, 3, "a")
    assert "duplicate key 'a' (first at line 1)" in info.value.message


def test_a_nested_duplicate_key_in_a_cell_file_names_its_field(tmp_path):
    path = tmp_path / "dup_op.yaml"
    path.write_text(GOOD.format(op="dup_op").replace("    tier: premerge\n",
                                                     "    tier: premerge\n    tier: postmerge\n"))
    with pytest.raises(FileProblem) as info:
        load_op_file(path)
    assert (info.value.line, info.value.field) == (18, "cells[0].tier"), str(info.value)
    assert "duplicate key 'tier' (first at line 17)" in info.value.message


# ------------------------------------------------------------------------------ not UTF-8


def test_a_cell_file_that_is_not_utf8_is_named_with_line_and_offset(tmp_path):
    text = GOOD.format(op="latin_op").encode()
    at = text.index(b"the standalone")
    path = tmp_path / "latin_op.yaml"
    path.write_bytes(text[:at] + b"\xe9" + text[at:])                 # latin-1 e-acute on line 2
    with pytest.raises(FileProblem) as info:
        load_op_file(path)
    assert (info.value.file, info.value.line, info.value.field) == (path, 2, "(file)")
    assert f"byte 0xe9 at offset {at}" in info.value.message


def test_an_items_file_that_is_not_utf8_is_named_with_line_and_offset(tmp_path):
    path = tmp_path / "items.json"
    path.write_bytes(b'{"items": [\n {"id": "t\xff"}\n]}\n')
    with pytest.raises(NotUtf8Error) as info:
        load_items(path)
    assert (info.value.file, info.value.line, info.value.offset) == (path, 2, 22)
    assert str(info.value).startswith(f"{path}:2: not UTF-8")


# ------------------------------------------------------------------------------ rules that raise


@pytest.mark.parametrize("rule, where", [
    ("rows < 'four'", "cell 'rows_4'"),                  # a type mismatch, on the file's own cell
    ("64 // (rows - 1) > 1", "the axis domain point {'rows': 1}"),  # only at the end of the domain
    ("value_heads + 'x' == 1", "cell 'rows_4'"),
])
def test_a_rule_that_raises_at_evaluation_names_file_line_and_field(tmp_path, rule, where):
    path = tmp_path / "rule_op.yaml"
    path.write_text(GOOD.format(op="rule_op").replace("archs: [cpu]\n",
                                                      f'archs: [cpu]\n    dispatch: "{rule}"\n'))
    with pytest.raises(FileProblem) as info:
        load_op_file(path)
    assert (info.value.line, info.value.field) == (13, "variants[0].dispatch"), str(info.value)
    assert f"the rule raises at {where}" in info.value.message


# -------------------------------------------------------------------------- paths that do not resolve


@pytest.mark.parametrize("old, new, line, field, words", [
    ("torch_ops:gated_rmsnorm", "torch_ops:gated_rmsnrom", 11, "variants[0].impl", "has no"),
    ("gdn.torch_ops:", "gdn.torch_opz:", 11, "variants[0].impl", "no module"),
    ("norms:gated_rmsnorm", "norms:nope", 3, "spec", "has no 'nope'"),
    ("spec.cases.gdn:", "spec.cases.gdnn:", 4, "inputs", "no module 'spec.cases.gdnn'"),
    ("norms:gated_rmsnorm", "norms:torch", 3, "spec", "not callable"),  # a module, not a function
])
def test_a_path_that_does_not_resolve_names_file_line_and_field(tmp_path, old, new, line, field,
                                                                words):
    path = tmp_path / "path_op.yaml"
    text = GOOD.format(op="path_op")
    assert old in text
    path.write_text(text.replace(old, new))
    catalog = load_catalog(tmp_path)
    assert not catalog.errors
    errors = callable_errors(catalog)
    assert [(e.file, e.line, e.field) for e in errors] == [(path, line, field)], errors
    assert words in errors[0].message


def test_the_catalogs_paths_all_resolve():
    assert callable_errors(load_catalog(PATHS.cells)) == []


# ------------------------------------------------------------------------------ pins


def _budgets_with_typo(tmp_path: Path) -> tuple[Path, str, int]:
    text = PATHS.budgets.read_text()
    real = "tests/framework/test_lists.py::test_the_committed_lists_are_current"
    typo = real.replace("committed", "comitted")
    assert f'"{real}"' in text
    path = tmp_path / "budgets.yaml"
    path.write_text(text.replace(f'"{real}"', f'"{typo}"'))
    line = next(n for n, s in enumerate(path.read_text().splitlines(), 1) if typo in s)
    return path, typo, line


def test_a_pin_that_matches_no_test_names_file_line_and_pin(tmp_path):
    path, typo, line = _budgets_with_typo(tmp_path)
    ids = {r["id"] for r in load_items(PATHS.lists / "items.json")}
    errors = pin_errors(path, load_budgets(path), ids)
    assert [(e.file, e.line, e.field) for e in errors] == [(path, line, f"pinned.premerge.{typo}")]
    assert "pins no test" in errors[0].message
    assert pin_errors(PATHS.budgets, load_budgets(PATHS.budgets), ids) == []


def test_the_list_generator_refuses_a_pin_that_matches_no_test(tmp_path):
    path, typo, line = _budgets_with_typo(tmp_path)
    paths = SimpleNamespace(budgets=path, lists=PATHS.lists, reach=PATHS.reach, cells=PATHS.cells)
    with pytest.raises(FileProblem) as info:
        load_inputs(paths)
    assert (info.value.line, info.value.field) == (line, f"pinned.premerge.{typo}")


# ------------------------------------------------------------------------------ `certify check`


def test_certify_check_reports_every_kind_of_problem_with_file_and_line(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[tool.certify]\ncells = "cells"\nbudgets = "budgets.yaml"\nlists = "lists"\n'
        'receipts = "receipts"\n')
    (tmp_path / "cells").mkdir()
    (tmp_path / "cells" / "good_op.yaml").write_text(
        GOOD.format(op="good_op").replace("torch_ops:gated_rmsnorm", "torch_ops:gated_rmsnrom"))
    budgets, typo, pin_line = _budgets_with_typo(tmp_path)
    (tmp_path / "lists").mkdir()
    shutil.copy(PATHS.lists / "items.json", tmp_path / "lists" / "items.json")
    write_receipts(tmp_path / "receipts", [_receipt("c1"), _receipt("c2")])
    receipts = tmp_path / "receipts" / "cpu.jsonl"
    receipts.write_bytes(receipts.read_bytes()[:-15])
    res = subprocess.run([sys.executable, "-m", "certify.cli", "check"], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert f"{tmp_path / 'cells' / 'good_op.yaml'}:11: variants[0].impl: " in out, out
    assert f"{budgets}:{pin_line}: pinned.premerge.{typo}: pins no test" in out, out
    assert f"{receipts}:2: not a receipt" in out, out


# ------------------------------------------------------------------------------ another checkout

_CONSOLE_SCRIPT = "import sys; from certify.checkout import main; sys.exit(main())"


def _other_checkout(tmp_path: Path) -> Path:
    """A clone of the framework's entry (checkout.py, files/paths.py) with a cli that says whose it
    is."""
    root = tmp_path / "clone"
    (root / "certify" / "files").mkdir(parents=True)
    (root / "sub").mkdir()
    (root / "pyproject.toml").write_text('[tool.certify]\ncells = "cells"\n')
    for name in ("__init__.py", "checkout.py", "files/__init__.py", "files/paths.py"):
        shutil.copy(ROOT / "certify" / name, root / "certify" / name)
    (root / "certify" / "cli.py").write_text(
        "import sys\n\ndef main(argv=None):\n"
        "    print('cli of', __file__, sys.argv[1:])\n    return 0\n")
    return root


def _console(cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """What the ``certify`` console script runs (``-P``: no working directory on the import path)."""
    return subprocess.run([sys.executable, "-P", "-c", _CONSOLE_SCRIPT, "check"], cwd=cwd,
                          env={**_env(), **env}, capture_output=True, text=True, timeout=60)


def test_the_console_script_is_the_checkout_entry():
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["certify"] == "certify.checkout:main"


def test_a_command_run_in_another_checkout_runs_that_checkouts_code(tmp_path):
    root = _other_checkout(tmp_path)
    res = _console(root / "sub")
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip() == f"cli of {root / 'certify' / 'cli.py'} ['check']"


def test_a_checkout_whose_package_cannot_come_first_is_refused_naming_both(tmp_path):
    """Where the fresh interpreter would still import the other package, the command refuses."""
    root = _other_checkout(tmp_path)
    res = _console(root / "sub", CERTIFY_CHECKOUT_ROOT=str(root.resolve()))
    assert res.returncode == 2, res.stdout + res.stderr
    assert "refusing" in res.stderr and str(root.resolve() / "certify") in res.stderr
    assert str(ROOT / "certify") in res.stderr and res.stdout == ""


def test_the_command_in_its_own_checkout_runs_in_place(tmp_path):
    res = subprocess.run([sys.executable, "-P", "-c",
                          "import certify.checkout as c, sys; "
                          "print(c.checkout_package(c.project_paths().root) == c.imported_package())"],
                         cwd=ROOT / "tests", env=_env(), capture_output=True, text=True, timeout=60)
    assert res.stdout.strip() == "True", res.stdout + res.stderr
