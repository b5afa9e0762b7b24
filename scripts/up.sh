#!/usr/bin/env bash
# Set everything up, then serve the whole mesh on the embedded store and run
# the two-agent demo. Extra arguments go to `inboxmesh up` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
exec .venv/bin/inboxmesh up "$@"
