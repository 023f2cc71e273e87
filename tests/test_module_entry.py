"""``python -m tracecar.collector`` serves, exactly as ``tracecar serve`` does (issue 13)."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import httpx


def test_python_m_tracecar_collector_serves_and_drains(collector_process: Callable[..., Any], kit: Any) -> None:
    pc = collector_process().start()  # conftest's ProcessCollector runs `python -m tracecar.collector`
    assert pc.proc.args[1:] == ["-m", "tracecar.collector"]
    spans = kit.trajectory(children=2)
    r = kit.post(pc.url, spans)
    assert r.status_code == 200, r.text
    assert r.json()["accepted"] == len(spans)
    listed = httpx.get(pc.url + "/v1/trajectories", timeout=10).json()
    assert [t["trace_id"] for t in listed["trajectories"]] == [spans[0]["trace_id"]]
    assert pc.terminate() in (0, -signal.SIGTERM)  # drains, then uvicorn re-raises the signal (as `tracecar serve`)
    assert "Traceback" not in pc.log_text()


def test_python_m_tracecar_collector_takes_the_serve_flags() -> None:
    done = subprocess.run([sys.executable, "-m", "tracecar.collector", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: tracecar serve") and "--data-dir" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "tracecar.collector", "--port", "not-a-port"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode != 0 and "--port" in bad.stderr
