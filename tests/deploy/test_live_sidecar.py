"""The real `tracecar serve` with the Kubernetes sidecar's settings (loopback only): probes and scrape
without the token, /v1/spans refused without it, the demo lands, SIGTERM drains in time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import clean_env, free_port, stop_process

from .manifests import Stage, healthcheck_exec, k8s_env, run_healthcheck


def _tracecar_cmd() -> list[str]:
    script = Path(sys.executable).with_name("tracecar")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from tracecar.client.cli import main; sys.exit(main())"]


def _get(url: str, token: str | None = None, method: str = "GET", data: bytes | None = None) -> tuple[int, str, str]:
    req = urllib.request.Request(url, method=method, data=data)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=3) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("Content-Type", ""), err.read().decode("utf-8", "replace")


def _wait_status(url: str, want: int, deadline_s: float, proc: subprocess.Popen[bytes]) -> int:
    end = time.monotonic() + deadline_s
    status = -1
    while time.monotonic() < end:
        assert proc.poll() is None, f"tracecar serve exited early with {proc.returncode}"
        try:
            status = _get(url)[0]
            if status == want:
                return status
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.2)
    return status


def _require_cli() -> None:
    import tracecar.client.cli  # noqa: F401  (fails loudly if the console script's module is gone)


@pytest.fixture
def live_collector(sidecar: dict[str, Any], tmp_path: Path) -> Iterator[tuple[str, str, subprocess.Popen[bytes]]]:
    _require_cli()
    port = free_port()
    token = "live-test-" + os.urandom(8).hex()
    env = clean_env()
    env.update({k: v for k, v in k8s_env(sidecar).items() if k.startswith("TRACECAR_")})
    env.update(
        {
            # Loopback here (this is a test host, not a pod); the local store (no W&B key).
            "TRACECAR_HOST": "127.0.0.1",
            "TRACECAR_PORT": str(port),
            "TRACECAR_DATA_DIR": str(tmp_path / "data"),
            "TRACECAR_TOKEN": token,
            "TRACECAR_BACKEND": "local",
            "TRACECAR_TOKEN2TEXT": "false",
            "TRACECAR_SHUTDOWN_DRAIN_S": "2",
        }
    )
    env.pop("WANDB_API_KEY", None)
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen([*_tracecar_cmd(), "serve"], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        yield f"http://127.0.0.1:{port}", token, proc
    finally:
        stop_process(proc, grace_s=0, kill_wait_s=10)
        log.close()


def test_live_probes_and_scrape_work_without_the_token(live_collector: tuple[str, str, subprocess.Popen[bytes]], runtime: Stage, tmp_path: Path) -> None:
    base, token, proc = live_collector
    try:
        assert _wait_status(base + "/healthz", 200, 90, proc) == 200, "GET /healthz never answered 200"
        port = int(base.rsplit(":", 1)[1])
        assert run_healthcheck(healthcheck_exec(runtime.all("HEALTHCHECK")[0]), port) == 0
        # kubelet probes and the Prometheus scrape (annotations) carry no bearer token.
        assert _wait_status(base + "/readyz", 200, 60, proc) == 200, "GET /readyz never became ready"
        status, ctype, body = _get(base + "/metrics")
        assert status == 200, f"GET /metrics without token -> {status}: annotation-based scraping would fail"
        assert ctype.startswith("text/plain") and "# TYPE" in body
        # Everything else needs the token (the collector listens beyond loopback in a pod).
        status, _, _ = _get(base + "/v1/spans", method="POST", data=b"{}")
        assert status in (401, 403), f"POST /v1/spans without token -> {status}"
        # What the compose demo-worker runs, with the token from its environment.
        demo_env = {**{k: v for k, v in os.environ.items() if not k.startswith("TRACECAR_")}, "TRACECAR_TOKEN": token}
        out = subprocess.run([*_tracecar_cmd(), "demo", "--url", base, "--steps", "1", "--samples", "2", "--rollout-n", "1"],
                             env=demo_env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert out.returncode == 0, f"tracecar demo failed: {out.stdout[-1000:]} {out.stderr[-2000:]}"
        total, end = 0, time.monotonic() + 15  # accepted spans reach the store asynchronously
        while total < 2 and time.monotonic() < end:
            listed = subprocess.run([*_tracecar_cmd(), "trajectories", "--url", base, "--json"],
                                    env=demo_env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
            assert listed.returncode == 0, listed.stderr[-2000:]
            total = json.loads(listed.stdout)["total"]
            time.sleep(0.3 if total < 2 else 0)
        assert total >= 2, f"the demo's spans did not land: {out.stdout} {out.stderr[-1000:]}"
        # SIGTERM: drain (2 s here) and exit cleanly well inside a pod's grace period.
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=2 + 20)
        # 0, or -SIGTERM: uvicorn re-raises the signal after its graceful shutdown (exit 143
        # to Docker/Kubernetes), which is still a clean, drained stop.
        assert rc in (0, -signal.SIGTERM), f"tracecar serve exited {rc} on SIGTERM"
    except BaseException:
        log = tmp_path / "serve.log"
        print(log.read_text(errors="replace")[-4000:] if log.exists() else "(no log)")
        raise


def test_live_cli_knows_the_commands_the_manifests_run() -> None:
    _require_cli()
    for sub, needle in (("serve", "serve"), ("demo", "--url")):
        out = subprocess.run([*_tracecar_cmd(), sub, "--help"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and needle in out.stdout + out.stderr, f"tracecar {sub} --help: {out.stderr[-500:]}"
