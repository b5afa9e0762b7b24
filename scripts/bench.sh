#!/usr/bin/env bash
# Set up the project's .venv and AutoGen's own .venv-autogen (AutoGen's grpc
# extra pins grpcio 1.70), then run the comparison and rewrite the results
# in docs/benchmarks.md: the two-agent comparison and after it the
# many-agent suite (bench/run.py, which runs bench/many_run.py), then the
# store comparison (bench/store_run.py). Extra arguments go to bench/run.py
# (`--many quick` for a smoke run of the many-agent suite, `--many none` to
# leave it out).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
if [ ! -x .venv-autogen/bin/python ] || ! cmp -s bench/autogen-requirements.txt .venv-autogen/.requirements; then
  "$PY" -m venv .venv-autogen
  .venv-autogen/bin/python -m pip install --quiet --upgrade pip >&2
  .venv-autogen/bin/python -m pip install --quiet -r bench/autogen-requirements.txt >&2
  cp bench/autogen-requirements.txt .venv-autogen/.requirements
fi
# the many-agent suite runs its uvloop setup on uvloop (bench/with_uvloop.py)
.venv/bin/python -c 'import uvloop' 2>/dev/null || .venv/bin/python -m pip install --quiet 'uvloop==0.23.0' >&2
.venv/bin/python bench/run.py "$@"
# the stores: SQLite, JetStream with one and with two mesh processes
exec .venv/bin/python bench/store_run.py
