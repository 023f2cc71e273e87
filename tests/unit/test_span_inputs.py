"""client/spans.py: a call's list arguments are sent as the call saw them, though agent loops grow
them in place afterwards (the caller notes their lengths only; the sender slices back)."""

from __future__ import annotations

from typing import Any

from tracecar.client.spans import KIND_OP, SpanRecord, _LazySignature


class Tokens(list):  # a list subclass is not a list by type: sent as it is when sent
    pass


def generate(self: Any, request_id: str, prompt_ids: list[int], extra: Any = None, *more: Any, **options: Any) -> None:
    return None


def _record(*args: Any, **kwargs: Any) -> SpanRecord:
    return SpanRecord("generate", KIND_OP, 1.0, None, {}, _LazySignature(generate), args, kwargs)


def test_positional_and_keyword_lists_are_sliced_back_to_their_length_at_the_call() -> None:
    prompt, more_list, stops, history = [1, 2, 3], [7], ["</s>"], [[1], [2]]
    record = _record(object(), "r1", prompt, {"k": [1]}, 5, more_list, stops=stops, history=history, temperature=0.7)
    prompt += [4, 5]
    more_list.append(8)
    stops.append("<eos>")
    history.append([3])
    inputs = record.to_wire()["inputs"]
    assert inputs["request_id"] == "r1" and inputs["prompt_ids"] == [1, 2, 3]
    assert inputs["extra"] == {"k": [1]}
    assert inputs["more"] == (5, [7])
    assert inputs["options"] == {"stops": ["</s>"], "history": [[1], [2]], "temperature": 0.7}
    assert prompt == [1, 2, 3, 4, 5]  # the caller's lists are left as they are


def test_lists_that_did_not_grow_are_sent_as_they_are_and_subclasses_untouched() -> None:
    prompt, ids = [1, 2, 3], Tokens([9, 9])
    record = _record(object(), "r2", prompt, ids)
    ids.append(10)
    inputs = record.to_wire()["inputs"]
    assert inputs["prompt_ids"] is prompt  # no copy when nothing changed
    assert inputs["extra"] == [9, 9, 10]


def test_no_list_arguments_costs_no_lengths() -> None:
    record = _record(object(), "r3", "not a list", request=None)
    assert record.list_lens is None


def test_shallow_copies_dict_arguments_at_the_call_in_their_places() -> None:
    """TRACECAR_SNAPSHOT=shallow: each dict argument's top-level keys as at the call (one copy kept bare,
    several in a list; an empty one too), lists by length, the caller's own objects left alone."""
    empty, params, nested = {}, {"temperature": 1.0, "extra": {"seed": 0}}, {"a": 1}
    prompt = [1, 2]
    record = SpanRecord("generate", KIND_OP, 1.0, None, {}, _LazySignature(generate), (object(), "r", prompt, empty),
                        {"params": params, "nested": nested}, True)
    empty["filled"] = True
    params["temperature"] = 0.0
    params["extra"]["seed"] = 7  # below the top level: shows its later state (documented)
    nested["b"] = 2
    prompt.append(3)
    inputs = record.to_wire()["inputs"]
    assert inputs["extra"] == {} and inputs["prompt_ids"] == [1, 2]
    assert inputs["options"] == {"params": {"temperature": 1.0, "extra": {"seed": 7}}, "nested": {"a": 1}}
    assert empty == {"filled": True} and params["temperature"] == 0.0  # the caller's objects are its own
    one = SpanRecord("generate", KIND_OP, 1.0, None, {}, _LazySignature(generate), (object(), "r", [1], params), None, True)
    assert type(one.dict_copies) is dict  # one copy kept bare
    refs = SpanRecord("generate", KIND_OP, 1.0, None, {}, _LazySignature(generate), (object(), "r", [1], params), None)
    params["late"] = True
    assert refs.dict_copies is None and refs.to_wire()["inputs"]["extra"]["late"] is True  # refs: as sent
