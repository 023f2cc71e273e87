#!/usr/bin/env bash
# The main job on a fresh machine (README "Set-up", command 1): a collector on the embedded
# local store, fed by a demo rollout; it lists what landed and keeps serving until Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[collector,demo]"
exec .venv/bin/tracecar quickstart "$@"
