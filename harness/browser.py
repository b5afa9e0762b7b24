"""The browser the web view's test drives: Debian's `chromium` package, headless.

The set-up (`harness.prepare`, run by scripts/test.sh before pytest) calls `ensure_chromium`, which finds
/usr/bin/chromium or installs the package with apt-get (as root; `apt-get update` first when the package
lists do not know it, or when an install from stale lists fails). Tests only look it up (`chromium_path`)
and fail, naming the set-up, when it is missing: they never install anything. No browser build is ever
downloaded (no `playwright install`): Playwright drives this binary through `executable_path`.

Imports only the standard library, like harness.prepare.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
"""Where Debian's `chromium` package puts the browser."""
PACKAGE = "chromium"
SETUP_COMMAND = ".venv/bin/python -m harness.prepare"
"""What installs it; named in every message about it missing (scripts/test.sh runs it too)."""
CHROMIUM_ARGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync")
"""How the tests start it: headless, without the sandbox (root in a container has no user namespaces for
it), and without anything that would reach the network on its own (updates, sync, QUIC)."""
APT_TIMEOUT_S = 900
"""Longest one apt-get command may take (the install fetches about 100 MB on a fresh machine)."""


class BrowserNotReady(RuntimeError):
    """Chromium is not installed, or cannot be: the message says why and what to run."""


def chromium_path() -> Path:
    """The installed browser, else BrowserNotReady naming the set-up command (for tests: never installs)."""
    if CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK):
        return CHROMIUM
    raise BrowserNotReady(f"no headless browser: {CHROMIUM} is missing. The web view's browser test needs"
                          f" Debian's `{PACKAGE}` package: run the set-up (`bash scripts/test.sh` does it ahead of"
                          f" pytest, or `{SETUP_COMMAND}`), or `apt-get install -y --no-install-recommends"
                          f" {PACKAGE}` as root")


def chromium_version(path: Path = CHROMIUM) -> str:
    """What `chromium --version` says (e.g. "Chromium 142.0.7444.59 built on Debian ..."); BrowserNotReady
    when it does not run."""
    try:
        done = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BrowserNotReady(f"{path} does not run: {exc}") from exc
    if done.returncode != 0:
        raise BrowserNotReady(f"{path} --version failed (exit {done.returncode}): {_tail(done.stderr)}")
    return done.stdout.strip()


def _tail(text: str, lines: int = 8) -> str:
    return " | ".join(text.strip().splitlines()[-lines:])


def _apt(args: list[str], say: Callable[[str], None]) -> subprocess.CompletedProcess[str]:
    say(f"chromium: apt-get {' '.join(args)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        return subprocess.run(["apt-get", *args], capture_output=True, text=True, env=env, timeout=APT_TIMEOUT_S,
                              check=False)
    except subprocess.TimeoutExpired as exc:
        raise BrowserNotReady(f"apt-get {' '.join(args)} took over {APT_TIMEOUT_S} s; try again, or install"
                              f" `{PACKAGE}` by hand") from exc


def _known(say: Callable[[str], None]) -> bool:
    """Whether the package lists have a candidate for the package."""
    done = subprocess.run(["apt-cache", "policy", PACKAGE], capture_output=True, text=True, timeout=120,
                          check=False)
    candidate = next((line.split(":", 1)[1].strip() for line in done.stdout.splitlines()
                      if line.strip().startswith("Candidate:")), "")
    if candidate and candidate != "(none)":
        say(f"chromium: package {PACKAGE} {candidate} available")
        return True
    return False


def ensure_chromium(say: Callable[[str], None] = print) -> Path:
    """The headless browser for the web view's test: /usr/bin/chromium when it is there, else Debian's
    `chromium` installed with apt-get (root only; `apt-get update` first when the lists do not know the
    package, and once more when an install from the lists there fails). Says each step through `say` (the
    set-up passes its logger's info). Raises BrowserNotReady with what to do when it cannot."""
    if CHROMIUM.is_file():
        say(f"chromium: installed ({chromium_version()})")
        return CHROMIUM
    if shutil.which("apt-get") is None:
        raise BrowserNotReady(f"{CHROMIUM} is missing and there is no apt-get here: install Chromium so that"
                              f" {CHROMIUM} runs it (the web view's browser test drives it)")
    if os.geteuid() != 0:
        raise BrowserNotReady(f"{CHROMIUM} is missing and installing it needs root: run `apt-get install -y"
                              f" --no-install-recommends {PACKAGE}` as root, or the set-up (`{SETUP_COMMAND}`)"
                              " as root")
    say(f"chromium: not installed, installing Debian's {PACKAGE} package (first run only)")
    updated = False
    if not _known(say):
        done = _apt(["update"], say)
        if done.returncode != 0:
            raise BrowserNotReady(f"apt-get update failed (exit {done.returncode}): {_tail(done.stderr)}")
        updated = True
        if not _known(say):
            raise BrowserNotReady(f"the package lists have no `{PACKAGE}` after apt-get update: this machine's"
                                  " apt sources do not carry it; install Chromium so that"
                                  f" {CHROMIUM} runs it")
    install = ["install", "-y", "--no-install-recommends", PACKAGE]
    done = _apt(install, say)
    if done.returncode != 0 and not updated:  # lists older than the mirror: packages it no longer has
        say(f"chromium: install failed ({_tail(done.stderr, 2)}); updating the package lists and trying again")
        if _apt(["update"], say).returncode == 0:
            done = _apt(install, say)
    if done.returncode != 0:
        raise BrowserNotReady(f"apt-get install {PACKAGE} failed (exit {done.returncode}): {_tail(done.stderr)}")
    if not CHROMIUM.is_file():
        raise BrowserNotReady(f"apt-get installed {PACKAGE} but {CHROMIUM} is not there")
    say(f"chromium: installed ({chromium_version()})")
    return CHROMIUM


if __name__ == "__main__":
    try:
        ensure_chromium(lambda line: print(line, flush=True))
    except BrowserNotReady as exc:
        raise SystemExit(f"chromium: {exc}") from exc
