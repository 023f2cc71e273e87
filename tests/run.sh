#!/usr/bin/env bash
# The test command (README "Set-up", command 2; .ci/run calls exactly this).
# Creates ./.venv if needed, installs tracecar with its collector and dev extras, runs ruff and mypy, then pytest.
# With TRACECAR_TEST_WEAVE_SERVER=1 it makes ./.venv-weave52 (weave's own trace server) so the
# Weave read-back tests run instead of skipping.
# With TRACECAR_TEST_OTLP_SERVERS=1 it makes ./.venv-mlflow (MLflow's server) and ./.venv-phoenix (Phoenix) for the exporters' read-back tests.
# With TRACECAR_TEST_PY310=1 it runs the client, pipeline and deploy tests on Python 3.10 in ./.venv-py310
# (skipped, with one line, when no working 3.10 with venv/ensurepip is found).
# With TRACECAR_TEST_VERL=1 it then runs the VERL adapter tests and the Weave parity harness
# (tests/test_weave_parity.py, which also needs .venv-weave52) against the real verl package in
# ./.venv-verl (CPU torch 2.13.0 from this machine's wheel directory; about 2 GB, 3 minutes), and TRL's GRPOTrainer
# (tests/test_trl.py) and VERL's enable_otel through RL-Insight's discovery (tests/test_verl_enable_otel.py; its
# multi-process part needs .venv-mlflow) in the same venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ "${TRACECAR_TEST_WEAVE_SERVER:-0}" = 1 ]; then
  # weave 0.52.42 is the last wheel with weave's own SQLite trace server: the forwarding tests
  # read what tracecar sent back through weave's query API (tests/support/weave_server.py).
  [ -x .venv-weave52/bin/python ] || "$PYTHON" -m venv .venv-weave52
  .venv-weave52/bin/python -m pip install -q weave==0.52.42 emoji sqlparse redis clickhouse_connect ddtrace
  export TRACECAR_WEAVE_SERVER_PYTHON="$PWD/.venv-weave52/bin/python"
fi
if [ "${TRACECAR_TEST_OTLP_SERVERS:-0}" = 1 ]; then
  # MLflow's own server (SQLite backend) for the mlflow exporter's read-back test
  # (tests/test_mlflow_export.py); its pins clash with the collector's, so it has its own venv.
  [ -x .venv-mlflow/bin/python ] || "$PYTHON" -m venv .venv-mlflow
  .venv-mlflow/bin/python -m pip install -q mlflow==3.17.2
  export TRACECAR_MLFLOW_SERVER_PYTHON="$PWD/.venv-mlflow/bin/python"
  # Arize Phoenix (phoenix serve, SQLite) for the OTLP exporter's read-back test (tests/test_phoenix_export.py)
  [ -x .venv-phoenix/bin/python ] || "$PYTHON" -m venv .venv-phoenix
  .venv-phoenix/bin/python -m pip install -q arize-phoenix==20.26.1
  export TRACECAR_PHOENIX_SERVER_PYTHON="$PWD/.venv-phoenix/bin/python"
fi
if [ "${TRACECAR_TEST_VERL:-0}" = 1 ]; then
  [ -x .venv-verl/bin/python ] || "$PYTHON" -m venv .venv-verl
  .venv-verl/bin/python -m pip install -q --upgrade pip
  .venv-verl/bin/python -m pip install -q torch==2.13.0          # first, so verl never pulls a CUDA build
  PYTHONWARNINGS=ignore::UserWarning .venv-verl/bin/python -m pip install -q verl==0.9.1 cachetools uvicorn fastapi -e ".[dev]"
  # MLflow's SDK for VERL's own trace.backend=mlflow (the mlflow parity harness's baseline)
  .venv-verl/bin/python -m pip install -q mlflow-skinny==3.17.2
  # TRL for tests/test_trl.py (GRPOTrainer, two steps on CPU): it accepts this venv's torch and transformers, so it
  # adds only itself and keeps verl's pins (about 4 s to install, ~30 s of test)
  .venv-verl/bin/python -m pip install -q trl==1.16.0
  # the adapter against real VERL; then the parity harnesses: VERL's own weave / mlflow backend vs
  # tracecar, read back from weave's own trace server / a real mlflow server (each skips without
  # .venv-weave52 / .venv-mlflow)
  .venv-verl/bin/python -m pytest -p no:cacheprovider -q tests/test_verl_adapter.py tests/test_truth_verl.py tests/test_weave_parity.py \
    tests/test_mlflow_parity.py tests/test_trl.py tests/test_verl_enable_otel.py
fi
if [ "${TRACECAR_TEST_PY310:-0}" = 1 ]; then
  PY310=""  # a working 3.10: on PATH, or a pyenv install (its shim fails when 3.10 is not selected)
  for candidate in python3.10 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.10*/bin/python3.10; do
    if "$candidate" -c 'import sys, venv, ensurepip; assert sys.version_info[:2] == (3, 10)' >/dev/null 2>&1; then PY310=$candidate; break; fi
  done
  if [ -n "$PY310" ]; then
    [ -x .venv-py310/bin/python ] || "$PY310" -m venv .venv-py310
    PYTHONWARNINGS=ignore::UserWarning .venv-py310/bin/python -m pip install -q -e ".[dev]"
    .venv-py310/bin/python -m pytest -p no:cacheprovider -q tests/test_client_resilience.py tests/test_fault_client.py \
      tests/test_traceparent.py tests/test_pipeline_e2e.py tests/test_ingest_formats.py tests/test_bearer.py tests/deploy tests/unit
  else
    echo "tests/run.sh: no working python3.10 (with venv and ensurepip) found; the Python 3.10 tests did not run" >&2
  fi
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# setuptools prints a page-long notice on every editable install; it is not a problem of ours
PYTHONWARNINGS=ignore::UserWarning .venv/bin/python -m pip install -q -e ".[dev]"
# lint first ([tool.ruff] in pyproject.toml, tests/ruff.toml): one clear list of findings, before any test runs
.venv/bin/python -m ruff check .
# then the types of client/ and collector/ ([tool.mypy] in pyproject.toml, pydantic's plugin)
.venv/bin/python -m mypy
exec .venv/bin/python -m pytest "$@"
