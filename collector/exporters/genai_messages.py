"""An LLM call's conversation as OpenTelemetry GenAI messages (``gen_ai.input.messages`` / ``output.messages``).

The semantic conventions (``gen-ai-input-messages.json``) make each message ``{"role", "parts"}``
with role ``system`` / ``user`` / ``assistant`` / ``tool`` and typed parts: ``text`` (``content``),
``tool_call`` (``id``, ``name``, ``arguments``) and ``tool_call_response`` (``id``, ``response``).
Backends read them as the call's conversation (MLflow's OTLP ingest shows them as a chat span's
inputs and outputs), so one user message holding the whole templated prompt, as sent before,
shows a wall of template tokens instead of the turns the model saw.

Where the conversation comes from, best first: messages the call itself was given (an
OpenAI-style ``messages`` input, see :func:`..chat.chat_in`); else the decoded prompt with its
chat template undone (:func:`..chat.parse_template`: the system prompt, the user turn, earlier
assistant turns and tool results up to this call, exactly what the model read); else the prompt
text as one user message. Hermes-style tool calls (``<tool_call>{json}</tool_call>`` in an
assistant turn, VERL's default parser) and tool results (``<tool_response>…</tool_response>``,
which Qwen's template renders as a user turn) become ``tool_call`` / ``tool`` parts.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from ..chat import chat_in, parse_template, strip_end

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_TOOL_RESPONSE = re.compile(r"\s*<tool_response>\s*(.*?)\s*</tool_response>\s*", re.S)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else orjson.dumps(value, default=str).decode()


def _arguments(value: Any) -> Any:
    """OpenAI sends arguments as JSON text: shown as the object it is."""
    if isinstance(value, str):
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError:
            return value
    return value


def _content_parts(content: Any) -> list[dict[str, Any]]:
    """A message's content as parts: text; an OpenAI content list item by item; Hermes tool calls."""
    if content is None:
        return []
    if isinstance(content, list):
        out: list[dict[str, Any]] = []
        for item in content:
            if isinstance(item, dict) and item.get("type") == "text" and isinstance(item.get("text"), str):
                out += _content_parts(item["text"])
            elif isinstance(item, dict) and isinstance(item.get("type"), str):
                out.append(dict(item))  # an image, audio…: a generic part, as it came
            else:
                out.append({"type": "text", "content": _text(item)})
        return out
    text = _text(content)
    parts: list[dict[str, Any]] = []
    position = 0
    for match in _TOOL_CALL.finditer(text):
        try:
            call = orjson.loads(match.group(1))
        except orjson.JSONDecodeError:
            continue  # not a tool call the parser could read either: stays text
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            continue
        if text[position:match.start()].strip():
            parts.append({"type": "text", "content": text[position:match.start()].strip()})
        parts.append({"type": "tool_call", "name": call["name"], "arguments": _arguments(call.get("arguments"))})
        position = match.end()
    rest = text[position:] if parts else text
    if rest.strip() or not parts:
        parts.append({"type": "text", "content": rest.strip() if parts else rest})
    return parts


def _tool_responses(content: Any) -> list[str] | None:
    """The tool results a user turn consists of (Qwen's template renders tool messages so); else None."""
    if not isinstance(content, str) or "<tool_response>" not in content:
        return None
    matches = list(_TOOL_RESPONSE.finditer(content))
    if not matches or "".join(m.group(0) for m in matches) != content:
        return None
    return [m.group(1) for m in matches]


def to_genai(message: dict[str, Any]) -> dict[str, Any]:
    """One chat message (``{"role", "content"}``, OpenAI's ``tool_calls`` / ``tool_call_id``) in the semconv shape."""
    role = str(message.get("role"))
    content = message.get("content")
    if role == "tool":
        part: dict[str, Any] = {"type": "tool_call_response", "response": content}
        if isinstance(message.get("tool_call_id"), str):
            part["id"] = message["tool_call_id"]
        return {"role": "tool", "parts": [part]}
    responses = _tool_responses(content) if role == "user" else None
    if responses is not None:
        return {"role": "tool", "parts": [{"type": "tool_call_response", "response": r} for r in responses]}
    parts = _content_parts(content)
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            part = {"type": "tool_call", "name": function["name"], "arguments": _arguments(function.get("arguments"))}
            if isinstance(call.get("id"), str):
                part["id"] = call["id"]
            parts.append(part)
    out: dict[str, Any] = {"role": role, "parts": parts}
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    return out


def _bounded(messages: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    """Each part's text (``content``, a tool's ``response``) cut at ``limit`` characters, marked as
    ``input.value`` is: the same bound as the rest of an exported span's content."""
    for message in messages:
        for part in message["parts"]:
            for key in ("content", "response"):
                text = part.get(key)
                if isinstance(text, str) and len(text) > limit:
                    part[key] = text[:limit] + f"…[truncated by tracecar: {len(text) - limit} chars]"
    return messages


def input_messages(inputs: Any, prompt_text: Any, limit: int = 1_000_000) -> list[dict[str, Any]] | None:
    """The conversation an LLM call was given, in the semconv shape; None when it recorded none."""
    chat = chat_in(inputs)
    if chat is None and isinstance(prompt_text, str):
        chat = parse_template(prompt_text) or [{"role": "user", "content": prompt_text}]
    return _bounded([to_genai(m) for m in chat], limit) if chat else None


def output_messages(response_text: Any, finish_reason: Any, limit: int = 1_000_000) -> list[dict[str, Any]] | None:
    """What the call generated: one assistant message, its end-of-turn token off, tool calls as parts."""
    if not isinstance(response_text, str):
        return None
    message = to_genai({"role": "assistant", "content": strip_end(response_text)})
    if isinstance(finish_reason, str):
        message["finish_reason"] = finish_reason
    return _bounded([message], limit)


def openinference_messages(prefix: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The same messages as OpenInference's flat attributes (``llm.input_messages.0.message.role`` …),
    what Phoenix's UI lists as an LLM span's conversation: text parts joined as the content, tool
    calls as ``message.tool_calls``, each tool result as one ``tool`` message."""
    out: dict[str, Any] = {}
    index = 0

    def put(key: str, value: Any) -> None:
        out[f"{prefix}.{index}.message.{key}"] = value

    for message in messages:
        parts = message.get("parts") or []
        responses = [p for p in parts if p.get("type") == "tool_call_response"]
        for part in responses:
            put("role", "tool")
            put("content", _text(part.get("response")))
            if isinstance(part.get("id"), str):
                put("tool_call_id", part["id"])
            index += 1
        if responses and len(responses) == len(parts):
            continue
        put("role", message.get("role"))
        texts = [p["content"] for p in parts if p.get("type") == "text" and isinstance(p.get("content"), str)]
        if texts:
            put("content", "\n".join(texts))
        calls = [p for p in parts if p.get("type") == "tool_call"]
        for number, call in enumerate(calls):
            base = f"tool_calls.{number}.tool_call"
            put(f"{base}.function.name", call["name"])
            put(f"{base}.function.arguments", _text(call.get("arguments")))
            if isinstance(call.get("id"), str):
                put(f"{base}.id", call["id"])
        index += 1
    return out
