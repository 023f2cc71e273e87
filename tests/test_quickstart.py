"""The quickstart on a busy machine (issue 12, items 1, 3, 4): loud on a busy port, never feeding
someone else's listener, stopping its collector on a signal, runnable hints, a fresh experiment
per run. Everything runs on free ports of 127.0.0.1 and is stopped by the test."""

from __future__ import annotations

import http.server
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.support import free_port, processes, stop_process
from tests.support.processes import pool_pids

pytestmark = pytest.mark.timeout(180)

SMALL = ["--steps", "1", "--samples", "2", "--rollout-n", "1"]
VENV_BIN = str(Path(sys.executable).parent)


def clean_env(**extra: str) -> dict[str, str]:
    """No TRACECAR_*/WANDB_* from the test host, and the venv *not* on PATH (as for a newcomer)."""
    env = processes.clean_env()
    env["PATH"] = os.pathsep.join(d for d in env.get("PATH", "").split(os.pathsep) if d and d != VENV_BIN)
    env.pop("VIRTUAL_ENV", None)
    env.update(extra)
    return env


class Recorder(http.server.BaseHTTPRequestHandler):
    """A foreign 'collector' that answers 200 to everything and records what it was sent."""

    seen: list[str] = []

    def _answer(self) -> None:
        Recorder.seen.append(f"{self.command} {self.path}")
        length = int(self.headers.get("content-length") or 0)
        if length:
            self.rfile.read(length)
        body = b'{"ready": true, "status": "ok"}'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def foreign_listener() -> Iterator[int]:
    Recorder.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def quickstart(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tracecar.client.cli", "quickstart", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("via", ["flag", "env"])
def test_busy_port_is_one_line_and_nonzero_and_feeds_nobody(via: str, foreign_listener: int, tmp_path: Path) -> None:
    port = foreign_listener
    args = ["--exit", "--data-dir", str(tmp_path / "d"), *SMALL]
    env = clean_env()
    if via == "flag":
        args += ["--port", str(port)]
    else:
        env["TRACECAR_PORT"] = str(port)
    done = quickstart(args, env, tmp_path, timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"port {port} on 127.0.0.1 is already in use" in lines[0] and "--port" in lines[0] and "TRACECAR_PORT" in lines[0]
    assert "collector ready" not in done.stdout
    assert Recorder.seen == []  # not one probe, let alone a demo span, went to the foreign listener


def test_help_documents_port_and_tracecar_port() -> None:
    done = subprocess.run([sys.executable, "-m", "tracecar.client.cli", "quickstart", "--help"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    assert "--port" in text and "$TRACECAR_PORT" in text and "0 picks a free one" in text


def test_sigterm_stops_the_child_and_hints_run_and_reruns_get_a_fresh_experiment(tmp_path: Path) -> None:
    port = free_port()
    data = tmp_path / "data"
    env = clean_env(TRACECAR_PORT=str(port))  # TRACECAR_PORT is honoured
    proc = subprocess.Popen([sys.executable, "-m", "tracecar.client.cli", "quickstart", "--data-dir", str(data), *SMALL],
                            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out: list[str] = []
    child_pid = None
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                break
            out.append(line)
            m = re.search(rf"collector ready at http://127.0.0.1:{port} \(pid (\d+)", line)
            if m:
                child_pid = int(m.group(1))
            if "Ctrl-C to stop" in line:
                break
        text = "".join(out)
        assert child_pid is not None and "Ctrl-C to stop" in text, text + proc.stderr.read()  # type: ignore[union-attr]
        first = re.search(r"experiment (demo-\d{8}-\d{6}) \(a fresh name each run", text)
        assert first, text

        # the printed hints run as printed, with the venv not on PATH
        hint = next(ln for ln in out if ln.startswith("List them:")).split(":", 1)[1].strip()
        argv = shlex.split(hint)
        assert argv[0] != "tracecar" and argv[0].endswith("/tracecar"), hint
        listed = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0, listed.stderr
        assert "2 trajectories" in listed.stdout

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _alive(child_pid):
            time.sleep(0.1)
        assert not _alive(child_pid), "SIGTERM to the quickstart left its collector running"
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is fine, a listener is not
            s.bind(("127.0.0.1", port))  # the port is free again
            s.listen()
    finally:
        stop_process(proc, grace_s=0)
        if child_pid is not None and _alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)

    # a rerun on the same store: its own experiment, and only its own trajectories listed
    again = quickstart(["--exit", "--port", "0", "--data-dir", str(data), *SMALL], clean_env(), tmp_path)
    assert again.returncode == 0, again.stderr
    second = re.search(r"experiment (demo-\d{8}-\d{6}) \(a fresh name each run", again.stdout)
    assert second, again.stdout
    assert second.group(1) != first.group(1)
    assert "\n2 trajectories" in again.stdout, again.stdout
    assert re.search(r"port 0: using free port \d+", again.stdout)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by init) counts as stopped
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _as_a_background_job() -> None:
    """What a non-interactive shell does to a job started with ``&`` (POSIX: SIGINT and SIGQUIT ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP,
                                 pytest.param(signal.SIGKILL, marks=pytest.mark.skipif(not sys.platform.startswith("linux"),
                                                                                      reason="PR_SET_PDEATHSIG is Linux's"))])
def test_other_signals_stop_the_child_too(sig: int, tmp_path: Path) -> None:
    """Started as a background job is (issue 28, item 9): ``cmd &`` in a shell, or by a supervisor
    that ignores SIGINT, starts it with SIGINT ignored, which Python then leaves ignored.
    SIGKILL: with a worker pool, the collector's whole tree ends too (issue 33)."""
    workers = {"TRACECAR_WORKERS": "2"} if sig == signal.SIGKILL else {}
    proc = subprocess.Popen([sys.executable, "-m", "tracecar.client.cli", "quickstart", "--port", "0",
                             "--data-dir", str(tmp_path / "d"), *SMALL],
                            env=clean_env(**workers), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=_as_a_background_job)
    child_pid = None
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                break
            m = re.search(r"collector ready at \S+ \(pid (\d+)", line)
            if m:
                child_pid = int(m.group(1))
            if "Ctrl-C to stop" in line:
                break
        assert child_pid is not None and _alive(child_pid)
        tree = [child_pid]
        if workers:
            deadline = time.monotonic() + 90
            while len(pool_pids(child_pid)) < 2:
                assert time.monotonic() < deadline, "the collector's worker pool did not start"
                time.sleep(0.2)
            tree += [p.pid for p in psutil.Process(child_pid).children(recursive=True)]
        proc.send_signal(sig)  # to the quickstart alone, not its process group
        proc.wait(timeout=60)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(pid) for pid in tree):
            time.sleep(0.1)
        assert not [pid for pid in tree if _alive(pid)], tree
    finally:
        stop_process(proc, grace_s=0)
        if child_pid is not None and _alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)


def test_the_demo_runs_with_a_budget_so_sampling_decisions_show(tmp_path: Path) -> None:
    """Issue 15 §7: a newcomer's quickstart decides its steps with a budget (kept and dropped)."""
    done = quickstart(["--exit", "--port", "0", "--data-dir", str(tmp_path / "data"), "--steps", "1",
                       "--samples", "4", "--rollout-n", "2", "--budget", "3"], clean_env(), tmp_path)
    assert done.returncode == 0, done.stderr
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("sampling:")), "")
    # groups of 2 kept whole (issue 31, item 2): one group fits a budget of 3, never a group cut to its survivor
    assert re.search(r"budget 3 trajectories per step, GRPO groups kept whole; step 1 kept 2 \(.+\), dropped 6$", line), done.stdout
    assert "\n2 trajectories" in done.stdout, done.stdout


def test_with_exit_the_hints_serve_the_store_again_and_show_a_real_id(tmp_path: Path) -> None:
    """Issue 31, item 6: with --exit the collector has stopped, so the hints start with serving the store
    again; "Show one" names a trajectory from the listing (no TRACE_ID placeholder). All run as printed."""
    data = tmp_path / "data"
    done = quickstart(["--exit", "--port", "0", "--data-dir", str(data), *SMALL], clean_env(), tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "TRACE_ID" not in done.stdout
    assert any(line.startswith("The collector stops now (--exit).") for line in lines), done.stdout
    hints = {line.split(":", 1)[0]: line.split(":", 1)[1].strip() for line in lines
             if line.split(":", 1)[0] in ("Serve", "List them", "Show one")}
    assert set(hints) == {"Serve", "List them", "Show one"}, done.stdout
    listed_ids = re.findall(r"^([0-9a-f]{32}) ", done.stdout, re.M)
    shown_id = shlex.split(hints["Show one"])[-1]
    assert shown_id == listed_ids[0], done.stdout

    serve = shlex.split(hints["Serve"])
    assert serve[0].endswith("/tracecar") and serve[1:3] == ["serve", "--data-dir"]
    port = serve[serve.index("--port") + 1]
    server = subprocess.Popen(serve, env=clean_env(), cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        processes.wait_http(f"http://127.0.0.1:{port}/readyz", server, 60)
        listed = subprocess.run(shlex.split(hints["List them"]), env=clean_env(), cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0 and "2 trajectories" in listed.stdout, listed.stderr
        shown = subprocess.run(shlex.split(hints["Show one"]), env=clean_env(), cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0 and shown.stdout.startswith(f"trajectory {shown_id} "), shown.stdout + shown.stderr
    finally:
        stop_process(server)
