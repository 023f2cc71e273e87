"""Engine spans that reach the collector before their trajectory wait for it (collector/receivers/engine_hold.py).

vLLM-shaped ``llm_request`` spans (opentelemetry-sdk, the OTLP/HTTP exporter, vLLM's span name,
kind, resource and ``gen_ai.*`` names, parented with ``trace_headers()``) are flushed while their
``generate`` call is still running and before the client has sent anything of the trajectory
(open markers off), so the collector sees them first. The exporter is a recording sink: the
assertion is on what the forwarder hands any exporter, and when.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from typing import Any

import httpx
import pytest

from tests.test_otlp_receiver import VllmEngine
from tracecar.client import engine_request, rollout_trace_attr, rollout_trace_op, trace_headers
from tracecar.collector.exporters.forward import SendResult

pytestmark = pytest.mark.timeout(120)


class RecordingSink:
    """Takes every batch; records each span as the exporter would see it (project included)."""

    name = "otlp"

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []

    async def send(self, spans: Sequence[Any]) -> SendResult:
        self.spans.extend(dict(s) for s in spans)
        return SendResult(delivered=[s["span_id"] for s in spans])

    async def aclose(self) -> None:
        return None


def _metric(url: str, name: str, label: str = "") -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + label + " ") or (not label and line.startswith(name + " ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _wait(check: Any, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.05)


def engine_first_rollout(engine: VllmEngine, gate: Any = None, sample_index: int = 1) -> str:
    """A trajectory whose two engine spans are exported (and answered) while their generate runs."""

    class Server:
        @rollout_trace_op
        async def generate(self, request_id: str, prompt_ids: list[int]) -> dict[str, Any]:
            engine.request(trace_headers(), request_id, len(prompt_ids), 3, arrival=time.time())
            engine.flush()  # at the collector before anything of the trajectory
            if gate is not None:
                gate()
            return {"prompt_ids": prompt_ids, "response_ids": [7, 8, 9]}

    async def trajectory() -> str:
        with rollout_trace_attr(sample_index=sample_index, step=2, rollout_n=0, name="agent_loop") as root:
            await Server().generate("r-1", [1, 2])
            await Server().generate("r-2", [1, 2, 7, 8, 9, 4])
        return root.span_id

    return asyncio.run(trajectory())


def test_engine_spans_first_wait_for_their_trajectory_then_leave_with_its_project(start_collector, tracer_to):
    sink = RecordingSink()
    col = start_collector(sink=sink)
    tracer = tracer_to(col.url, project="grpo-proj", experiment="exp-a", worker_id="w7", open_markers=False,
                       flush_interval_s=30)  # nothing of the trajectory leaves before the test says so
    engine = VllmEngine(col.url + "/v1/traces")
    seen_waiting: list[float] = []

    def gate() -> None:  # both engine spans stored, none handed to the exporter
        _wait(lambda: _metric(col.url, "tracecar_otlp_held_spans_total", '{outcome="held"}') >= len(seen_waiting) + 1)
        time.sleep(0.3)  # the forwarder had its chance
        assert not [s for s in sink.spans if s["name"] == "llm_request"]
        seen_waiting.append(_metric(col.url, "tracecar_otlp_held_spans_waiting"))

    trace_id = engine_first_rollout(engine, gate)
    engine.close()
    assert seen_waiting == [1, 2]
    rows = col.collector.spool.query("SELECT state, project, worker FROM spans WHERE trace_id = ?", [trace_id])
    assert [(r["state"], r["project"]) for r in rows] == [(4, None), (4, None)]  # stored (acknowledged), waiting
    assert tracer.flush(10)
    _wait(lambda: len([s for s in sink.spans if s["trace_id"] == trace_id]) == 5)
    engines = [s for s in sink.spans if s["name"] == "llm_request"]
    assert len(engines) == 2 and {s["project"] for s in engines} == {"grpo-proj"}  # the trajectory's destination
    assert {s["worker"] for s in engines} == {"w7"} and {s["attributes"]["step"] for s in engines} == {2}
    generates = {s["span_id"] for s in sink.spans if s["name"].endswith("generate")}
    assert {s["parent_id"] for s in engines} == generates
    stored = col.collector.spool.query("SELECT project, experiment, step FROM spans WHERE name = 'llm_request'")
    assert [(r["project"], r["experiment"], r["step"]) for r in stored] == [("grpo-proj", "exp-a", 2)] * 2
    assert _metric(col.url, "tracecar_otlp_held_spans_total", '{outcome="joined"}') == 2
    assert _metric(col.url, "tracecar_otlp_held_spans_waiting") == 0


def test_an_engine_span_whose_trajectory_never_comes_is_released_after_the_age_bound(start_collector):
    sink = RecordingSink()
    col = start_collector(sink=sink, otlp_hold_max_age_s=1.0)
    engine = VllmEngine(col.url + "/v1/traces")
    orphan = {"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"}
    engine.request(orphan, "lonely", 5, 2, arrival=time.time())
    engine.flush()
    engine.close()
    _wait(lambda: _metric(col.url, "tracecar_otlp_held_spans_total", '{outcome="held"}') == 1)
    started = time.monotonic()
    _wait(lambda: any(s["name"] == "llm_request" for s in sink.spans))
    assert 0.3 < time.monotonic() - started < 10
    assert _metric(col.url, "tracecar_otlp_held_spans_total", '{outcome="expired"}') == 1
    [span] = sink.spans
    assert span["project"] is None  # the default destination, as before: nothing acknowledged is kept back for good


def test_the_count_bound_releases_the_oldest_and_a_foreign_trace_never_waits(start_collector):
    sink = RecordingSink()
    col = start_collector(sink=sink, otlp_hold_max_spans=2)
    engine = VllmEngine(col.url + "/v1/traces")
    for n in range(3):
        engine.request({"traceparent": f"00-{n + 1:032x}-{n + 1:016x}-01"}, f"q{n}", 5, 2, arrival=time.time())
        engine.flush()
    # another producer's trace: its root comes with its child, so the child knows where it goes
    with engine.tracer.start_as_current_span("agent.run"):
        with engine.tracer.start_as_current_span("tool.call"):
            pass
    engine.flush()
    engine.close()
    _wait(lambda: len(sink.spans) == 3)
    names = sorted(s["name"] for s in sink.spans)
    assert names == ["agent.run", "llm_request", "tool.call"]
    released = next(s for s in sink.spans if s["name"] == "llm_request")
    assert released["trace_id"] == f"{1:032x}"  # the oldest
    assert _metric(col.url, "tracecar_otlp_held_spans_total", '{outcome="overflow"}') == 1
    assert _metric(col.url, "tracecar_otlp_held_spans_waiting") == 2
    assert _metric(col.url, "tracecar_otlp_held_spans_total", '{outcome="held"}') == 3


def test_waiting_engine_spans_survive_a_restart_and_join_their_trajectory_after_it(start_collector, tracer_to, tmp_path):
    data = tmp_path / "hold-data"
    first = start_collector(sink=RecordingSink(), data_dir=data)
    tracer = tracer_to(first.url, project="proj-r", open_markers=False, flush_interval_s=30)
    engine = VllmEngine(first.url + "/v1/traces")
    trace_id = engine_first_rollout(engine)  # the trajectory's spans stay in the client
    engine.close()
    first.stop()
    sink = RecordingSink()
    second = start_collector(sink=sink, data_dir=data, port=first.settings.port)  # the same address, a new life
    assert _metric(second.url, "tracecar_otlp_held_spans_waiting") == 2
    time.sleep(0.5)
    assert sink.spans == []
    assert tracer.flush(20)  # the worker's client reaches the restarted collector
    _wait(lambda: len([s for s in sink.spans if s["trace_id"] == trace_id]) == 5)
    assert {s["project"] for s in sink.spans if s["trace_id"] == trace_id} == {"proj-r"}
    assert _metric(second.url, "tracecar_otlp_held_spans_total", '{outcome="joined"}') == 2


def test_engine_spans_of_a_trajectory_a_head_budget_drops_are_dropped_with_it(start_collector, tracer_to):
    sink = RecordingSink()
    col = start_collector(sink=sink, max_samples_per_step_per_worker=1)
    tracer = tracer_to(col.url, project="p", open_markers=False, flush_interval_s=30)
    engine = VllmEngine(col.url + "/v1/traces")
    kept = engine_first_rollout(engine)
    assert tracer.flush(10)
    dropped = engine_first_rollout(engine, sample_index=2)  # the same step and worker: over the budget of 1
    assert tracer.flush(10)
    engine.close()
    _wait(lambda: _metric(col.url, "tracecar_otlp_held_spans_total", '{outcome="dropped"}') == 2)
    _wait(lambda: len(sink.spans) == 5)
    assert {s["trace_id"] for s in sink.spans} == {kept}
    assert col.collector.spool.query("SELECT COUNT(*) AS n FROM spans WHERE trace_id = ?", [dropped])[0]["n"] == 0
    assert _metric(col.url, "tracecar_otlp_held_spans_total", '{outcome="joined"}') == 2


def test_engine_spans_first_share_a_tail_budgets_decision_with_their_trajectory(start_collector, tracer_to, kit):
    sink = RecordingSink()
    col = start_collector(sink=sink, max_trajectories_per_step=1, trajectories_per_step=2, reward_wait_s=0,
                          keep_errors_share=0, keep_reward_extremes=0, keep_spread_groups=0)
    tracer = tracer_to(col.url, project="p", open_markers=False, flush_interval_s=30)
    engine = VllmEngine(col.url + "/v1/traces")
    both = [engine_first_rollout(engine, sample_index=i) for i in (0, 1)]
    assert _metric(col.url, "tracecar_otlp_held_spans_waiting") == 4
    assert tracer.flush(10)
    engine.close()
    decided = kit.wait_for(lambda: (d := httpx.get(col.url + "/v1/decisions", params={"step": 2}, timeout=10).json())
                           ["kept"] + d["dropped"] == 2 and d, 30)
    [kept] = [row["trace_id"] for row in decided["decisions"] if row["keep"]]
    assert kept in both
    _wait(lambda: len(sink.spans) == 5)
    time.sleep(0.5)
    assert {s["trace_id"] for s in sink.spans} == {kept} and len(sink.spans) == 5  # its 2 engine spans with it
    assert {s["project"] for s in sink.spans} == {"p"}
    assert col.collector.spool.query("SELECT COUNT(*) AS n FROM spans WHERE state IN (3, 4)")[0]["n"] == 0


# ---- engine spans without a parent context, joined by their request id (VERL's enable_otel) ----------
VERL_RESOURCE = {"project": "proj-o", "experiment_name": "exp-o", "replica": "0"}  # what enable_otel puts on the resource


def request_rollout(engine: VllmEngine, gate: Any = None, sample_index: int = 1) -> tuple[str, list[str]]:
    """A trajectory of two generate calls, each noting the request id it hands the engine; the engine's
    spans carry that id and no parent context. The first is exported and answered while its call runs
    (before anything of the trajectory), the second only when the test flushes the engine."""
    sent: list[str] = []

    class Server:
        @rollout_trace_op
        async def generate(self, turn: int, prompt_ids: list[int]) -> dict[str, Any]:
            request_id = uuid.uuid4().hex  # VERL's LLMServerClient._vllm_request_id: a fresh uuid per turn
            engine_request(request_id)
            sent.append(request_id)
            engine.request(None, request_id, len(prompt_ids), 3, arrival=time.time())
            if turn == 0:
                engine.flush()
                if gate is not None:
                    gate()
            return {"prompt_ids": prompt_ids, "response_ids": [7, 8, 9]}

    async def trajectory() -> str:
        with rollout_trace_attr(sample_index=sample_index, step=4, rollout_n=0, name="agent_loop") as root:
            await Server().generate(0, [1, 2])
            await Server().generate(1, [1, 2, 7, 8, 9, 4])
        return root.span_id

    return asyncio.run(trajectory()), sent


def test_engine_spans_without_a_parent_context_join_the_call_that_sent_their_request(start_collector, tracer_to):
    sink = RecordingSink()
    col = start_collector(sink=sink)
    tracer = tracer_to(col.url, project="grpo-proj", experiment="exp-o", worker_id="w3", open_markers=False,
                       flush_interval_s=30)
    engine = VllmEngine(col.url + "/v1/traces", resource=VERL_RESOURCE)

    def gate() -> None:  # the first engine span is stored, waiting, handed to no exporter
        _wait(lambda: _metric(col.url, "tracecar_otlp_held_spans_waiting") == 1)
        time.sleep(0.3)
        assert sink.spans == []

    trace_id, sent = request_rollout(engine, gate)
    assert tracer.flush(10)  # the trajectory: the first engine span joins it now
    _wait(lambda: _metric(col.url, "tracecar_otlp_request_joins_total", '{outcome="joined_late"}') == 1)
    engine.flush()  # the second arrives after its call: joined on arrival
    engine.close()
    _wait(lambda: len([s for s in sink.spans if s["trace_id"] == trace_id]) == 5)
    generates = {s["attributes"]["engine_request_ids"][0]: s for s in sink.spans if s["name"].endswith("generate")}
    assert list(generates) == sent or sorted(generates) == sorted(sent)
    engines = [s for s in sink.spans if s["name"] == "llm_request"]
    assert len(engines) == 2
    for span in engines:
        call = generates[span["attributes"]["gen_ai.request.id"]]
        assert span["parent_id"] == call["span_id"] and span["trace_id"] == trace_id
        assert (span["project"], span["worker"], span["attributes"]["step"]) == ("grpo-proj", "w3", 4)
        assert span["attributes"]["otel"]["joined_by"] == "gen_ai.request.id"
        # placed in Weave's tree as trace_headers' tracestate would have: a turn under its top-level generate
        assert span["attributes"]["tracecar"] == {"root": call["span_id"], "turn": span["span_id"]}
    assert _metric(col.url, "tracecar_otlp_request_joins_total", '{outcome="joined"}') == 1
    assert _metric(col.url, "tracecar_otlp_held_spans_total", '{outcome="joined"}') == 1
    assert _metric(col.url, "tracecar_otlp_held_spans_waiting") == 0
    rows = col.collector.spool.query("SELECT trace_id, parent_id, state FROM spans WHERE name = 'llm_request'")
    assert {r["trace_id"] for r in rows} == {trace_id} and all(r["state"] != 4 for r in rows)


def test_an_engine_span_whose_call_never_comes_is_released_after_the_age_bound_and_counted(start_collector, tracer_to):
    sink = RecordingSink()
    col = start_collector(sink=sink, otlp_hold_max_age_s=1.0)
    engine = VllmEngine(col.url + "/v1/traces", resource=VERL_RESOURCE)
    engine.request(None, "never-sent-by-a-traced-call", 5, 2, arrival=time.time())
    engine.flush()
    engine.close()
    _wait(lambda: _metric(col.url, "tracecar_otlp_held_spans_total", '{outcome="held"}') == 1)
    _wait(lambda: len(sink.spans) == 1)
    assert _metric(col.url, "tracecar_otlp_request_joins_total", '{outcome="engine_unmatched"}') == 1
    assert _metric(col.url, "tracecar_otlp_held_spans_total", '{outcome="expired"}') == 1
    assert sink.spans[0]["project"] is None and sink.spans[0]["parent_id"] is None  # as it came, not lost


def test_a_parentless_engine_span_waits_only_where_a_request_join_can_come(start_collector, tracer_to):
    sink = RecordingSink()
    col = start_collector(sink=sink)
    plain = VllmEngine(col.url + "/v1/traces")  # vLLM traced on its own: no VERL resource, no client noting requests
    plain.request(None, "plain-1", 5, 2, arrival=time.time())
    plain.flush()
    _wait(lambda: len(sink.spans) == 1)  # its own trace, at once
    assert _metric(col.url, "tracecar_otlp_held_spans_total", '{outcome="held"}') == 0
    tracer = tracer_to(col.url, project="p", open_markers=False, flush_interval_s=30)
    # the first trajectory of a client that notes its requests: its first engine span came before any such
    # note reached the collector, so it could not know to wait (sent as it is); the second joins on arrival
    cold, sent = request_rollout(plain)
    _wait(lambda: len(sink.spans) == 2)
    assert [s["trace_id"] for s in sink.spans if s["attributes"].get("gen_ai.request.id") == sent[0]] != [cold]
    assert tracer.flush(10)
    plain.flush()
    _wait(lambda: len([s for s in sink.spans if s["trace_id"] == cold]) == 4)
    warm, _ = request_rollout(plain, sample_index=2)  # from now on such spans wait for their call
    assert tracer.flush(10)
    plain.flush()
    plain.close()
    _wait(lambda: len([s for s in sink.spans if s["trace_id"] == warm]) == 5)
    assert _metric(col.url, "tracecar_otlp_request_joins_total", '{outcome="joined_late"}') == 1
    assert _metric(col.url, "tracecar_otlp_request_joins_total", '{outcome="engine_unmatched"}') == 0


def test_engine_spans_waiting_for_their_request_survive_a_restart_and_join_after_it(start_collector, tracer_to, tmp_path):
    data = tmp_path / "hold-requests"
    first = start_collector(sink=RecordingSink(), data_dir=data)
    tracer = tracer_to(first.url, project="proj-r", open_markers=False, flush_interval_s=30)
    engine = VllmEngine(first.url + "/v1/traces", resource=VERL_RESOURCE)

    def gate() -> None:
        _wait(lambda: _metric(first.url, "tracecar_otlp_held_spans_waiting") == 1)

    trace_id, sent = request_rollout(engine, gate)  # the trajectory's spans stay in the client
    first.stop()
    sink = RecordingSink()
    second = start_collector(sink=sink, data_dir=data, port=first.settings.port)
    assert _metric(second.url, "tracecar_otlp_held_spans_waiting") == 1
    assert tracer.flush(20)
    engine.flush()
    engine.close()
    _wait(lambda: len([s for s in sink.spans if s["trace_id"] == trace_id]) == 5)
    engines = [s for s in sink.spans if s["name"] == "llm_request"]
    assert sorted(s["attributes"]["gen_ai.request.id"] for s in engines) == sorted(sent)
    assert {s["project"] for s in engines} == {"proj-r"}
    assert _metric(second.url, "tracecar_otlp_request_joins_total", '{outcome="joined_late"}') == 1


def test_in_a_local_store_an_early_engine_span_waits_for_its_call_and_the_viewer_never_lists_it_alone(start_collector,
                                                                                                        tracer_to):
    col = start_collector()  # backend=local: no exporter, the store is the destination
    assert col.collector.spool.local_only
    tracer = tracer_to(col.url, project="local-p", experiment="exp-l", open_markers=False, flush_interval_s=30)
    engine = VllmEngine(col.url + "/v1/traces", resource=VERL_RESOURCE)
    seen: list[dict[str, Any]] = []

    def gate() -> None:  # stored, waiting: not in the viewer's list as a trajectory of its own
        _wait(lambda: _metric(col.url, "tracecar_otlp_held_spans_waiting") == 1)
        seen.extend(httpx.get(col.url + "/ui/api/trajectories", params={"limit": 100}, timeout=10).json()["trajectories"])

    trace_id, sent = request_rollout(engine, gate)
    assert seen == []
    assert tracer.flush(10)
    engine.flush()
    engine.close()
    _wait(lambda: httpx.get(f"{col.url}/v1/trajectories/{trace_id}", timeout=10).json().get("span_count") == 5)
    listed = httpx.get(col.url + "/ui/api/trajectories", params={"limit": 100}, timeout=10).json()["trajectories"]
    assert [t["trace_id"] for t in listed] == [trace_id] and listed[0]["span_count"] == 5
    tree = httpx.get(f"{col.url}/ui/api/trajectories/{trace_id}", timeout=10).json()
    assert sorted(e["request_id"] for t in tree["turns"] for e in t["engine"]) == sorted(sent)
    assert _metric(col.url, "tracecar_otlp_request_joins_total", '{outcome="joined_late"}') == 1
    assert col.collector.spool.awaiting_count == 0
