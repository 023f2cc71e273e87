"""collector/processors/validate.py: one bad span is refused by name, the rest of its batch kept."""

from __future__ import annotations

import math
from typing import Any

import pytest

from tracecar.client.redact import REDACTED
from tracecar.collector.processors.validate import (
    EnvelopeError,
    parents_to_look_up,
    reject_foreign_children,
    validate_batch,
)


def span(span_id: str, parent: str | None = None, trace: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"span_id": span_id, "trace_id": trace or (span_id if parent is None else "root"), "parent_id": parent,
            "name": "op", "kind": "op", "start_time": 1.0, "end_time": 2.0, **extra}


def batch(*spans: dict[str, Any], **envelope: Any) -> dict[str, Any]:
    return {"worker": "w0", "project": "p", "entity": "e", "spans": list(spans), **envelope}


def test_a_good_span_gets_its_batchs_worker_project_and_entity() -> None:
    out = validate_batch(batch(span("root")), 10)
    (s,) = out.spans
    assert (s["worker"], s["project"], s["entity"]) == ("w0", "p", "e")
    assert s["attributes"] == {} and s["inputs"] == {} and "exception_info" not in s
    assert out.rejected == [] and out.index_of == {"root": 0}


@pytest.mark.parametrize("bad, field, words", [
    (span("x", end_time=0.5), "end_time", "ends before it starts"),
    ({**span("x"), "trace_id": "other"}, "trace_id", "root span"),
    (span("x", parent="x", trace="x"), "parent_id", "own parent"),
    (span("x", attributes={"step": "3"}), "attributes.step", "must be an integer"),
    (span("x", attributes={"sample_index": 1.5}), "attributes.sample_index", "integer or a string"),
    (span("x", attributes={"validate": 1}), "attributes.validate", "boolean"),
    ({**span("x"), "span_id": "has space"}, "span_id", ""),
    ({**span("x"), "name": ""}, "name", ""),
])
def test_a_bad_span_is_rejected_naming_its_field_and_the_good_one_beside_it_kept(bad, field, words) -> None:
    out = validate_batch(batch(span("good"), bad), 10)
    assert [s["span_id"] for s in out.spans] == ["good"]
    (rejection,) = out.rejected
    assert rejection.index == 1 and rejection.field == f"spans[1].{field}", rejection
    assert words in rejection.reason


def test_a_duplicate_span_id_names_the_first() -> None:
    out = validate_batch(batch(span("a"), span("a")), 10)
    assert len(out.spans) == 1
    assert out.rejected[0].field == "spans[1].span_id" and "duplicate of spans[0]" in out.rejected[0].reason


def test_a_parent_cycle_inside_the_batch_rejects_only_the_cycle() -> None:
    out = validate_batch(batch(span("root"), span("a", parent="b"), span("b", parent="a"), span("c", parent="root")), 10)
    assert sorted(s["span_id"] for s in out.spans) == ["c", "root"]
    assert sorted((r.field, r.reason) for r in out.rejected) == [
        ("spans[1].parent_id", "parent chain forms a cycle"), ("spans[2].parent_id", "parent chain forms a cycle")]


@pytest.mark.parametrize("raw, field", [
    ([1, 2], "body"), ({"spans": []}, "worker"), ({"worker": "w"}, "spans"), ({"worker": "", "spans": []}, "worker"),
])
def test_a_bad_envelope_refuses_the_whole_batch_by_field(raw, field) -> None:
    with pytest.raises(EnvelopeError) as e:
        validate_batch(raw, 10)
    assert e.value.field == field


def test_more_spans_than_the_bound_refuses_the_batch_naming_the_setting() -> None:
    with pytest.raises(EnvelopeError, match="TRACECAR_MAX_BATCH_SPANS=2"):
        validate_batch(batch(span("a"), span("b"), span("c")), 2)


def test_values_under_redact_keys_never_pass() -> None:
    out = validate_batch(batch(span("a", inputs={"api_key": "sk-1", "nested": [{"Authorization": "Bearer t"}], "q": 1}),
                               client={"api_key": "sk-2", "weave_version": "1"}), 10)
    (s,) = out.spans
    assert s["inputs"] == {"api_key": REDACTED, "nested": [{"Authorization": REDACTED}], "q": 1}
    assert s["client"] == {"api_key": REDACTED, "weave_version": "1"}


def test_non_finite_rewards_are_kept_as_strings_with_a_warning() -> None:
    out = validate_batch(batch(span("a", attributes={"reward": math.nan}, output={"score": math.inf})), 10)
    (s,) = out.spans
    assert s["attributes"]["reward"] == "nan" and s["output"]["score"] == "inf"
    assert len(out.warnings["a"]) == 2


def test_a_bad_wandb_run_id_is_a_warning_not_a_rejection() -> None:
    out = validate_batch(batch(span("a"), wandb_run_id="has spaces in it"), 10)
    assert [s["span_id"] for s in out.spans] == ["a"] and "wandb_run_id" not in out.spans[0]
    assert "wandb_run_id: ignored" in out.warnings["a"][0]
    good = validate_batch(batch(span("a"), wandb_run_id="team/rl/run1"), 10)
    assert good.spans[0]["wandb_run_id"] == "team/rl/run1"


def test_a_bad_wandb_run_id_is_described_never_echoed() -> None:
    # the warning goes into the answer and every stored span: a misplaced secret must not
    for value, got in (({"entity": "me", "api_key": "sk-WANDB-SECRET-42"}, "a dict"),
                       ("Bearer sk-TOKEN-SECRET-43", "a string of 25 characters")):
        out = validate_batch(batch(span("a"), wandb_run_id=value), 10)
        (warning,) = out.warnings["a"]
        assert "SECRET" not in warning and warning.endswith(f"got {got}"), warning


def test_an_advantage_past_64_bits_is_refused_by_name() -> None:
    # the store's trajectory index binds it as an SQLite INTEGER: 2**63 there made every list a 500
    out = validate_batch(batch(span("r"), span("n", trace_id="r", parent_id=None, kind="annotation",
                                                attributes={"advantage": 2**63})), 10)
    assert [s["span_id"] for s in out.spans] == ["r"]
    (rejection,) = out.rejected
    assert rejection.field == "spans[1].attributes.advantage" and "64-bit" in rejection.reason
    ok = validate_batch(batch(span("n", trace_id="r", parent_id=None, kind="annotation", attributes={"advantage": 2**63 - 1})), 10)
    assert [s["span_id"] for s in ok.spans] == ["n"]


def test_a_child_whose_trace_differs_from_its_known_parents_is_refused() -> None:
    out = validate_batch(batch(span("root"), span("child", parent="root", trace="elsewhere"), span("orphan", parent="gone")), 10)
    assert parents_to_look_up(out) == ["gone", "root"]  # the batch's own too: a stored copy would win
    reject_foreign_children(out, {"gone": "another-root"})
    assert [s["span_id"] for s in out.spans] == ["root"]
    fields = sorted(r.field for r in out.rejected)
    assert fields == ["spans[1].trace_id", "spans[2].trace_id"]
    assert any("a span already stored" in r.reason for r in out.rejected)


def test_a_batch_copy_of_a_stored_span_does_not_decide_its_childrens_trajectory() -> None:
    """The copy is dropped as a duplicate when written: a good child of the stored span is kept."""
    out = validate_batch(batch(span("P", trace="other", parent="other"), span("child", parent="P", trace="T")), 10)
    reject_foreign_children(out, {"P": "T", "other": "other"})
    assert [s["span_id"] for s in out.spans] == ["P", "child"] and out.rejected == []


def test_a_bad_fate_names_a_misspelling_but_never_echoes_another_value() -> None:
    notes = [{**span(sid, trace="t1"), "kind": "annotation", "attributes": {"fate": fate}}
             for sid, fate in (("a", "trainedd"), ("b", "sk-FATE-SECRET-44"))]
    out = validate_batch(batch(*notes), 10)
    first, second = out.rejected
    assert first.field == "spans[0].attributes.fate" and "got 'trainedd'" in first.reason
    assert second.field == "spans[1].attributes.fate" and "SECRET" not in second.reason, second.reason
