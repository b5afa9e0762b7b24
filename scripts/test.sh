#!/usr/bin/env bash
# Set everything up, check lint (ruff) and types (mypy), then run the whole
# test suite: once on the embedded SQLite store (with the real-model
# scenario), then once more on the JetStream store (a nats-server the tests
# start; INBOXMESH_TEST_STORE).
# Set-up comes first, outside every test: .venv (scripts/_venv.sh), then
# llama-server and the scenario's model weights (harness.prepare; the first
# run builds and downloads, later runs find them in the cache). Both passes
# run even when the first fails (and when lint or types fail); the exit
# status is the first failure's.
# Extra arguments go to pytest, and then only that one run is made (after
# the same set-up).
set -euo pipefail
cd "$(dirname "$0")/.."

started=$EPOCHREALTIME
seconds_since() { awk -v from="$1" -v to="$EPOCHREALTIME" 'BEGIN { printf "%.1f", to - from }'; }
timings=()
status=0
# phase NAME COMMAND...: run COMMAND under a heading, record its time and exit code, keep going.
phase() {
  local name=$1 from=$EPOCHREALTIME code=0
  shift
  echo "== $name =="
  "$@" || code=$?
  timings+=("$name $(seconds_since "$from") s (exit $code)")
  echo "== $name: $(seconds_since "$from") s, exit $code =="
  if [ "$status" -eq 0 ]; then status=$code; fi
}
summary() {
  echo "== timings =="
  printf '  %s\n' "${timings[@]}" "total $(seconds_since "$started") s"
}

echo "== set-up: .venv, then llama-server and the real-model scenario's weights =="
source scripts/_venv.sh
echo "set-up: .venv ready after $(seconds_since "$started") s"
.venv/bin/python -m harness.prepare || {
  code=$?
  echo "== set-up failed after $(seconds_since "$started") s (exit $code); no tests were run ==" >&2
  exit "$code"
}
timings+=("set-up $(seconds_since "$started") s")
echo "== set-up: $(seconds_since "$started") s =="

if [ $# -gt 0 ]; then
  phase "pytest $*" .venv/bin/python -m pytest "$@"
  summary
  exit "$status"
fi
phase "lint (ruff)" .venv/bin/ruff check .
phase "types (mypy)" .venv/bin/mypy
phase "SQLite pass" .venv/bin/python -m pytest
phase "JetStream pass" env INBOXMESH_TEST_STORE=jetstream .venv/bin/python -m pytest -q \
  --ignore=harness/test_real_llm.py --ignore=tests/test_generated_code.py
summary
exit "$status"
