"""collector/processors/decoding.py: which id lists are decoded, and how bad ids cost only themselves."""

from __future__ import annotations

from typing import Any

import pytest
from tokenizers import Tokenizer

from tracecar.collector.processors.decoding import collect_jobs, decode_spans


@pytest.fixture(scope="module")
def tok(small_bpe_path: str) -> Tokenizer:
    return Tokenizer.from_file(small_bpe_path)


def span(span_id: str, output: Any, inputs: Any = None) -> Any:
    return {"span_id": span_id, "trace_id": span_id, "parent_id": None, "name": "generate", "kind": "op",
            "start_time": 1.0, "end_time": 2.0, "attributes": {}, "inputs": inputs or {}, "output": output,
            "exception": None, "worker": "w", "project": None, "entity": None}


def test_prompt_and_response_ids_become_text_and_count_as_tokens(tok: Tokenizer) -> None:
    prompt, response = tok.encode("tool call 12").ids, tok.encode("reward 7 🙂").ids
    s = span("a", {"prompt_ids": prompt, "response_ids": response})
    warnings: dict[str, list[str]] = {}
    assert decode_spans([s], tok, warnings) == len(prompt) + len(response)
    assert s["output"]["prompt_text"] == tok.decode(prompt, skip_special_tokens=False)
    assert s["output"]["response_text"] == tok.decode(response, skip_special_tokens=False)
    assert warnings == {}


def test_the_first_present_key_wins_and_inputs_prompt_ids_are_the_fallback(tok: Tokenizer) -> None:
    ids = tok.encode("answer 3").ids
    jobs = collect_jobs(span("a", {"token_ids": ids}, inputs={"prompt_ids": ids}))
    assert [(j.target, j.source) for j in jobs] == [("prompt_text", "inputs.prompt_ids"), ("response_text", "output.token_ids")]
    assert collect_jobs(span("b", "not a dict")) == []


def test_a_value_that_is_not_a_list_is_named_and_the_next_key_tried(tok: Tokenizer) -> None:
    warnings: dict[str, list[str]] = {}
    jobs = collect_jobs(span("a", {"response_ids": "1 2 3", "token_ids": [1, 2]}), warnings)
    assert [(j.target, j.source) for j in jobs] == [("response_text", "output.token_ids")]
    assert warnings == {"a": ["output.response_text: not decoded from output.response_ids: a str, not a list of token ids"]}


def test_ids_outside_the_vocabulary_or_not_integers_are_left_out_by_name(tok: Tokenizer) -> None:
    good = tok.encode("sum 5").ids
    vocab = tok.get_vocab_size(with_added_tokens=True)
    bad = span("bad", {"response_ids": [*good, vocab + 5, "x"]})
    none_ok = span("none", {"response_ids": [vocab, vocab + 1]})
    fine = span("fine", {"response_ids": good})
    warnings: dict[str, list[str]] = {}
    decode_spans([bad, none_ok, fine], tok, warnings)
    assert bad["output"]["response_text"] == fine["output"]["response_text"] == tok.decode(good, skip_special_tokens=False)
    assert "response_text" not in none_ok["output"]
    assert "outside the vocabulary" in warnings["bad"][0] and "not integers (str)" in warnings["bad"][0]
    assert warnings["none"][0].endswith("none decodable, not decoded") and "fine" not in warnings


def test_an_empty_list_decodes_to_the_empty_string(tok: Tokenizer) -> None:
    s = span("a", {"response_ids": []})
    assert decode_spans([s], tok, {}) == 0 and s["output"]["response_text"] == ""
