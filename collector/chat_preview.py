"""The last user message of a chat-templated prompt, for one-line previews.

A decoded RL prompt is the whole chat template: a system prompt (the same in every row) and the
template's tokens, then the question. A list that shows the prompt's first or last characters
shows the system prompt or the generation prompt (``<|im_start|>assistant``), the same in every
row. What tells rows apart is the last user message, so that is what a preview shows.

Known templates: ChatML (Qwen, ``<|im_start|>user … <|im_end|>``), Llama 3 (header ids),
DeepSeek V3/R1 (``<｜User｜>`` … ``<｜Assistant｜>``), Gemma (``<start_of_turn>user``), Mistral and
Llama 2 (``[INST] … [/INST]``, ``<<SYS>>`` stripped), Phi-3 / Zephyr (``<|user|>``). Gemma's templates
fold a system prompt into the first user turn, so there a one-turn prompt's preview begins with it. Text in no
known template is returned unchanged by :func:`last_user_message` (None). Pure string work on a
bounded text: cheap enough for every row of a list page.
"""

from __future__ import annotations

import re

# (user turn start, end of that turn): the end is the template's end-of-turn token or the next turn's start
TEMPLATES: tuple[tuple[str, re.Pattern[str], re.Pattern[str]], ...] = (
    ("chatml", re.compile(r"<\|im_start\|>user[^\S\n]*\n?"), re.compile(r"<\|im_end\|>|<\|im_start\|>")),
    ("llama3", re.compile(r"<\|start_header_id\|>user<\|end_header_id\|>\s*"), re.compile(r"<\|eot_id\|>|<\|start_header_id\|>")),
    ("deepseek", re.compile(r"<｜User｜>"), re.compile(r"<｜Assistant｜>|<｜end▁of▁sentence｜>|<｜User｜>|<｜tool▁")),
    ("gemma", re.compile(r"<start_of_turn>user\s*"), re.compile(r"<end_of_turn>|<start_of_turn>")),
    ("inst", re.compile(r"\[INST\]\s*"), re.compile(r"\[/INST\]|\[INST\]")),
    ("phi", re.compile(r"<\|user\|>\s*"), re.compile(r"<\|end\|>|</s>|<\|assistant\|>|<\|system\|>|<\|user\|>|<\|endoftext\|>")),
)
_SYS_BLOCK = re.compile(r"<<SYS>>.*?<</SYS>>\s*", re.S)  # Llama 2's system prompt inside the first [INST]
_SPECIAL = re.compile(r"<\|[^|<>\s]{1,40}\|>|<｜[^｜<>\s]{1,40}｜>|</?s>")  # leftover template tokens
_TOOL_ONLY = re.compile(r"^\s*<tool_response>.*</tool_response>\s*$", re.S)  # Qwen: tool results in a user turn


def user_messages(text: str) -> tuple[str | None, list[str]]:
    """(the template's name, its user messages in order, template tokens stripped); (None, []) if none is known."""
    for name, start, end in TEMPLATES:
        starts = list(start.finditer(text))
        if not starts:
            continue
        messages = []
        for found in starts:
            rest = text[found.end():]
            stop = end.search(rest)
            body = rest[:stop.start()] if stop else rest
            if name == "inst":
                body = _SYS_BLOCK.sub("", body)
            messages.append(_SPECIAL.sub("", body).strip())
        return name, messages
    return None, []


def last_user_message(text: str | None) -> str | None:
    """The last user message that is not only a tool result; None when the text follows no known template."""
    if not text:
        return None
    _, messages = user_messages(text)
    asked = [m for m in messages if m and not _TOOL_ONLY.match(m)]
    if asked:
        return asked[-1]
    return next((m for m in reversed(messages) if m), None)


def prompt_preview(text: str | None, chars: int) -> str | None:
    """One line of at most ``chars`` (+ an ellipsis): the last user message's beginning (where the question
    is), or, for a text in no known template, its end; whitespace collapsed."""
    if text is None:
        return None
    message = last_user_message(text)
    if message is None:
        return text if len(text) <= chars else "…" + text[-chars:]
    line = " ".join(message.split())
    return line if len(line) <= chars else line[:chars].rstrip() + "…"
