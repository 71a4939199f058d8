"""Synthetic tasks for the trained tiny checkpoint: seeded generators, fixed evaluation sets identified
by content hashes (``evalsets``), and scoring. Text is ASCII bytes (``tokenizer``), the tiny model's
vocabulary of 256."""

from impl.tasks.arithmetic import Arithmetic
from impl.tasks.base import Params, Sample, Task
from impl.tasks.frames import Frames
from impl.tasks.mqar import Mqar
from impl.tasks.retrieval import Retrieval

TASKS: dict[str, Task] = {t.name: t for t in (Arithmetic(), Mqar(), Retrieval(), Frames())}

__all__ = ["TASKS", "Sample", "Params", "Task"]
