"""Fan-out: several exporters at once, each with its own delivery cursor, backoff and metrics.

Two real sinks from the registry — ``otlp`` and ``mlflow`` (MLflow's OTLP flavour) — push to
two loopback OTLP/HTTP servers that decode every ExportTraceServiceRequest and can be taken
down (503) or made to refuse (400, partial success). The collector is real (uvicorn on
127.0.0.1, spans posted over HTTP). One destination down never slows the other; after recovery
both have every span exactly once; a restart mid-outage, an old single-exporter spool and a
sampling budget keep those promises.
"""

from __future__ import annotations

import gzip
import sqlite3
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest, ExportTraceServiceResponse

from tracecar.collector.exporters.otlp_translate import span_id_bytes
from tracecar.collector.exporters.registry import EXPORTERS

pytestmark = pytest.mark.timeout(180)

FAST = {"forward_retry_initial_s": 0.05, "forward_retry_max_s": 0.3}


class OtlpRecorder:
    """A loopback OTLP/HTTP traces endpoint recording each delivered span id, in arrival order.

    ``down``: answer 503 (a backend outage); ``refuse``: answer 400 (a permanent rejection);
    ``partial``: answer 200 with ``partial_success.rejected_spans`` = that many.
    """

    def __init__(self) -> None:
        self.down = False
        self.refuse = False
        self.partial = 0
        self.spans: list[str] = []
        self.failed = 0
        self.batch_times: list[float] = []  # monotonic time of each accepted request
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802
                raw = self.rfile.read(int(self.headers["content-length"]))
                status, body = outer._answer(raw)
                self.send_response(status)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                return None

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                return None  # a killed collector resets its kept-alive connection: not the test's concern

        self.server = Server(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.url = self.base + "/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _answer(self, raw: bytes) -> tuple[int, bytes]:
        if self.down or self.refuse:
            with self._lock:
                self.failed += 1
            return (503 if self.down else 400), b"stub says no"
        request = ExportTraceServiceRequest()
        request.ParseFromString(gzip.decompress(raw))
        ids = [s.span_id.hex() for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
        with self._lock:
            self.spans.extend(ids)
            self.batch_times.append(time.monotonic())
        answer = ExportTraceServiceResponse()
        if self.partial:
            answer.partial_success.rejected_spans = self.partial
            answer.partial_success.error_message = "stub refused some"
        return 200, answer.SerializeToString()

    def got(self) -> list[str]:
        with self._lock:
            return list(self.spans)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def recorders() -> Any:
    made = [OtlpRecorder(), OtlpRecorder()]
    yield made
    for r in made:
        r.close()


def fanout_settings(a: OtlpRecorder, b: OtlpRecorder, **extra: Any) -> dict[str, Any]:
    return {"exporters": "otlp,mlflow", "otlp_endpoint": a.url, "mlflow_tracking_uri": b.base,
            "mlflow_experiment_id": "1", **FAST, **extra}


def otlp_ids(spans: list[dict[str, Any]]) -> list[str]:
    """The OTLP span ids the exporters send for these tracecar spans."""
    return [span_id_bytes(s["span_id"], s["trace_id"]).hex() for s in spans]


def states(url: str) -> dict[str, Any]:
    return httpx.get(url + "/readyz", timeout=10).json()["exporters"]


def test_registry_names_equal_sink_names(recorders):
    from tracecar.collector.settings import CollectorSettings

    a, b = recorders
    settings = CollectorSettings(**fanout_settings(a, b))
    for name in ("otlp", "mlflow"):
        assert EXPORTERS[name](settings).name == name
    assert CollectorSettings(backend="otlp", otlp_endpoint=a.url).effective_exporters == ["otlp"]  # old configs
    assert CollectorSettings(backend="local").effective_exporters == []
    assert settings.effective_exporters == ["otlp", "mlflow"]


def test_one_exporter_down_the_other_keeps_delivering_then_both_have_everything_once(start_collector, recorders, kit):
    a, b = recorders
    b.down = True  # mlflow's server is down for a while
    col = start_collector(**fanout_settings(a, b))
    sent: list[dict[str, Any]] = []
    lags: list[float] = []
    deadline = time.monotonic() + 20
    for i in range(12):  # bounded: 12 batches, each waited for at most until the deadline
        spans = kit.trajectory(children=4, sample_index=i)
        posted = time.monotonic()
        assert kit.post(col.url, spans).json()["accepted"] == 5
        sent += spans
        want = set(otlp_ids(sent))
        assert kit.wait_for(lambda: want <= set(a.got()), max(0.1, deadline - time.monotonic())), i
        lags.append(time.monotonic() - posted)
    total = len(sent)
    assert b.got() == [] and b.failed >= 2
    st = states(col.url)
    assert st["otlp"]["pending"] == 0 and st["otlp"]["reachable"] is True
    assert st["mlflow"]["pending"] == total and st["mlflow"]["reachable"] is False and "503" in st["mlflow"]["last_forward_error"]
    metrics = httpx.get(col.url + "/metrics").text
    assert kit.metric(metrics, "tracecar_exporter_pending", exporter="mlflow") == total
    assert kit.metric(metrics, "tracecar_exporter_pending", exporter="otlp") == 0
    assert kit.metric(metrics, "tracecar_backend_unreachable", exporter="mlflow") == 1
    assert kit.metric(metrics, "tracecar_backend_unreachable", exporter="otlp") == 0
    assert kit.metric(metrics, "tracecar_forward_failures_total", exporter="mlflow") >= 2
    assert kit.metric(metrics, "tracecar_forward_failures_total", exporter="otlp") == 0
    assert kit.metric(metrics, "tracecar_spans_forwarded_total", exporter="otlp") == total
    # the spans are still pending (not evictable): one destination does not have them yet
    assert kit.metric(metrics, "tracecar_spool_depth") == total
    # the healthy exporter delivered each batch at its own pace, never waiting on the other's backoff
    print(f"\nfan-out outage: spans={total} otlp lag per batch max={max(lags):.3f}s median={sorted(lags)[len(lags) // 2]:.3f}s "
          f"mlflow failed attempts={b.failed}")
    assert max(lags) < 2.0

    b.down = False  # recovery
    want = otlp_ids(sent)
    assert kit.wait_for(lambda: len(b.got()) >= total, 30)
    assert kit.wait_for(lambda: kit.metrics(col.url, "tracecar_spool_depth") == 0, 10)
    for recorder in (a, b):
        got = recorder.got()
        assert sorted(got) == sorted(want) and len(got) == len(set(got)) == total  # everything, nothing twice
    assert states(col.url)["mlflow"]["pending"] == 0
    assert kit.metrics(col.url, "tracecar_spans_forwarded_total", exporter="mlflow") == total
    rows = col.collector.spool.query("SELECT state, COUNT(*) AS n FROM spans GROUP BY state")
    assert rows == [{"state": 1, "n": total}]  # all done (kept in the store)
    assert col.collector.spool.query("SELECT COUNT(*) AS n FROM deliveries")[0]["n"] == 0


def test_dead_letters_are_per_exporter_and_a_span_one_backend_took_is_done(start_collector, recorders, kit):
    a, b = recorders
    b.refuse = True  # mlflow's server rejects this batch for good (400)
    col = start_collector(**fanout_settings(a, b))
    spans = kit.trajectory(children=2)
    assert kit.post(col.url, spans).json()["accepted"] == 3
    assert kit.wait_for(lambda: kit.metrics(col.url, "tracecar_spans_dead_lettered_total", exporter="mlflow") == 3, 20)
    assert kit.wait_for(lambda: len(a.got()) == 3, 20)
    b.refuse = False
    later = kit.trajectory(children=1, sample_index=1)
    assert kit.post(col.url, later).json()["accepted"] == 2
    assert kit.wait_for(lambda: len(b.got()) == 2, 20)  # the rest flows past the rejection

    page = httpx.get(col.url + "/v1/dead-letters", params={"exporter": "mlflow"}).json()
    assert page["count"] == 3 and {d["exporter"] for d in page["dead_letters"]} == {"mlflow"}
    assert "HTTP 400" in page["dead_letters"][0]["reason"]
    assert httpx.get(col.url + "/v1/dead-letters", params={"exporter": "otlp"}).json()["count"] == 0
    bad = httpx.get(col.url + "/v1/dead-letters", params={"exporter": "nope"})
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "exporter"
    cli = subprocess.run([sys.executable, "-m", "tracecar.client.cli", "dead-letters", "--url", col.url, "--exporter", "mlflow"],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0 and '"exporter": "mlflow"' in cli.stdout and spans[0]["span_id"] in cli.stdout
    # otlp has them, mlflow dead-lettered them: forwarded (done), not dead, nothing pending
    assert kit.wait_for(lambda: kit.metrics(col.url, "tracecar_spool_depth") == 0, 10)
    done = col.collector.spool.query("SELECT state, COUNT(*) AS n FROM spans GROUP BY state")
    assert done == [{"state": 1, "n": 5}]


def test_partial_success_refusals_are_counted_per_exporter(start_collector, recorders, kit):
    a, b = recorders
    a.partial = 1  # the OTLP backend says it refused one span of the batch, without naming it
    col = start_collector(**fanout_settings(a, b))
    assert kit.post(col.url, kit.trajectory(children=3)).json()["accepted"] == 4
    assert kit.wait_for(lambda: kit.metrics(col.url, "tracecar_otlp_partial_rejected_spans_total", exporter="otlp") >= 1, 20)
    assert kit.wait_for(lambda: len(b.got()) == 4, 20)
    metrics = httpx.get(col.url + "/metrics").text
    assert kit.metric(metrics, "tracecar_otlp_partial_rejected_spans_total", exporter="mlflow") == 0
    assert kit.metric(metrics, "tracecar_spans_forwarded_total", exporter="otlp") == 4


def test_collector_restart_mid_outage_loses_nothing_and_sends_nothing_twice(collector_process, recorders, kit):
    a, b = recorders
    b.down = True
    env = {"TRACECAR_EXPORTERS": "otlp,mlflow", "TRACECAR_OTLP_ENDPOINT": a.url, "TRACECAR_MLFLOW_TRACKING_URI": b.base,
           "TRACECAR_MLFLOW_EXPERIMENT_ID": "1", "TRACECAR_FORWARD_RETRY_INITIAL_S": "0.05",
           "TRACECAR_FORWARD_RETRY_MAX_S": "0.3", "TRACECAR_SHUTDOWN_DRAIN_S": "0.5"}
    pc = collector_process(**env).start()
    first = [s for i in range(4) for s in kit.trajectory(children=3, sample_index=i)]
    assert kit.post(pc.url, first).json()["accepted"] == len(first)
    assert kit.wait_for(lambda: len(a.got()) == len(first), 20)
    assert kit.wait_for(lambda: kit.metrics(pc.url, "tracecar_exporter_pending", exporter="otlp") == 0, 10)
    pc.kill()  # SIGKILL mid-outage: mlflow still owes everything

    pc.start()
    assert states(pc.url)["mlflow"]["pending"] == len(first)
    second = kit.trajectory(children=3, sample_index=9)
    assert kit.post(pc.url, second).json()["accepted"] == 4
    assert kit.wait_for(lambda: len(a.got()) == len(first) + 4, 20)
    b.down = False
    everything = otlp_ids(first + second)
    assert kit.wait_for(lambda: len(b.got()) >= len(everything), 30)
    assert kit.wait_for(lambda: kit.metrics(pc.url, "tracecar_spool_depth") == 0, 10)
    for recorder in (a, b):
        got = recorder.got()
        assert sorted(got) == sorted(everything) and len(got) == len(set(got))
    assert pc.terminate() in (0, -15)  # drains, then uvicorn re-raises the signal


def _old_dead_letters(path: Path) -> None:
    """Rewrites the dead-letter table as spools before fan-out had it (keyed by span alone)."""
    conn = sqlite3.connect(str(path))
    conn.executescript("DROP TABLE dead_letters; CREATE TABLE dead_letters (span_id TEXT PRIMARY KEY, trace_id TEXT,"
                       " name TEXT, reason TEXT NOT NULL, failed_at REAL NOT NULL);"
                       "INSERT INTO dead_letters VALUES ('old-span', 'old-trace', 'op', 'HTTP 422 before', 1.0);")
    conn.close()


def test_old_single_exporter_spool_migrates_to_fanout_and_back(start_collector, recorders, kit, tmp_path):
    a, b = recorders
    data = tmp_path / "shared-data"
    a.down = True  # a single-exporter collector (old config: TRACECAR_BACKEND=otlp) leaves spans pending
    old = start_collector(data_dir=data, backend="otlp", otlp_endpoint=a.url, **FAST)
    legacy = [s for i in range(3) for s in kit.trajectory(children=2, sample_index=i)]
    assert kit.post(old.url, legacy).json()["accepted"] == len(legacy)
    assert kit.wait_for(lambda: a.failed >= 1, 10)
    old.stop()
    spool_file = data / "spool.sqlite3"
    conn = sqlite3.connect(str(spool_file))
    assert not conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'deliveries'").fetchone()  # single mode: format as before
    conn.close()
    _old_dead_letters(spool_file)

    # the same spool under two exporters: every pending span is owed to both
    a.down = False
    b.down = True
    fan = start_collector(data_dir=data, **fanout_settings(a, b))
    assert kit.wait_for(lambda: len(a.got()) == len(legacy), 20)
    assert states(fan.url)["mlflow"]["pending"] == len(legacy)
    dead = httpx.get(fan.url + "/v1/dead-letters").json()
    assert dead["count"] == 1 and dead["dead_letters"][0]["span_id"] == "old-span"  # kept through the migration
    fresh = kit.trajectory(children=2, sample_index=7)
    assert kit.post(fan.url, fresh).json()["accepted"] == 3
    assert kit.wait_for(lambda: len(a.got()) == len(legacy) + 3, 20)
    fan.stop()

    # back to the old single-exporter config: otlp already has all of them, so nothing is resent
    back = start_collector(data_dir=data, backend="otlp", otlp_endpoint=a.url, **FAST)
    assert kit.metrics(back.url, "tracecar_spool_depth") == 0
    time.sleep(0.5)
    got = a.got()
    assert sorted(got) == sorted(otlp_ids(legacy + fresh)) and len(got) == len(set(got))
    assert b.got() == []
    back.stop()

    # and fan-out again, mlflow up: it never got the spans (they were done when it left), so it owes none
    b.down = False
    again = start_collector(data_dir=data, **fanout_settings(a, b))
    assert states(again.url)["mlflow"]["pending"] == 0 and states(again.url)["otlp"]["pending"] == 0
    late = kit.trajectory(children=1, sample_index=8)
    assert kit.post(again.url, late).json()["accepted"] == 2
    assert kit.wait_for(lambda: len(b.got()) == 2 and len(a.got()) == len(got) + 2, 20)


@pytest.mark.parametrize("budget", ["head", "tail"])
def test_sampling_decides_once_and_every_exporter_sees_the_same_kept_set(budget, start_collector, recorders, kit):
    a, b = recorders
    limits = ({"max_samples_per_step_per_worker": 2} if budget == "head" else
              {"max_trajectories_per_step": 3, "trajectories_per_step": 6, "reward_wait_s": 0, "keep_spread_groups": 0})
    col = start_collector(**fanout_settings(a, b), **limits)
    trajectories = [kit.trajectory(children=2, sample_index=i) for i in range(6)]
    for spans in trajectories:
        assert kit.post(col.url, spans).status_code == 200
    kept_traces = 2 if budget == "head" else 3
    assert kit.wait_for(lambda: len(a.got()) == kept_traces * 3 and len(b.got()) == kept_traces * 3, 30), (a.got(), b.got())
    time.sleep(0.3)
    stored = httpx.get(col.url + "/v1/trajectories", params={"limit": 100}).json()
    kept = {t["trace_id"] for t in stored["trajectories"]}
    assert len(kept) == kept_traces
    expected = sorted(otlp_ids([s for spans in trajectories if spans[-1]["trace_id"] in kept for s in spans]))
    assert sorted(a.got()) == sorted(b.got()) == expected  # one decision, the same kept set everywhere


def test_unknown_exporter_is_one_line_and_exit_2(tmp_path):
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRACECAR_", "WANDB_", "WF_"))}
    env.update({"TRACECAR_DATA_DIR": str(tmp_path / "d"), "TRACECAR_EXPORTERS": "otlp,zipkin"})
    for command in ("config", "serve"):
        done = subprocess.run([sys.executable, "-m", "tracecar.client.cli", command], env=env, capture_output=True,
                              text=True, timeout=60)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, done.stderr
        assert "TRACECAR_EXPORTERS" in lines[0] and "'zipkin'" in lines[0] and "weave, otlp, mlflow" in lines[0]
    env["TRACECAR_EXPORTERS"] = "weave,otlp"
    done = subprocess.run([sys.executable, "-m", "tracecar.client.cli", "config"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "TRACECAR_EXPORTERS includes otlp but TRACECAR_OTLP_ENDPOINT is not set" in done.stderr
    env["TRACECAR_OTLP_ENDPOINT"] = "http://127.0.0.1:9/v1/traces"
    done = subprocess.run([sys.executable, "-m", "tracecar.client.cli", "config"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "TRACECAR_EXPORTERS includes weave but WANDB_API_KEY is not set" in done.stderr
    assert "take weave out of TRACECAR_EXPORTERS" in done.stderr


def test_health_counts_a_span_forwarded_once_however_many_exporters_took_it():
    """/v1/health's spans_forwarded is what every exporter has (not their sum), each exporter's count beside it."""
    from prometheus_client import CollectorRegistry, Counter

    from tracecar.collector.service.health import health_snapshot

    registry = CollectorRegistry()
    forwarded = Counter("tracecar_spans_forwarded", "test", ["backend", "exporter"], registry=registry)
    forwarded.labels(backend="weave", exporter="weave").inc(10)
    forwarded.labels(backend="otlp", exporter="otlp").inc(7)
    answer = health_snapshot(registry, {})
    assert answer["spans_forwarded"] == 7 and answer["spans_forwarded_by_exporter"] == {"weave": 10, "otlp": 7}
