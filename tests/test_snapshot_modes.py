"""TRACECAR_SNAPSHOT (issue 27 §7): which later changes a traced call's values show, against weave.

VERL's weave backend hands a call's inputs to weave's ``create_call`` when the call starts and its
output to ``finish_call`` when it returns; weave copies their containers right there
(``redact_sensitive_keys`` rebuilds every dict, list and tuple, ``map_to_refs`` every pydantic model
and dataclass) and serialises the copies later. The reference below is that code of the installed
weave, run at the same two moments; tracecar's values go through the real client to a real
collector on 127.0.0.1 and are read back from its store.

* ``deep``: what weave shows, whatever is changed after the call, by the callee, or below two levels;
* ``shallow`` (default): a dict argument's top-level keys as at the call, list arguments at their
  length then, the output two levels deep; changes below that show (the documented difference);
* ``refs``: dict arguments as they are when the sender packs them.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from tracecar.client import rollout_trace_attr, rollout_trace_op
from tracecar.client.spans import deep_snapshot, restore

weave_serialize = pytest.importorskip("weave.trace.serialization.serialize")
from pydantic_core import to_jsonable_python  # noqa: E402
from weave.trace.weave_client import map_to_refs, redact_sensitive_keys  # noqa: E402

pytestmark = pytest.mark.timeout(120)


class Metrics(BaseModel):
    generate_sequences: float = 0.0
    extra: dict[str, Any] = {}


class Output(BaseModel):
    response_ids: list[int]
    info: dict[str, Any]
    metrics: Metrics


def weave_copy(value: Any) -> Any:
    """What weave's create_call / finish_call keep of ``value`` at that moment (serialised later)."""
    return map_to_refs(redact_sensitive_keys(value))


def weave_json(copied: Any) -> Any:
    return to_jsonable_python(weave_serialize.to_json(copied, "e/p", None, use_dictify=False))


class Loop:
    async def _generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], messages: list[dict[str, Any]],
                        **kwargs: Any) -> Output:
        """The callee changes its arguments during the call: a top-level key, a nested one, an item in place."""
        await asyncio.sleep(0)
        sampling_params["n"] = 2
        sampling_params["extra"]["seed"] = 7
        messages[0]["content"] = "edited by the callee"
        prompt_ids[0] = -1
        kwargs["options"]["stop"] = ["</s>"]
        return Output(response_ids=[5, 6], info={"a": {"b": 1}, "top": 1}, metrics=Metrics(extra={"x": {"y": 1}}))

    generate = rollout_trace_op(_generate)


def reference_generate(loop: Loop, *args: Any, **kwargs: Any) -> tuple[Any, Any, Output]:
    """VERL's weave branch of rollout_trace_op, with weave's own copying at start and finish."""
    bound = inspect.signature(Loop._generate).bind(loop, *args, **kwargs)
    bound.apply_defaults()
    inputs = dict(bound.arguments)
    del inputs["self"]
    at_start = weave_copy(inputs)
    result = asyncio.run(Loop._generate(loop, *args, **kwargs))
    return at_start, weave_copy(result), result


def fresh_arguments() -> tuple[tuple[Any, ...], dict[str, Any]]:
    return ([1, 2, 3], {"temperature": 1.0, "extra": {"seed": 0}}, [{"role": "user", "content": "hi"}]), \
        {"options": {"stop": None}, "tag": "t"}


def change_after(args: tuple[Any, ...], kwargs: dict[str, Any], result: Output) -> None:
    """The caller changes arguments and output after the call returned (output below two levels too)."""
    prompt_ids, sampling_params, messages = args
    prompt_ids.append(4)
    sampling_params["temperature"] = 0.0
    messages.append({"role": "assistant", "content": "later"})
    kwargs["options"]["late"] = True
    result.info["a"]["b"] = 2
    result.info["top"] = 2
    result.metrics.extra["x"]["y"] = 2
    result.response_ids.append(7)


def reference() -> tuple[Any, Any]:
    args, kwargs = fresh_arguments()
    at_start, at_finish, result = reference_generate(Loop(), *args, **kwargs)
    change_after(args, kwargs, result)
    return weave_json(at_start), weave_json(at_finish)


def traced(start_collector: Any, tracer_to: Any, mode: str) -> dict[str, Any]:
    col = start_collector()
    tracer = tracer_to(col.url, experiment=f"snap-{mode}", snapshot=mode)

    async def one() -> str:
        args, kwargs = fresh_arguments()
        with rollout_trace_attr(sample_index=0, step=1, rollout_n=0, name="agent_loop") as traj:
            result = await Loop().generate(*args, **kwargs)
        change_after(args, kwargs, result)
        return traj.span_id

    trace_id = asyncio.run(one())
    assert tracer.flush(20)
    tree = httpx.get(f"{col.url}/v1/trajectories/{trace_id}", timeout=30).json()
    [span] = tree["root"]["children"]
    return span


def test_deep_shows_exactly_what_weave_shows_whatever_changes_later(start_collector, tracer_to):
    inputs, output = reference()
    span = traced(start_collector, tracer_to, "deep")
    assert span["inputs"] == inputs and span["output"] == output
    # weave's view, spelled out: everything as at the call's start / return
    assert inputs["sampling_params"] == {"temperature": 1.0, "extra": {"seed": 0}} and inputs["prompt_ids"] == [1, 2, 3]
    assert inputs["messages"] == [{"role": "user", "content": "hi"}] and inputs["kwargs"]["options"] == {"stop": None}
    assert output["info"] == {"a": {"b": 1}, "top": 1} and output["metrics"]["extra"] == {"x": {"y": 1}}


def test_shallow_default_keeps_top_level_keys_and_lengths_and_shows_deeper_changes(start_collector, tracer_to):
    inputs, output = reference()
    span = traced(start_collector, tracer_to, "shallow")
    got_in, got_out = span["inputs"], span["output"]
    # as weave: a dict argument's top-level keys, a list argument's length, the output's first two levels
    assert got_in["sampling_params"]["temperature"] == 1.0 and "n" not in got_in["sampling_params"]
    assert len(got_in["prompt_ids"]) == 3 and len(got_in["messages"]) == 1
    assert got_in["kwargs"]["options"] == {"stop": None} == inputs["kwargs"]["options"]  # a dict passed as a keyword too
    assert got_out["info"]["top"] == 1 and got_out["response_ids"] == [5, 6]
    # the documented difference: what changed in place below that shows its later state
    assert got_in["sampling_params"]["extra"] == {"seed": 7} != inputs["sampling_params"]["extra"]
    assert got_in["messages"][0]["content"] == "edited by the callee" and got_in["prompt_ids"][0] == -1
    assert got_out["info"]["a"] == {"b": 2} != output["info"]["a"]
    assert got_out["metrics"]["extra"] == {"x": {"y": 2}}


def test_refs_show_dict_arguments_as_they_are_when_sent(start_collector, tracer_to):
    span = traced(start_collector, tracer_to, "refs")
    assert span["inputs"]["sampling_params"] == {"temperature": 0.0, "n": 2, "extra": {"seed": 7}}
    assert len(span["inputs"]["prompt_ids"]) == 3  # lists are still cut back to their length at the call


def test_an_unknown_mode_is_one_warning_and_the_default(tracer_to, caplog):
    tracer = tracer_to("http://127.0.0.1:9", snapshot="everything")
    assert tracer.copy_dicts is True and tracer.deep_inputs is None
    assert any("TRACECAR_SNAPSHOT='everything'" in r.getMessage() for r in caplog.records)


def test_deep_copies_are_bounded_and_leave_other_objects_by_reference():
    import numpy as np

    cyclic: dict[str, Any] = {"n": 1}
    cyclic["self"] = cyclic
    copied = deep_snapshot(cyclic, depth=4)
    assert copied["self"]["self"]["self"]["self"] is cyclic  # cut at the depth bound, never a hang
    marker = object()
    array = np.arange(3)
    out = restore(deep_snapshot({"obj": marker, "ids": array, "texts": ["a", "b"], "mixed": [1, {"k": [2]}]}))
    array[0] = 9
    assert out["obj"] is marker and out["ids"].tolist() == [0, 1, 2] and out["mixed"] == [1, {"k": [2]}]
