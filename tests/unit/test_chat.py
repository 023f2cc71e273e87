"""collector/chat.py: where a trajectory's chat is recorded, and chat templates undone."""

from __future__ import annotations

import numpy as np
import pytest

from tracecar.client.wire import WireEncoder
from tracecar.collector.chat import chat_in, last_user_message, parse_template, strip_end

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2? 🙂"}]


def test_the_chat_is_found_where_verl_binds_its_kwargs_and_under_any_name() -> None:
    assert chat_in({"sampling_params": {}, "priority": 0, "kwargs": {"raw_prompt": CHAT, "index": 3}}) == CHAT
    assert chat_in({"raw_prompt": CHAT}) == CHAT
    assert chat_in({"messages": CHAT, "tools": []}) == CHAT
    assert chat_in({"conversation": CHAT}) == CHAT  # any messages-shaped input
    assert chat_in({"options": {"history": CHAT}}) == CHAT
    # raw_prompt wins over another chat-shaped value, wherever each is
    other = [{"role": "user", "content": "other"}]
    assert chat_in({"history": other, "kwargs": {"raw_prompt": CHAT}}) == CHAT
    for nothing in ({}, {"raw_prompt": []}, {"raw_prompt": [{"content": "no role"}]}, {"prompt_ids": [1, 2]}, None, [CHAT]):
        assert chat_in(nothing) is None


def test_a_numpy_object_array_recorded_as_its_repr_is_read_back_when_whole() -> None:
    recorded = WireEncoder().encode({"raw_prompt": np.array(CHAT, dtype=object)})  # weave's form: the repr
    assert isinstance(recorded["raw_prompt"], str) and recorded["raw_prompt"].startswith("array([")
    assert chat_in(recorded) == CHAT
    assert chat_in({"raw_prompt": recorded["raw_prompt"][:-5] + "..."}) is None  # cut at weave's 1,000 characters
    assert chat_in({"raw_prompt": "array([__import__('os')], dtype=object)"}) is None  # never evaluated


@pytest.mark.parametrize("text", [
    # ChatML (Qwen), with the open generation prompt
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2? 🙂<|im_end|>\n<|im_start|>assistant\n",
    # Llama 3
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\n2+2? 🙂<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    # Llama 2 (system in the first [INST])
    "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\n2+2? 🙂 [/INST]",
    # DeepSeek V3
    "<｜begin▁of▁sentence｜>Be brief.<｜User｜>2+2? 🙂<｜Assistant｜>",
])
def test_common_chat_templates_are_undone(text: str) -> None:
    assert parse_template(text) == CHAT


def test_gemma_mistral_and_multi_turn_templates() -> None:
    gemma = "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\nhello<end_of_turn>\n<start_of_turn>model\n"
    assert parse_template(gemma) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    mistral = "<s>[INST] hi [/INST] hello</s>[INST] again [/INST]"
    assert parse_template(mistral) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                                       {"role": "user", "content": "again"}]
    tool = "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<tool_call>{}</tool_call><|im_end|>\n<|im_start|>tool\n5<|im_end|>\n"
    assert [m["role"] for m in parse_template(tool) or []] == ["user", "assistant", "tool"]


def test_text_that_no_template_fits_wholly_is_left_alone() -> None:
    for text in ("plain question", "<|user|>question<|assistant|>", "<|im_start|>user\nq<|im_end|>\ntrailing words",
                 "prefix <|im_start|>user\nq<|im_end|>\n", "", None):
        assert parse_template(text) is None


def test_end_of_turn_tokens_are_stripped_from_a_decoded_response() -> None:
    assert strip_end("The answer is 5.<|im_end|>") == "The answer is 5."
    assert strip_end("Done.<|eot_id|>") == "Done." and strip_end("ok</s>") == "ok" and strip_end("a<|im_end|><|endoftext|>") == "a"
    assert strip_end("<|im_end|> in the middle") == "<|im_end|> in the middle" and strip_end(None) is None


def test_a_templated_prompt_previews_as_its_last_user_message_even_from_its_tail() -> None:
    chatml = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2? 🙂<|im_end|>\n<|im_start|>assistant\n"
    assert last_user_message(chatml) == "2+2? 🙂"
    assert last_user_message("…" + chatml[25:]) == "2+2? 🙂"  # the viewer stores long prompts as head … tail
    assert last_user_message("<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\n2+2? 🙂 [/INST]") == "2+2? 🙂"
    assert last_user_message("<｜begin▁of▁sentence｜>Be brief.<｜User｜>2+2? 🙂<｜Assistant｜>") == "2+2? 🙂"
    # a prompt that ends with a tool result (a later turn) or in no template: no question to show
    assert last_user_message("<|im_start|>user\nq<|im_end|>\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n") is None
    assert last_user_message("plain text") is None and last_user_message(None) is None
