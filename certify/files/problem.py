"""One error for bad input: a file the framework reads (a cell, budgets, scenario or gate file)
names the problem's file, line and field, and what is wrong there. Loaders collect or raise it;
the file's other entries, and the other files, still load."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class FileProblem(Exception):
    file: Path
    line: int
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.field}: {self.message}"
