"""What a trajectory means to an RL engineer: turns, tool calls, reward and metrics.

The store holds generic spans; the viewer needs the conversation. One set of rules, used by
the trajectory index (per span, for sorting by turns), the trajectory page (per tree) and the
OTLP exporter (GenAI attributes), so it sits below both viewer/ and exporters/:

* an *LLM call* (one turn) is an op span whose output carries generated tokens
  (``response_ids`` / ``token_ids`` ids or a decoded ``response_text``) and that has no child
  spans; an op with token output *and* children is the agent loop aggregating its turns
  (VERL's ``ToolAgentLoop.run`` returns all ``response_ids``) and is not a turn;
* a *tool call* is an op span without token output whose method is a tool's entry point:
  ``execute`` (VERL's ``BaseTool.execute``), ``call_tool``/``run_tool``/``invoke_tool``/``execute_tool``,
  or ``__call__``/``call``/``run``/``invoke``/``forward`` (and their async forms) of a class whose
  name ends in ``Tool``; a helper whose name merely contains "tool" (``SearchTool.lookup``,
  ``format_tool_response``) or a tool *parser* is not one;
* the *reward* is the root's ``attributes.reward`` if numeric, else the latest annotation's
  (the same precedence as :mod:`spool.query`);
* an *engine span* is one that came in over OTLP (``attributes["otel"]``, e.g. vLLM's
  ``llm_request``): it never makes its parent an aggregate; under a turn it gives that turn's
  engine timings (queue, time to first token, prefill, decode, tokens).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson

RESPONSE_ID_KEYS = ("response_ids", "token_ids")
TOOL_METHODS = frozenset({"execute", "call_tool", "run_tool", "invoke_tool", "execute_tool", "acall_tool"})
# a *Tool class's own entry points (LangChain's BaseTool, smolagents' Tool, callables)
TOOL_CLASS_METHODS = frozenset({"__call__", "call", "acall", "run", "arun", "_run", "_arun", "invoke", "ainvoke", "forward"})


_JUST_INT = frozenset({int})


def int_list(value: Any) -> list[int] | None:
    """``value`` when it is a non-empty list of plain ints (every element checked: what is built
    from it, a token count or a typed column, depends on each of them; a bool is not one), else None."""
    if isinstance(value, list) and value and type(value[0]) is int and _JUST_INT.issuperset(map(type, value)):
        return value
    return None


def dict_or_empty(value: Any) -> dict[str, Any]:
    """``value`` if it is a dict, else a fresh empty one (a span's inputs or output may be anything)."""
    return value if isinstance(value, dict) else {}


def token_output(kind: str, output: Any) -> bool:
    """True when an op span's output carries generated tokens (ids or decoded text)."""
    if kind != "op" or not isinstance(output, dict):
        return False
    return isinstance(output.get("response_text"), str) or any(int_list(output.get(k)) is not None for k in RESPONSE_ID_KEYS)


def token_counts(span: dict[str, Any]) -> tuple[int | None, int | None]:
    """(prompt tokens, response tokens) of an LLM call; None where the ids were not sent."""
    output = dict_or_empty(span.get("output"))
    inputs = dict_or_empty(span.get("inputs"))
    prompt = int_list(output.get("prompt_ids")) or int_list(inputs.get("prompt_ids"))
    response = next((ids for ids in (int_list(output.get(k)) for k in RESPONSE_ID_KEYS) if ids is not None), None)
    return (len(prompt) if prompt else None), (len(response) if response else None)


def is_tool(kind: str, name: str, output: Any) -> bool:
    """A real tool call (the module docstring's rule), never a helper that merely names a tool."""
    if kind != "op" or token_output(kind, output):
        return False
    owner, _, method = name.lower().rpartition(".")
    if "pars" in name.lower():  # ToolParser.extract_tool_calls reads calls, it does not make one
        return False
    return method in TOOL_METHODS or (owner.rsplit(".", 1)[-1].endswith("tool") and method in TOOL_CLASS_METHODS)


# methods that ask a model for tokens: a call of one that raised (no output) is still an LLM call
LLM_METHODS = frozenset({"generate", "agenerate", "async_generate", "chat", "achat", "completion", "acompletion"})
AGENT_METHODS = frozenset({"run", "arun"})


def call_role(kind: str, name: str, output: Any, *, aggregates: bool, failed: bool = False) -> str:
    """What a tracecar span is to a GenAI backend: ``AGENT`` (a trajectory root, an agent loop's
    ``run``), ``LLM`` (an LLM call, also one that raised), ``TOOL`` (a real tool call,
    :func:`is_tool`) or ``CHAIN`` (anything else: parsers, helpers, aggregating calls)."""
    if kind == "trajectory":
        return "AGENT"
    if kind != "op":
        return "CHAIN"
    owner, _, method = name.lower().rpartition(".")
    cls = owner.rsplit(".", 1)[-1]
    if method in AGENT_METHODS and cls.endswith(("agentloop", "agent")):
        return "AGENT"
    if token_output(kind, output):
        return "AGENT" if aggregates else "LLM"
    if failed and output is None and not aggregates and method in LLM_METHODS:
        return "LLM"
    if is_tool(kind, name, output):
        return "TOOL"
    return "CHAIN"


# what the viewer shows of an engine span: vLLM's SpanAttributes names (vllm/tracing/utils.py)
ENGINE_TIMINGS = (
    ("queue_s", "gen_ai.latency.time_in_queue"), ("ttft_s", "gen_ai.latency.time_to_first_token"),
    ("prefill_s", "gen_ai.latency.time_in_model_prefill"), ("decode_s", "gen_ai.latency.time_in_model_decode"),
    ("inference_s", "gen_ai.latency.time_in_model_inference"), ("e2e_s", "gen_ai.latency.e2e"),
    ("prompt_tokens", "gen_ai.usage.prompt_tokens"), ("completion_tokens", "gen_ai.usage.completion_tokens"),
    ("request_id", "gen_ai.request.id"),
)


def is_engine(span: dict[str, Any]) -> bool:
    """True for a span received over OTLP (an inference engine's, or another producer's)."""
    return isinstance((span.get("attributes") or {}).get("otel"), dict)


def is_engine_payload(payload: bytes | None) -> bool:
    """:func:`is_engine` on a stored payload, parsing it only when it may be one."""
    if not payload or b'"otel":{' not in payload:
        return False
    try:
        span = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return False
    return isinstance(span, dict) and is_engine(span)


def own_children(span: dict[str, Any]) -> list[dict[str, Any]]:
    """The span's children minus engine spans (which never make a call an aggregate)."""
    return [c for c in span.get("children", ()) if not is_engine(c)]


def engine_timings(span: dict[str, Any]) -> dict[str, Any]:
    attrs = span.get("attributes") or {}
    out: dict[str, Any] = {"span_id": span.get("span_id"), "name": span.get("name"), "duration": _duration(span),
                           "error": span.get("exception")}
    for key, attribute in ENGINE_TIMINGS:
        if attrs.get(attribute) is not None:
            out[key] = attrs[attribute]
    return out


def numeric(value: Any) -> float | None:
    return float(value) if type(value) in (int, float) else None


def _walk(span: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every span of the tree, depth-first in child order; iterative, so no depth is too deep."""
    stack = [span]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(node.get("children", ())))


def _duration(span: dict[str, Any]) -> float | None:
    start, end = span.get("start_time"), span.get("end_time")
    return end - start if isinstance(start, (int, float)) and isinstance(end, (int, float)) else None


def _new_context(prompt: str | None, previous: dict[str, Any] | None) -> str | None:
    """The part of a turn's prompt the previous turn had not seen (e.g. the tool responses)."""
    if prompt is None or previous is None:
        return prompt
    for seen in ((previous.get("prompt_text") or "") + (previous.get("response_text") or ""), previous.get("prompt_text") or ""):
        if seen and prompt.startswith(seen):
            return prompt[len(seen):]
    return prompt


def _arguments(inputs: Any) -> Any:
    if isinstance(inputs, dict) and isinstance(inputs.get("parameters"), dict):
        return inputs["parameters"]
    return inputs


def decode_problem(span: dict[str, Any]) -> str | None:
    """Why this span has no decoded text, from the warning the collector stored with it."""
    for warning in span.get("warnings") or []:
        if isinstance(warning, str) and (warning.startswith("tokenizer:") or "decode failed" in warning):
            return warning
    return None


def shape(tree: dict[str, Any]) -> dict[str, Any]:
    """The conversation view of one :func:`store_query.get_trajectory` result."""
    root = tree["root"]
    spans = [s for s in _walk(root) if s is not root]
    turns: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    in_turns: set[str] = set()
    for span in spans:
        kind, name, output = span.get("kind", ""), span.get("name", ""), span.get("output")
        base = {"span_id": span["span_id"], "name": name, "start_time": span.get("start_time"),
                "duration": _duration(span), "error": span.get("exception")}
        if is_engine(span):
            if span["span_id"] not in in_turns and not own_children(span):
                events.append({**base, "type": "engine", "engine": engine_timings(span)})
        elif token_output(kind, output) and not own_children(span):
            assert isinstance(output, dict)  # token_output says so
            prompt_tokens, response_tokens = token_counts(span)
            engine = [c for c in span.get("children", ()) if is_engine(c)]
            in_turns.update(c["span_id"] for c in engine)
            turns.append({**base, "prompt_text": output.get("prompt_text"), "response_text": output.get("response_text"),
                          "prompt_tokens": prompt_tokens, "response_tokens": response_tokens,
                          "stop_reason": output.get("stop_reason", output.get("finish_reason")),
                          "engine": [engine_timings(c) for c in engine],
                          "decode_problem": decode_problem(span)})
        elif is_tool(kind, name, output):
            events.append({**base, "type": "tool", "arguments": _arguments(span.get("inputs")), "result": output})
        elif kind == "op" and not own_children(span):
            events.append({**base, "type": "op", "arguments": span.get("inputs"), "result": output})
    turns.sort(key=lambda t: t["start_time"] or 0)
    events.sort(key=lambda e: e["start_time"] or 0)
    previous = None
    for number, turn in enumerate(turns, 1):
        turn["index"] = number
        turn["new_context"] = _new_context(turn["prompt_text"], previous)
        turn["after"] = []
        previous = turn
    before: list[dict[str, Any]] = []
    for event in events:  # each tool call belongs to the last turn that started before it
        owner = None
        for turn in turns:
            if (turn["start_time"] or 0) <= (event["start_time"] or 0):
                owner = turn
        (owner["after"] if owner is not None else before).append(event)
    reward, metrics = _reward_and_metrics(root, spans, tree.get("annotations", []))
    tools = [e for e in events if e["type"] == "tool"]
    attributes = root.get("attributes") or {}
    return {
        "trace_id": tree["trace_id"],
        "name": root.get("name"),
        "attributes": attributes,
        "kept_because": attributes.get("kept_because"),
        "root_received": root.get("kind") != "missing",
        "start_time": root.get("start_time"),
        "duration": _duration(root),
        "error": root.get("exception"),
        "reward": reward,
        "metrics": metrics,
        "annotations": [{"span_id": a["span_id"], "start_time": a.get("start_time"), "values": a.get("attributes") or {}}
                        for a in tree.get("annotations", [])],
        "span_count": tree.get("span_count"),
        "has_error": any(s.get("exception") for s in _walk(root)),
        "turn_count": len(turns),
        "tool_calls": len(tools),
        "tool_errors": sum(1 for t in tools if t["error"]),
        "response_tokens": sum(t["response_tokens"] or 0 for t in turns),
        "before_first_turn": before,
        "turns": turns,
    }


def _reward_and_metrics(root: dict[str, Any], spans: list[dict[str, Any]],
                        annotations: list[dict[str, Any]]) -> tuple[float | None, list[dict[str, Any]]]:
    metrics: list[dict[str, Any]] = []
    reward = numeric((root.get("attributes") or {}).get("reward"))
    annotated = None
    for note in annotations:  # stored oldest first: the latest value wins
        values = note.get("attributes") or {}
        if numeric(values.get("reward")) is not None:
            annotated = numeric(values["reward"])
        for key, value in values.items():
            if key != "reward":
                metrics.append({"source": "annotation", "key": key, "value": value})
    for span in spans:
        output = span.get("output")
        if isinstance(output, dict) and own_children(span):
            if isinstance(output.get("metrics"), dict):
                metrics.extend({"source": span["name"], "key": k, "value": v} for k, v in output["metrics"].items())
            for key in ("num_turns", "reward_score"):
                if output.get(key) is not None:
                    metrics.append({"source": span["name"], "key": key, "value": output[key]})
    return (reward if reward is not None else annotated), metrics
