"""RL-Insight's Agent Loop protocol in: its spans become tracecar trajectories.

RL-Insight (PyPI ``rl-insight``; ``docs/monitor/agent_loop_protocol.md`` in its repository) defines
three completed spans that any agent runtime emits with ``rl_insight.trace_span`` and its
``agent_loop_session`` helper, each a root span of a trace of its own (its hub exports them over
OTLP/HTTP, with the resource ``service.name`` = its namespace), every one carrying the session's
identity (``project``, ``experiment_name``, ``sample``, ``session``, ``traj``, ``state_lane_id``,
``uid``, ``global_steps``, ``session_id``) and ``monitor.trace_source``:

* ``agent_session`` (``session``): ``runner_name``, ``status``, ``num_trajectories``,
  ``reward_source``, ``finished``: sent once, when the session finishes;
* ``agent_task`` (``task``): ``task_name``, ``image_ref``, ``prompt_hash``, ``status``,
  ``reward``, ``accuracy``, ``finished``, ``reward_posted``, ``error``;
* ``gateway_generation`` (``gateway``): ``traj``, ``chain_id``, ``turn``, ``type``, ``tools``,
  ``content``, ``prompt_tokens``, ``completion_tokens``, ``finish_reason``, ``status``, ``error``.

Mapping (one tracecar trajectory per agent session, the unit RL-Insight scores):

* the trajectory's id is derived from the session's identity (project, experiment, step, sample,
  session, session id, uid), so spans sent by different processes, in any order, meet;
* ``agent_session`` is its root (kind ``trajectory``, span id = trace id): ``step`` =
  ``global_steps``, ``sample_index`` = ``sample`` (an int when it is one), ``rollout_n`` =
  ``session`` (when an int), ``validate`` = false (the protocol has no such flag; a ``validate``
  attribute the runtime adds wins), ``experiment_name``; it arrives last, as a tracecar root does;
* ``agent_task`` is a child call (inputs: task name, image, prompt hash; output: status, reward,
  accuracy, finished, reward_posted, error), and its ``reward`` (with ``accuracy`` as a metric) is
  also an annotation of the trajectory, so lists, RL views and budgets see the reward whichever
  span comes first;
* ``gateway_generation`` is a child LLM call: inputs ``turn``, ``traj``, ``chain_id``, ``type``,
  ``tools``; output ``response_text`` (``content``), ``finish_reason``, ``prompt_tokens``,
  ``completion_tokens``, ``status``; a session's chains (``traj``) stay told apart by those inputs;
* an ``error`` text, or ``status`` ``error``, makes the span failed (its ``exception``);
* every span keeps its attributes as sent, its OTel facts under ``attributes.rl_insight`` (not
  ``otel``: these are tracecar calls, not an engine's spans), takes the identity's ``project`` as its
  destination and the worker ``rl-insight:<service.name>``.

Anything else RL-Insight sends (``trace_state`` intervals, ``trace_op`` durations) is an OTLP
trace of its own, as before.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from .otlp_translate import Translated

SESSION, TASK, GATEWAY = "agent_session", "agent_task", "gateway_generation"
SOURCES = {SESSION: "session", TASK: "task", GATEWAY: "gateway"}  # name -> its monitor.trace_source
WORKER_PREFIX = "rl-insight:"
_IDENTITY = ("project", "experiment_name", "global_steps", "sample", "session", "session_id", "uid")
_INT = re.compile(r"^-?[0-9]{1,18}$")  # an int64 written as text (RL-Insight sends sample and session as str)
_TASK_INPUTS = ("task_name", "image_ref", "prompt_hash")
_TASK_OUTPUT = ("status", "reward", "accuracy", "finished", "reward_posted", "error")
_GATEWAY_INPUTS = ("turn", "traj", "chain_id", "type", "tools")
_GATEWAY_OUTPUT = ("finish_reason", "prompt_tokens", "completion_tokens", "status", "error")


def is_protocol_span(span: dict[str, Any]) -> bool:
    """A span of the protocol: one of its three names with its ``monitor.trace_source``, and an experiment."""
    source = SOURCES.get(span["name"])
    attrs = span["attributes"]
    return source is not None and attrs.get("monitor.trace_source") == source and isinstance(attrs.get("experiment_name"), str)


def trajectory_id(attrs: dict[str, Any]) -> str:
    """The session's trace id: 32 hex from its identity (the same for every span of the session)."""
    key = "\x00".join(f"{k}={attrs.get(k, '')!s}" for k in _IDENTITY)
    return hashlib.sha256(("rl-insight agent loop\x00" + key).encode()).hexdigest()[:32]


def _as_int(value: Any) -> int | None:
    if type(value) is int:
        return value
    if isinstance(value, str) and _INT.match(value):
        return int(value)
    return None


def _failure(attrs: dict[str, Any]) -> str | None:
    error = attrs.get("error")
    if isinstance(error, str) and error:
        return error
    return "status: error" if attrs.get("status") == "error" else None


def adapt(translated: Translated) -> dict[str, tuple[str | None, str]]:
    """Turns the protocol's spans of one request into tracecar spans, in place (and adds a reward
    annotation per task); returns span id -> (destination project, worker) of every span it made."""
    made: dict[str, tuple[str | None, str]] = {}
    extra: list[tuple[int, dict[str, Any], str | None]] = []
    for i, span in enumerate(translated.spans):
        if not is_protocol_span(span):
            continue
        attrs = span["attributes"]
        old_id = span["span_id"]
        trace_id = trajectory_id(attrs)
        otel = attrs.pop("otel", None)
        attrs["rl_insight"] = {"otel": otel}
        step, sample, session = _as_int(attrs.get("global_steps")), attrs.get("sample"), _as_int(attrs.get("session"))
        if step is not None:
            attrs["step"] = step
        index = _as_int(sample)
        if index is not None or (isinstance(sample, str) and 0 < len(sample) <= 256):
            attrs["sample_index"] = index if index is not None else sample
        if session is not None:
            attrs["rollout_n"] = session
        if type(attrs.get("validate")) is not bool:  # the protocol has no validation flag: its sessions train
            attrs["validate"] = False
        span["trace_id"] = trace_id
        span["exception"] = span["exception"] or _failure(attrs)
        if span["name"] == SESSION:
            span["span_id"], span["parent_id"], span["kind"] = trace_id, None, "trajectory"
            span["output"] = {k: attrs[k] for k in ("status", "num_trajectories", "finished", "runner_name", "reward_source")
                              if k in attrs}
        else:
            span["span_id"], span["parent_id"] = trace_id[:16] + old_id[16:], trace_id
            if span["name"] == TASK:
                span["inputs"] = {k: attrs[k] for k in _TASK_INPUTS if k in attrs}
                span["output"] = {k: attrs[k] for k in _TASK_OUTPUT if k in attrs}
                reward = attrs.get("reward")
                if type(reward) in (int, float):
                    extra.append((i, _reward_annotation(span, attrs, reward), attrs.get("project")))
            else:
                span["inputs"] = {k: attrs[k] for k in _GATEWAY_INPUTS if k in attrs}
                content = attrs.get("content")
                span["output"] = {"response_text": content if isinstance(content, str) else "",
                                  **{k: attrs[k] for k in _GATEWAY_OUTPUT if k in attrs}}
        if old_id in translated.warnings:
            translated.warnings[span["span_id"]] = translated.warnings.pop(old_id)
        project = attrs.get("project")
        made[span["span_id"]] = (project if isinstance(project, str) and project else None,
                                 WORKER_PREFIX + (translated.services[i] or "rl_insight_monitor"))
    for i, note, _ in extra:
        translated.spans.append(note)
        translated.indices.append(translated.indices[i])
        translated.services.append(translated.services[i])
        made[note["span_id"]] = made[translated.spans[i]["span_id"]]
    return made


def _reward_annotation(task: dict[str, Any], attrs: dict[str, Any], reward: float) -> dict[str, Any]:
    """The task's reward as an annotation of its trajectory (what ``tracecar.client.annotate`` sends)."""
    values: dict[str, Any] = {"reward": reward}
    accuracy = attrs.get("accuracy")
    if type(accuracy) in (int, float):
        values["accuracy"] = accuracy
    for key in ("experiment_name", "step", "sample_index", "rollout_n", "validate"):
        if key in attrs:
            values[key] = attrs[key]
    end = task["end_time"] if task["end_time"] is not None else task["start_time"]
    return {"span_id": hashlib.sha256(("reward\x00" + task["span_id"]).encode()).hexdigest()[:32],
            "trace_id": task["trace_id"], "parent_id": None, "name": "annotation", "kind": "annotation",
            "start_time": end, "end_time": end, "attributes": values, "inputs": {}, "output": None, "exception": None}
