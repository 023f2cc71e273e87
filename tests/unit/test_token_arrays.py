"""collector/processors/token_arrays.py: the per-value checks (done in C) accept and refuse exactly
what a plain per-value reading of the rules does, on any mix of values."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracecar.collector.processors import token_arrays
from tracecar.collector.processors.token_arrays import extract

_values = st.one_of(
    st.integers(min_value=-(2**40), max_value=2**40), st.sampled_from([0, 1, True, False, None, 2**31 - 1, -(2**31), 2**31]),
    st.floats(allow_nan=False), st.text(max_size=3),
)


def _reference_floats(values: list[Any]) -> list[float] | None:
    out = []
    for v in values:
        if v is None:
            out.append(math.nan)
        elif type(v) in (int, float):
            out.append(float(v))
        else:
            return None
    return out


def _reference_mask(values: list[Any]) -> list[int] | None:
    return [int(v) for v in values] if all(type(v) in (int, bool) and v in (0, 1) for v in values) else None


def _reference_ids(ids: list[Any]) -> bool:
    return all(type(i) is int and -(2**31) <= i < 2**31 for i in ids)


def _same_floats(a: list[float] | None, b: list[float] | None) -> bool:
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b))


@settings(max_examples=400, deadline=None)
@given(st.lists(_values, max_size=12))
def test_the_checks_match_a_per_value_reading_of_the_rules(values: list[Any]) -> None:
    assert _same_floats(token_arrays._floats(values), _reference_floats(values))
    mask = token_arrays._mask(values)
    assert mask == _reference_mask(values) and (mask is None or all(type(v) is int for v in mask))
    assert token_arrays._int32_ids(values) == _reference_ids(values)


def test_a_generate_output_without_per_token_arrays_is_not_packed_and_its_ids_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    def read(ids: list[Any]) -> bool:
        raise AssertionError("the ids of an output without per-token arrays were read")

    monkeypatch.setattr(token_arrays, "_int32_ids", read)
    assert extract({"output": {"token_ids": list(range(500)), "stop_reason": "stop"}}, []) is None
    with pytest.raises(AssertionError):  # and with an array beside them they are
        extract({"output": {"token_ids": [1, 2], "response_mask": [1, 1]}}, [])


def test_a_log_probability_past_a_double_is_not_packed_and_named() -> None:
    warnings: list[str] = []
    assert extract({"output": {"response_ids": [1, 2], "response_logprobs": [10**400, -0.5]}}, warnings) is None
    assert warnings == ["output.response_logprobs: not a list of numbers; not packed"]


def test_arrays_are_packed_only_with_valid_ids_and_mismatches_are_named() -> None:
    warnings: list[str] = []
    span = {"output": {"response_ids": [5, 6, 7], "response_mask": [1, True, 0], "response_logprobs": [-0.5, None]}}
    found = extract(span, warnings)
    assert found is not None and found.mask == [1, 1, 0] and found.logprobs is None
    assert warnings == ["output.response_logprobs: 2 values for 3 tokens in output.response_ids; not packed"]
    assert extract({"output": {"response_ids": [5, 2**31], "response_mask": [1, 1]}}, []) is None
    assert extract({"output": {"response_ids": [5, True], "response_mask": [1, 1]}}, []) is None
