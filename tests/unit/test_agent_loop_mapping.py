"""RL-Insight's agent-loop spans are recognised by name *and* source, and nothing else is taken for one."""

from __future__ import annotations

from typing import Any

from tracecar.collector.receivers import agent_loop
from tracecar.collector.receivers.otlp_translate import Translated

IDENTITY = {"project": "p", "experiment_name": "e", "sample": "3", "session": "1", "traj": "0", "uid": "",
            "global_steps": 5, "session_id": "s-1", "state_lane_id": "experiment=e/sample=3/session=1/traj=0"}


def _span(name: str, span_id: str, **attrs: Any) -> dict[str, Any]:
    return {"span_id": span_id, "trace_id": span_id[:16] + "0" * 16, "parent_id": None, "name": name, "kind": "op",
            "start_time": 1.0, "end_time": 2.0, "attributes": {**attrs, "otel": {"span_id": span_id[16:]}},
            "inputs": {}, "output": None, "exception": None}


def _translated(*spans: dict[str, Any]) -> Translated:
    t = Translated()
    for i, span in enumerate(spans):
        t.spans.append(span)
        t.indices.append(i)
        t.services.append("rl_insight_monitor")
        t.locations.append(f"resourceSpans[0].scopeSpans[0].spans[{i}]")
        t.otel_ids.append(span["span_id"][16:])
    return t


def test_only_the_protocols_names_with_their_source_are_adapted():
    others = [
        _span("llm_request", "a" * 32, experiment_name="e", **{"gen_ai.request.id": "r"}),  # no source: an engine's
        _span("agent_task", "b" * 32, experiment_name="e"),  # the name without its source
        _span("agent_task", "c" * 32, **{"monitor.trace_source": "gateway"}, experiment_name="e"),  # another's source
        _span("agent_session", "d" * 32, **{"monitor.trace_source": "session"}),  # no experiment
    ]
    t = _translated(*others)
    assert agent_loop.adapt(t) == {}
    assert [s["span_id"] for s in t.spans] == ["a" * 32, "b" * 32, "c" * 32, "d" * 32]


def test_a_session_its_task_and_generation_share_one_trajectory_and_the_reward_becomes_an_annotation():
    t = _translated(
        _span("gateway_generation", "1" * 32, **IDENTITY, **{"monitor.trace_source": "gateway"}, turn=1, content="hi",
              prompt_tokens=3, completion_tokens=1, finish_reason="stop", status="success", error=""),
        _span("agent_task", "2" * 32, **IDENTITY, **{"monitor.trace_source": "task"}, reward=0.5, accuracy=1.0,
              status="failure", error="sandbox crashed"),
        _span("agent_session", "3" * 32, **IDENTITY, **{"monitor.trace_source": "session"}, status="success"),
    )
    made = agent_loop.adapt(t)
    generation, task, session, note = t.spans
    trace_id = session["span_id"]
    assert session["trace_id"] == trace_id and session["parent_id"] is None and session["kind"] == "trajectory"
    assert {s["trace_id"] for s in t.spans} == {trace_id} and generation["parent_id"] == task["parent_id"] == trace_id
    assert (session["attributes"]["step"], session["attributes"]["sample_index"], session["attributes"]["rollout_n"]) == (5, 3, 1)
    assert generation["output"]["response_text"] == "hi" and generation["exception"] is None
    assert task["exception"] == "sandbox crashed"
    assert note["kind"] == "annotation" and note["attributes"]["reward"] == 0.5 and note["attributes"]["accuracy"] == 1.0
    assert t.indices == [0, 1, 2, 1]  # the annotation is placed at its task in the request
    assert set(made.values()) == {("p", "rl-insight:rl_insight_monitor")} and len(made) == 4
    assert agent_loop.trajectory_id(session["attributes"]) == trace_id
    other_step = {**IDENTITY, "global_steps": 6}
    assert agent_loop.trajectory_id(other_step) != trace_id  # the same sample and session at another step
