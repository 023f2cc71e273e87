"""A trajectory's chat: where agent loops record their messages, and chat templates undone.

Two readers need the conversation a trajectory started from (the dataset export, the viewer's
previews), and two places hold it:

* the recorded inputs of a traced call. VERL's agent loops take the chat as ``**kwargs``
  (``ToolAgentLoop.run(self, sampling_params, priority=0, **kwargs)`` reads
  ``kwargs["raw_prompt"]``), and VERL, like Python's ``inspect``, binds the extra keywords under
  the ``**`` parameter's name: the chat is at ``inputs["kwargs"]["raw_prompt"]``. Other loops pass
  it as ``messages`` or under a name of their own: any input shaped like a list of
  ``{"role", "content"}`` messages counts. A numpy object array is recorded as its repr
  (as weave does); that text is read back when it is whole.
* only the decoded prompt, when no call recorded the chat (e.g. a loop that receives token
  ids). That text carries the model's chat template; :func:`parse_template` turns the common
  templates (ChatML, Llama 3, Gemma, Mistral / Llama 2 ``[INST]``, DeepSeek) back into messages,
  and :func:`strip_end` takes the end-of-turn token off a decoded response.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from typing import Any

CHAT_KEYS = ("raw_prompt", "messages")  # named first, in this order; then any chat-shaped input
MAX_REPR_CHARS = 1_000_000  # a repr longer than this is not parsed back
_ARRAY_REPR = re.compile(r"\Aarray\((\[.*\]),\s*dtype=object\)\Z", re.S)


def is_chat(value: Any) -> bool:
    """A non-empty list of messages: dicts with a text ``role`` and a ``content`` key."""
    return (isinstance(value, list) and bool(value)
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value))


def _as_chat(value: Any) -> list[dict[str, Any]] | None:
    if is_chat(value):
        return value
    if isinstance(value, str) and value.startswith("array([") and len(value) <= MAX_REPR_CHARS:
        match = _ARRAY_REPR.match(value)  # numpy's repr of an object array of dicts (weave's form)
        if match:
            try:
                parsed = ast.literal_eval(match.group(1))
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                return None
            return parsed if is_chat(parsed) else None
    return None


def _places(inputs: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The inputs, then every dict-valued input (a ``**kwargs`` bound under its parameter's name)."""
    yield inputs
    for value in inputs.values():
        if isinstance(value, dict):
            yield value


def chat_in(inputs: Any) -> list[dict[str, Any]] | None:
    """The chat a call was given: ``raw_prompt``, then ``messages``, then any chat-shaped input,
    at the top level of its inputs or one level down (``kwargs``)."""
    if not isinstance(inputs, dict):
        return None
    places = list(_places(inputs))
    for key in CHAT_KEYS:
        for place in places:
            chat = _as_chat(place.get(key))
            if chat is not None:
                return chat
    for place in places:
        for value in place.values():
            if isinstance(value, list) and is_chat(value):
                return value
    return None


# ---- chat templates ------------------------------------------------------------------------
# (compiled pattern of one message, group of the role, group of the content, name of the family);
# a template is recognised when its messages cover the whole text, apart from a begin-of-text
# token at the start and an open generation prompt at the end
_BOS = r"(?:<s>|<\|begin_of_text\|>|<bos>|<\|startoftext\|>|<｜begin▁of▁sentence｜>)?"
_TEMPLATES: tuple[tuple[re.Pattern[str], re.Pattern[str]], ...] = (
    # ChatML (Qwen, Yi, many others): <|im_start|>role\ncontent<|im_end|>\n
    (re.compile(r"<\|im_start\|>(?P<role>[^\n<]+)\n(?P<content>.*?)<\|im_end\|>\n?", re.S),
     re.compile(r"<\|im_start\|>assistant\n?\Z")),
    # Llama 3: <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>
    (re.compile(r"<\|start_header_id\|>(?P<role>[^<]+)<\|end_header_id\|>\n\n(?P<content>.*?)<\|eot_id\|>", re.S),
     re.compile(r"<\|start_header_id\|>assistant<\|end_header_id\|>\n*\Z")),
    # Gemma: <start_of_turn>role\ncontent<end_of_turn>\n (the model's role is "model")
    (re.compile(r"<start_of_turn>(?P<role>[^\n<]+)\n(?P<content>.*?)<end_of_turn>\n?", re.S),
     re.compile(r"<start_of_turn>model\n?\Z")),
)
_GEMMA_ROLES = {"model": "assistant"}
_INST = re.compile(r"\s*\[INST\]\s*(?P<user>.*?)\s*\[/INST\](?P<answer>.*?)(?:</s>|(?=\s*\[INST\])|\Z)", re.S)
_DEEPSEEK = re.compile(r"<｜(?P<role>User|Assistant)｜>(?P<content>.*?)(?=<｜(?:User|Assistant)｜>|<｜end▁of▁sentence｜>|\Z)", re.S)
#: tokens that end a turn in the common templates (left on a decoded response by token2text)
END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "</s>", "<|endoftext|>",
              "<｜end▁of▁sentence｜>", "<|end|>")


def _message(role: str, content: str) -> dict[str, Any]:
    return {"role": role, "content": content}


def _tagged(text: str, one: re.Pattern[str], open_end: re.Pattern[str]) -> list[dict[str, Any]] | None:
    position = len(re.match(_BOS, text).group(0))  # type: ignore[union-attr]
    messages = []
    for match in one.finditer(text, position):
        if match.start() != position:
            return None
        role = match.group("role").strip()
        messages.append(_message(_GEMMA_ROLES.get(role, role), match.group("content")))
        position = match.end()
    rest = text[position:]
    if not messages or (rest.strip() and not open_end.match(rest)):
        return None
    return messages


def _inst(text: str) -> list[dict[str, Any]] | None:
    """Mistral / Llama 2: ``<s>[INST] user [/INST] answer</s>[INST] …``; a system prompt is folded
    into the first user turn (Llama 2's ``<<SYS>>`` block is split back out)."""
    body = re.match(_BOS, text).group(0)  # type: ignore[union-attr]
    position, messages = len(body), []
    for match in _INST.finditer(text, position):
        if match.start() != position:
            return None
        user = match.group("user")
        system = re.match(r"<<SYS>>\n?(?P<system>.*?)\n?<</SYS>>\s*(?P<user>.*)\Z", user, re.S)
        if system:
            messages.append(_message("system", system.group("system")))
            user = system.group("user")
        messages.append(_message("user", user))
        if match.group("answer").strip():
            messages.append(_message("assistant", match.group("answer").strip()))
        position = match.end()
        while text.startswith("<s>", position):
            position += 3
    if not messages or text[position:].strip():
        return None
    return messages


def _deepseek(text: str) -> list[dict[str, Any]] | None:
    """DeepSeek V3 / R1: ``<｜begin▁of▁sentence｜>system<｜User｜>q<｜Assistant｜>a<｜end▁of▁sentence｜>``."""
    start = len(re.match(_BOS, text).group(0))  # type: ignore[union-attr]
    first = text.find("<｜User｜>", start)
    if first < 0:
        return None
    messages = [_message("system", text[start:first])] if text[start:first] else []
    for match in _DEEPSEEK.finditer(text, first):
        content = match.group("content").replace("<｜end▁of▁sentence｜>", "")
        messages.append(_message(match.group("role").lower(), content))
    if messages and messages[-1]["role"] == "assistant" and messages[-1]["content"] == "":
        messages.pop()  # the open generation prompt
    return messages or None


def parse_template(text: str | None) -> list[dict[str, Any]] | None:
    """The messages a decoded, templated prompt was made from; None when no known template fits
    the whole text (the caller then keeps the text as it is)."""
    if not isinstance(text, str) or not text:
        return None
    for one, open_end in _TEMPLATES:
        messages = _tagged(text, one, open_end)
        if messages is not None:
            return messages
    if "[INST]" in text:
        return _inst(text)
    if "<｜User｜>" in text:
        return _deepseek(text)
    return None


def strip_end(text: str | None) -> str | None:
    """A decoded response without the end-of-turn token(s) the model emitted last."""
    if not isinstance(text, str):
        return text
    stripped = True
    while stripped:
        stripped = False
        for token in END_TOKENS:
            if text.endswith(token):
                text = text[: -len(token)]
                stripped = True
    return text


def last_user_message(text: str | None) -> str | None:
    """The question a templated prompt ends with: the content of its last user message, when the
    text ends with that message (and the open generation prompt) in a known template; else None.
    Works on a prompt's tail alone (the viewer stores long prompts as head and tail)."""
    if not isinstance(text, str) or not text:
        return None
    for one, open_end in _TEMPLATES:
        last = None
        for match in one.finditer(text):
            last = match
        if last is not None and last.group("role").strip() == "user":
            rest = text[last.end():]
            if not rest.strip() or open_end.match(rest):
                return last.group("content")
    if text.rstrip().endswith("[/INST]"):
        start = text.rfind("[INST]")
        if start >= 0:
            user = text[start + len("[INST]"): text.rstrip().rfind("[/INST]")]
            return re.sub(r"\A\s*<<SYS>>.*?<</SYS>>", "", user, flags=re.S).strip()
    if text.endswith("<｜Assistant｜>") and "<｜User｜>" in text:
        return text[text.rfind("<｜User｜>") + len("<｜User｜>"): -len("<｜Assistant｜>")]
    return None
