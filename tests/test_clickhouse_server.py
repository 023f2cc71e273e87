"""The ClickHouse store on a server (``TRACECAR_STORE_URL``, issue 26 item 4): start, faults and ownership.

The server is ClickHouse's HTTP interface served by ClickHouse's engine (chDB) in its own process
on 127.0.0.1 (tests/support/clickhouse_http.py: no ClickHouse server installs here); the collector
reaches it through clickhouse-connect, with a user and a password. What every read API answers on
it is tests/test_read_store_contract.py's; here: a bad URL, an unreachable server, a wrong password
and a database another collector uses are each one line at start (exit 2, the password never
printed); the server going away mid-run is a 503 naming it and counted, and once it is back the
store catches up with what came in meanwhile; a restarted collector resumes on the same database.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.cluster_workload import batches, post, workload
from tests.support import free_port
from tests.support.clickhouse_http import ClickHouseHttp
from tests.support.cluster import process_collector, wait_until
from tests.support.collector import collector_env, scrape_metric

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ClickHouseHttp]:
    made = ClickHouseHttp(tmp_path / "clickhouse-server")
    try:
        yield made
    finally:
        made.stop()


def start_refused(tmp_path: Path, url: str) -> list[str]:
    """``python -m tracecar.collector`` with the store on ``url``: its stderr lines (it must exit 2)."""
    env = collector_env(free_port(), tmp_path / "refused", store="clickhouse", store_url=url, store_timeout_s=3)
    done = subprocess.run([sys.executable, "-m", "tracecar.collector"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "s3cret-pw" not in done.stderr + done.stdout and "hunter2" not in done.stderr + done.stdout
    return [line for line in done.stderr.splitlines() if line.strip()]


def test_a_bad_url_an_unreachable_server_and_a_wrong_password_are_one_line_at_start(tmp_path: Path,
                                                                                    server: ClickHouseHttp) -> None:
    for url, expected in (
        ("clickhouse://user:hunter2@db/tracecar", "names no port"),
        ("mysql://user:hunter2@db:3306/tracecar", "must start with clickhouse://"),
        ("clickhouse://user:hunter2@db:8123/trace-car", "not a plain identifier"),
        (f"clickhouse://user:hunter2@127.0.0.1:{free_port()}/tracecar", "cannot be used"),
        (server.url(password="hunter2"), "cannot be used"),  # the server answers 516 AUTHENTICATION_FAILED
    ):
        lines = start_refused(tmp_path, url)
        assert len(lines) == 1 and lines[0].startswith("tracecar: ") and "TRACECAR_STORE_URL" in lines[0], lines
        assert expected in lines[0], lines
    lines = start_refused(tmp_path, server.url(password="hunter2"))
    assert "AUTHENTICATION_FAILED" in lines[0] or "516" in lines[0], lines
    # a URL without TRACECAR_STORE=clickhouse is a misconfiguration too
    env = collector_env(free_port(), tmp_path / "sqlite", store_url=server.url())
    done = subprocess.run([sys.executable, "-m", "tracecar.collector"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "TRACECAR_STORE=clickhouse" in done.stderr and "s3cret-pw" not in done.stderr


def server_sql(server: ClickHouseHttp, query: str) -> str:
    """One statement on the server, as another client of it would send it (its answer as text)."""
    answer = httpx.post(f"http://127.0.0.1:{server.port}/", content=query, auth=(server.user, server.password), timeout=30)
    assert answer.status_code == 200, answer.text[:300]
    return answer.text.strip()


def wait_until_listed(url: str, trace_ids: set[str]) -> dict:
    """The list once it holds exactly ``trace_ids`` (a read answering 503 meanwhile is retried)."""
    found: dict = {}

    def done() -> bool:
        r = httpx.get(url + "/v1/trajectories", params={"limit": 1000, "sort": "start"}, timeout=60)
        found.update(r.json() if r.status_code == 200 else {})
        return r.status_code == 200 and {t["trace_id"] for t in found["trajectories"]} == trace_ids

    wait_until(done, 90, "every trajectory listed from the server")
    return found


def listed(url: str) -> dict:
    r = httpx.get(url + "/v1/trajectories", params={"limit": 1000, "sort": "start"}, timeout=60)
    assert r.status_code == 200, r.text[:300]
    return r.json()


def test_the_server_going_away_is_a_503_naming_it_and_the_store_catches_up_once_it_is_back(
        tmp_path: Path, server: ClickHouseHttp) -> None:
    pc = process_collector(tmp_path / "collector", store="clickhouse", store_url=server.url(), log_level="warning",
                           store_timeout_s=5).start()
    second = process_collector(tmp_path / "second", store="clickhouse", store_url=server.url(), log_level="warning")
    try:
        plan = list(batches(workload()))
        half = len(plan) // 2
        with httpx.Client() as client:
            for worker, spans in plan[:half]:
                post(client, pc.url, worker, spans)
        first = listed(pc.url)
        assert first["index"]["store"] == "clickhouse" and first["total"] > 0
        # the rows are in the server's database, as the collector's own store answers them
        assert int(server_sql(server, "SELECT count() FROM tracecar.trajectories FINAL WHERE deleted = 0")) == first["total"]
        # another collector on the same database would wipe this one's rows: refused at start, in one line
        env = dict(second.env, TRACECAR_STORE_TIMEOUT_S="5")
        done = subprocess.run([sys.executable, "-m", "tracecar.collector"], env=env, capture_output=True, text=True, timeout=120)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 2 and len(lines) == 1 and "another collector's" in lines[0], done.stderr[-2000:]
        assert "s3cret-pw" not in done.stderr
        # on its own database (a second gateway replica: TRACECAR_STORE_DATABASE=tracecar_$(POD_NAME)) it starts
        second.env["TRACECAR_STORE_DATABASE"] = "tracecar_tracecar-gateway-1"
        second.start()
        assert listed(second.url)["total"] == 0 and listed(pc.url)["total"] == first["total"]
        assert server_sql(server, "SELECT value FROM tracecar_tracecar_gateway_1.meta FINAL WHERE key = 'owner'")
        second.terminate()

        server.stop()  # the server goes away: ingest goes on (the spool is the collector's), reads say why they cannot
        with httpx.Client() as client:
            for worker, spans in plan[half:]:
                post(client, pc.url, worker, spans)
        r = httpx.get(pc.url + "/v1/trajectories", params={"limit": 5}, timeout=60)
        assert r.status_code == 503 and r.headers.get("retry-after"), (r.status_code, r.text[:300])
        assert "ClickHouse store (server) failed" in r.text and str(server.port) not in r.text and "s3cret-pw" not in r.text, r.text
        assert scrape_metric(pc.url, "tracecar_store_errors_total", store="clickhouse") >= 1

        server.start()  # back, on its port and data: the running collector's store catches up with what came meanwhile
        everything = {t.trace_id for t in workload()}
        kept = wait_until_listed(pc.url, everything)
        assert kept["index"]["store_pending"] == 0
        mirror = server_sql(server, "SELECT value FROM tracecar.meta FINAL WHERE key = 'mirror'")
        assert len(mirror) == 32  # the mirror's token (a uuid4 hex): a refill would write a new one
        pc.terminate()  # a restart resumes on the same database (its claim is its own): nothing lost, nothing doubled
        pc.start()
        assert listed(pc.url)["trajectories"] == kept["trajectories"]
        assert server_sql(server, "SELECT value FROM tracecar.meta FINAL WHERE key = 'mirror'") == mirror  # resumed, not refilled
        assert "s3cret-pw" not in pc.log_text() and "s3cret-pw" not in httpx.get(pc.url + "/metrics", timeout=10).text
    finally:
        for p in (pc, second):
            if p.proc is not None and p.proc.poll() is None:
                p.terminate()
