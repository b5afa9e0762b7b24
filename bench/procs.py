"""Child processes for benchmarks: started with a pipe, read line by line,
CPU read from /proc, always stopped by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

_TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


class Child:
    def __init__(self, args: list[str], env: dict[str, str] | None = None, name: str = ""):
        self.name = name or os.path.basename(args[1] if len(args) > 1 else args[0])
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def expect(self, prefix: str, timeout: float = 60.0) -> str:
        """Read lines until one starts with prefix; returns the rest of it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                err = self.proc.stderr.read()
                raise SystemExit(f"{self.name} exited (code {self.proc.wait()}) before '{prefix}':\n{err[-4000:]}")
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        raise SystemExit(f"{self.name}: no '{prefix}' within {timeout}s")

    def tell(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def cpu(self) -> float:
        return proc_cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def python() -> str:
    return sys.executable
