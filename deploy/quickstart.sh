#!/usr/bin/env bash
# The main job on a fresh machine (README "Set-up", command 1): a collector on the embedded
# local store, fed by a demo rollout; it lists what landed and keeps serving until Ctrl-C.
# Options are `tracecar quickstart`'s (deploy/quickstart.sh --help): --port N (or TRACECAR_PORT;
# a busy port is an error, 0 picks a free one), --data-dir, --experiment, --exit.
# `exec` hands this process to the quickstart, so SIGTERM/SIGINT reach it directly (SIGINT also when
# this script runs as a background job) and it stops its collector on any signal or exit (the
# collector, its worker processes included, drains and stops with it even on SIGKILL).
set -euo pipefail
export TRACECAR_HINT_CWD="$PWD"  # the printed hints are runnable from where you started
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# setuptools prints a page-long notice on every editable install; it is not a problem of ours
PYTHONWARNINGS=ignore::UserWarning .venv/bin/python -m pip install -q -e ".[collector,demo]"
exec .venv/bin/tracecar quickstart "$@"
