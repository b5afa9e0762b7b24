# Sourced by the other scripts: make sure .venv exists and holds the project
# with its pinned dependencies. Reinstalls only when pyproject.toml changed;
# otherwise this is a hash of pyproject.toml and nothing more.
set -euo pipefail
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for candidate in python3.11 python3 python; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
      PY=$candidate; break
    fi
  done
fi
[ -n "$PY" ] || { echo "inboxmesh needs Python >= 3.11 on PATH (or PYTHON=...)" >&2; exit 1; }
if [ ! -x .venv/bin/python ]; then
  echo "setting up .venv with $($PY --version)" >&2
  "$PY" -m venv .venv
fi
stamp=.venv/.inboxmesh-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  venv_started=$SECONDS
  echo "installing the project and its pinned dependencies into .venv (first run, or pyproject.toml changed)" >&2
  .venv/bin/python -m pip install --quiet --upgrade pip >&2
  .venv/bin/python -m pip install --quiet -e '.[dev]' >&2
  echo "$want" > "$stamp"
  echo ".venv ready in $((SECONDS - venv_started)) s" >&2
fi
