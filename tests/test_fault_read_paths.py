"""Reads under hostile input: bounded query integers (422 naming the parameter), deep trajectories.

A real collector (uvicorn on 127.0.0.1) answers every integer query parameter of every read
endpoint past SQLite's int64 with a 422 naming the parameter, and serves trajectories whose
spans nest 128 and 1000 deep (each the child of the previous), flattened below
``TRACECAR_MAX_TREE_DEPTH`` with a marker, with values nested up to the store's own limit.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.timeout(180)

BIG, SMALL = 2**63, -(2**63) - 1  # one past each end of int64
INT64_MAX, INT64_MIN = 2**63 - 1, -(2**63)

# (path, integer parameter, smallest allowed, largest allowed); every one must be listed
INT_PARAMS = [
    ("/v1/trajectories", "step", INT64_MIN, INT64_MAX),
    ("/v1/trajectories", "step_min", INT64_MIN, INT64_MAX),
    ("/v1/trajectories", "step_max", INT64_MIN, INT64_MAX),
    ("/v1/trajectories", "sample_index", INT64_MIN, INT64_MAX),
    ("/v1/trajectories", "rollout_n", INT64_MIN, INT64_MAX),
    ("/v1/trajectories", "limit", 1, 1000),
    ("/v1/trajectories", "offset", 0, INT64_MAX),
    ("/v1/decisions", "step", INT64_MIN, INT64_MAX),
    ("/v1/dead-letters", "limit", 1, 10000),
    ("/ui/api/trajectories", "step", INT64_MIN, INT64_MAX),
    ("/ui/api/trajectories", "step_min", INT64_MIN, INT64_MAX),
    ("/ui/api/trajectories", "step_max", INT64_MIN, INT64_MAX),
    ("/ui/api/trajectories", "sample_index", INT64_MIN, INT64_MAX),
    ("/ui/api/trajectories", "rollout_n", INT64_MIN, INT64_MAX),
    ("/ui/api/trajectories", "limit", 1, 500),
    ("/ui/api/trajectories", "offset", 0, INT64_MAX),
    ("/v1/groups", "step", INT64_MIN, INT64_MAX),
    ("/v1/groups", "limit", 1, 1000),
    ("/v1/groups", "offset", 0, INT64_MAX),
    ("/ui/api/groups", "step", INT64_MIN, INT64_MAX),
    ("/ui/api/groups", "limit", 1, 1000),
    ("/ui/api/groups", "offset", 0, INT64_MAX),
    ("/v1/trajectories/{trace_id}/tokens", "lowest", 0, 1000),
    ("/ui/api/trajectories/{trace_id}/tokens", "lowest", 0, 1000),
    ("/v1/export", "step", INT64_MIN, INT64_MAX),
    ("/v1/export", "step_min", INT64_MIN, INT64_MAX),
    ("/v1/export", "step_max", INT64_MIN, INT64_MAX),
    ("/v1/export", "sample_index", INT64_MIN, INT64_MAX),
    ("/v1/export", "rollout_n", INT64_MIN, INT64_MAX),
    ("/v1/export", "limit", 1, INT64_MAX),
    ("/ui/api/export", "step", INT64_MIN, INT64_MAX),
    ("/ui/api/export", "step_min", INT64_MIN, INT64_MAX),
    ("/ui/api/export", "step_max", INT64_MIN, INT64_MAX),
    ("/ui/api/export", "sample_index", INT64_MIN, INT64_MAX),
    ("/ui/api/export", "rollout_n", INT64_MIN, INT64_MAX),
    ("/ui/api/export", "limit", 1, INT64_MAX),
    ("/v1/health", "step", INT64_MIN, INT64_MAX),
    ("/ui/api/health", "step", INT64_MIN, INT64_MAX),
    ("/v1/live", "step", INT64_MIN, INT64_MAX),
    ("/v1/live", "sample_index", INT64_MIN, INT64_MAX),
    ("/v1/live", "limit", 1, 1000),
    ("/ui/api/live", "step", INT64_MIN, INT64_MAX),
    ("/ui/api/live", "sample_index", INT64_MIN, INT64_MAX),
    ("/ui/api/live", "limit", 1, 1000),
]


def _base(path: str) -> dict[str, Any]:
    return {"step": 1} if path in ("/v1/decisions", "/v1/groups", "/ui/api/groups") else {}


def test_every_integer_query_parameter_is_bounded_with_a_422_naming_it(start_collector, kit):
    col = start_collector()
    spans = kit.trajectory(children=2, step=3)
    assert kit.post(col.url, spans).status_code == 200
    listed = {(p, n) for p, n, _, _ in INT_PARAMS}
    # the table above covers every integer query parameter the app declares
    from tracecar.collector.query_params import api_routes, int_query_params
    declared = {(path, q.alias) for path, route in api_routes(col.server.config.app.routes) for q in int_query_params(route)}
    sample_index = {(p, n) for p, n in listed if n == "sample_index"}  # an int or a string: bounded when an int
    assert declared | sample_index == listed, declared ^ listed
    with httpx.Client(base_url=col.url, timeout=10) as client:
        for route, name, low, high in INT_PARAMS:
            path = route.replace("{trace_id}", spans[-1]["span_id"])  # a trajectory that exists
            for value in (low, high):  # the ends of the range are served
                r = client.get(path, params={**_base(path), name: str(value)})
                assert r.status_code == 200, (path, name, value, r.text[:300])
            for value in (low - 1, high + 1, BIG, SMALL, 10**40):
                r = client.get(path, params={**_base(path), name: str(value)})
                assert r.status_code == 422, (path, name, value, r.status_code, r.text[:300])
                error = r.json()["error"]
                assert error["field"] == name and error["reason"], (path, name, value, error)
        # sample_index is an int or a string: a string filters (matches nothing here), no error
        for path in ("/v1/trajectories", "/ui/api/trajectories"):
            r = client.get(path, params={"sample_index": "prompt-7"})
            assert r.status_code == 200 and r.json()["trajectories"] == [], r.text[:300]
            r = client.get(path, params={"step": "3", "sample_index": "0"})
            assert r.status_code == 200 and len(r.json()["trajectories"]) == 1, r.text[:300]
        # a non-integer where an integer belongs is named too
        r = client.get("/v1/trajectories", params={"step_min": "abc"})
        assert r.status_code == 422 and r.json()["error"]["field"] == "step_min"
        r = client.get("/v1/decisions")
        assert r.status_code == 422 and r.json()["error"]["field"] == "step"
    metrics = httpx.get(col.url + "/metrics").text
    assert kit.metric(metrics, "tracecar_requests_total", status="500") == 0


def test_an_unbounded_integer_query_parameter_stops_the_app_at_creation():
    from fastapi import FastAPI

    from tracecar.collector.query_params import OptionalInt64, check_bounded_ints

    app = FastAPI()

    @app.get("/fine")
    async def fine(step: OptionalInt64 = None) -> None: ...

    check_bounded_ints(app.routes)

    @app.get("/forgot")
    async def forgot(page: int = 0) -> None: ...

    with pytest.raises(RuntimeError, match=r"/forgot\?page"):
        check_bounded_ints(app.routes)


# ---- deep trajectories --------------------------------------------------------------------
def chain(kit: Any, depth: int, deep_value_at: int | None = None, value_depth: int = 0) -> list[dict[str, Any]]:
    """A root and ``depth`` spans, each the child of the previous (root last, as a client sends)."""
    root = kit.new_id()
    attrs = {"step": 1, "sample_index": 0, "rollout_n": 0, "validate": False, "experiment_name": "deep"}
    spans, parent = [], root
    for level in range(1, depth + 1):
        span_id = kit.new_id()
        inputs: dict[str, Any] = {"level": level}
        if level == deep_value_at:
            inputs["deep"] = nested(value_depth)
        spans.append({"span_id": span_id, "trace_id": root, "parent_id": parent, "name": f"level{level}", "kind": "op",
                      "start_time": 1000.0 + level, "end_time": 5000.0 - level, "attributes": attrs,
                      "inputs": inputs, "output": {"level": level}})
        parent = span_id
    spans.append({"span_id": root, "trace_id": root, "parent_id": None, "name": "agent_loop", "kind": "trajectory",
                  "start_time": 1000.0, "end_time": 5000.0, "attributes": attrs, "inputs": {}, "output": None})
    return spans


def nested(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = {"d": value}
    return value


def depth_of(value: Any) -> int:
    deepest, stack = 0, [(value, 0)]
    while stack:
        node, level = stack.pop()
        deepest = max(deepest, level)
        if isinstance(node, dict):
            stack.extend((v, level + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, level + 1) for v in node)
    return deepest


def walk(root: dict[str, Any]) -> Iterator[tuple[dict[str, Any], int]]:
    stack = [(root, 0)]
    while stack:
        span, level = stack.pop()
        yield span, level
        stack.extend((c, level + 1) for c in span.get("children", ()))


def _check_tree(root: dict[str, Any], spans: list[dict[str, Any]], cap: int) -> dict[str, tuple[dict[str, Any], int]]:
    seen = {}
    for span, level in walk(root):
        assert span["span_id"] not in seen, "a span appears twice"
        seen[span["span_id"]] = (span, level)
    assert set(seen) == {s["span_id"] for s in spans}  # every accepted span is readable, once
    for span_id, (span, level) in seen.items():
        true_level = int(span["name"].removeprefix("level")) if span["name"].startswith("level") else 0
        assert level <= cap
        if true_level > cap:  # flattened at the cap, with a marker and its true depth
            assert level == cap and span["depth_capped"] is True and span["depth"] == true_level, span_id
        else:
            assert level == true_level and "depth_capped" not in span, span_id
    return seen


@pytest.mark.parametrize("depth", [128, 1000])
def test_deep_trajectories_are_readable_flattened_below_the_cap(start_collector, kit, depth):
    cap = 64  # the default TRACECAR_MAX_TREE_DEPTH
    col = start_collector()
    assert col.settings.max_tree_depth == cap
    spans = chain(kit, depth, deep_value_at=cap - 2, value_depth=240)  # and a value nested 240 deep
    r = kit.post(col.url, spans, timeout=60)
    assert r.status_code == 200 and r.json()["accepted"] == depth + 1, r.text[:500]
    root_id = spans[-1]["span_id"]

    r = httpx.get(f"{col.url}/v1/trajectories/{root_id}", timeout=60)
    assert r.status_code == 200, r.text[:300]
    tree = json.loads(r.content)  # the standard library reads it too
    assert tree["span_count"] == depth + 1 and tree["depth_cap"] == cap
    seen = _check_tree(tree["root"], spans, cap)
    deep_span = seen[spans[cap - 3]["span_id"]][0]
    assert deep_span["inputs"]["deep"] == nested(240)  # values past orjson's own depth come back whole
    assert depth_of(r.json()) > 255

    r = httpx.get(f"{col.url}/ui/api/trajectories/{root_id}", timeout=60)
    assert r.status_code == 200, r.text[:300]
    view = r.json()
    assert view["tree_depth_cap"] == cap and view["span_count"] == depth + 1
    _check_tree(view["tree"], spans, cap)
    events = {e["name"] for e in view["before_first_turn"]}  # the leaf ops are listed, deep ones too
    assert f"level{depth}" in events

    r = httpx.get(f"{col.url}/ui/api/trajectories", params={"experiment": "deep"}, timeout=30)
    assert r.status_code == 200 and r.json()["total"] == 1


def test_the_cap_is_a_setting_and_cycles_across_batches_stay_readable(start_collector, kit):
    col = start_collector(max_tree_depth=3)
    spans = chain(kit, 10)
    assert kit.post(col.url, spans).json()["accepted"] == 11
    tree = httpx.get(f"{col.url}/v1/trajectories/{spans[-1]['span_id']}").json()
    _check_tree(tree["root"], spans, 3)

    # two spans naming each other as parent, in different batches (no in-batch cycle to reject)
    root = kit.trajectory(children=0)[0]
    a, b = kit.new_id(), kit.new_id()
    base = {"trace_id": root["span_id"], "name": "op", "kind": "op", "start_time": root["start_time"] + 1,
            "attributes": root["attributes"], "inputs": {}, "output": None}
    assert kit.post(col.url, [dict(base, span_id=a, parent_id=b), root]).json()["accepted"] == 2
    assert kit.post(col.url, [dict(base, span_id=b, parent_id=a)]).json()["accepted"] == 1
    for path in ("/v1/trajectories/", "/ui/api/trajectories/"):
        got = httpx.get(col.url + path + root["span_id"]).json()
        tree_root = got["root"] if "root" in got else got["tree"]
        ids = [s["span_id"] for s, _ in walk(tree_root)]
        assert sorted(ids) == sorted([root["span_id"], a, b]), ids


def test_tail_truncation_copes_with_values_at_the_stores_depth_limit():
    """A kept trajectory cut under TRACECAR_MAX_TRAJECTORY_BYTES may hold a value nested as deep as
    the store accepts (254 levels); measuring it must not fail the step decision."""
    from tracecar.collector.processors.sampling.truncate import truncate_trajectory

    root = {"span_id": "r", "trace_id": "r", "parent_id": None, "attributes": {}, "inputs": {}, "output": None}
    child = {"span_id": "c", "trace_id": "r", "parent_id": "r", "attributes": {},
             "inputs": {"deep": nested(253), "blob": "x" * 50_000}, "output": None}
    got = truncate_trajectory([root, child], cap=8192, root_id="r")
    assert got is not None
    payloads, before, after = got
    assert before > 50_000 and after <= 8192 and set(payloads) == {"r", "c"}
    assert json.loads(payloads["c"])["inputs"]["blob"].startswith("x")
