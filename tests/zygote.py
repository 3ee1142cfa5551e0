"""Zygote: processes that end as a user's script ends, started in milliseconds.

A rank that ``pt.launch`` (or multiprocessing's forkserver) starts leaves through ``os._exit``:
its interpreter never finalises, so what happens to a process at a script's real end (atexit
handlers, daemon threads ended during finalisation, C++ destructors) is never seen. A fresh
interpreter per rank costs 2-3 CPU-s of imports each. The zygote imports torch, pipetrain and
the test's module once, then forks a child per request; the child runs the named function and
leaves through ``sys.exit`` from the zygote's main frame, a script's own exit::

    test ──"start 3 mod fn args"──► zygote ──fork──► child: fn(*args), then the interpreter exits
         ◄──"exit 3 <code> <time>"──        ◄─waitpid─  (code < 0: killed by that signal)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

_MAIN = r"""
import importlib, json, os, sys, threading, time
sys.path.insert(0, {tests!r})
for name in {preload!r}:
    importlib.import_module(name)
children, lock = {{}}, threading.Lock()

def report(line):
    with lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

def reap():
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            time.sleep(0.02)
            continue
        report(f"exit {{children.pop(pid, pid)}} {{os.waitstatus_to_exitcode(status)}} "
               f"{{time.time()}}")

child = None
for line in sys.stdin:
    job, module, function, args, log = json.loads(line)
    pid = os.fork()
    if pid == 0:
        child = (module, function, args, log)
        break
    children[pid] = job
    if len(children) == 1 and not any(t.name == "reap" for t in threading.enumerate()):
        threading.Thread(target=reap, name="reap", daemon=True).start()
    report(f"started {{job}} {{pid}}")
if child is None:
    sys.exit(0)
module, function, args, log = child
fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
os.dup2(fd, 1)
os.dup2(fd, 2)
os.close(0)
sys.stdout = open(1, "w", buffering=1, closefd=False)  # not the zygote's (its lock may be held)
sys.stderr = open(2, "w", buffering=1, closefd=False)
sys.exit(getattr(importlib.import_module(module), function)(*args))
"""


class Zygote:
    """A process that forks children which exit as scripts do; see the module."""

    def __init__(self, preload: list[str]) -> None:
        tests = str(Path(__file__).parent)
        code = _MAIN.format(tests=tests, preload=["torch", "pipetrain", *preload])
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        self.pids: dict[str, int] = {}
        self.exits: dict[str, tuple[int, float]] = {}
        """Per job, its exit code (negative: the signal that ended it) and when it exited."""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def start(self, job: str, module: str, function: str, args: list[Any], log: Path) -> None:
        """Fork a child that runs ``module.function(*args)`` and exits with what it returns
        (its stdout and stderr go to ``log``)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps([job, module, function, args, str(log)]) + "\n")
        self.proc.stdin.flush()

    def wait(self, jobs: list[str], seconds: float) -> None:
        """Until every job in ``jobs`` exited, or ``seconds`` passed."""
        deadline = time.time() + seconds
        while time.time() < deadline and not all(job in self.exits for job in jobs):
            time.sleep(0.02)

    def close(self) -> None:
        """Kill every child still running, then the zygote."""
        for job, pid in self.pids.items():
            if job not in self.exits:
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    continue
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            what, job, *rest = line.split()
            if what == "started":
                self.pids[job] = int(rest[0])
            elif what == "exit":
                self.exits[job] = (int(rest[0]), float(rest[1]))
