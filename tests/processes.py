"""Mesh processes for tests: `inboxmesh up` started as a real subprocess on a
free port, found through what it prints, stopped by its PID."""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

_LISTENING = re.compile(r"inboxmesh listening on (\S+)")
_KEPT_LINES = 500
"""The last lines of a mesh process's output kept for a failing test to show (MeshProcess.output)."""


class MeshProcess:
    def __init__(self, data_dir: Path, *extra: str, admin_token: str = "test-admin-token",
                 env: dict[str, str] | None = None, log_level: str = "warning", kept_lines: int = _KEPT_LINES):
        self.data_dir = data_dir
        self.env = {**os.environ, **(env or {})}
        self.args = [sys.executable, "-m", "inboxmesh.cli.main", "--log-level", log_level, "up", "--port", "0",
                     "--no-demo", "--data-dir", str(data_dir), "--admin-token", admin_token, *extra]
        self.proc: subprocess.Popen | None = None
        self.address = ""
        self.lines: collections.deque[str] = collections.deque(maxlen=kept_lines)
        """Its last lines of output. Read all along by a thread: a pipe nobody reads fills up (64 KiB) and
        then blocks the process at its next log line, which froze a mesh whose NATS was down a while."""

    def start(self, timeout: float = 30.0) -> str:
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     cwd=Path(__file__).resolve().parent.parent, env=self.env)
        assert self.proc.stdout is not None, "stdout is a pipe"
        deadline = time.monotonic() + timeout
        seen = []
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            match = _LISTENING.search(line)
            if match:
                self.address = match.group(1)
                self.lines.extend(seen)
                threading.Thread(target=self._drain, args=(self.proc.stdout,), daemon=True).start()
                return self.address
        self.kill()
        raise RuntimeError(f"mesh process did not start: {''.join(seen)}")

    def _drain(self, stdout) -> None:
        try:
            for line in stdout:
                self.lines.append(line)
        except (OSError, ValueError):  # closed by __exit__
            pass

    def output(self) -> str:
        """Its last lines of output (for a failing test's message)."""
        return "".join(self.lines)

    def wait(self, timeout: float) -> int:
        """The process's exit code, waiting up to timeout for it to exit."""
        if self.proc is None:
            raise RuntimeError("the mesh process was never started")
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """kill -9: no chance to flush or say goodbye."""
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self, timeout: float = 15.0) -> int:
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            return self.proc.wait(timeout)
        return self.proc.returncode if self.proc else 0

    def __enter__(self) -> MeshProcess:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.kill()
        if self.proc and self.proc.stdout:
            self.proc.stdout.close()
