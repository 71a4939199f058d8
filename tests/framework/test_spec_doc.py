"""docs/spec.md is the prose definition of spec/, and the repository's citations of it resolve.

- No file of the repository names the prose definition by a file that does not exist (``OLD_NAME``).
- A citation that names a section, ``docs/spec.md, "<heading>"`` (the comma is optional; a heading
  with a colon may be cited by its words before the colon; several sections may follow, joined by
  ``and`` / ``or`` / a comma), names a ``##`` or ``###`` heading of docs/spec.md; ``"<heading>" item N``
  / ``items N, M`` / ``steps N-M`` after it name numbered items that exist in that section.

The checks are plain functions of a text, so the last tests show that each one fails on a bad text.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPEC_DOC = ROOT / "docs" / "spec.md"
SELF = Path(__file__).resolve()
OLD_NAME = "MATH" + ".md"  # spelled in two pieces so that this file does not match itself

_SKIP_DIRS = {".git", "__pycache__", ".hypothesis", ".pytest_cache", ".venv", "build"}
_HEADING = re.compile(r"^(#{2,3}) +(.+?) *$", re.M)
_CITATION = re.compile(r'docs/spec\.md,?\s+"([^"]{1,120})"')
_MORE = re.compile(r'\s*(?:\([^()"]*\)\s*)?(?:,|and|or)\s+"([^"]{1,120})"')
_ITEMS = re.compile(r"\s+(?:items?|steps?)\s+(\d+(?:\s*(?:-|,|and)\s*\d+)*)")
_NUMBERED = re.compile(r"^(\d+)\. ", re.M)


# ------------------------------------------------------------------------------------------ files

def repository_files() -> list[Path]:
    """Every file of the checkout outside .git: tracked and untracked, less what git ignores (a walk
    that skips caches and virtual environments where git is unavailable)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, capture_output=True, check=True).stdout
        paths = [ROOT / p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        paths = [p for p in ROOT.rglob("*") if not _SKIP_DIRS & set(p.relative_to(ROOT).parts)]
    return sorted(p for p in paths if p.is_file())


def read_text(path: Path) -> str | None:
    """The file's text, or None for a binary file."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def texts() -> dict[str, str]:
    """Relative path -> text of every text file of the repository but this one."""
    out = {}
    for path in repository_files():
        if path.resolve() == SELF:
            continue
        text = read_text(path)
        if text is not None:
            out[path.relative_to(ROOT).as_posix()] = text
    return out


# ------------------------------------------------------------------------------------------ checks

def old_name_errors(rel: str, text: str) -> list[str]:
    """'file:line' of every line of ``text`` that names OLD_NAME."""
    return [f"{rel}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1)
            if OLD_NAME in line]


def sections(doc: str) -> dict[str, str]:
    """Citable name -> the section's text (up to the next heading of the same or a higher level).

    A heading is citable by its full text and, when it has a colon, by the words before it."""
    heads = list(_HEADING.finditer(doc))
    out: dict[str, str] = {}
    for i, h in enumerate(heads):
        level = len(h.group(1))
        end = next((g.start() for g in heads[i + 1:] if len(g.group(1)) <= level), len(doc))
        body = doc[h.end():end]
        title = h.group(2)
        out[title] = body
        if ":" in title:
            out.setdefault(title.split(":", 1)[0].strip(), body)
    return out


def _name(raw: str) -> str:
    """A cited name with its line breaks (and comment markers after them) folded to single spaces."""
    return " ".join(re.sub(r"\n\s*(?:#\s*)?", " ", raw).split())


def _numbers(spec: str) -> list[int]:
    out: list[int] = []
    for part in re.split(r"\s*(?:,|and)\s*", spec.strip()):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def citation_errors(rel: str, text: str, known: dict[str, str]) -> list[str]:
    """Every citation of a section (or of an item of it) in ``text`` that docs/spec.md does not have."""
    errors = []
    for m in _CITATION.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        names, end = [(m.group(1), m.end())], m.end()
        while (more := _MORE.match(text, end)) is not None:
            names.append((more.group(1), more.end()))
            end = more.end()
        for raw, after in names:
            name = _name(raw)
            if name not in known:
                errors.append(f'{rel}:{line}: "{name}" is no heading of docs/spec.md')
                continue
            items = _ITEMS.match(text, after)
            if items is None:
                continue
            have = {int(n) for n in _NUMBERED.findall(known[name])}
            missing = [n for n in _numbers(items.group(1)) if n not in have]
            if missing:
                errors.append(f'{rel}:{line}: "{name}" has no item {missing} in docs/spec.md')
    return errors


# ------------------------------------------------------------------------------------------ tests

def test_no_file_cites_the_old_name():
    errors = [e for rel, text in texts().items() for e in old_name_errors(rel, text)]
    assert not errors, (f"cite docs/spec.md, not {OLD_NAME}:\n  " + "\n  ".join(errors))


def test_every_section_citation_names_a_heading_of_docs_spec():
    known = sections(SPEC_DOC.read_text())
    all_texts = texts()
    assert sum(len(_CITATION.findall(t)) for t in all_texts.values()) > 50, "the citations vanished"
    errors = [e for rel, text in all_texts.items() for e in citation_errors(rel, text, known)]
    assert not errors, "\n  ".join(["citations docs/spec.md does not resolve:"] + errors)


def test_docs_spec_keeps_the_numbered_items_code_cites():
    """The numbered items the code cites by number exist: QSA 1-7, the HC site's steps 1-4."""
    known = sections(SPEC_DOC.read_text())
    assert {int(n) for n in _NUMBERED.findall(known["QSA"])} == set(range(1, 8))
    assert {int(n) for n in _NUMBERED.findall(known["Hyper-connections"])} == set(range(1, 5))


def test_the_checks_fail_on_bad_text():
    """Each check reports a planted fault, and only it."""
    known = sections(SPEC_DOC.read_text())
    good = 'x (docs/spec.md, "QSA" items 4 and 5) and docs/spec.md "Rollback / commit" and'
    assert citation_errors("f.py", good, known) == []
    assert citation_errors("f.py", 'see docs/spec.md, "QSB" item 1', known) == [
        'f.py:1: "QSB" is no heading of docs/spec.md']
    assert citation_errors("f.py", '\n# docs/spec.md, "QSA: sparse attention with a\n# block index"',
                           known) == []
    assert citation_errors("f.py", 'docs/spec.md, "KV storage" and "GDN layers"', known) == [
        'f.py:1: "GDN layers" is no heading of docs/spec.md']
    assert citation_errors("f.py", 'docs/spec.md, "Hyper-connections" steps 1-5', known) == [
        'f.py:1: "Hyper-connections" has no item [5] in docs/spec.md']
    assert old_name_errors("a.py", f"x\n# see {OLD_NAME}, QSA\n") == [f"a.py:2: # see {OLD_NAME}, QSA"]
