"""Issue 28, item 8: one collector per data dir.

Two collectors on one store doubled what the viewer listed (the quickstart's own "port busy"
hint, ``--port 0``, led there). Real ``python -m tracecar.collector`` processes on 127.0.0.1:
a second one on a held data dir refuses in one line naming the holder's pid and port and exits
non-zero without touching the store; the lock dies with its holder, even by SIGKILL; the
quickstart's hints never lead into a held data dir.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.collector import COLLECTOR_ARGV, collector_env, launch_collector
from tests.support.processes import free_port, stop_process

pytestmark = pytest.mark.timeout(180)


def _refused(env: dict[str, str], argv: tuple[str, ...] = COLLECTOR_ARGV) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), env=env, capture_output=True, text=True, timeout=120)


def _post_and_read(kit: Any, url: str) -> str:
    spans = kit.trajectory(children=2)
    answer = kit.post(url, spans)
    assert answer.status_code == 200 and answer.json()["accepted"] == len(spans), answer.text
    trace = spans[-1]["trace_id"]
    got = httpx.get(f"{url}/v1/trajectories/{trace}", timeout=30)
    assert got.status_code == 200 and got.json()["span_count"] == len(spans), got.text
    return str(trace)


def test_a_second_collector_on_a_held_data_dir_refuses_in_one_line_naming_the_holder(tmp_path: Path, kit: Any) -> None:
    data = tmp_path / "data"
    first_port = free_port()
    first = launch_collector(collector_env(first_port, data), tmp_path / "first.log")
    try:
        trace = _post_and_read(kit, first.url)
        spool = data / "spool.sqlite3"
        before = spool.stat().st_mtime_ns, spool.stat().st_size

        second_port = free_port()
        done = _refused(collector_env(second_port, data))
        assert done.returncode != 0
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, done.stderr
        assert f"pid {first.pid} on port {first_port}" in lines[0] and str(data) in lines[0], lines[0]
        assert "--data-dir" in lines[0] and "TRACECAR_DATA_DIR" in lines[0]
        assert (spool.stat().st_mtime_ns, spool.stat().st_size) == before  # the refused one never opened the store
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{second_port}/healthz", timeout=2)  # and never listened

        # port 0 (a free one, bound after the lock): the holder is still named by the port it bound
        done = _refused(collector_env(0, data))
        assert done.returncode != 0 and f"pid {first.pid} on port {first_port}" in done.stderr

        assert httpx.get(f"{first.url}/v1/trajectories/{trace}", timeout=30).json()["span_count"] == 3  # unharmed
    finally:
        first.proc.kill()  # SIGKILL: no clean exit, no unlock call
        first.proc.wait(30)

    # the kernel dropped the lock with its holder: a new collector takes the dir and serves
    again = launch_collector(collector_env(free_port(), data), tmp_path / "again.log")
    try:
        assert httpx.get(f"{again.url}/v1/trajectories/{trace}", timeout=30).json()["span_count"] == 3
        _post_and_read(kit, again.url)
    finally:
        stop_process(again.proc)


def test_tracecar_serve_refuses_a_held_data_dir_too(tmp_path: Path) -> None:
    data = tmp_path / "data"
    port = free_port()
    first = launch_collector(collector_env(port, data), tmp_path / "first.log")
    try:
        done = _refused(collector_env(free_port(), data), (str(Path(sys.executable).parent / "tracecar"), "serve"))
        assert done.returncode == 1, done.stderr
        assert re.fullmatch(rf"tracecar: data dir \S+ is in use by the collector with pid {first.pid} on port {port}: .+",
                            done.stderr.strip()), done.stderr
    finally:
        stop_process(first.proc)


def _quickstart(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    from tests.support.processes import clean_env

    return subprocess.run([sys.executable, "-m", "tracecar.client.cli", "quickstart", "--exit", "--steps", "1",
                           "--samples", "1", "--rollout-n", "1", *args], env=clean_env(), cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_the_quickstarts_hints_never_lead_into_a_held_data_dir(tmp_path: Path) -> None:
    """A quickstart already serves ./tracecar-data on its port; what the second one says, and does."""
    data = tmp_path / "tracecar-data"
    port = free_port()
    first = launch_collector(collector_env(port, data), tmp_path / "first.log")
    try:
        busy = _quickstart(["--port", str(port)], tmp_path)  # the default data dir, the same port
        assert busy.returncode == 1
        [line] = busy.stderr.strip().splitlines()
        assert f"port {port} on 127.0.0.1 is already in use" in line and "--port N" in line
        assert f"another --data-dir: ./tracecar-data is held by the collector with pid {first.pid} on port {port}" in line

        followed = _quickstart(["--port", "0"], tmp_path)  # the hint's --port 0 alone: refused, one line
        assert followed.returncode == 1
        [line] = followed.stderr.strip().splitlines()
        assert f"data dir ./tracecar-data is in use by the collector with pid {first.pid} on port {port}" in line, line
        assert "--data-dir" in line and "collector ready" not in followed.stdout
        assert not (data / "collector.log").exists()  # nothing of the second one landed in the held dir

        elsewhere = _quickstart(["--port", "0", "--data-dir", str(tmp_path / "other")], tmp_path)  # the whole hint
        assert elsewhere.returncode == 0, elsewhere.stderr
        assert "\n1 trajectories (showing 1" in elsewhere.stdout, elsewhere.stdout
    finally:
        stop_process(first.proc)


def test_a_data_dir_that_cannot_be_locked_is_one_line_too(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    done = _refused(collector_env(free_port(), tmp_path / "a-file" / "data"))
    assert done.returncode == 1
    assert done.stderr.strip() == (f"tracecar: data dir {tmp_path}/a-file/data: cannot open "
                                   f"{tmp_path}/a-file/data/collector.lock: Not a directory"), done.stderr
