"""Generated files written whole or not at all, and a lock for reading, merging and writing them.

``atomic_write_text`` writes a temporary file in the target's own directory, flushes and fsyncs it,
then renames it over the target (``os.replace``): a reader sees the old file or the new one, never part
of one. A full disk or an interrupt during the write leaves the old file as it was and removes the
temporary file; a kill leaves the old file too, and at most a stray ``.<name>.*.certify-tmp``.

``locked(directory)`` holds an inter-process lock on a directory: the file ``.certify.lock`` in it,
locked with ``filelock`` (``flock`` on POSIX, released by the kernel when a holder dies, so a crash
leaves no stale lock). Commands that read, merge and write the same files (two ``certify run`` merging
receipts) do it under the lock, so each keeps the other's records; a set of files written under one
lock (the reports, the test lists) is never interleaved with another writer's set. The lock is
re-entrant within a thread: code holding it may call code that takes it again.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from pathlib import Path
from typing import Iterator

from filelock import FileLock

LOCK_NAME = ".certify.lock"
TEMP_SUFFIX = ".certify-tmp"
LOCK_TIMEOUT_S = 300.0   # a writer holds the lock for milliseconds; this long means something is stuck

_LOCKS: dict[str, FileLock] = {}   # one instance per lock file, so that the lock is re-entrant
_LOCKS_GUARD = threading.Lock()


def _lock_of(directory: Path) -> FileLock:
    key = str((directory / LOCK_NAME).resolve())
    with _LOCKS_GUARD:
        lock = _LOCKS.get(key)
        if lock is None:
            lock = _LOCKS[key] = FileLock(key, timeout=LOCK_TIMEOUT_S)
        return lock


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """Hold the lock of ``directory`` (created if missing) for the duration of the block."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with _lock_of(directory):
        yield


@contextlib.contextmanager
def locked_all(directories: list[Path]) -> Iterator[None]:
    """Hold the locks of several directories, taken in one fixed order (sorted resolved paths), so two
    writers of overlapping sets cannot each hold one lock and wait for the other's."""
    with contextlib.ExitStack() as stack:
        for d in sorted({Path(d).resolve() for d in directories}):
            stack.enter_context(locked(d))
        yield


def _new_file_mode(path: Path) -> int:
    """The target's mode where it exists, else what a plain ``open`` would give (0o666 less umask)."""
    try:
        return path.stat().st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (see the module docstring); parents are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = _new_file_mode(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_directory(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` (UTF-8, newlines as given) atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def _fsync_directory(directory: Path) -> None:
    """Make the rename itself durable (POSIX); where a directory cannot be opened, nothing to do."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
