"""WeaveSink against a loopback Weave stub, checked against the real weave package.

Every request goes to 127.0.0.1. Weave's own models and client (weave 0.54) are the oracle
for the request shape: the vendored ``V2CallCompleteParams``/``Batch`` types, the
``RemoteHTTPTraceServer`` binding and the ``WeaveClient.create_call``/``finish_call`` path.
"""

from __future__ import annotations

import asyncio
import base64
import email.utils
import json
import logging
import time
import uuid
from typing import Any

import pytest

from tests.support import free_port
from tests.support.weave_stub import WeaveSqliteServer, WeaveStub, weave_server_python
from tracecar.collector.exporters import weave_sink as ws
from tracecar.collector.exporters.weave_sink import SendResult, WeaveSink, weave_call_id

API_KEY = "k" * 36 + "SECR"  # 40 chars, like a W&B key
BASIC = base64.b64encode(f"api:{API_KEY}".encode()).decode()
ENTITY, PROJECT = "ent", "proj"
PREFIX = "5f0e6b1c2d3a4958"  # like the thin client's ids: 64-bit process prefix + counter


def sid(n: int) -> str:
    return f"{PREFIX}{n:016x}"


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def trajectory(t0: float = 1_760_000_000.25, root: int = 1) -> list[dict[str, Any]]:
    """A VERL-like trajectory as tracecar's client sends it: the trajectory root, the agent loop
    under it (marked top-level), a failing tool under that (marked with its root and turn)."""
    r, loop, tool = sid(root), sid(root + 1), sid(root + 2)
    attrs = {"step": 3, "sample_index": 5, "rollout_n": 2, "validate": False, "experiment_name": "exp1"}
    base = {"trace_id": r, "worker": "w0", "project": None, "entity": None}
    return [
        {**base, "span_id": r, "parent_id": None, "name": "agent_loop", "kind": "trajectory",
         "start_time": t0, "end_time": t0 + 9.5,
         "attributes": {**attrs, "kept_because": "reward_top", "tracecar": {"trajectory": True}},
         "inputs": {}, "output": {"reward": 1.0}, "exception": None},
        {**base, "span_id": loop, "parent_id": r, "name": "ToolAgentLoop.run", "kind": "op",
         "start_time": t0 + 0.5, "end_time": t0 + 9.0, "attributes": {**attrs, "tracecar": {"top": True}},
         "inputs": {"sampling_params": {"temperature": 1.0}, "raw_prompt": [{"role": "user", "content": "2+2?"}]},
         "output": {"prompt_ids": [1, 2, 3], "response_ids": [4, 5], "prompt_text": "2+2?", "response_text": "4",
                    "num_turns": 2, "nan_metric": float("nan")},
         "exception": None},
        {**base, "span_id": tool, "parent_id": loop, "name": "BaseTool.execute", "kind": "op",
         "start_time": t0 + 1.0, "end_time": t0 + 1.5, "attributes": {**attrs, "tracecar": {"root": loop, "turn": tool}},
         "inputs": {"instance_id": "i-1", "parameters": {"code": "1/0"}}, "output": None,
         "exception": "ValueError: tool exploded: bad input"},
    ]


def op_trace(t0: float = 1_760_000_000.25, root: int = 1) -> list[dict[str, Any]]:
    """The same three spans as a trace rooted in an op (no trajectory): forwarded as they are,
    three calls, for the tests of batching and failure handling."""
    spans = trajectory(t0, root)
    spans[0] = {**spans[0], "kind": "op"}
    for sp in spans:
        sp["attributes"] = {k: v for k, v in sp["attributes"].items() if k != "tracecar"}
    return spans


def sink(stub: WeaveStub, **kw: Any) -> WeaveSink:
    return WeaveSink(api_key=API_KEY, entity=ENTITY, project=PROJECT, server_url=stub.url, **kw)


async def send_once(stub: WeaveStub, spans: list[dict[str, Any]], **kw: Any) -> SendResult:
    async with sink(stub, **kw) as s:
        return await s.send(spans)


def complete_requests(stub: WeaveStub) -> list[Any]:
    return stub.requests_to(r"/calls/complete$")


# ------------------------------------------------------------------------------ ids ----
def test_call_ids_are_canonical_deterministic_and_need_only_the_span_id() -> None:
    a = weave_call_id(sid(1))
    assert a == weave_call_id(sid(1), 123.0) == weave_call_id(sid(1), 999.0)
    u = uuid.UUID(a)
    assert str(u) == a  # weave's require_uuid: lowercase and round-trips (validation_util.py)
    assert u.version == 8 and u.variant == uuid.RFC_4122
    ids = {weave_call_id(sid(n)) for n in range(5000)}
    assert len(ids) == 5000


def test_a_span_id_that_is_already_uuidv7_hex_is_kept() -> None:
    v7 = "0190a2b3c4d57e6f8a9b0c1d2e3f4a5b"
    assert weave_call_id(v7) == str(uuid.UUID(v7))
    assert uuid.UUID(weave_call_id(v7)).version == 7


# ------------------------------------------------------------------- mapping/shape ----
class Decided:
    """Stands in for the spool: the tail decision that kept a trajectory, its top-level calls."""

    def __init__(self, kept: dict[str, str] | None = None, tops: dict[str, list[str]] | None = None) -> None:
        self.kept, self.tops, self.asked = kept or {}, tops or {}, []

    def kept_because(self, trace_ids: list[str]) -> dict[str, str]:
        self.asked.append(sorted(trace_ids))
        return {t: self.kept[t] for t in trace_ids if t in self.kept}

    def top_calls(self, trace_ids: list[str]) -> dict[str, list[str]]:
        return {t: list(self.tops[t]) for t in trace_ids if t in self.tops}


def test_mapping_keeps_tree_ids_attributes_and_payloads(weave_stub: WeaveStub) -> None:
    """VERL's weave backend makes no call for rollout_trace_attr: the agent loop is the root."""
    spans = trajectory()
    decided = Decided(kept={spans[0]["span_id"]: "reward_top"})
    res = run(send_once(weave_stub, spans, trajectories=decided, wb_run_id="run-7"))
    assert sorted(res.delivered) == sorted(s["span_id"] for s in spans) and not res.rejected
    (req,) = complete_requests(weave_stub)
    assert req.path == f"/v2/{ENTITY}/{PROJECT}/calls/complete"
    assert req.headers["authorization"] == f"Basic {BASIC}"
    assert req.headers["content-type"] == "application/json"
    calls = {c["id"]: c for c in req.body["batch"]}
    assert weave_call_id(spans[0]["span_id"]) not in calls  # the trajectory root is not a call
    loop, tool = (calls[weave_call_id(s["span_id"])] for s in spans[1:])
    assert len(calls) == 2

    assert loop["id"] == loop["trace_id"] == weave_call_id(spans[1]["span_id"]) and loop["parent_id"] is None
    assert tool["parent_id"] == loop["id"] and tool["trace_id"] == loop["id"]
    assert all(c["project_id"] == f"{ENTITY}/{PROJECT}" for c in calls.values())

    assert loop["attributes"]["kept_because"] == "reward_top" and "kept_because" not in tool["attributes"]
    assert decided.asked == [[spans[0]["span_id"]]]
    for c, s in zip((loop, tool), spans[1:]):
        for k, v in s["attributes"].items():
            if k != "tracecar":
                assert c["attributes"][k] == v
        assert c["attributes"]["tracecar"] == {"span_id": s["span_id"], "trace_id": spans[0]["span_id"],
                                               "kind": s["kind"], "worker": "w0"}
        assert c["inputs"] == s["inputs"]
        # the trainer's run, in weave's entity/project/run_id form, at the trajectory's step
        assert (c["wb_run_id"], c["wb_run_step"], c["wb_run_step_end"]) == (f"{ENTITY}/{PROJECT}/run-7", 3, 3)
    # threads: the trajectory is the thread, the agent loop's children its turns
    assert loop["thread_id"] is None and loop["turn_id"] is None
    assert tool["thread_id"] == spans[0]["span_id"] and tool["turn_id"] == tool["id"]
    assert loop["output"]["prompt_text"] == "2+2?" and loop["output"]["response_text"] == "4"
    assert loop["output"]["prompt_ids"] == [1, 2, 3] and loop["output"]["response_ids"] == [4, 5]
    assert loop["output"]["nan_metric"] is None  # weave sends NaN as null too

    assert loop["op_name"].startswith(f"weave:///{ENTITY}/{PROJECT}/op/ToolAgentLoop.run:")
    assert all(c["display_name"] is None for c in calls.values())
    assert json.loads(tool["exception"]) == {"type": "ValueError", "message": "tool exploded: bad input"}
    assert loop["exception"] is None
    # weave rolls child status up to the parent: the loop shows descendant_error
    assert loop["summary"] == {"status_counts": {"success": 1, "error": 1}}
    assert tool["summary"] == {"status_counts": {"success": 0, "error": 1}}
    assert loop["started_at"] == "2025-10-09T08:53:20.750000Z" and loop["ended_at"] == "2025-10-09T08:53:29.250000Z"


def test_deeper_calls_keep_their_turn_and_run_steps_follow_the_trajectory(weave_stub: WeaveStub) -> None:
    spans = trajectory()
    loop, tool = spans[1]["span_id"], spans[2]["span_id"]
    inner = {**spans[2], "span_id": sid(99), "parent_id": tool, "name": "inner", "exception": None}
    batch_run = [{**s, "wandb_run_id": "ent/proj/from-client"} for s in spans + [inner]]
    async_step = [{**s, "attributes": {**s["attributes"], "step": -1}} for s in trajectory(root=20)]
    untraced_run = trajectory(root=40)
    async def go() -> None:
        async with sink(weave_stub, wb_run_id="from-settings") as s:
            await s.send(batch_run)
            await s.send(async_step)
        async with sink(weave_stub) as s:
            await s.send(untraced_run)
    run(go())
    calls = {c["id"]: c for c in weave_stub.completed_calls()}
    deep = calls[weave_call_id(sid(99))]
    assert deep["trace_id"] == weave_call_id(loop) and deep["parent_id"] == weave_call_id(tool)
    assert deep["thread_id"] == spans[0]["span_id"] and deep["turn_id"] == weave_call_id(tool)
    # the batch's run wins over the setting, placed in the call's project as weave requires
    assert deep["wb_run_id"] == f"{ENTITY}/{PROJECT}/from-client" and deep["wb_run_step"] == 3
    for s in async_step[1:]:  # fully async (step -1): the run, but no step
        c = calls[weave_call_id(s["span_id"])]
        assert c["wb_run_id"] == f"{ENTITY}/{PROJECT}/from-settings" and c["wb_run_step"] is None
    for s in untraced_run[1:]:  # no run known: no link, as weave without wandb.init
        c = calls[weave_call_id(s["span_id"])]
        assert c["wb_run_id"] is None and c["wb_run_step"] is None


def test_body_validates_with_weaves_request_models(weave_stub: WeaveStub) -> None:
    from pydantic import TypeAdapter
    from weave.vendor.weave_server_sdk.types import v2_call_complete_params as p

    run(send_once(weave_stub, trajectory()))
    (req,) = complete_requests(weave_stub)
    TypeAdapter(p.V2CallCompleteParams).validate_python({"entity": ENTITY, **req.body}, strict=False)
    assert set(req.body) == {"batch"}
    allowed, required = set(p.Batch.__annotations__), set(p.Batch.__required_keys__)
    for call in req.body["batch"]:
        TypeAdapter(p.Batch).validate_python(call)
        assert required <= set(call) <= allowed, set(call) ^ allowed


def test_weaves_own_binding_sends_the_same_body(weave_stub: WeaveStub) -> None:
    """RemoteHTTPTraceServer.calls_complete, given our calls, posts what we post."""
    from weave.trace_server_bindings.remote_http_trace_server import RemoteHTTPTraceServer

    calls = ws.to_weave_calls(trajectory(), ENTITY, PROJECT)
    ours = [json.loads(ws.encode_call(c)) for c in calls]
    server = RemoteHTTPTraceServer(weave_stub.url, should_batch=False)
    server.set_auth(("api", API_KEY))
    server.calls_complete({"batch": calls})
    (req,) = complete_requests(weave_stub)
    assert req.path == f"/v2/{ENTITY}/{PROJECT}/calls/complete"
    assert req.headers["authorization"] == f"Basic {BASIC}"
    assert req.body == {"batch": ours}


def test_shape_matches_weaves_client_create_call_with_a_string_op(
    weave_stub: WeaveStub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real WeaveClient path VERL uses: create_call(op="Qual.name") and finish_call."""
    monkeypatch.setenv("WEAVE_DISABLED", "false")  # tests/conftest.py turns weave off by default
    monkeypatch.setenv("WEAVE_PRINT_CALL_LINK", "false")
    from weave.trace.context.weave_client_context import set_weave_client_global
    from weave.trace.weave_client import WeaveClient
    from weave.trace.weave_client import sanitize_object_name as weave_sanitize
    from weave.trace_server_bindings.remote_http_trace_server import RemoteHTTPTraceServer

    spans = trajectory()
    server = RemoteHTTPTraceServer(weave_stub.url, should_batch=True)
    server.set_auth(("api", API_KEY))
    client = WeaveClient(ENTITY, PROJECT, server, ensure_project_exists=False)
    set_weave_client_global(client)
    try:
        # VERL's weave backend: rollout_trace_attr only sets attributes, the agent loop is the root
        verl_attrs = {k: v for k, v in spans[0]["attributes"].items() if k not in ("kept_because", "tracecar")}
        loop = client.create_call(op="ToolAgentLoop.run", inputs=spans[1]["inputs"],
                                  attributes=verl_attrs, use_stack=False)
        tool = client.create_call(op="BaseTool.execute", inputs=spans[2]["inputs"], parent=loop,
                                  attributes=verl_attrs, use_stack=False)
        client.finish_call(tool, exception=ValueError("tool exploded: bad input"))
        client.finish_call(loop, output=spans[1]["output"])
        client.flush()
    finally:
        set_weave_client_global(None)
        client.finish()
    theirs = {c["op_name"].split("/op/")[1].split(":")[0]: c for c in weave_stub.completed_calls()}
    their_objs = [r.body["obj"] for r in weave_stub.requests_to(r"^/obj/create$")]
    their_files = weave_stub.requests_to(r"^/file/create$")
    weave_stub.reset()

    run(send_once(weave_stub, spans))
    ours = {c["op_name"].split("/op/")[1].split(":")[0]: c for c in weave_stub.completed_calls()}
    our_objs = [r.body["obj"] for r in weave_stub.requests_to(r"^/obj/create$")]
    our_files = weave_stub.requests_to(r"^/file/create$")

    assert set(theirs) == set(ours) == {"ToolAgentLoop.run", "BaseTool.execute"}
    for name in theirs:
        t, o = theirs[name], ours[name]
        assert set(t) == set(o), set(t) ^ set(o)
        assert o["op_name"] == t["op_name"]  # same ref URI: same op object, same digest
        assert (o["parent_id"] is None) == (t["parent_id"] is None)
        assert (o["id"] == o["trace_id"]) == (o["parent_id"] is None)
        assert o["summary"] == t["summary"]
        assert o["exception"] == t["exception"]
        assert o["inputs"] == t["inputs"] and o["display_name"] == t["display_name"]
        assert {k: v for k, v in t["attributes"].items() if k != "weave"} == {
            k: v for k, v in o["attributes"].items() if k != "tracecar"}
    # weave's root id differs from its trace_id unless a caller pins it; ours keep them equal,
    # which is the invariant weave_client.create_call documents for trace roots
    assert ours["ToolAgentLoop.run"]["id"] == ours["ToolAgentLoop.run"]["trace_id"]
    assert sorted(our_objs, key=lambda o: o["object_id"]) == sorted(their_objs, key=lambda o: o["object_id"])
    assert len(our_files) == len(their_files) == 1
    assert our_files[0].form == their_files[0].form  # same stub obj.py, project and expected digest
    assert our_files[0].form["file"] == ws.ANONYMOUS_OP_CODE.encode()
    for name in ("agent_loop", "ToolAgentLoop.run", "outer.<locals>.inner", "a b/c", "x" * 300):
        assert ws.sanitize_object_name(name) == weave_sanitize(name)


def test_ops_are_published_once_per_project(weave_stub: WeaveStub) -> None:
    async def go() -> None:
        async with sink(weave_stub) as s:
            await s.send(trajectory(root=1))
            await s.send(trajectory(root=10))
            other = [{**sp, "project": "other"} for sp in trajectory(root=20)]
            await s.send(other)

    run(go())
    objs = [r.body["obj"] for r in weave_stub.requests_to(r"^/obj/create$")]
    assert sorted((o["project_id"], o["object_id"]) for o in objs) == sorted(
        (f"{ENTITY}/{p}", n) for p in (PROJECT, "other") for n in ("ToolAgentLoop.run", "BaseTool.execute"))
    assert len(weave_stub.requests_to(r"^/file/create$")) == 2


def test_plain_op_names_without_publishing(weave_stub: WeaveStub) -> None:
    spans = trajectory()
    spans[1]["name"] = "N" * 200
    run(send_once(weave_stub, spans, publish_ops=False))
    assert not weave_stub.requests_to(r"^/(obj|file)/create$")
    names = [c["op_name"] for c in weave_stub.completed_calls()]
    assert names[1] == "BaseTool.execute"
    assert len(names[0]) < ws.MAX_OP_NAME_LENGTH and names[0].startswith("NNN")


def test_a_sanitized_op_name_keeps_the_real_name_as_display_name(weave_stub: WeaveStub) -> None:
    spans = trajectory()
    spans[1]["name"] = "make_loop.<locals>.Loop.run"
    run(send_once(weave_stub, spans))
    call = weave_stub.completed_calls()[0]
    assert "/op/make_loop-locals-Loop.run:" in call["op_name"]
    assert call["display_name"] == "make_loop.<locals>.Loop.run"


def test_resending_is_idempotent(weave_stub: WeaveStub) -> None:
    run(send_once(weave_stub, trajectory()))
    run(send_once(weave_stub, trajectory()))
    first, second = complete_requests(weave_stub)
    assert first.raw == second.raw


def test_spans_group_by_their_own_project_and_entity(weave_stub: WeaveStub) -> None:
    a = trajectory(root=1)
    b = [{**sp, "project": "p2"} for sp in trajectory(root=10)]
    c = [{**sp, "project": "e3/p3"} for sp in trajectory(root=20)]
    d = [{**sp, "entity": "e4"} for sp in trajectory(root=30)]
    res = run(send_once(weave_stub, a + b + c + d, publish_ops=False))
    assert len(res.delivered) == 12
    paths = sorted(r.path for r in complete_requests(weave_stub))
    assert paths == sorted(f"/v2/{e}/{p}/calls/complete" for e, p in
                           [(ENTITY, PROJECT), (ENTITY, "p2"), ("e3", "p3"), ("e4", PROJECT)])
    for r in complete_requests(weave_stub):
        e, p = r.path.split("/")[2:4]
        assert {c["project_id"] for c in r.body["batch"]} == {f"{e}/{p}"}


def test_invalid_spans_are_rejected_alone(weave_stub: WeaveStub) -> None:
    spans = trajectory()
    unfinished = {**trajectory(root=40)[1], "end_time": None}
    orphan_root = {**trajectory(root=60)[1], "parent_id": None}
    bad_project = {**trajectory(root=70)[1], "project": "a/b/c"}
    res = run(send_once(weave_stub, spans + [unfinished, orphan_root, bad_project]))
    assert sorted(res.delivered) == sorted(s["span_id"] for s in spans)
    assert set(res.rejected) == {s["span_id"] for s in (unfinished, orphan_root, bad_project)}
    assert "unfinished" in res.rejected[unfinished["span_id"]]


def _note(trace_id: str, n: str = "note1", **payload: Any) -> dict[str, Any]:
    return {"span_id": n, "trace_id": trace_id, "parent_id": None, "name": "annotation",
            "kind": "annotation", "start_time": 1_760_000_010.0, "end_time": 1_760_000_010.0,
            "attributes": payload or {"reward": 0.75, "acc": 1}, "inputs": {}, "output": None, "exception": None}


def test_annotations_become_feedback_on_the_top_level_calls(weave_stub: WeaveStub) -> None:
    """The reward lands on the call a user looks at: the trajectory's top-level call(s)."""
    from typing import get_type_hints

    from pydantic import TypeAdapter
    from weave.vendor.weave_server_sdk.types import feedback_batch_create_params as fb

    spans = trajectory()
    root, loop = spans[0], spans[1]
    note = _note(root["span_id"])
    res = run(send_once(weave_stub, spans + [note]))  # the sink itself saw the top-level call
    assert sorted(res.delivered) == sorted(s["span_id"] for s in spans + [note]) and not res.rejected
    [req] = weave_stub.requests_to("/feedback/batch/create")
    TypeAdapter(fb.FeedbackBatchCreateParams).validate_python(req.body)  # weave's own request type
    [item] = req.body["batch"]
    assert set(item) <= set(get_type_hints(fb.Batch)) and item["feedback_type"] == "tracecar.annotation"
    assert item["weave_ref"] == f"weave:///{ENTITY}/{PROJECT}/call/{weave_call_id(loop['span_id'])}"
    assert item["payload"] == {"reward": 0.75, "acc": 1} and item["id"] == weave_call_id(f"note1>{loop['span_id']}")

    # after a restart the sink remembers nothing: the spool names the top-level calls (two here)
    weave_stub.reset()
    second = sid(500)
    decided = Decided(tops={root["span_id"]: [loop["span_id"], second]})
    res = run(send_once(weave_stub, [note], trajectories=decided))
    assert res.delivered == ["note1"] and not res.rejected
    [req] = weave_stub.requests_to("/feedback/batch/create")
    assert sorted(i["weave_ref"] for i in req.body["batch"]) == sorted(
        f"weave:///{ENTITY}/{PROJECT}/call/{weave_call_id(t)}" for t in (loop["span_id"], second))

    # nothing known of the trajectory: rejected (dead-lettered) with a reason, never dropped silently
    weave_stub.reset()
    res = run(send_once(weave_stub, [_note("f" * 32, "note2")], trajectories=Decided()))
    assert not res.delivered and "none of its calls is known" in res.rejected["note2"]
    assert not weave_stub.requests_to("/feedback/batch/create")


def test_the_trainers_batch_rows_are_delivered_without_feedback(weave_stub: WeaveStub) -> None:
    """Issue 29: an annotation carrying only output.trainer_tokens is read by tracecar; Weave gets no empty feedback."""
    spans = trajectory()
    row = {**_note(spans[0]["span_id"], "note3"), "attributes": {}, "output": {"trainer_tokens": {"response_ids": "AQAAAA=="}}}
    reward = _note(spans[0]["span_id"], "note4")
    res = run(send_once(weave_stub, spans + [row, reward]))
    assert sorted(res.delivered) == sorted(s["span_id"] for s in [*spans, row, reward]) and not res.rejected
    [req] = weave_stub.requests_to("/feedback/batch/create")
    assert [i["payload"] for i in req.body["batch"]] == [{"reward": 0.75, "acc": 1}]


def test_entity_is_required() -> None:
    with pytest.raises(ValueError):
        WeaveSink(api_key=API_KEY, entity="", project=PROJECT, server_url="http://127.0.0.1:1")
    with pytest.raises(ValueError):
        WeaveSink(api_key="", entity=ENTITY, project=PROJECT, server_url="http://127.0.0.1:1")


def test_default_entity_resolves_like_weave_init(weave_stub: WeaveStub) -> None:
    assert run(ws.resolve_default_entity(API_KEY, weave_stub.url)) == "stub-entity"
    (req,) = weave_stub.requests_to(r"^/graphql$")
    assert req.headers["authorization"] == f"Basic {BASIC}"
    assert "defaultEntity" in req.body["query"]
    weave_stub.default_entity = None
    assert run(ws.resolve_default_entity(API_KEY, weave_stub.url)) is None


# ------------------------------------------------------------------------ batching ----
def test_requests_are_split_by_bytes(weave_stub: WeaveStub) -> None:
    spans = [sp for n in range(20) for sp in trajectory(root=1 + 10 * n)]
    for sp in spans:
        sp["inputs"]["pad"] = "x" * 2000
    limit = 20_000
    res = run(send_once(weave_stub, spans, max_request_bytes=limit, publish_ops=False))
    assert sorted(res.delivered) == sorted(sp["span_id"] for sp in spans)
    reqs = complete_requests(weave_stub)
    assert len(reqs) > 3 and all(len(r.raw) <= limit for r in reqs)
    assert sum(len(r.body["batch"]) for r in reqs) == len(spans) - 20  # trajectory roots are not calls


def test_pack_keeps_an_oversized_item_alone() -> None:
    assert ws.pack([5, 100, 5, 5], 40) == [(0, 1), (1, 2), (2, 4)]
    assert ws.pack([], 40) == []


def test_413_and_422_split_the_batch(weave_stub: WeaveStub) -> None:
    weave_stub.fail_next(1, 413)
    res = run(send_once(weave_stub, op_trace(), publish_ops=False))
    assert len(res.delivered) == 3
    assert [len(r.body["batch"]) for r in complete_requests(weave_stub)] == [3, 1, 2]

    weave_stub.reset()
    weave_stub.fail_next(1, 422)  # the whole batch...
    res = run(send_once(weave_stub, op_trace(), publish_ops=False))
    assert len(res.delivered) == 3

    weave_stub.reset()
    spans = op_trace()
    weave_stub.fail_next(2, 422, body={"detail": "call 0 is invalid"})  # the batch, then its first half
    res = run(send_once(weave_stub, spans, publish_ops=False))
    assert list(res.rejected) == [spans[0]["span_id"]] and "invalid" in res.rejected[spans[0]["span_id"]]
    assert sorted(res.delivered) == sorted(s["span_id"] for s in spans[1:])


def test_a_refusal_of_every_call_is_not_split_call_by_call(weave_stub: WeaveStub) -> None:
    spans = [sp for n in range(100) for sp in op_trace(root=1 + 10 * n)]
    weave_stub.fail_next(10_000, 422, body={"detail": "unknown field"})
    res = run(send_once(weave_stub, spans, publish_ops=False))
    assert len(res.rejected) == 300 and len(complete_requests(weave_stub)) == 3  # batch + both halves

    weave_stub.reset()  # one bad call among many: found alone in about 2*log2(n) requests
    bad = spans[137]["span_id"]
    weave_stub.refuse_call_ids = {weave_call_id(bad)}
    res = run(send_once(weave_stub, spans, publish_ops=False))
    assert list(res.rejected) == [bad] and len(res.delivered) == 299
    assert len(complete_requests(weave_stub)) <= 2 * 9 + 1


# ------------------------------------------------------------------ classification ----
@pytest.mark.parametrize("status", [500, 502, 503, 408])
def test_server_errors_are_retryable(weave_stub: WeaveStub, status: int) -> None:
    weave_stub.fail_next(1, status)
    res = run(send_once(weave_stub, op_trace(), publish_ops=False))
    assert len(res.retryable) == 3 and not res.delivered and not res.rejected
    assert res.retry_after is None and str(status) in (res.retry_reason or "")


def test_429_and_503_honour_retry_after(weave_stub: WeaveStub) -> None:
    weave_stub.fail_next(1, 429, retry_after="7")
    res = run(send_once(weave_stub, op_trace(), publish_ops=False))
    assert len(res.retryable) == 3 and res.retry_after == 7.0

    weave_stub.fail_next(1, 503, retry_after="1.5")
    res = run(send_once(weave_stub, op_trace(), publish_ops=False))
    assert res.retry_after == 1.5

    when = email.utils.formatdate(time.time() + 30, usegmt=True)
    weave_stub.fail_next(1, 503, retry_after=when)
    res = run(send_once(weave_stub, op_trace(), publish_ops=False))
    assert res.retry_after is not None and 25 <= res.retry_after <= 31


def test_a_retryable_failure_stops_the_rest_of_the_send(weave_stub: WeaveStub) -> None:
    spans = [sp for n in range(10) for sp in op_trace(root=1 + 10 * n)]
    weave_stub.fail_next(1, 503, retry_after="2")
    res = run(send_once(weave_stub, spans, max_request_bytes=3000, publish_ops=False))
    assert len(complete_requests(weave_stub)) == 1
    assert sorted(res.retryable) == sorted(sp["span_id"] for sp in spans) and res.retry_after == 2.0


def test_other_4xx_are_permanent_and_never_leak_the_key(weave_stub: WeaveStub, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    # 3 calls: the batch, then its halves (1 | 2) refused too: about every call, all rejected
    weave_stub.fail_next(3, 400, body=f"bad request; you sent {API_KEY} as Basic {BASIC} " + "y" * 5000)
    res = run(send_once(weave_stub, op_trace(), publish_ops=False))
    assert len(res.rejected) == 3 and not res.retryable
    assert len(complete_requests(weave_stub)) == 3
    for reason in res.rejected.values():
        assert "HTTP 400" in reason and "bad request" in reason
        assert API_KEY not in reason and BASIC not in reason and len(reason) <= ws.MAX_REASON_CHARS
    weave_stub.fail_next(1, 401)  # the key is refused: not the spans' fault, they stay pending
    res = run(send_once(weave_stub, op_trace(), publish_ops=False))
    assert len(res.retryable) == 3 and not res.rejected
    assert API_KEY not in caplog.text and BASIC not in caplog.text


def test_connection_refused_is_retryable() -> None:
    port = free_port()  # closed again before the sink connects
    async def go() -> SendResult:
        async with WeaveSink(api_key=API_KEY, entity=ENTITY, project=PROJECT, server_url=f"http://127.0.0.1:{port}") as s:
            return await s.send(op_trace())
    res = run(go())
    assert len(res.retryable) == 3 and "Connect" in (res.retry_reason or "")
    assert API_KEY not in (res.retry_reason or "")


def test_a_dropped_connection_is_retryable(weave_stub: WeaveStub) -> None:
    weave_stub.drop_next(1)
    res = run(send_once(weave_stub, op_trace(), publish_ops=False))
    assert len(res.retryable) == 3
    res = run(send_once(weave_stub, op_trace(), publish_ops=False))
    assert len(res.delivered) == 3


def test_op_publish_failures(weave_stub: WeaveStub) -> None:
    weave_stub.fail_next(1, 503, retry_after="3")  # the first /file/create
    res = run(send_once(weave_stub, op_trace()))
    assert len(res.retryable) == 3 and res.retry_after == 3.0
    assert not complete_requests(weave_stub)

    weave_stub.reset()
    weave_stub.fail_next(3, 403)  # file/create refused for good (once per op): plain names
    res = run(send_once(weave_stub, op_trace()))
    assert len(res.delivered) == 3
    assert [c["op_name"] for c in weave_stub.completed_calls()] == ["agent_loop", "ToolAgentLoop.run", "BaseTool.execute"]


def test_unencodable_values_do_not_sink_the_batch(weave_stub: WeaveStub) -> None:
    spans = op_trace()
    spans[1]["output"]["blob"] = b"\x00\x01"
    spans[1]["output"]["huge"] = 2**70
    spans[1]["output"]["tags"] = {"a"}
    res = run(send_once(weave_stub, spans, publish_ops=False))
    assert len(res.delivered) == 3
    out = weave_stub.completed_calls()[1]["output"]
    assert out["blob"] == "AAE=" and out["huge"] == 2**70 and out["tags"] == ["a"]


# ------------------------------------------------------------- weave's own server ----
@pytest.mark.skipif(weave_server_python() is None, reason="needs a venv with weave==0.52.42 (see weave_stub.weave_server_python)")
def test_weaves_own_server_accepts_and_reads_back_what_we_send() -> None:
    """weave 0.52.42's SQLite trace server validates the body with CallsUpsertCompleteReq and
    the ClickHouse id validators; weave 0.54's client reads it back with calls_query filters."""
    from weave.trace.serialization.digest import compute_object_digest
    from weave.trace_server_bindings.remote_http_trace_server import RemoteHTTPTraceServer

    python = weave_server_python()
    assert python is not None
    spans = trajectory()
    other = [{**sp, "project": "other"} for sp in trajectory(root=10)]
    decided = Decided(kept={spans[0]["span_id"]: "reward_top"})
    with WeaveSqliteServer(python) as server:
        async def go() -> SendResult:
            async with WeaveSink(api_key=API_KEY, entity=ENTITY, project=PROJECT, server_url=server.url,
                                 trajectories=decided, wb_run_id="run-1") as s:
                return await s.send(spans + other)

        res = run(go())
        assert len(res.delivered) == 6 and not res.rejected and not res.retryable, res
        client = RemoteHTTPTraceServer(server.url)
        client.set_auth(("api", API_KEY))

        def query(**req: Any) -> list[Any]:
            return list(client.calls_query_stream({"project_id": f"{ENTITY}/{PROJECT}", **req}))

        loop_id, tool_id = (weave_call_id(s["span_id"]) for s in spans[1:])
        everything = {c.id: c for c in query()}
        assert set(everything) == {loop_id, tool_id}  # no call for the trajectory; other project apart
        (root,) = query(filter={"trace_roots_only": True})
        assert root.id == root.trace_id == loop_id and root.parent_id is None
        assert [c.id for c in query(filter={"parent_ids": [loop_id]})] == [tool_id]
        assert [c.id for c in query(filter={"trace_ids": [loop_id]}, sort_by=[{"field": "started_at", "direction": "asc"}])] == [
            loop_id, tool_id]
        by_attr = query(query={"$expr": {"$and": [
            {"$eq": [{"$getField": "attributes.step"}, {"$literal": 3}]},
            {"$eq": [{"$getField": "attributes.kept_because"}, {"$literal": "reward_top"}]}]}})
        assert [c.id for c in by_attr] == [loop_id]
        # the run page's link: calls of a W&B run; the Threads view: the trajectory as a thread
        assert {c.id for c in query(filter={"wb_run_ids": [f"{ENTITY}/{PROJECT}/run-1"]})} == {loop_id, tool_id}
        assert [c.id for c in query(filter={"thread_ids": [spans[0]["span_id"]]})] == [tool_id]
        assert everything[tool_id].turn_id == tool_id and everything[loop_id].wb_run_step == 3
        (tool,) = query(filter={"op_names": [f"weave:///{ENTITY}/{PROJECT}/op/BaseTool.execute:*"]})
        assert tool.id == tool_id and json.loads(tool.exception)["type"] == "ValueError"
        assert tool.summary["weave"]["status"] == "error"
        assert root.summary["weave"]["status"] == "descendant_error"  # the status_counts rollup
        loop = everything[loop_id]
        assert loop.output["response_text"] == "4" and loop.output["prompt_ids"] == [1, 2, 3]
        assert loop.inputs == spans[1]["inputs"] and loop.attributes["sample_index"] == 5
        assert loop.started_at.timestamp() == pytest.approx(spans[1]["start_time"], abs=1e-6)
        # the op digest weave's server computed is the one weave's client computes locally
        val = {"_type": "CustomWeaveType", "weave_type": {"type": "Op"}, "files": {"obj.py": ws.ANONYMOUS_OP_FILE_DIGEST}}
        assert loop.op_name == f"weave:///{ENTITY}/{PROJECT}/op/ToolAgentLoop.run:{compute_object_digest(val)}"
        assert len(list(client.calls_query_stream({"project_id": f"{ENTITY}/other"}))) == 2


def test_status_rolls_up_across_batches(weave_stub: WeaveStub) -> None:
    """Children end (and arrive) before their parents, often in an earlier batch: a failed
    tool sent first still makes its agent loop ``descendant_error``, as in weave's client."""
    spans = trajectory()
    async def go() -> None:
        async with sink(weave_stub, publish_ops=False) as s:
            await s.send([spans[2]])  # the failing tool alone
            await s.send([spans[1], spans[0]])  # then the loop and the trajectory root
    run(go())
    calls = {c["id"]: c for c in weave_stub.completed_calls()}
    assert calls[weave_call_id(spans[1]["span_id"])]["summary"] == {"status_counts": {"success": 1, "error": 1}}
    assert calls[weave_call_id(spans[2]["span_id"])]["summary"] == {"status_counts": {"success": 0, "error": 1}}


def test_an_unmarked_trajectory_keeps_its_root_call(weave_stub: WeaveStub) -> None:
    """A client without the marks (older, or another one): the tree is sent whole, root and all,
    so no call names a parent that never reaches Weave."""
    spans = op_trace()
    spans[0] = {**spans[0], "kind": "trajectory"}
    res = run(send_once(weave_stub, spans, publish_ops=False))
    assert sorted(res.delivered) == sorted(s["span_id"] for s in spans) and not res.rejected
    calls = {c["id"]: c for c in weave_stub.completed_calls()}
    root, loop, tool = (calls[weave_call_id(s["span_id"])] for s in spans)
    assert root["parent_id"] is None and root["id"] == root["trace_id"]
    assert loop["parent_id"] == root["id"] and tool["parent_id"] == loop["id"]
    assert {c["trace_id"] for c in calls.values()} == {root["id"]} and loop["thread_id"] is None


def _engine_span(parent: dict[str, Any], n: int) -> dict[str, Any]:
    """A vLLM ``llm_request`` span joined under ``parent`` as the OTLP receiver stores it: no place mark."""
    return {"trace_id": parent["trace_id"], "worker": "w0", "project": None, "entity": None, "span_id": sid(n),
            "parent_id": parent["span_id"], "name": "llm_request", "kind": "op", "start_time": parent["start_time"],
            "end_time": parent["end_time"], "attributes": {"otel": {"scope": "vllm"}, "gen_ai.usage.output_tokens": 3},
            "inputs": {}, "output": None, "exception": None}


class _Marks:
    """The spool's side of the lookup (forward.SpoolTrajectories.marks) for a parent sent long ago."""

    def __init__(self, spans: list[dict[str, Any]]) -> None:
        self.by_id = {s["span_id"]: s["attributes"]["tracecar"] for s in spans if "tracecar" in s["attributes"]}
        self.asked: list[str] = []

    def kept_because(self, trace_ids: list[str]) -> dict[str, str]:
        return {}

    def top_calls(self, trace_ids: list[str]) -> dict[str, list[str]]:
        return {}

    def marks(self, span_ids: list[str]) -> dict[str, dict[str, Any]]:
        self.asked.extend(span_ids)
        return {i: self.by_id[i] for i in span_ids if i in self.by_id}


def test_an_engine_span_lands_in_its_generate_calls_weave_trace(weave_stub: WeaveStub) -> None:
    """An OTLP engine span under a tool (a turn) or under the agent loop itself goes into the
    agent loop's Weave trace, whether its parent is in the same batch, was sent by this sink
    earlier, or is only in the spool (a restart): never into a trace of its own."""
    spans = trajectory()
    loop, tool = spans[1], spans[2]
    under_tool, under_loop, after_restart = _engine_span(tool, 20), _engine_span(loop, 21), _engine_span(tool, 22)
    lookup = _Marks(spans)

    async def go() -> None:
        async with sink(weave_stub, publish_ops=False) as s:
            await s.send([tool, under_tool])  # parent in the batch
            await s.send([loop, spans[0]])
            await s.send([under_loop])  # parent sent earlier by this sink
        async with sink(weave_stub, publish_ops=False, trajectories=lookup) as s:  # a fresh sink: the spool knows
            await s.send([after_restart])
    run(go())
    calls = {c["id"]: c for c in weave_stub.completed_calls()}
    root_id = weave_call_id(loop["span_id"])
    for engine, turn in ((under_tool, tool), (under_loop, None), (after_restart, tool)):
        call = calls[weave_call_id(engine["span_id"])]
        assert call["trace_id"] == root_id and call["parent_id"] == weave_call_id(engine["parent_id"])
        assert call["thread_id"] == spans[0]["span_id"]
        assert call["turn_id"] == weave_call_id(turn["span_id"] if turn else engine["span_id"])
    assert lookup.asked == [tool["span_id"]]
