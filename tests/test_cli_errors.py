"""Query commands against a collector that is down, refuses the token, or says no: one line, a
non-zero exit, a sentence (issue 12, item 9); `--version`; `decisions` without sampling."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import clean_env, free_port

pytestmark = pytest.mark.timeout(120)

QUERIES = [
    ["trajectories"], ["trajectories", "--experiment", "x", "--step", "1"], ["show", "0" * 32],
    ["decisions", "--step", "1"], ["dead-letters"],
]


def run(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    full = clean_env()
    full.update(env)
    return subprocess.run([sys.executable, "-m", "tracecar.client.cli", *args], env=full, capture_output=True,
                          text=True, timeout=60)


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


@pytest.mark.parametrize("query", QUERIES, ids=lambda q: q[0])
def test_collector_down_is_one_line(query: list[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    line = one_line(run([*query, "--url", url]))
    assert line.startswith(f"tracecar: cannot reach the collector at {url}") and "tracecar serve" in line


def test_demo_against_nothing_is_one_line_at_once() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    line = one_line(run(["demo", "--url", url, "--steps", "1"]))
    assert line.startswith(f"tracecar: cannot reach the collector at {url}")


def test_url_without_scheme_is_named() -> None:
    port = free_port()
    done = run(["trajectories"], TRACECAR_URL=f"127.0.0.1:{port}")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    # the client's own configure-time line, then the command's: it used http:// as the client does
    assert done.stderr.strip().splitlines() == [
        f"tracecar: TRACECAR_URL='127.0.0.1:{port}' has no scheme; using http://127.0.0.1:{port} (write it as http://HOST:PORT)",
        f"tracecar: cannot reach the collector at http://127.0.0.1:{port} ([Errno 111] Connection refused): is it running? "
        "Start one with `tracecar serve`, or point --url / TRACECAR_URL at it"]
    line = one_line(run(["trajectories", "--url", "ftp://127.0.0.1:1"]))
    assert "is not an http(s) URL with a host" in line and "give --url or TRACECAR_URL as http://HOST:PORT" in line


def test_wrong_token_and_not_found_are_sentences(start_collector) -> None:
    col = start_collector(token="right-token")
    line = one_line(run(["trajectories", "--url", col.url], TRACECAR_TOKEN="wrong"))
    assert "HTTP 401" in line and "Authorization: missing or wrong bearer token" in line and "set TRACECAR_TOKEN" in line
    assert "{" not in line  # a sentence, not raw JSON
    line = one_line(run(["show", "f" * 32, "--url", col.url], TRACECAR_TOKEN="right-token"))
    assert "HTTP 404" in line and f"trace_id: no trajectory {'f' * 32!r} in the store" in line


def test_version() -> None:
    from tracecar.client import __version__

    done = run(["--version"])
    assert done.returncode == 0 and done.stdout.strip() == f"tracecar {__version__}"


def test_decisions_without_sampling_says_sampling_is_off(start_collector) -> None:
    col = start_collector()
    done = run(["decisions", "--step", "3", "--experiment", "demo", "--url", col.url])
    assert done.returncode == 0, done.stderr
    assert "sampling is off for experiment 'demo'" in done.stdout and "kept 0" not in done.stdout


def test_decisions_with_head_budget_says_so(start_collector) -> None:
    col = start_collector(max_samples_per_step_per_worker=2)
    done = run(["decisions", "--step", "3", "--url", col.url])
    assert done.returncode == 0, done.stderr
    assert "head-based budget" in done.stdout and "max_samples_per_step_per_worker" in done.stdout


def test_decisions_without_experiment_picks_the_newest_with_that_step_and_says_so(start_collector, tracer_to) -> None:
    """Issue 31, item 4: the No-traces checklist's `tracecar decisions --step N`, no --experiment."""
    import asyncio
    import time

    import httpx

    from tracecar.client import annotate, rollout_trace_attr

    col = start_collector(max_trajectories_per_step=2, step_idle_s=0.2, reward_wait_s=0.1)

    async def step(n: int) -> None:
        for i in range(3):
            with rollout_trace_attr(sample_index=i, step=n, rollout_n=0, name="agent_loop") as traj:
                pass
            annotate(traj, reward=float(i))

    for experiment in ("exp-a", "exp-b"):  # exp-b decided last: the newest
        tracer = tracer_to(col.url, experiment=experiment)
        asyncio.run(step(3))
        assert tracer.flush(20)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not httpx.get(col.url + "/v1/decisions", params={"step": 3, "experiment": experiment}).json()["decisions"]:
            time.sleep(0.1)
    done = run(["decisions", "--step", "3", "--url", col.url])
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == ("tracecar: no --experiment given: showing 'exp-b', the newest experiment with decisions at step 3; "
                                   "also: 'exp-a' (--experiment NAME for another)")
    assert done.stdout.startswith("step 3 of experiment 'exp-b' (mode tail, budget {'max_trajectories_per_step': 2}): kept 2"), done.stdout
    assert "None" not in done.stdout
    nothing = run(["decisions", "--step", "99", "--url", col.url])
    assert nothing.returncode == 0 and "no experiment has sampling decisions at step 99" in nothing.stderr, nothing.stderr
    assert "experiment None" not in nothing.stdout and "(sent without an experiment name)" in nothing.stdout
