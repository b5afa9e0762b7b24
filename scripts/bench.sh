#!/usr/bin/env bash
# Set up the project's .venv and AutoGen's own .venv-autogen (AutoGen's grpc
# extra pins grpcio 1.70), then run the comparison and rewrite the results
# in docs/benchmarks.md (then the store comparison, bench/store_run.py). Extra
# arguments go to bench/run.py.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
if [ ! -x .venv-autogen/bin/python ] || ! cmp -s bench/autogen-requirements.txt .venv-autogen/.requirements; then
  "$PY" -m venv .venv-autogen
  .venv-autogen/bin/python -m pip install --quiet --upgrade pip >&2
  .venv-autogen/bin/python -m pip install --quiet -r bench/autogen-requirements.txt >&2
  cp bench/autogen-requirements.txt .venv-autogen/.requirements
fi
.venv/bin/python bench/run.py "$@"
# the stores: SQLite, JetStream with one and with two mesh processes
exec .venv/bin/python bench/store_run.py
