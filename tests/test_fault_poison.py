"""No poisoned exporter (issue 28, item 1).

A real collector process fans out to Weave (a loopback stub) and OTLP (a loopback OTLP/HTTP
server). Times no exporter can carry are refused at ingest by field name, on ``/v1/spans`` and
``/v1/traces``; a span that passes validation but that one exporter's translation cannot take
(a native span whose ``attributes.otel.status`` is not an object: the OTLP translation reads it
as the status of a span that came in over OTLP) is dead-lettered for that exporter alone, with
the error as its reason, and every later span still reaches both. On the previous release the
OTLP exporter retried the head-of-line batch for ever (``sink error`` in /readyz, every later
span pending).
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest, ExportTraceServiceResponse

from tests.test_fanout import OtlpRecorder, otlp_ids

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def otlp_recorder():
    recorder = OtlpRecorder()
    yield recorder
    recorder.close()


def _otlp_request(start_ns: int, end_ns: int) -> bytes:
    request = ExportTraceServiceRequest()
    span = request.resource_spans.add().scope_spans.add().spans.add()
    span.trace_id, span.span_id, span.name = bytes(range(1, 17)), bytes(range(1, 9)), "vllm.generate"
    span.start_time_unix_nano, span.end_time_unix_nano = start_ns, end_ns
    return request.SerializeToString()


def test_times_no_exporter_carries_are_refused_by_name_and_a_poisoned_span_never_blocks_an_exporter(
        faulty_weave_stub, weave_collector_process, otlp_recorder, kit):
    stub = faulty_weave_stub
    pc = weave_collector_process(stub.url, TRACECAR_EXPORTERS="weave,otlp", TRACECAR_OTLP_ENDPOINT=otlp_recorder.url).start()

    # (a) validation: a time past what every exporter carries is refused by name, its batch-mates kept
    far = kit.trajectory(children=2, sample_index=1)
    far[0]["start_time"], far[0]["end_time"] = 1e11, 1e11 + 1
    answer = kit.post(pc.url, far).json()
    assert answer["accepted"] == 2 and [r["field"] for r in answer["rejected"]] == ["spans[0].start_time"], answer
    assert "before 2300-01-01" in answer["rejected"][0]["reason"]
    r = httpx.post(pc.url + "/v1/traces", content=_otlp_request(2**64 - 1, 2**64 - 1),
                   headers={"Content-Type": "application/x-protobuf"}, timeout=10)
    otlp_answer = ExportTraceServiceResponse.FromString(r.content)
    assert r.status_code == 200 and otlp_answer.partial_success.rejected_spans == 1
    assert "start_time" in otlp_answer.partial_success.error_message, otlp_answer

    # (b) a span that passes validation but the OTLP translation cannot take: dead-lettered for otlp only
    first, poisoned, last = (kit.trajectory(children=3, sample_index=i) for i in (2, 3, 4))
    poison = poisoned[1]
    poison["attributes"] = {**poison["attributes"], "otel": {"status": "not an object"}}
    for batch in (first, poisoned):
        assert kit.post(pc.url, batch).json()["accepted"] == 4
    assert kit.wait_for(lambda: kit.metrics(pc.url, "tracecar_spans_dead_lettered_total", exporter="otlp") >= 1, 30)
    assert kit.post(pc.url, last).json()["accepted"] == 4  # posted after the poison: still flows to both

    spans = [s for s in far[1:] + first + poisoned + last]
    good_otlp = set(otlp_ids([s for s in spans if s is not poison]))
    assert kit.wait_for(lambda: set(otlp_recorder.got()) >= good_otlp, 30), "the OTLP exporter is blocked"
    weave_calls = {s["span_id"] for s in spans if s["kind"] == "op"}
    assert kit.wait_for(lambda: set(stub.delivered()) >= weave_calls, 30), "weave missed spans"
    assert kit.wait_for(lambda: kit.metrics(pc.url, "tracecar_spool_depth") == 0, 30)

    cli = subprocess.run([sys.executable, "-m", "tracecar.client.cli", "dead-letters", "--url", pc.url],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    rows = json.loads(cli.stdout)["dead_letters"]
    ready = httpx.get(pc.url + "/readyz").json()
    print(f"\npoison: otlp got {len(set(otlp_recorder.got()))} spans, weave {len(set(stub.delivered()))} calls, "
          f"dead letters {[(row['exporter'], row['reason'][:90]) for row in rows]}")
    assert [(row["span_id"], row["exporter"]) for row in rows] == [(poison["span_id"], "otlp")]
    assert "could not translate" in rows[0]["reason"] and "AttributeError" in rows[0]["reason"]
    assert poison["span_id"] in stub.delivered()  # Weave took it: the dead letter is the OTLP exporter's alone
    assert otlp_ids([poison])[0] not in otlp_recorder.got()
    assert all("sink error" not in str(e.get("last_error")) for e in ready["exporters"].values()), ready
    assert kit.metrics(pc.url, "tracecar_spans_dead_lettered_total", exporter="weave") == 0
