"""A warm worker: one process that imports the heavy third-party modules once and forks a fresh child
per job (``python -m certify.mutants.warm``).

A mutant's run then pays for its own project imports and tests only, never again for an interpreter,
torch, Triton, scipy, hypothesis and pytest. Nothing of the project is imported in the server: each
child installs its import finder (``certify.mutants.worker``) before the project is imported, so every
importer sees the mutant, and no child sees another's. The server runs no torch op and starts no
thread (a fork copies only the forking thread, so a lock another thread held would stay held).

The protocol is one JSON line each way. The runner writes ``{"job": JOB.json, "result": RESULT.json,
"log": LOG}``; the server forks and answers ``{"pid": PID}`` at once, then ``{"exit": CODE, "cpu":
SECONDS}`` when the child ends (a negative code: the signal that ended it; its user + system CPU
seconds). A child is the leader of its own process group, so the runner can kill it and what it
started. A child writes its output to the log, its result (the worker's) to the result file, and
exits 0; with no result file the job crashed.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import sys
import threading
import traceback

PRELOAD = ("torch", "triton", "triton.language", "numpy", "scipy.stats", "hypothesis", "pytest",
           "yaml", "pydantic", "safetensors", "threadpoolctl", "filelock")


def preload() -> list[str]:
    """Import the third-party modules a worker needs and pytest's entry-point plugins; the names
    that could not be imported (those a worker then imports itself)."""
    missing = []
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 (an optional module; the child imports it, or fails, itself)
            missing.append(name)
    for ep in importlib.metadata.entry_points(group="pytest11"):
        try:
            importlib.import_module(ep.value.partition(":")[0])
        except Exception:  # noqa: BLE001
            missing.append(ep.value)
    return missing


def _child(request: dict, protocol: list[int]) -> None:
    """The forked child: run the job, write its result, and leave without returning to the server."""
    code = 1
    try:
        os.setsid()
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        for fd in (*protocol, log, null):
            os.close(fd)
        from certify.mutants import worker  # noqa: PLC0415 (imports nothing of the project under test)

        with open(request["job"]) as f:
            job = json.load(f)
        result = worker.run(job)
        with open(request["result"], "w") as f:
            json.dump(result, f)
        code = 0
    except BaseException:  # noqa: BLE001 (whatever happens, the child must not return to the server)
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve() -> int:
    inp = os.fdopen(os.dup(0), "r")
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)   # stray prints of the imports go to stderr, not into the protocol
    missing = preload()
    if threading.active_count() != 1:
        missing.append("(a preloaded module started a thread: forking would not be safe)")
        print(json.dumps({"ready": False, "missing": missing}), file=out, flush=True)
        return 1
    print(json.dumps({"ready": True, "missing": missing}), file=out, flush=True)
    for line in inp:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request, [inp.fileno(), out.fileno()])
        print(json.dumps({"pid": pid}), file=out, flush=True)
        _, status, usage = os.wait4(pid, 0)
        print(json.dumps({"exit": os.waitstatus_to_exitcode(status),
                          "cpu": usage.ru_utime + usage.ru_stime}), file=out, flush=True)
    out.flush()
    os._exit(0)   # nothing to finalize: torch's and the imports' teardown would only cost seconds


if __name__ == "__main__":
    raise SystemExit(serve())
