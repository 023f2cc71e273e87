"""The collector says when Weave cannot be reached and when workers send a wrong token (issue 12,
item 6): a rate-limited warning with counts, a metric, and details on /readyz."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.conftest import FaultKit
from tests.support import free_port
from tests.support.weave_stub import WeaveStub

pytestmark = pytest.mark.timeout(120)

API_KEY = FaultKit.WANDB_KEY


def until(predicate: Callable[[], Any], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(0.05)
    raise TimeoutError("condition not met")


def metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def span_batch() -> dict[str, Any]:
    return {"v": 1, "worker": "w", "spans": FaultKit().trajectory(children=1)}


def test_wrong_token_is_logged_rate_limited_counted_and_on_readyz(start_collector, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tracecar.collector")
    col = start_collector(token="the-collector-token")
    for i in range(5):
        r = httpx.post(col.url + "/v1/spans", json=span_batch(), headers={"Authorization": f"Bearer wrong-{i}"})
        assert r.status_code == 401
    assert httpx.get(col.url + "/v1/trajectories").status_code == 401  # no token at all
    lines = [r.getMessage() for r in caplog.records if "TRACECAR_TOKEN must equal" in r.getMessage()]
    assert len(lines) == 1, lines  # six refusals, one line (the next comes a minute later, with the count)
    assert "refused 1 request(s) with wrong bearer token (latest: POST /v1/spans" in lines[0]
    assert all("wrong-" not in r.getMessage() and "the-collector-token" not in r.getMessage() for r in caplog.records)
    assert metric(col.url, 'tracecar_auth_failures_total{route="POST /v1/spans"}') == 5
    assert metric(col.url, 'tracecar_auth_failures_total{route="GET /v1/trajectories"}') == 1
    ready = httpx.get(col.url + "/readyz").json()
    assert ready["auth_failures"]["total"] == 6
    assert ready["auth_failures"]["last"]["reason"] == "no bearer token"
    assert "wrong-" not in str(ready)


def test_weave_unreachable_is_logged_once_on_readyz_and_metrics(start_collector, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tracecar.collector")
    nowhere = f"http://127.0.0.1:{free_port()}"
    col = start_collector(backend="weave", wandb_api_key=API_KEY, wandb_entity="team", wandb_project="rl",
                          weave_server_url=nowhere, forward_retry_initial_s=0.05, forward_retry_max_s=0.1)
    assert httpx.post(col.url + "/v1/spans", json=span_batch()).status_code == 200
    ready = until(lambda: (r := httpx.get(col.url + "/readyz").json())["forwarding"]["consecutive_failures"] >= 3 and r)
    assert ready["ready"] is True  # spans are safe in the spool: still ready, but it says why nothing leaves
    assert ready["forwarding"]["reachable"] is False and "ConnectError" in ready["forwarding"]["last_error"]
    assert ready["forwarding"]["backend"] == "weave" and ready["spool_depth"] == 2
    assert metric(col.url, "tracecar_backend_unreachable") == 1
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cannot forward to weave")]
    assert len(lines) == 1, lines
    assert "ConnectError" in lines[0] and "check WANDB_API_KEY" in lines[0]
    assert API_KEY not in caplog.text and API_KEY not in str(ready)


def test_weave_outage_then_recovery(start_collector, weave_stub: WeaveStub, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tracecar.collector")
    weave_stub.fail_next(8, 503)
    col = start_collector(backend="weave", wandb_api_key=API_KEY, wandb_entity="team", wandb_project="rl",
                          weave_server_url=weave_stub.url, forward_retry_initial_s=0.05, forward_retry_max_s=0.1)
    assert httpx.post(col.url + "/v1/spans", json=span_batch()).status_code == 200
    until(lambda: weave_stub.completed_calls())
    ready = until(lambda: (r := httpx.get(col.url + "/readyz").json())["forwarding"]["reachable"] and r)
    assert ready["forwarding"]["last_error"] is None and ready["forwarding"]["last_success_at"]
    assert metric(col.url, "tracecar_backend_unreachable") == 0
    messages = [r.getMessage() for r in caplog.records]
    assert sum(m.startswith("cannot forward to weave") for m in messages) == 1
    assert any(m.startswith("forwarding to weave recovered after") for m in messages), messages
