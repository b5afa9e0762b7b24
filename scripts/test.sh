#!/usr/bin/env bash
# Set everything up, then run the whole test suite: once on the embedded
# SQLite store (with the real-model scenario), then once more on the
# JetStream store (a nats-server the tests start; INBOXMESH_TEST_STORE).
# Extra arguments go to pytest, and then only that one run is made.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
.venv/bin/python -m pytest
echo "== the same suite on the JetStream store =="
INBOXMESH_TEST_STORE=jetstream exec .venv/bin/python -m pytest -q \
  --ignore=harness/test_real_llm.py --ignore=tests/test_generated_code.py
