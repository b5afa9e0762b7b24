#!/usr/bin/env bash
# Set up the project's .venv and AutoGen's own .venv-autogen (AutoGen's grpc
# extra pins grpcio 1.70), then run the comparison and rewrite the results
# in docs/benchmarks.md. Extra arguments go to bench/run.py.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
if [ ! -x .venv-autogen/bin/python ] || ! cmp -s bench/autogen-requirements.txt .venv-autogen/.requirements; then
  "$PY" -m venv .venv-autogen
  .venv-autogen/bin/python -m pip install --quiet --upgrade pip >&2
  .venv-autogen/bin/python -m pip install --quiet -r bench/autogen-requirements.txt >&2
  cp bench/autogen-requirements.txt .venv-autogen/.requirements
fi
exec .venv/bin/python bench/run.py "$@"
