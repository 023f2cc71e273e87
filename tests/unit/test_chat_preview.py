"""The list's prompt preview is the last user message of a chat-templated prompt (issue 31, item 3),
checked on prompts rendered by real models' chat templates (tests/fixtures/chat_templates, from TRL)."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tracecar.collector.chat_preview import last_user_message, prompt_preview, user_messages

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
SPECIAL = {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}
BOS = {"llama3_1": "<|begin_of_text|>", "gemma3": "<bos>", "phi3": "<s>", "qwen2_5": "", "qwen3": ""}
SYSTEM = "You are a careful math tutor. Think step by step and put the final answer after ####. " * 3


def render(template: str, messages: list[dict[str, Any]]) -> str:
    """As transformers' apply_chat_template renders (sandboxed jinja2, trim_blocks, lstrip_blocks)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime(2026, 1, 1).strftime(fmt))
    name = template.removesuffix(".jinja")
    tokens = {**SPECIAL, "bos_token": BOS.get(name, SPECIAL["bos_token"])}
    return env.from_string((TEMPLATES / template).read_text()).render(messages=messages, add_generation_prompt=True, **tokens)


ALL = sorted(p.name for p in TEMPLATES.glob("*.jinja"))


@pytest.mark.parametrize("template", ALL)
def test_the_question_of_a_real_template_is_the_preview(template: str) -> None:
    system = [] if template == "gemma3.jinja" else [{"role": "system", "content": SYSTEM}]  # gemma folds it into the turn
    one = render(template, [*system, {"role": "user", "content": "What is 7 cubed?"}])
    assert SYSTEM.strip()[:40] in one or template == "gemma3.jinja"
    assert last_user_message(one) == "What is 7 cubed?", one
    assert prompt_preview(one, 200) == "What is 7 cubed?"
    turns = render(template, [*system, {"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"},
                              {"role": "user", "content": "And  times 3?\nShow the steps."}])
    assert last_user_message(turns) == "And  times 3?\nShow the steps.", turns
    assert prompt_preview(turns, 200) == "And times 3? Show the steps."  # one line
    assert prompt_preview(turns, 8) == "And time…"


def test_tool_results_in_a_user_turn_are_not_the_question() -> None:
    text = render("qwen2_5.jinja", [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Weather in Paris?"},
                                     {"role": "assistant", "content": "", "tool_calls": [
                                         {"function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
                                     {"role": "tool", "content": "18 C, sunny"}])
    assert "<tool_response>" in text
    assert last_user_message(text) == "Weather in Paris?"


def test_text_in_no_known_template_keeps_its_end() -> None:
    assert user_messages("plain text, no template") == (None, [])
    assert last_user_message("plain text") is None
    assert prompt_preview("x" * 300, 200) == "…" + "x" * 200 and prompt_preview("short", 200) == "short"
    assert prompt_preview(None, 200) is None
    assert last_user_message("<s>[INST] <<SYS>>\nbe brief\n<</SYS>>\n\nTell me a joke [/INST]") == "Tell me a joke"
    assert last_user_message("<|user|>What is 7 cubed?<|assistant|>") == "What is 7 cubed?"  # the demo's prompt
