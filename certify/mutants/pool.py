"""The runner's side of the warm workers (``certify.mutants.warm``): a few servers, started once per
run, each running one job at a time in a forked child, with a time limit per job.

A server that dies (it should not: only its children run the project) is replaced by a fresh one
before its next job. ``kill_all`` ends every running child and every server at once (an interrupt).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

READY_S = 300.0   # the most seconds a server may take to import its modules


class WorkerDied(RuntimeError):
    """A warm server ended or answered nothing usable."""


class WarmWorker:
    """One server process and a thread that reads its answers into a queue."""

    def __init__(self, root: Path, env: dict[str, str], log: Path):
        self.log = open(log, "ab")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen([sys.executable, "-m", "certify.mutants.warm"], cwd=root,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, start_new_session=True)
        self.answers: queue.Queue[dict | None] = queue.Queue()
        self.child: int | None = None
        self.ready = False
        self.cpu = 0.0   # the CPU seconds of its finished children
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.answers.put(json.loads(line))
            except json.JSONDecodeError:
                continue
        self.answers.put(None)

    def _answer(self, key: str, timeout: float | None) -> dict:
        a = self.answers.get(timeout=timeout)
        if a is None or key not in a:
            raise WorkerDied(f"the warm worker answered {a!r} (expected {key!r}); see {self.log.name}")
        return a

    def wait_ready(self) -> None:
        a = self._answer("ready", READY_S)
        if not a["ready"]:
            raise WorkerDied(f"the warm worker could not start: {a.get('missing')}")

    def run(self, job_file: Path, result_file: Path, log_file: Path,
            timeout: float) -> tuple[int | None, float]:
        """(the child's exit code, or None when it ran past ``timeout`` and was killed; seconds)."""
        request = {"job": str(job_file), "result": str(result_file), "log": str(log_file)}
        t0 = time.perf_counter()
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except OSError as e:
            raise WorkerDied(f"the warm worker is gone: {e}") from None
        self.child = self._answer("pid", READY_S)["pid"]
        try:
            done = self._answer("exit", timeout)
        except queue.Empty:
            self.kill_child()
            done = self._answer("exit", READY_S)
            done["exit"] = None
        finally:
            self.child = None
        self.cpu += done.get("cpu", 0.0)
        return done["exit"], time.perf_counter() - t0

    def kill_child(self) -> None:
        """End the running child and what it started (its own process group)."""
        pid = self.child
        if pid is None:
            return
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
                return
            except (ProcessLookupError, PermissionError):
                continue

    def close(self, kill: bool = False) -> None:
        if kill:
            self.kill_child()
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        else:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=None if kill else 30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


class WarmPool:
    """``size`` warm workers; ``take()`` lends an idle one for one job."""

    def __init__(self, size: int, root: Path, env: dict[str, str], logs: Path):
        self.root, self.env, self.logs = root, env, logs
        self.count = 0
        self.gone_cpu = 0.0   # the CPU seconds of the replaced workers' children
        self.ended = False    # after kill_all: no worker starts again
        self.guard = threading.Lock()
        self.all: list[WarmWorker] = [self._start() for _ in range(max(1, size))]
        self.idle: queue.Queue[WarmWorker] = queue.Queue()
        for w in self.all:
            self.idle.put(w)

    def _start(self) -> WarmWorker:
        with self.guard:
            self.count += 1
            return WarmWorker(self.root, self.env, self.logs / f"warm{self.count}.log")

    @contextmanager
    def take(self):
        w = self.idle.get()
        if self.ended:
            self.idle.put(w)
            raise WorkerDied("the run was interrupted")
        if w.proc.poll() is not None:
            w = self._swap(w)
        try:
            if not w.ready:
                w.wait_ready()
                w.ready = True
            yield w
        except WorkerDied:
            self.idle.put(self._swap(w))
            raise
        except BaseException:
            self.idle.put(w)
            raise
        self.idle.put(w if w.proc.poll() is None else self._swap(w))

    def _swap(self, w: WarmWorker) -> WarmWorker:
        """A fresh worker in the place of ``w``, which is ended (none after ``kill_all``)."""
        w.close(kill=True)
        if self.ended:
            return w
        fresh = self._start()
        with self.guard:
            self.all[self.all.index(w)] = fresh
            self.gone_cpu += w.cpu
        return fresh

    @property
    def cpu(self) -> float:
        """The CPU seconds of every finished child so far."""
        with self.guard:
            return sum(w.cpu for w in self.all) + self.gone_cpu

    def pytest(self, args: list[str], work: Path, name: str, timeout: float) -> tuple[int | None, str]:
        """Run ``pytest ARGS`` on the unmutated code in a warm child: (its exit code, or None when it
        gave no result; its output)."""
        job, result, log = work / f"{name}.job.json", work / f"{name}.result.json", work / f"{name}.log"
        job.write_text(json.dumps({"args": args}))
        with self.take() as w:
            code, _ = w.run(job, result, log, timeout)
        out = log.read_text(errors="replace") if log.is_file() else ""
        if code != 0 or not result.is_file():
            return None, out
        return json.loads(result.read_text())["exit"], out

    def kill_all(self) -> None:
        self.ended = True
        with self.guard:
            workers = list(self.all)
        for w in workers:
            w.close(kill=True)

    def close(self) -> None:
        with self.guard:
            workers = list(self.all)
        for w in workers:
            w.close()
