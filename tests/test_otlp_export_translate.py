"""tracecar spans → OTLP (GenAI conventions): the exporter's translation, read field by field and round-tripped."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest, ExportTraceServiceResponse

from tracecar.client import rollout_trace_attr, rollout_trace_op
from tracecar.collector.exporters.otlp_translate import span_id_bytes, to_otlp_request, to_otlp_span, trace_id_bytes
from tracecar.collector.receivers.otlp_translate import translate

TRACE = "73a3946399484862" + "0000000000000001"


def _attrs(span: Any) -> dict[str, Any]:
    from tracecar.collector.receivers.otlp_translate import attributes

    return attributes(span.attributes)


def _trajectory() -> list[dict[str, Any]]:
    base = {"trace_id": TRACE, "worker": "w1", "project": "grpo", "end_time": 12.0}
    attrs = {"step": 3, "sample_index": 1, "rollout_n": 0, "validate": False}
    return [
        {**base, "span_id": TRACE, "parent_id": None, "name": "agent_loop", "kind": "trajectory", "start_time": 10.0,
         "attributes": {**attrs, "reward": 0.5}, "inputs": {}, "output": None, "exception": None},
        {**base, "span_id": TRACE[:16] + "0000000000000002", "parent_id": TRACE, "name": "ToolAgentLoop.run", "kind": "op",
         "start_time": 10.1, "attributes": attrs, "inputs": {"x": 1},
         "output": {"prompt_ids": [1, 2], "response_ids": [3, 4, 5, 6]}, "exception": None},
        {**base, "span_id": TRACE[:16] + "0000000000000003", "parent_id": TRACE[:16] + "0000000000000002",
         "name": "LLMServerClient.generate", "kind": "op", "start_time": 10.2, "attributes": attrs,
         "inputs": {"prompt_ids": [1, 2]}, "output": {"token_ids": [3, 4], "prompt_text": "hi", "response_text": "yo",
                                                       "stop_reason": "stop"}, "exception": None},
        {**base, "span_id": "ffeeddccbbaa9988" + "0000000000000001", "parent_id": TRACE[:16] + "0000000000000002",
         "name": "CalculatorTool.execute", "kind": "op", "start_time": 10.3, "attributes": attrs,
         "inputs": {"parameters": {"expr": "1/0"}}, "output": None,
         "exception": "ZeroDivisionError: division by zero\nTraceback (most recent call last): ..."},
        {**base, "span_id": "ann-1", "parent_id": None, "name": "annotation", "kind": "annotation", "start_time": 13.0,
         "attributes": {"reward": 1.0}, "inputs": {}, "output": None, "exception": None},
    ]


def test_span_ids_are_unique_across_processes_and_stable_across_resends():
    assert trace_id_bytes(TRACE) == bytes.fromhex(TRACE)
    # two worker processes: the same counter under different random prefixes, each its own trajectory
    other_trace = "ffeeddccbbaa9988" + "0000000000000001"
    ours = [span_id_bytes(TRACE[:16] + f"{n:016x}", TRACE) for n in range(1, 2001)]
    theirs = [span_id_bytes(other_trace[:16] + f"{n:016x}", other_trace) for n in range(1, 2001)]
    assert len(set(ours) | set(theirs)) == 4000  # the counter alone repeated in every process
    assert all(len(i) == 8 and any(i) for i in ours + theirs)  # W3C: 8 bytes, not all zero
    assert bytes.fromhex("0000000000000001") not in ours
    # deterministic: a resend (or another collector) maps the same span to the same id
    assert span_id_bytes(TRACE[:16] + "00000000000000a1", TRACE) == span_id_bytes(TRACE[:16] + "00000000000000a1", TRACE)
    # a free-form id (another client) is unique per trace too
    assert span_id_bytes("s1", "trace-a") != span_id_bytes("s1", "trace-b")
    assert len(trace_id_bytes("free-form:id")) == 16 and len(span_id_bytes("free-form:id", "t")) == 8


def test_trajectory_becomes_genai_spans_without_content():
    request = to_otlp_request(_trajectory())
    [rs] = request.resource_spans
    assert {kv.key: kv.value.string_value for kv in rs.resource.attributes} == {"service.name": "tracecar"}
    spans = {s.name: s for s in rs.scope_spans[0].spans}
    assert set(spans) == {"agent_loop", "ToolAgentLoop.run", "LLMServerClient.generate", "CalculatorTool.execute"}
    root, run, gen, tool = (spans[n] for n in ("agent_loop", "ToolAgentLoop.run", "LLMServerClient.generate", "CalculatorTool.execute"))
    assert root.trace_id == bytes.fromhex(TRACE) and root.span_id == span_id_bytes(TRACE, TRACE) and root.parent_span_id == b""
    assert run.parent_span_id == root.span_id and gen.parent_span_id == run.span_id and tool.parent_span_id == run.span_id
    assert (root.start_time_unix_nano, root.end_time_unix_nano) == (10_000_000_000, 12_000_000_000)
    a = _attrs(root)
    assert a["gen_ai.operation.name"] == "invoke_agent" and a["gen_ai.conversation.id"] == TRACE
    assert (a["tracecar.step"], a["tracecar.sample_index"], a["tracecar.reward"], a["tracecar.worker"]) == (3, 1, 0.5, "w1")
    assert "gen_ai.operation.name" not in _attrs(run)  # token output, but it aggregates the turns: not a chat call
    g = _attrs(gen)
    assert (g["gen_ai.operation.name"], g["gen_ai.usage.input_tokens"], g["gen_ai.usage.output_tokens"]) == ("chat", 2, 2)
    assert g["gen_ai.response.finish_reasons"] == ["stop"]
    assert not any(k in g for k in ("gen_ai.input.messages", "gen_ai.output.messages", "tracecar.inputs", "tracecar.output"))
    t = _attrs(tool)
    assert (t["gen_ai.operation.name"], t["gen_ai.tool.name"]) == ("execute_tool", "CalculatorTool")
    assert tool.status.code == 2 and tool.status.message == "ZeroDivisionError: division by zero"
    [event] = tool.events
    ev = {kv.key: kv.value.string_value for kv in event.attributes}
    assert event.name == "exception" and ev["exception.type"] == "ZeroDivisionError" and ev["exception.message"] == "division by zero"
    assert ev["exception.stacktrace"].startswith("Traceback")
    assert all(s.kind == 1 for s in spans.values())


def test_content_is_sent_only_when_asked():
    gen = next(s for s in _trajectory() if s["name"] == "LLMServerClient.generate")
    a = _attrs(to_otlp_span(gen, content=True, max_content_chars=20, openinference=True))
    assert orjson.loads(a["gen_ai.input.messages"]) == [{"role": "user", "parts": [{"type": "text", "content": "hi"}]}]
    assert orjson.loads(a["gen_ai.output.messages"]) == [{"role": "assistant", "parts": [{"type": "text", "content": "yo"}],
                                                          "finish_reason": "stop"}]
    assert a["input.value"] == '{"prompt_ids":[1,2]}' and a["input.mime_type"] == "application/json"
    assert a["output.value"].startswith('{"token_ids":[3,4],"') and "truncated by tracecar" in a["output.value"]
    assert a["openinference.span.kind"] == "LLM"
    off = _attrs(to_otlp_span(gen, content=False, openinference=True))
    assert "input.value" not in off and "output.value" not in off and off["llm.token_count.completion"] == 2


def test_openinference_kinds_inputs_outputs_and_token_counts():
    """Phoenix's columns: AGENT for the root and the agent loop's run, LLM for generate (also when it
    raised), TOOL only for a real tool call, CHAIN otherwise (a helper named like a tool, an engine span)."""
    spans = _trajectory()
    run = spans[1]
    failed_generate = {**spans[2], "span_id": TRACE[:16] + "0000000000000005", "output": None,
                       "exception": "RuntimeError: engine died\nTraceback ..."}
    helper = {**spans[2], "span_id": TRACE[:16] + "0000000000000006", "name": "ToolAgentLoop._format_tool_response",
              "inputs": {"text": "4"}, "output": "<tool_response>4</tool_response>"}
    lookup = {**helper, "span_id": TRACE[:16] + "0000000000000007", "name": "SearchTool.lookup", "output": ["a"]}
    parser = {**helper, "span_id": TRACE[:16] + "0000000000000008", "name": "HermesToolParser.extract_tool_calls",
              "output": [[], "text"]}
    marked = {**spans[2], "attributes": {**spans[2]["attributes"], "tracecar": {"root": TRACE, "turn": TRACE}}}
    request = to_otlp_request([spans[0], run, marked, spans[3], failed_generate, helper, lookup, parser],
                              content=True, openinference=True)
    got = {s.name + ("!" if s.status.code == 2 and s.name.endswith("generate") else ""): _attrs(s)
           for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans}
    kinds = {name: a["openinference.span.kind"] for name, a in got.items()}
    assert kinds == {"agent_loop": "AGENT", "ToolAgentLoop.run": "AGENT", "LLMServerClient.generate": "LLM",
                     "CalculatorTool.execute": "TOOL", "LLMServerClient.generate!": "LLM",
                     "ToolAgentLoop._format_tool_response": "CHAIN", "SearchTool.lookup": "CHAIN",
                     "HermesToolParser.extract_tool_calls": "CHAIN"}
    for name, a in got.items():  # every span: input and output as JSON
        assert a["input.mime_type"] == a["output.mime_type"] == "application/json", name
        orjson.loads(a["input.value"]), orjson.loads(a["output.value"])
        assert "tracecar.tracecar" not in a and "tracecar" not in a  # the place mark is internal
    root = got["agent_loop"]
    assert orjson.loads(root["input.value"]) == {"step": 3, "sample_index": 1, "rollout_n": 0, "validate": False}
    assert orjson.loads(root["output.value"]) == {"status": "OK", "reward": 0.5}
    gen = got["LLMServerClient.generate"]
    assert (gen["llm.token_count.prompt"], gen["llm.token_count.completion"], gen["llm.token_count.total"]) == (2, 2, 4)
    failed = got["LLMServerClient.generate!"]
    assert orjson.loads(failed["output.value"]) == {"error": "RuntimeError: engine died"}
    assert failed["gen_ai.operation.name"] == "chat"
    assert got["CalculatorTool.execute"]["tool.name"] == "CalculatorTool"
    assert "gen_ai.operation.name" not in got["SearchTool.lookup"] and "gen_ai.operation.name" not in got["ToolAgentLoop._format_tool_response"]


def test_a_span_received_over_otlp_goes_back_out_as_it_came_under_its_parents_exported_id():
    received = ExportTraceServiceRequest()
    rs = received.resource_spans.add()
    rs.resource.attributes.add(key="service.name").value.string_value = "vllm"
    ss = rs.scope_spans.add()
    ss.scope.name, ss.scope.version = "vllm.llm_engine", "0.11"
    span = ss.spans.add(trace_id=bytes.fromhex(TRACE), span_id=bytes.fromhex("a2c4e6f8a2c4e6f8"),
                        parent_span_id=bytes.fromhex(TRACE[16:]), name="llm_request", kind=2,
                        start_time_unix_nano=5, end_time_unix_nano=9)
    span.attributes.add(key="gen_ai.usage.prompt_tokens").value.int_value = 7
    span.status.code = 2
    [stored] = translate(received).spans
    stored = {**stored, "worker": "w1"}
    again = to_otlp_request([stored])
    [out_rs] = again.resource_spans
    assert out_rs.resource == rs.resource and out_rs.scope_spans[0].scope == ss.scope
    [out] = out_rs.scope_spans[0].spans
    # its parent (the tracecar span its traceparent named) leaves under the id that span leaves with
    assert (out.trace_id, out.parent_span_id, out.kind, out.status.code) == (span.trace_id, span_id_bytes(TRACE, TRACE), 2, 2)
    assert out.span_id == span_id_bytes(TRACE[:16] + "a2c4e6f8a2c4e6f8", TRACE) != span.span_id
    assert _attrs(out)["gen_ai.usage.prompt_tokens"] == 7 and "otel" not in _attrs(out)
    engine = _attrs(to_otlp_request([stored], openinference=True).resource_spans[0].scope_spans[0].spans[0])
    assert engine["openinference.span.kind"] == "CHAIN"  # its generate is the LLM call: tokens counted once
    assert orjson.loads(engine["input.value"]) == {"usage.prompt_tokens": 7}
    assert orjson.loads(engine["output.value"]) == {"error": "ERROR"}


def test_round_trip_through_a_collector_keeps_the_tree(start_collector, tracer_to):
    """A collector exporting to another collector's /v1/traces: the trace id and every parent link
    survive (span ids are the exported ones, derived the same way wherever they are computed)."""
    source = start_collector()
    tracer = tracer_to(source.url)

    @rollout_trace_op
    def generate(prompt_ids: list[int]) -> dict[str, Any]:
        return {"prompt_ids": prompt_ids, "response_ids": [9, 9]}

    @rollout_trace_op
    def run() -> str:
        generate([1, 2])
        generate([1, 2, 9, 9, 3])
        return "ok"

    with rollout_trace_attr(sample_index=0, step=1) as root:
        run()
    assert tracer.flush(10)
    rows = source.collector.spool.query("SELECT payload FROM spans WHERE trace_id = ?", [root.span_id])
    spans = [orjson.loads(r["payload"]) for r in rows]
    assert len(spans) == 4
    sink = start_collector()
    r = httpx.post(sink.url + "/v1/traces", content=to_otlp_request(spans, content=True).SerializeToString(),
                   headers={"Content-Type": "application/x-protobuf"}, timeout=10)
    assert r.status_code == 200 and ExportTraceServiceResponse.FromString(r.content).partial_success.rejected_spans == 0
    back = {r["span_id"]: r for r in sink.collector.spool.query("SELECT span_id, trace_id, parent_id, name FROM spans")}
    exported = {s["span_id"]: root.span_id[:16] + span_id_bytes(s["span_id"], s["trace_id"]).hex() for s in spans}
    assert {(exported[s["span_id"]], s["trace_id"], exported.get(s["parent_id"]), s["name"]) for s in spans} == \
        {(b["span_id"], b["trace_id"], b["parent_id"], b["name"]) for b in back.values()}
    tree = httpx.get(f"{sink.url}/v1/trajectories/{root.span_id}", timeout=10).json()
    assert tree["root"]["span_id"] == exported[root.span_id] and tree["span_count"] == 4


# Qwen2.5's chat template as it renders a multi-turn tool conversation (VERL's default tool
# parser is Hermes: the model's tool calls are <tool_call> JSON, tool results <tool_response>)
QWEN_PROMPT = ("<|im_start|>system\nYou are a calculator.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
               "<|im_start|>assistant\nLet me add.\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 2, \"b\": 3}}\n"
               "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
               "<|im_start|>assistant\n")


def _generate(inputs: dict[str, Any], output: dict[str, Any]) -> dict[str, Any]:
    gen = next(s for s in _trajectory() if s["name"] == "LLMServerClient.generate")
    return {**gen, "inputs": inputs, "output": {"token_ids": [3, 4], **output}}


def test_input_messages_carry_the_whole_conversation_in_the_semconv_shape():
    """gen_ai.input.messages: every turn the model read (semconv's gen-ai-input-messages.json:
    role system/user/assistant/tool, typed parts), from the templated prompt; Phoenix's
    llm.input_messages the same conversation."""
    span = _generate({"prompt_ids": [1, 2]}, {"prompt_text": QWEN_PROMPT, "response_text": "It is 5.<|im_end|>",
                                              "finish_reason": "stop"})
    a = _attrs(to_otlp_span(span, content=True, openinference=True))
    assert orjson.loads(a["gen_ai.input.messages"]) == [
        {"role": "system", "parts": [{"type": "text", "content": "You are a calculator."}]},
        {"role": "user", "parts": [{"type": "text", "content": "What is 2+3?"}]},
        {"role": "assistant", "parts": [{"type": "text", "content": "Let me add."},
                                        {"type": "tool_call", "name": "add", "arguments": {"a": 2, "b": 3}}]},
        {"role": "tool", "parts": [{"type": "tool_call_response", "response": "5"}]},
    ]
    assert orjson.loads(a["gen_ai.output.messages"]) == [
        {"role": "assistant", "parts": [{"type": "text", "content": "It is 5."}], "finish_reason": "stop"}]
    assert [a[f"llm.input_messages.{i}.message.role"] for i in range(4)] == ["system", "user", "assistant", "tool"]
    assert "llm.input_messages.4.message.role" not in a
    assert a["llm.input_messages.2.message.content"] == "Let me add."
    assert a["llm.input_messages.2.message.tool_calls.0.tool_call.function.name"] == "add"
    assert orjson.loads(a["llm.input_messages.2.message.tool_calls.0.tool_call.function.arguments"]) == {"a": 2, "b": 3}
    assert a["llm.input_messages.3.message.content"] == "5"
    assert (a["llm.output_messages.0.message.role"], a["llm.output_messages.0.message.content"]) == ("assistant", "It is 5.")
    off = _attrs(to_otlp_span(span, content=False, openinference=True))
    assert not [k for k in off if k.startswith(("gen_ai.input", "gen_ai.output", "llm.input_messages", "llm.output_messages"))]


def test_messages_the_call_was_given_win_over_its_prompt_text_and_tool_calls_come_out_as_parts():
    """An OpenAI-style call (messages in its inputs, tool calls and results with ids); a response
    that is a Hermes tool call."""
    messages = [{"role": "system", "content": "sys"},
                {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "u"}}]},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 1}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "2"}]
    span = _generate({"kwargs": {"messages": messages}}, {
        "prompt_text": "ignored", "response_text": '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call><|im_end|>'})
    a = _attrs(to_otlp_span(span, content=True, openinference=True))
    assert orjson.loads(a["gen_ai.input.messages"]) == [
        {"role": "system", "parts": [{"type": "text", "content": "sys"}]},
        {"role": "user", "parts": [{"type": "text", "content": "look"}, {"type": "image_url", "image_url": {"url": "u"}}]},
        {"role": "assistant", "parts": [{"type": "tool_call", "name": "add", "arguments": {"a": 1}, "id": "c1"}]},
        {"role": "tool", "parts": [{"type": "tool_call_response", "response": "2", "id": "c1"}]},
    ]
    assert orjson.loads(a["gen_ai.output.messages"]) == [
        {"role": "assistant", "parts": [{"type": "tool_call", "name": "add", "arguments": {"a": 2}}]}]
    assert a["llm.input_messages.3.message.tool_call_id"] == "c1"
    assert a["llm.output_messages.0.message.tool_calls.0.tool_call.function.name"] == "add"
    # text in no known template, and a tool call that is not JSON: as they are
    span = _generate({"prompt_ids": [1]}, {"prompt_text": "plain <b>", "response_text": "<tool_call>oops</tool_call>"})
    a = _attrs(to_otlp_span(span, content=True))
    assert orjson.loads(a["gen_ai.input.messages"]) == [{"role": "user", "parts": [{"type": "text", "content": "plain <b>"}]}]
    assert orjson.loads(a["gen_ai.output.messages"])[0]["parts"] == [{"type": "text", "content": "<tool_call>oops</tool_call>"}]


def test_each_message_part_is_cut_at_the_content_bound():
    span = _generate({"prompt_ids": [1]}, {"prompt_text": QWEN_PROMPT.replace("What is 2+3?", "x" * 50),
                                           "response_text": "y" * 50})
    a = _attrs(to_otlp_span(span, content=True, max_content_chars=20, openinference=True))
    [_, user, *_] = orjson.loads(a["gen_ai.input.messages"])
    assert user["parts"][0]["content"] == "x" * 20 + "…[truncated by tracecar: 30 chars]"
    assert orjson.loads(a["gen_ai.output.messages"])[0]["parts"][0]["content"] == "y" * 20 + "…[truncated by tracecar: 30 chars]"
    assert a["llm.input_messages.1.message.content"] == user["parts"][0]["content"]


def test_an_llm_call_that_raised_still_shows_the_messages_it_was_given():
    span = {**_generate({"messages": [{"role": "user", "content": "hi"}]}, {}), "output": None,
            "exception": "RuntimeError: engine dead"}
    a = _attrs(to_otlp_span(span, content=True, openinference=True))
    assert a["openinference.span.kind"] == "LLM" and a["gen_ai.operation.name"] == "chat"
    assert orjson.loads(a["gen_ai.input.messages"]) == [{"role": "user", "parts": [{"type": "text", "content": "hi"}]}]
    assert a["llm.input_messages.0.message.content"] == "hi" and "gen_ai.output.messages" not in a
    token_ids_only = {**span, "inputs": {"prompt_ids": [1, 2]}}  # nothing decoded: no conversation is made up
    assert not [k for k in _attrs(to_otlp_span(token_ids_only, content=True, openinference=True)) if "messages" in k]
