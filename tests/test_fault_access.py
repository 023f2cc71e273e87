"""Guarantee 7: the bearer token guards every data route, and secrets never leak.

A real `tracecar serve` process with TRACECAR_TOKEN set forwards to a loopback Weave stub that,
when failing, echoes the Authorization header it got back in its error body (as some proxies
do). Requests without the token, with a wrong one or the wrong scheme get 401 and store
nothing. Neither the token nor WANDB_API_KEY (nor its Basic-auth form) appears in the
collector's stderr (debug level), /metrics, any response body, the dead-letter reasons or
`tracecar config`.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from types import SimpleNamespace

import httpx
import pytest

pytestmark = pytest.mark.timeout(120)

TOKEN = "tc-bearer-" + "Zq8xP2mW7vK4nR9sT1uY3"


def test_token_required_and_no_secret_in_logs_metrics_or_bodies(faulty_weave_stub, weave_collector_process, kit):
    stub = faulty_weave_stub
    key = kit.WANDB_KEY
    secrets = {"token": TOKEN, "api key": key, "basic auth": base64.b64encode(f"api:{key}".encode()).decode()}
    pc = weave_collector_process(stub.url, TRACECAR_TOKEN=TOKEN, TRACECAR_LOG_LEVEL="debug").start()
    bodies: list[str] = []

    def call(method: str, path: str, auth: str | None, **kw: object) -> httpx.Response:
        headers = {"Authorization": auth} if auth is not None else {}
        body, ctype = kit.encode(kit.trajectory(children=2)) if method == "POST" else (None, {})
        r = httpx.request(method, pc.url + path, content=body, headers={**headers, **ctype}, timeout=10)
        bodies.append(r.text)
        return r

    refused = 0
    for auth in (None, "Bearer wrong-token", f"Basic {TOKEN}", f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", TOKEN, "Bearer", f"Token {TOKEN}"):
        r = call("POST", "/v1/spans", auth)
        assert r.status_code == 401, (auth, r.status_code)
        assert r.headers["WWW-Authenticate"] == "Bearer" and r.json()["error"]["field"] == "Authorization"
        refused += 1
    for path in ("/v1/trajectories", "/v1/dead-letters", "/v1/trajectories/abc"):
        assert call("GET", path, None).status_code == 401
        assert call("GET", path, "Bearer nope").status_code == 401
    assert kit.metrics(pc.url, "tracecar_spans_received_total") == 0  # nothing of a refused request was read
    assert kit.metrics(pc.url, "tracecar_spool_depth") == 0

    # With the token: stored and forwarded. Meanwhile Weave fails and echoes the credentials it got.
    stub.outage = 500
    good = kit.trajectory(children=3)
    poison = good[0]["span_id"]
    r = kit.post(pc.url, good, token=TOKEN)
    bodies.append(r.text)
    assert r.status_code == 200 and r.json()["accepted"] == 4
    assert kit.wait_for(lambda: kit.metrics(pc.url, "tracecar_forward_failures_total") >= 2, 20)
    ready = call("GET", "/readyz", None).json()
    assert "HTTP 500" in ready["last_forward_error"]
    stub.poison = {poison}  # then a permanent 422, also echoing the credentials, for one span
    stub.outage = None
    assert kit.wait_for(lambda: len(stub.delivered()) == 3, 20)
    assert kit.wait_for(lambda: kit.metrics(pc.url, "tracecar_dead_letters") == 1, 20)
    dead = call("GET", "/v1/dead-letters", f"bearer {TOKEN}")  # the scheme is case-insensitive
    assert dead.status_code == 200 and dead.json()["count"] == 1
    assert "echo_authorization" in dead.json()["dead_letters"][0]["reason"]  # the echo was there, redacted
    assert call("GET", "/v1/trajectories", f"Bearer {TOKEN}").status_code == 200
    stub_saw_key = sum(1 for req in stub.requests if req.headers.get("authorization") == f"Basic {secrets['basic auth']}")
    bodies.append(httpx.get(pc.url + "/metrics").text)

    env = {**pc.env}
    config = subprocess.run([sys.executable, "-m", "tracecar.client.cli", "config"], env=env, capture_output=True,
                            text=True, timeout=60)
    assert config.returncode == 0, config.stderr
    assert '"token": "***set***"' in config.stdout and '"wandb_api_key": "***set***"' in config.stdout
    pc.terminate()
    logs = pc.log_text()
    places = {"stderr log": logs, "response bodies and /metrics": "\n".join(bodies), "tracecar config": config.stdout + config.stderr}
    leaks = {(what, where) for what, secret in secrets.items() for where, text in places.items() if secret in text}
    print(f"\naccess: refused_posts={refused} refused_gets=6 stored_when_refused=0 accepted_with_token=4 forwarded=3 "
          f"dead=1 stub_requests_with_key={stub_saw_key} log_lines={len(logs.splitlines())} leaks={sorted(leaks)}")
    assert stub_saw_key >= 3  # the key really was in play
    assert len(logs.splitlines()) > 20  # debug logging really was on
    assert leaks == set()
    assert "insecure_bind" not in logs  # loopback bind: no warning


def test_compare_is_constant_time_and_a_wrong_token_stores_nothing(start_collector, kit, monkeypatch):
    from tracecar.collector import bearer as auth  # the one bearer parser the API check uses

    calls: list[tuple[bytes, bytes]] = []
    real = auth.hmac.compare_digest

    def recording(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", recording)
    col = start_collector(token=TOKEN)
    assert kit.post(col.url, kit.trajectory(children=1), token="guess").status_code == 401
    assert kit.post(col.url, kit.trajectory(children=1), token=TOKEN).json()["accepted"] == 2
    assert calls == [(b"guess", TOKEN.encode()), (TOKEN.encode(), TOKEN.encode())]
    assert col.collector.spool.query("SELECT COUNT(*) AS n FROM spans")[0]["n"] == 2


def test_loopback_by_default_and_an_open_bind_without_token_warns(monkeypatch, capfd, tmp_path):
    import logging

    from tracecar.collector.service import server
    from tracecar.collector.settings import CollectorSettings

    for name in list(os.environ):
        if name.startswith("TRACECAR_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)  # the default data dir (./tracecar-data) is this test's own
    assert CollectorSettings().host == "127.0.0.1"

    dummy = SimpleNamespace(run=lambda: None, collector=SimpleNamespace(spool=SimpleNamespace(pending_count=0)))
    monkeypatch.setattr(server, "build_server", lambda settings: dummy)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        warned = {}
        for host, token in (("0.0.0.0", None), ("0.0.0.0", TOKEN), ("127.0.0.1", None), ("::1", None)):
            server.serve(CollectorSettings(host=host, token=token))
            err = capfd.readouterr().err
            warned[(host, token is not None)] = "insecure_bind" in err
            assert TOKEN not in err
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    print(f"\nbind warnings: {warned}")
    assert warned == {("0.0.0.0", False): True, ("0.0.0.0", True): False, ("127.0.0.1", False): False, ("::1", False): False}


def test_api_schema_needs_the_token_and_docs_pages_are_off_with_one(start_collector, kit):
    """/openapi.json describes the API, so it is guarded like it; /docs and /redoc (browser pages that
    cannot send the header) are switched off while a token is set, and served as usual without one."""
    col = start_collector(token=TOKEN)
    assert httpx.get(col.url + "/openapi.json").status_code == 401
    assert httpx.get(col.url + "/openapi.json", headers={"Authorization": "Bearer wrong"}).status_code == 401
    r = httpx.get(col.url + "/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200 and "/v1/spans" in r.json()["paths"]
    for page in ("/docs", "/redoc", "/docs/oauth2-redirect"):
        assert httpx.get(col.url + page, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 404, page
    assert TOKEN not in r.text

    open_col = start_collector()
    assert httpx.get(open_col.url + "/openapi.json").status_code == 200
    assert httpx.get(open_col.url + "/docs").status_code == 200
    assert httpx.get(open_col.url + "/redoc").status_code == 200
