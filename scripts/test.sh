#!/usr/bin/env bash
# Set everything up, then run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
exec .venv/bin/python -m pytest "$@"
