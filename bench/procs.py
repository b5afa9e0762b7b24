"""Child processes for benchmarks: commands in on stdin, answers out on
stdout (one line each), stderr kept in a file for when something fails,
CPU read from /proc, always stopped by PID. Standard library only, so the
AutoGen bench can use it from its own virtual environment."""

from __future__ import annotations

import asyncio
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import IO, NoReturn

_TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


async def read_command() -> str:
    """In a child: the next line the parent wrote ('' once stdin is closed)."""
    return (await asyncio.to_thread(sys.stdin.readline)).strip()


class Child:
    """A child process; its stdout lines arrive on a queue, its stderr in a file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.name = name
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     text=True, bufsize=1, env=env)
        assert self.proc.stdin is not None and self.proc.stdout is not None, "both are pipes"
        self._stdin: IO[str] = self.proc.stdin
        self._stdout: IO[str] = self.proc.stdout
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _pump(self) -> None:
        for line in self._stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def send(self, command: str) -> None:
        try:
            self._stdin.write(command + "\n")
            self._stdin.flush()
        except BrokenPipeError:
            self.fail(f"exited (rc={self.proc.wait()}) before '{command}'")

    def expect(self, prefix: str, timeout: float = 120, others: Sequence[Child] = ()) -> str:
        """Wait for a stdout line starting with `prefix`; return the rest of it.
        Fails at the deadline or as soon as one of `others` has exited."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=min(0.2, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                for other in others:
                    if other is not self and other.proc.poll() is not None:
                        other.fail(f"exited (rc={other.proc.returncode}) while waiting for {self.name}")
                if time.monotonic() >= deadline:
                    self.fail(f"printed no '{prefix}' within {timeout:.0f}s")
                continue
            if line is None:
                self.fail(f"exited (rc={self.proc.wait()}) before printing '{prefix}'")
            if line.startswith(prefix):
                return line[len(prefix):].strip()

    def cpu(self) -> float:
        return proc_cpu_seconds(self.proc.pid)

    def fail(self, why: str) -> NoReturn:
        raise SystemExit(f"{self.name} {why}; its stderr:\n{self.stderr_tail()}")

    def stderr_tail(self, chars: int = 4000) -> str:
        self.stderr.seek(0)
        return self.stderr.read()[-chars:]

    def close(self) -> None:
        """Close stdin (a bench child then exits); SIGTERM it by PID after 2 s
        (a mesh server ignores stdin), SIGKILL after 5 s more."""
        try:
            self._stdin.close()
        except OSError:
            pass
        for wait, stop in ((2, self.proc.terminate), (5, self.proc.kill)):
            try:
                self.proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                stop()
        self.proc.wait()
