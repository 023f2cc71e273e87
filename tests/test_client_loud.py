"""A worker's tracing mistakes are said (issue 12, item 5): a TRACECAR_URL without http:// or
pointing at nothing, a wrong token. Each runs a real worker process; it must exit 0 (tracing
never raises into the job), warn once on the first failed send, and say at exit what it dropped."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.support import clean_env, free_port

pytestmark = pytest.mark.timeout(120)

WORKER = textwrap.dedent("""
    import asyncio, time
    from tracecar.client import rollout_trace_attr, rollout_trace_op, get_tracer

    @rollout_trace_op
    async def generate(prompt_ids):
        return {"response_ids": [1, 2, 3]}

    async def main():
        for i in range(20):
            with rollout_trace_attr(sample_index=i, step=1, rollout_n=0, name="agent_loop"):
                await generate([5, 6])
        time.sleep(float(__import__("os").environ.get("WORKER_LINGER_S", "1.5")))
        print("tracer", "on" if get_tracer() else "off", get_tracer().config.url if get_tracer() else "")
    asyncio.run(main())
    print("job done")
""")


def worker(**env: str) -> subprocess.CompletedProcess[str]:
    full = clean_env()
    full.update({"TRACECAR_FLUSH_INTERVAL_S": "0.05", "TRACECAR_RETRY_INITIAL_S": "0.05", "TRACECAR_RETRY_MAX_S": "0.1",
                 "TRACECAR_SHUTDOWN_TIMEOUT_S": "1"})
    full.update(env)
    return subprocess.run([sys.executable, "-c", WORKER], env=full, capture_output=True, text=True, timeout=90)


def test_url_pointing_at_nothing_warns_once_and_reports_drops_at_exit() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    done = worker(TRACECAR_URL=url)
    assert done.returncode == 0 and "job done" in done.stdout, done.stderr
    failures = [ln for ln in done.stderr.splitlines() if "cannot send spans to the collector" in ln]
    # dozens of retries in 1.5 s, but one warning (rate-limited to one a minute)
    assert len(failures) == 1, done.stderr
    assert url in failures[0] and "connection: ConnectError" in failures[0] and "check TRACECAR_URL" in failures[0]
    report = [ln for ln in done.stderr.splitlines() if "at shutdown" in ln]
    assert len(report) == 1, done.stderr
    assert "sent 0 spans" in report[0] and "dropped 40 (shutdown_timeout 40)" in report[0]
    assert "last send error: connection: ConnectError" in report[0]


def test_url_without_scheme_is_fixed_with_a_warning(start_collector) -> None:
    col = start_collector()
    bare = col.url.removeprefix("http://")
    done = worker(TRACECAR_URL=bare)
    assert done.returncode == 0, done.stderr
    assert f"TRACECAR_URL={bare!r} has no scheme; using http://{bare}" in done.stderr
    assert f"tracer on http://{bare}" in done.stdout
    assert "cannot send spans" not in done.stderr and "at shutdown" not in done.stderr


@pytest.mark.parametrize("url", ["ftp://127.0.0.1:9470", "http://", "http://127.0.0.1:notaport"])
def test_url_that_cannot_work_turns_tracing_off_and_says_so(url: str) -> None:
    done = worker(TRACECAR_URL=url)
    assert done.returncode == 0 and "tracer off" in done.stdout, done.stderr
    assert "tracing is off" in done.stderr and repr(url.rstrip("/")) in done.stderr


def test_wrong_token_is_said_once_with_the_fix(start_collector) -> None:
    col = start_collector(token="the-right-one")
    done = worker(TRACECAR_URL=col.url, TRACECAR_TOKEN="wrong", TRACECAR_BATCH_MAX_SPANS="4")
    assert done.returncode == 0, done.stderr
    failures = [ln for ln in done.stderr.splitlines() if "cannot send spans" in ln]
    assert len(failures) == 1 and "http_401" in failures[0] and "set TRACECAR_TOKEN" in failures[0], done.stderr
    report = [ln for ln in done.stderr.splitlines() if "at shutdown" in ln]
    assert len(report) == 1 and "dropped 40 (http_401 40)" in report[0], done.stderr
    assert "the-right-one" not in done.stderr and "wrong" not in done.stderr.replace("wrong bearer", "")


# ---- issue 31, item 5: the worker's own mistakes, each one line, once --------------------------------
def lines_with(text: str, needle: str) -> list[str]:
    return [ln for ln in text.splitlines() if needle in ln]


def test_a_typo_in_tracecar_url_is_said_once_with_the_closest_name() -> None:
    done = worker(TRACECAR_ULR="http://127.0.0.1:9470")
    assert done.returncode == 0 and "tracer off" in done.stdout, done.stderr
    said = lines_with(done.stderr, "TRACECAR_ULR")
    assert said == ["tracecar: TRACECAR_ULR is not a tracecar setting and is ignored (did you mean 'TRACECAR_URL'?); "
                    "tracing is off (TRACECAR_URL is unset)"], done.stderr


def test_a_typo_in_another_setting_is_said_once_by_a_tracing_worker_and_collector_settings_are_not(start_collector) -> None:
    col = start_collector()
    done = worker(TRACECAR_URL=col.url, TRACECAR_QUEUE_MAX_SPAN="10", TRACECAR_TOKEN2TEXT="true", TRACECAR_SPOOL_MAX_BYTES="1000000")
    assert done.returncode == 0 and "tracer on" in done.stdout, done.stderr
    said = lines_with(done.stderr, "is not a tracecar setting")
    assert said == ["tracecar: TRACECAR_QUEUE_MAX_SPAN is not a tracecar setting and is ignored "
                    "(did you mean 'TRACECAR_QUEUE_MAX_SPANS'?)"], done.stderr  # the collector's own names are known


def test_a_url_naming_the_ingest_endpoint_is_taken_as_the_base_url_and_said(start_collector) -> None:
    col = start_collector()
    done = worker(TRACECAR_URL=col.url + "/v1/spans")
    assert done.returncode == 0 and f"tracer on {col.url}\n" in done.stdout, done.stderr
    said = lines_with(done.stderr, "names an endpoint")
    assert said == [f"tracecar: TRACECAR_URL='{col.url}/v1/spans' names an endpoint; using the collector's base URL {col.url} "
                    "(give it as http://HOST:PORT: the client adds /v1/spans itself)"], done.stderr
    assert "cannot send spans" not in done.stderr and "at shutdown" not in done.stderr  # every span arrived
    import httpx

    assert httpx.get(col.url + "/v1/trajectories", params={"limit": 100}).json()["total"] == 20


def test_stats_of_the_tracer_when_tracing_is_off_does_not_raise() -> None:
    script = ("from tracecar.client import get_tracer\n"
              "t = get_tracer()\n"
              "print(bool(t), t.stats()['enabled'], t.stats()['sent'], t.stats()['dropped_total'], t.flush(1), t.config.url)\n")
    done = subprocess.run([sys.executable, "-c", script], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "False False 0 0 True None\n" and done.stderr == ""
