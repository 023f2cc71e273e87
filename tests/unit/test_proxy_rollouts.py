"""The capture proxy's rollouts: one root per rollout, closed by its reward, when idle (never with a
request in flight), at the bound (least recently active first) or at shutdown; trace ids shared by
every proxy of an experiment; header and reward values checked as the collector will check them."""

from __future__ import annotations

from typing import Any

import pytest

from tracecar.client.integrations.proxy_rollouts import MetaError, Rollouts, header_meta, rollout_trace_id
from tracecar.client.spans import SpanRecord


def registry(**kwargs: Any) -> tuple[Rollouts, list[SpanRecord]]:
    sent: list[SpanRecord] = []
    options: dict[str, Any] = {"experiment": "exp", "idle_s": 10.0, "max_open": 3, **kwargs}
    return Rollouts(sent.append, options["experiment"], options["idle_s"], options["max_open"]), sent


def roots(sent: list[SpanRecord]) -> list[str]:
    return [r.attributes["rollout_id"] for r in sent if r.kind == "trajectory"]  # type: ignore[index]


def test_trace_ids_depend_on_experiment_rollout_and_attempt_only():
    a = rollout_trace_id("exp", "ro-1", None)
    assert a == rollout_trace_id("exp", "ro-1", None) and len(a) == 32 and int(a, 16)
    assert len({a, rollout_trace_id("other", "ro-1", None), rollout_trace_id("exp", "ro-2", None),
                rollout_trace_id("exp", "ro-1", "a1")}) == 4


def test_the_least_recently_active_rollout_is_closed_at_the_bound():
    rollouts, sent = registry()
    for name in ("a", "b", "c"):
        rollouts.touch(name, None, {})
    rollouts.touch("a", None, {})  # a is active again: b is now the oldest
    rollouts.touch("d", None, {})
    assert roots(sent) == ["b"] and rollouts.closed == {"evicted": 1} and len(rollouts.open) == 3


def test_idle_rollouts_close_unless_a_request_is_in_flight():
    rollouts, sent = registry()
    busy = rollouts.touch("busy", None, {})
    busy.in_flight = 1
    rollouts.touch("quiet", None, {})
    now = busy.last_active + 11
    assert rollouts.sweep(now) == 1 and roots(sent) == ["quiet"]
    busy.in_flight = 0
    assert rollouts.sweep(now) == 1 and roots(sent) == ["quiet", "busy"] and rollouts.closed == {"idle": 2}
    assert rollouts.close_all() == 0


def test_a_reward_closes_its_rollout_with_its_attributes_and_annotates_it():
    rollouts, sent = registry()
    rollouts.touch("r", None, {"step": 2})
    answer = rollouts.reward("r", None, {"reward": 0.5, "sample_index": "q7", "rollout_n": 1, "advantage": -0.25, "judge": "gpt"})
    assert answer == {"trace_id": rollout_trace_id("exp", "r", None), "rollout": "closed"}
    root, note = sent
    assert root.attributes is not None
    assert (root.attributes["step"], root.attributes["sample_index"], root.attributes["rollout_n"]) == (2, "q7", 1)
    assert note.kind == "annotation" and note.attributes == {"reward": 0.5, "advantage": -0.25, "judge": "gpt"}
    assert note.to_wire()["trace_id"] == answer["trace_id"] == root.span_id
    kept = rollouts.reward("r2", None, {"reward": 1, "done": False})  # unknown here: a root of its own, closed at once
    assert kept["rollout"] == "unknown" and len(rollouts.open) == 0 and rollouts.closed == {"reward": 2}


@pytest.mark.parametrize("body, field", [({"reward": float("nan")}, "reward"), ({"reward": True}, "reward"),
                                         ({"reward": 1, "sample_index": ""}, "sample_index"), ({"reward": 1, "step": 2**63}, "step"),
                                         ({"reward": 1, "note": {"a": 1}}, "note"), ({"reward": 1, "filtered_by": ""}, "filtered_by")])
def test_a_reward_value_the_collector_would_refuse_is_refused_by_name(body, field):
    rollouts, sent = registry()
    with pytest.raises(MetaError) as refused:
        rollouts.reward("r", None, body)
    assert refused.value.field == field and sent == []


def test_headers_give_rollout_attributes_and_bad_ones_are_named_and_ignored():
    meta, ignored = header_meta([(b"x-tracecar-step", b"12"), (b"x-tracecar-sample-index", b"-3"), (b"x-tracecar-validate", b"true"),
                                 (b"x-tracecar-rollout-n", b"first"), (b"authorization", b"Bearer x")])
    assert meta == {"step": 12, "sample_index": -3, "validate": True}
    assert ignored == ["header x-tracecar-rollout-n: must be a signed 64-bit integer"]
