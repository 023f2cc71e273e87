#!/usr/bin/env bash
# The test command (README "Set-up", command 2; .ci/run calls exactly this).
# Creates ./.venv if needed, installs tracecar with its collector and dev extras, runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[dev]"
exec .venv/bin/python -m pytest "$@"
