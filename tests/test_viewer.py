"""The local trajectory viewer (/ui/): its JSON, its trajectory index, its access rules, and the
page itself driven in a real headless Chromium (Debian's /usr/bin/chromium, through playwright).

Screenshots of the browser tests land in ``artifacts/viewer/`` at the repository root (git-ignored), or in
``$TRACECAR_ARTIFACTS/viewer/``: every page, to look at.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tracecar.client import annotate, rollout_trace_attr, rollout_trace_op
from tracecar.client.demo import run_demo
from tracecar.collector.settings import CollectorSettings
from tracecar.collector.spool.store import Spool, SpoolRow
from tracecar.collector.viewer.index import ListFilter, TrajectoryIndex
from tracecar.collector.viewer.routes import COOKIE

pytestmark = pytest.mark.timeout(240)

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
ARTIFACTS = Path(os.environ.get("TRACECAR_ARTIFACTS") or Path(__file__).resolve().parents[1] / "artifacts") / "viewer"
TAIL_SAMPLING = "max_trajectories_per_step" in CollectorSettings.model_fields


def demo_collector(start_collector: Any, tracer_to: Any, tokenizer: str, **settings: Any) -> Any:
    """A collector on the embedded store fed `tracecar quickstart`'s demo: 3 steps × 8 samples × 4 rollouts."""
    col = start_collector(token2text=True, tokenizer=tokenizer, **settings)
    token = settings.get("token")
    tracer = tracer_to(col.url, experiment="demo", project="tracecar-demo", token=token)
    assert asyncio.run(run_demo(3, 8, 4)) == 96
    assert tracer.flush(30)
    return col


def js_fixed(x: float, digits: int) -> str:
    """``Number(x).toFixed(digits)`` as the browser shows it: a tie rounds away from zero on the exact
    binary value (Python's ``f"{0.8125:.3f}"`` gives 0.812, JavaScript 0.813)."""
    from decimal import ROUND_HALF_UP, Decimal

    return str(Decimal(abs(x) if x == 0 else x).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP))  # -0.0: "0.000"


def get(col: Any, path: str, **params: Any) -> Any:
    headers = {"Authorization": f"Bearer {col.settings.token.get_secret_value()}"} if col.settings.token else {}
    response = httpx.get(col.url + path, params=params, headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def _walk(span: dict[str, Any]) -> Any:
    yield span
    for child in span["children"]:
        yield from _walk(child)


# ---- JSON and index ------------------------------------------------------------------------------
def test_list_filters_sorts_and_pages_agree_with_the_store(start_collector, tracer_to, deepseek_tokenizer_path):
    col = demo_collector(start_collector, tracer_to, deepseek_tokenizer_path)
    stored = {t["trace_id"]: t for t in get(col, "/v1/trajectories", step=2, limit=100)["trajectories"]}
    assert len(stored) == 32

    page = get(col, "/ui/api/trajectories", experiment="demo", step=2, sort="reward", order="asc", limit=100)
    assert page["total"] == 32 and page["index"]["caught_up"]
    rewards = [t["reward"] for t in page["trajectories"]]
    assert rewards == sorted(rewards) and rewards == sorted(t["reward"] for t in stored.values())
    assert {t["trace_id"]: t["reward"] for t in page["trajectories"]} == {k: v["reward"] for k, v in stored.items()}

    seen = [t["trace_id"] for offset in (0, 10, 20, 30)
            for t in get(col, "/ui/api/trajectories", step=2, sort="reward", limit=10, offset=offset)["trajectories"]]
    assert len(seen) == 32 and set(seen) == set(stored)

    for row in page["trajectories"]:  # turns and tool calls match the span trees
        tree = get(col, f"/v1/trajectories/{row['trace_id']}")["root"]
        spans = list(_walk(tree))
        run = next(s for s in spans if s["name"].endswith(".run"))
        tools = [s for s in spans if s["name"].endswith(".execute")]
        assert row["turns"] == sum(s["name"].endswith(".generate") for s in spans) and "num_turns" in run["output"]
        assert (row["tool_calls"], row["tool_errors"]) == (len(tools), sum(bool(s["exception"]) for s in tools))
        assert row["span_count"] == len(spans) and row["has_error"] == any(s["exception"] for s in spans)

    by_turns = get(col, "/ui/api/trajectories", sort="turns", order="desc", limit=500)["trajectories"]
    assert [t["turns"] for t in by_turns] == sorted((t["turns"] for t in by_turns), reverse=True) and len(by_turns) == 96
    by_duration = get(col, "/ui/api/trajectories", sort="duration", order="asc", limit=500)["trajectories"]
    assert [t["duration"] for t in by_duration] == sorted(t["duration"] for t in by_duration)

    checks = {
        "rollout_n": (dict(rollout_n=1), lambda t: t["rollout_n"] == 1, 24),
        "sample_index": (dict(sample_index=3, step=1), lambda t: t["sample_index"] == 3 and t["step"] == 1, 4),
        "step range": (dict(step_min=2, step_max=3), lambda t: t["step"] in (2, 3), 64),
        "reward range": (dict(reward_min=0.5, reward_max=0.8), lambda t: 0.5 <= t["reward"] <= 0.8, None),
        "errors": (dict(has_error="true"), lambda t: t["has_error"] and t["tool_errors"] > 0, None),
        "validation": (dict(validate="true"), lambda t: False, 0),
        "training": (dict(validate="false"), lambda t: t["validate"] is False, 96),
    }
    for name, (params, ok, expected) in checks.items():
        result = get(col, "/ui/api/trajectories", limit=500, **params)
        assert all(ok(t) for t in result["trajectories"]), name
        assert result["total"] == len(result["trajectories"]), name
        if expected is not None:
            assert result["total"] == expected, name
        else:
            assert 0 < result["total"] < 96, name


def test_trajectory_json_is_the_conversation(start_collector, tracer_to, deepseek_tokenizer_path):
    col = demo_collector(start_collector, tracer_to, deepseek_tokenizer_path)
    # one whose first tool call failed (the demo's agent then takes another turn): the richest case
    worst = get(col, "/ui/api/trajectories", has_error="true", sort="reward", order="asc", limit=1)["trajectories"][0]
    view = get(col, f"/ui/api/trajectories/{worst['trace_id']}")
    raw = get(col, f"/v1/trajectories/{worst['trace_id']}")
    generates = sorted((s for s in _walk(raw["root"]) if s["name"].endswith(".generate")), key=lambda s: s["start_time"])
    tools = sorted((s for s in _walk(raw["root"]) if s["name"].endswith(".execute")), key=lambda s: s["start_time"])

    assert view["reward"] == worst["reward"] == raw["annotations"][-1]["attributes"]["reward"]
    assert view["summary"]["trace_id"] == worst["trace_id"] and view["tree"]["span_id"] == worst["trace_id"]
    assert [t["span_id"] for t in view["turns"]] == [g["span_id"] for g in generates] and view["turn_count"] == worst["turns"]
    for turn, span in zip(view["turns"], generates):
        assert turn["prompt_text"] == span["output"]["prompt_text"] and turn["prompt_text"].startswith("<|user|>")
        assert turn["response_text"] == span["output"]["response_text"]
        assert turn["prompt_tokens"] == len(span["inputs"]["prompt_ids"])
        assert turn["response_tokens"] == len(span["output"]["token_ids"])
    first, second = view["turns"][0], view["turns"][1]
    assert second["new_context"].startswith("<tool_response>")  # what the tool fed back, not the whole prompt again
    assert second["prompt_text"] == first["prompt_text"] + first["response_text"] + second["new_context"]

    calls = [e for t in view["turns"] for e in t["after"] if e["type"] == "tool"]
    assert [c["span_id"] for c in calls] == [s["span_id"] for s in tools]
    for call, span in zip(calls, tools):
        assert call["arguments"] == span["inputs"]["parameters"] and "expression" in call["arguments"]
        assert call["error"] == span["exception"] and call["result"] == span["output"]
        assert call["duration"] == pytest.approx(span["end_time"] - span["start_time"])
    assert worst["tool_errors"] > 0 and any(c["error"] for c in calls) and len(view["turns"]) >= 2
    run = next(s for s in _walk(raw["root"]) if s["name"].endswith(".run"))
    metrics = {m["key"]: m["value"] for m in view["metrics"]}
    assert metrics["num_turns"] == run["output"]["num_turns"] and metrics["generate_calls"] == run["output"]["metrics"]["generate_calls"]

    assert httpx.get(col.url + "/ui", timeout=10).headers["location"] == "/ui/"
    assert httpx.get(col.url + "/ui/", params={"token": "x"}, timeout=10).status_code == 200  # no token configured
    missing = httpx.get(col.url + "/ui/api/trajectories/nope", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["field"] == "trace_id"


def test_overview_has_each_steps_distribution_best_and_worst(start_collector, tracer_to, deepseek_tokenizer_path):
    col = demo_collector(start_collector, tracer_to, deepseek_tokenizer_path)
    facets = get(col, "/ui/api/facets")
    assert [e["experiment"] for e in facets["experiments"]] == ["demo"] and facets["experiments"][0]["train"] == 96
    overview = get(col, "/ui/api/overview")  # the latest experiment by default
    assert overview["experiment"] == "demo" and [s["step"] for s in overview["steps"]] == [1, 2, 3]
    for step in overview["steps"]:
        rows = get(col, "/ui/api/trajectories", experiment="demo", step=step["step"], limit=100)["trajectories"]
        rewards = sorted(t["reward"] for t in rows)
        assert step["trajectories"] == step["scored"] == 32 == sum(step["hist"])
        assert (step["min"], step["max"]) == (rewards[0], rewards[-1])
        assert step["mean"] == pytest.approx(sum(rewards) / 32) and step["min"] <= step["p10"] <= step["p50"] <= step["p90"] <= step["max"]
        assert {t["trace_id"]: t["reward"] for t in rows}[step["worst"]["trace_id"]] == rewards[0]
        assert {t["trace_id"]: t["reward"] for t in rows}[step["best"]["trace_id"]] == rewards[-1]
        assert step["kept"] == {}
    assert get(col, "/ui/api/overview", experiment="demo", split="validation")["steps"] == []


def test_kept_because_on_roots_is_listed_filtered_and_counted(start_collector, tracer_to):
    col = start_collector()
    tracer = tracer_to(col.url, experiment="rules")
    for index in range(6):  # kept_because as a root attribute, the way a sampler writes it
        with rollout_trace_attr(sample_index=index, step=1, rollout_n=0, kept_because=["reward_max", "error", None][index % 3]) as traj:
            pass
        annotate(traj, reward=float(index))
    assert tracer.flush(20)
    facets = get(col, "/ui/api/facets")
    assert {r["rule"]: r["trajectories"] for r in facets["kept_because"]} == {"reward_max": 2, "error": 2}
    only = get(col, "/ui/api/trajectories", kept_because="error")["trajectories"]
    assert sorted(t["sample_index"] for t in only) == [1, 4] and {t["kept_because"] for t in only} == {"error"}
    assert get(col, "/ui/api/overview", experiment="rules")["steps"][0]["kept"] == {"reward_max": 2, "error": 2}


def test_tool_call_count_counts_real_tool_calls_only(start_collector, tracer_to):
    """A helper whose name merely contains "tool" (a tool's own helper, the agent loop's formatter,
    a tool parser) is no tool call: the list, the trajectory page and the exporters agree."""
    col = start_collector()
    tracer = tracer_to(col.url, experiment="tools")

    class SearchTool:
        @rollout_trace_op
        def lookup(self, query: str) -> list[str]:
            return [query]

        @rollout_trace_op
        async def execute(self, instance_id: str, parameters: dict[str, Any]) -> str:
            return self.lookup(parameters["q"])[0]

    class HermesToolParser:
        @rollout_trace_op
        async def extract_tool_calls(self, ids: list[int]) -> list[str]:
            return ["search"]

    class ToolAgentLoop:
        @rollout_trace_op
        def format_tool_response(self, text: str) -> str:
            return f"<tool_response>{text}</tool_response>"

        @rollout_trace_op
        async def run(self) -> str:
            await HermesToolParser().extract_tool_calls([1])
            text = await SearchTool().execute("i", {"q": "x"})
            return self.format_tool_response(text)

    async def trajectory() -> None:
        with rollout_trace_attr(sample_index=0, step=1, rollout_n=0):
            await ToolAgentLoop().run()

    asyncio.run(trajectory())
    assert tracer.flush(20)
    [row] = get(col, "/ui/api/trajectories", experiment="tools")["trajectories"]
    assert row["tool_calls"] == 1 and row["span_count"] == 6
    view = get(col, f"/ui/api/trajectories/{row['trace_id']}")
    assert view["tool_calls"] == 1


@pytest.mark.skipif(not TAIL_SAMPLING, reason="tail-based sampling (collector.selection) is not in this tree")
def test_tail_sampled_steps_appear_once_decided_with_their_rules(start_collector, tracer_to, deepseek_tokenizer_path):
    """Held spans are not shown until their step is decided; kept ones then carry kept_because."""
    col = demo_collector(start_collector, tracer_to, deepseek_tokenizer_path, max_trajectories_per_step=8,
                         trajectories_per_step=32, reward_wait_s=0.2, step_idle_s=0.5)
    overview: dict[str, Any] = {}
    for _ in range(200):  # bounded: the collector decides each step once its 32 trajectories are complete
        overview = get(col, "/ui/api/overview", experiment="demo")
        if overview["index"]["held_spans"] == 0 and len(overview["steps"]) == 3 and all(s["trajectories"] == 8 for s in overview["steps"]):
            break
        time.sleep(0.1)
    assert [s["trajectories"] for s in overview["steps"]] == [8, 8, 8], overview
    for step in overview["steps"]:  # the rules the page counts are the sampler's own records
        decided = get(col, "/v1/decisions", step=step["step"], experiment="demo")
        assert step["kept"] == decided["kept_by_rule"] and sum(step["kept"].values()) == 8
        kept_ids = {d["trace_id"] for d in decided["decisions"] if d["keep"]}
        listed_ids = {t["trace_id"] for t in get(col, "/ui/api/trajectories", step=step["step"], limit=100)["trajectories"]}
        assert listed_ids == kept_ids
    listed = get(col, "/ui/api/trajectories", limit=500)
    assert listed["total"] == 24 and all(t["kept_because"] for t in listed["trajectories"])
    assert get(col, "/v1/trajectories", limit=500)["total"] == 24


def _spans(trace: str, step: int, *, reward: float | None, children: int = 2, late_child: bool = False) -> list[dict[str, Any]]:
    attrs = {"step": step, "sample_index": 0, "rollout_n": 0, "validate": False, "experiment_name": "idx"}
    base = {"worker": "w", "project": None, "entity": None, "inputs": {}, "exception": None}
    run = f"{trace}-run"
    out = [{**base, "span_id": f"{trace}-g{i}", "trace_id": trace, "parent_id": run, "name": "Loop.generate", "kind": "op",
            "start_time": 10.0 + i, "end_time": 10.5 + i, "attributes": attrs, "inputs": {"prompt_ids": [1, 2, 3]},
            "output": {"token_ids": [4, 5]}} for i in range(children)]
    out.append({**base, "span_id": run, "trace_id": trace, "parent_id": trace, "name": "Loop.run", "kind": "op",
                "start_time": 10.0, "end_time": 20.0, "attributes": attrs, "output": {"response_ids": [4, 5] * children}})
    out.append({**base, "span_id": trace, "trace_id": trace, "parent_id": None, "name": "agent_loop", "kind": "trajectory",
                "start_time": 9.0, "end_time": 21.0, "attributes": attrs, "output": None})
    if late_child:  # a turn that arrives after its parent (another batch, another order)
        out.insert(len(out), out.pop(0))
    if reward is not None:
        out.append({**base, "span_id": f"{trace}-a", "trace_id": trace, "parent_id": None, "name": "annotation",
                    "kind": "annotation", "start_time": 22.0, "end_time": 22.0, "attributes": {"reward": reward}, "output": None})
    return out


def _write(spool: Spool, spans: list[dict[str, Any]]) -> None:
    spool.write([SpoolRow(span, orjson.dumps(span), None) for span in spans])


def test_index_catches_up_incrementally_persists_and_rebuilds_for_a_new_spool(tmp_path):
    path = tmp_path / "spool.sqlite3"
    spool = Spool(path, local_only=True)
    _write(spool, _spans("t1", 1, reward=None, children=3))
    index = TrajectoryIndex(path)
    assert index.refresh()
    first = index.list(ListFilter(), sort="reward")["trajectories"]
    assert [(t["trace_id"], t["turns"], t["reward"], t["response_tokens"]) for t in first] == [("t1", 3, None, 6)]

    late = _spans("t1", 1, reward=0.25)[-1]  # the reward annotation arrives after the root
    _write(spool, [late, *_spans("t2", 1, reward=0.75, late_child=True)])
    assert index.refresh()
    rows = {t["trace_id"]: t for t in index.list(ListFilter(), sort="reward", descending=True)["trajectories"]}
    assert rows["t1"]["reward"] == 0.25 and rows["t2"]["reward"] == 0.75
    assert rows["t2"]["turns"] == 2 and rows["t2"]["span_count"] == 4  # the aggregating run span is no turn
    assert [t["trace_id"] for t in index.list(ListFilter(), sort="reward", descending=True)["trajectories"]] == ["t2", "t1"]
    unscored = _spans("t3", 1, reward=None)
    _write(spool, unscored)
    assert index.refresh()
    for descending in (True, False):  # unscored trajectories come last in either order
        assert index.list(ListFilter(), sort="reward", descending=descending)["trajectories"][-1]["trace_id"] == "t3"
    page = index.list(ListFilter(), sort="reward", descending=True, limit=1, offset=2)
    assert page["total"] == 3 and [t["trace_id"] for t in page["trajectories"]] == ["t3"]
    index.close()

    reopened = TrajectoryIndex(path)  # the cache survives a restart: nothing is read again
    assert reopened.status()["indexed_seq"] == reopened.status()["latest_seq"] > 0
    assert reopened.list(ListFilter())["total"] == 3
    reopened.close()
    spool.close()

    for suffix in ("", "-wal", "-shm"):  # a new store in the same place: the index starts over
        Path(str(path) + suffix).unlink(missing_ok=True)
    spool = Spool(path, local_only=True)
    _write(spool, [*_spans("n1", 5, reward=1.0), *_spans("n2", 5, reward=2.0), *_spans("n3", 5, reward=3.0),
                   *_spans("n4", 5, reward=4.0)])
    fresh = TrajectoryIndex(path)
    assert fresh.refresh()
    assert sorted(t["trace_id"] for t in fresh.list(ListFilter())["trajectories"]) == ["n1", "n2", "n3", "n4"]
    fresh.close()
    spool.close()


def test_trajectories_without_an_experiment_name_are_their_own_experiment(tmp_path):
    path = tmp_path / "spool.sqlite3"
    spool = Spool(path, local_only=True)
    anonymous = _spans("anon", 7, reward=0.5)
    for span in anonymous:
        span["attributes"].pop("experiment_name", None)
    _write(spool, [*anonymous, *_spans("named", 7, reward=0.9)])
    index = TrajectoryIndex(path)
    assert index.refresh()
    assert [t["trace_id"] for t in index.list(ListFilter(experiment=""))["trajectories"]] == ["anon"]
    assert {e["experiment"] for e in index.facets()["experiments"]} == {None, "idx"}
    assert index.overview(None)["steps"][0]["best"]["trace_id"] == "anon"
    index.close()
    spool.close()


def test_list_and_overview_queries_use_indexes(tmp_path):
    """EXPLAIN QUERY PLAN: every sort walks its own index (no sort of all rows); filters seek."""
    path = tmp_path / "spool.sqlite3"
    spool = Spool(path, local_only=True)
    for step in range(1, 4):
        for n in range(4):
            _write(spool, _spans(f"s{step}-{n}", step, reward=step + n / 10))
    index = TrajectoryIndex(path)
    assert index.refresh()
    db = index._db()

    def plan(sql: str, params: list[Any]) -> str:
        return " | ".join(row[3] for row in db.execute("EXPLAIN QUERY PLAN " + sql, params))

    for sort, name in (("start", "traj_start"), ("reward", "traj_reward"), ("turns", "traj_turns"), ("duration", "traj_duration")):
        for descending in (True, False):
            sql, params = index.list_sql(ListFilter(), sort, descending, nulls=False)
            text = plan(sql, [*params, 50, 0])
            assert f"INDEX {name}" in text and "TEMP B-TREE" not in text, (sort, text)
    sql, params = index.list_sql(ListFilter(experiment="idx", step=2), "reward", True, nulls=False)
    text = plan(sql, [*params, 50, 0])
    assert "USING INDEX traj_filter (experiment=? AND step=?)" in text or "traj_overview (experiment=?" in text, text
    sql, params = index.list_sql(ListFilter(step_min=1, step_max=2), "start", True, nulls=False)
    assert "INDEX" in plan(sql, [*params, 50, 0])
    for validate in (False, True):
        text = plan(*index.overview_sql("idx", validate))
        assert "COVERING INDEX traj_overview" in text and "TEMP B-TREE" not in text, text
    text = plan("SELECT COUNT(*) FROM trajectories WHERE root_seq IS NOT NULL", [])
    assert "INDEX" in text, text
    index.close()
    spool.close()


def test_held_spans_wait_for_their_decision(tmp_path):
    """A span the sampler holds (state 3) is indexed once released, with what the decision wrote."""
    path = tmp_path / "spool.sqlite3"
    spool = Spool(path, local_only=True)
    spans = _spans("h1", 1, reward=0.5) + _spans("h2", 1, reward=0.1)
    index = TrajectoryIndex(path)
    db = sqlite3.connect(path)
    _write(spool, spans)
    db.execute("UPDATE spans SET state = 3")  # as a tail-based budget stores them
    db.commit()
    assert index.refresh()
    assert index.list(ListFilter())["total"] == 0 and index.status()["held_spans"] == len(spans)
    root = next(s for s in spans if s["span_id"] == "h1")
    patched = {**root, "attributes": {**root["attributes"], "kept_because": "reward_max"}}
    db.execute("UPDATE spans SET payload = ?, state = 1 WHERE span_id = 'h1'", (orjson.dumps(patched),))
    db.execute("UPDATE spans SET state = 1 WHERE trace_id = 'h1'")
    db.execute("DELETE FROM spans WHERE trace_id = 'h2'")  # dropped
    db.commit()
    index._held_checked_at = 0.0
    assert index.refresh()
    rows = index.list(ListFilter())["trajectories"]
    assert [(t["trace_id"], t["kept_because"], t["reward"], t["turns"]) for t in rows] == [("h1", "reward_max", 0.5, 2)]
    assert index.status()["held_spans"] == 0
    db.close()
    index.close()
    spool.close()


# ---- access --------------------------------------------------------------------------------------
def test_token_guards_every_viewer_route_and_the_cookie_only_reads(start_collector):
    col = start_collector(token="s3cret-token")
    url = col.url
    with httpx.Client(timeout=10) as client:
        assert client.get(url + "/ui/").status_code == 401
        assert "token" in client.get(url + "/ui/").text
        for path in ("/ui/api/facets", "/ui/api/trajectories", "/ui/static/app.js"):
            assert client.get(url + path).status_code == 401, path
            assert client.get(url + path, headers={"Authorization": "Bearer s3cret-token"}).status_code == 200, path
            assert client.get(url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
        assert client.get(url + "/ui/", params={"token": "wrong"}).status_code == 401
    with httpx.Client(timeout=10, cookies={COOKIE: "forged"}) as forged:
        assert forged.get(url + "/ui/").status_code == 401 and forged.get(url + "/ui/api/facets").status_code == 401
    with httpx.Client(timeout=10) as client:
        login = client.get(url + "/ui/", params={"token": "s3cret-token"})
        assert login.status_code == 303 and login.headers["location"] == "/ui/"  # the token leaves the address bar
        set_cookie = login.headers["set-cookie"]
        assert "HttpOnly" in set_cookie and "SameSite=strict" in set_cookie.replace("Strict", "strict") and "Path=/ui" in set_cookie
        cookie = login.cookies[COOKIE]
        assert cookie and "s3cret-token" not in cookie
    with httpx.Client(timeout=10, cookies={COOKIE: cookie}) as browser:
        page = browser.get(url + "/ui/")
        assert page.status_code == 200 and "static/app.js" in page.text
        assert "default-src 'none'" in page.headers["content-security-policy"]
        assert browser.get(url + "/ui/api/facets").status_code == 200
        assert browser.get(url + "/ui/static/vendor/chart.umd.min.js").status_code == 200
        assert browser.get(url + "/v1/trajectories").status_code == 401  # the cookie is for the viewer only
        assert browser.post(url + "/v1/spans", content=b"{}", headers={"content-type": "application/json"}).status_code == 401
        assert browser.get(url + "/ui/static/../viewer.py").status_code == 404
        assert browser.get(url + "/ui/static/%2e%2e/viewer.py").status_code == 404


def test_static_files_are_shipped_with_the_vendored_chart_library():
    from tracecar.collector.viewer import routes as viewer

    names = viewer._static_files()
    assert {"app.js", "style.css", "vendor/chart.umd.min.js", "vendor/chart.js.LICENSE.md"} <= set(names)
    assert (viewer.STATIC / "index.html").is_file()
    chart = (viewer.STATIC / "vendor" / "chart.umd.min.js").read_text()
    assert chart.startswith("/*!\n * Chart.js v4.") and "sourceMappingURL" not in chart
    for name in ("index.html", "app.js", "style.css"):  # nothing the page loads names another origin
        text = (viewer.STATIC / name).read_text()
        assert "http://" not in text and "https://" not in text and "//cdn" not in text, name


# ---- the page, in Chromium -------------------------------------------------------------------------
def _browser() -> Any:
    if not CHROMIUM.exists():
        pytest.skip("Debian's Chromium is not installed at /usr/bin/chromium (apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright

    return sync_playwright()


def expect(target: Any) -> Any:
    """playwright's polling assertions (no page-side eval, which the page's CSP forbids)."""
    from playwright.sync_api import expect as pw_expect

    return pw_expect(target)


class Page:
    """A playwright page that records console errors and every request's URL, and saves screenshots."""

    def __init__(self, pw: Any, tmp_path: Path, origin: str) -> None:
        self.browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        self.page = self.browser.new_page(viewport={"width": 1400, "height": 1000})
        self.page.set_default_timeout(20_000)
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.origin = origin
        self.tmp_path = tmp_path
        self.page.on("console", lambda m: self.errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))
        self.page.on("request", lambda r: self.requests.append(r.url))

    def shot(self, name: str) -> Path:
        path = self.tmp_path / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, ARTIFACTS / path.name)
        return path

    def check_clean(self) -> None:
        assert self.errors == []
        foreign = [u for u in self.requests if not u.startswith(self.origin + "/") and not u.startswith("data:")]
        assert foreign == []  # the page fetched nothing from any other origin

    def close(self) -> None:
        self.browser.close()


def test_page_newcomer_flow_list_filter_open_and_compare(start_collector, tracer_to, deepseek_tokenizer_path, tmp_path):
    col = demo_collector(start_collector, tracer_to, deepseek_tokenizer_path, token="viewer-token")
    step2 = get(col, "/ui/api/trajectories", experiment="demo", step=2, sort="reward", order="asc", limit=100)["trajectories"]
    worst, best = step2[0], step2[-1]
    with _browser() as pw:
        b = Page(pw, tmp_path, col.url)
        page = b.page
        try:
            page.goto(col.url + "/ui/?token=viewer-token")  # sets the cookie, then lands on /ui/
            assert page.url == col.url + "/ui/"
            page.wait_for_selector("[data-testid=steps-table] [data-testid=step-row]")
            expect(page.locator("canvas[data-testid=reward-chart]")).to_have_attribute("width", re.compile(r"^[1-9]"))
            assert page.locator("[data-testid=step-row]").count() == 3
            b.shot("01-overview")

            # Newcomer: the worst trajectory of step 2 (click 1), compared with the best (click 2).
            row = page.locator("[data-testid=step-row][data-step='2']")
            assert row.locator("[data-testid=worst-link]").inner_text() == js_fixed(worst['reward'], 3)
            row.locator("[data-testid=worst-link]").click()
            page.wait_for_selector(f"[data-testid=trajectory][data-trace-id='{worst['trace_id']}']")
            assert page.locator("[data-testid=trajectory] [data-testid=reward]").inner_text() == js_fixed(worst['reward'], 3)
            page.wait_for_selector("[data-testid=compare-with-best]")
            b.shot("02-worst-of-step-2")
            page.locator("[data-testid=compare-with-best]").click()
            page.wait_for_selector("[data-testid=compare-grid]")
            cols = page.locator("[data-testid=compare-col]")
            assert [cols.nth(i).get_attribute("data-trace-id") for i in range(cols.count())] == [worst["trace_id"], best["trace_id"]]
            assert page.locator("[data-testid=compare-reward]").all_inner_texts() == [f"{worst['reward']:.3f}", f"{best['reward']:.3f}"]
            assert page.locator("[data-testid=compare-grid] .differs").count() > 0
            assert page.locator("[data-testid=compare-grid] mark.chg").count() > 0
            b.shot("03-compare-worst-vs-best")

            # Or straight from the steps table: one click.
            page.goto(col.url + "/ui/#/")
            page.locator("[data-testid=step-row][data-step='2'] [data-testid=compare-best-worst]").click()
            page.wait_for_selector("[data-testid=compare-grid]")
            cols = page.locator("[data-testid=compare-col]")
            assert {cols.nth(i).get_attribute("data-trace-id") for i in range(cols.count())} == {worst["trace_id"], best["trace_id"]}

            # The list: filter step 2, rollout 1, worst first; then sort by turns from the header.
            page.goto(col.url + "/ui/#/list")
            page.wait_for_selector("[data-testid=traj-row]")
            assert page.locator("[data-testid=page-info]").inner_text() == "1–50 of 96"
            form = page.locator("[data-testid=filter-form]")
            form.locator("input[name=step]").fill("2")
            form.locator("input[name=rollout_n]").fill("1")
            form.locator("select[name=sort]").select_option("reward")
            form.locator("select[name=order]").select_option("asc")
            form.locator("[data-testid=apply-filters]").click()
            expect(page.locator("[data-testid=page-info]")).to_have_text("1–8 of 8")
            expected = [t for t in step2 if t["rollout_n"] == 1]
            assert page.locator("[data-testid=traj-row]").evaluate_all("rows => rows.map(r => r.dataset.traceId)") == [t["trace_id"] for t in expected]
            assert page.locator("[data-testid=traj-row] [data-testid=reward]").all_inner_texts() == [f"{t['reward']:.3f}" for t in expected]
            page.locator("th[data-sort=turns]").click()
            page.wait_for_selector("th.sorted[data-sort=turns]")
            turns = [int(x) for x in page.locator("[data-testid=traj-row] td:nth-child(10)").all_inner_texts()]
            assert turns == sorted(turns, reverse=True) and len(turns) == 8
            b.shot("04-list-step-2-rollout-1")

            # Compare two ticked rows.
            boxes = page.locator("[data-testid=traj-row] input[type=checkbox]")
            boxes.nth(0).check()
            boxes.nth(1).check()
            ticked = page.locator("[data-testid=traj-row]").evaluate_all("rows => rows.slice(0, 2).map(r => r.dataset.traceId)")
            page.locator("[data-testid=compare-selected]").click()
            page.wait_for_selector("[data-testid=compare-grid]")
            cols = page.locator("[data-testid=compare-col]")
            assert [cols.nth(i).get_attribute("data-trace-id") for i in range(cols.count())] == ticked

            # One trajectory: every turn with decoded text and token counts, its tool calls, its spans.
            page.goto(col.url + f"/ui/#/t/{worst['trace_id']}")
            page.wait_for_selector("[data-testid=turn]")
            assert page.locator("[data-testid=turn]").count() == worst["turns"]
            first_turn = page.locator("[data-testid=turn]").first.inner_text()
            assert "<|user|>" in first_turn and "prompt tokens" in first_turn and "<tool_call>" in first_turn
            assert page.locator("[data-testid=tool-call]").count() == worst["tool_calls"]
            assert "expression" in page.locator("[data-testid=tool-call]").first.inner_text()
            assert ("ValueError" in page.locator("[data-testid=trajectory]").inner_text()) == (worst["tool_errors"] > 0)
            page.locator("[data-testid=span-tree] summary").first.click()
            page.wait_for_selector("[data-testid=span-tree] pre.json")
            assert "experiment_name" in page.locator("[data-testid=span-tree] pre.json").first.inner_text()
            b.shot("05-trajectory")
            b.check_clean()
        finally:
            b.close()


@pytest.mark.skipif(not TAIL_SAMPLING, reason="tail-based sampling (collector.selection) is not in this tree")
def test_page_shows_trajectories_kept_per_rule(start_collector, tracer_to, deepseek_tokenizer_path, tmp_path):
    col = demo_collector(start_collector, tracer_to, deepseek_tokenizer_path, max_trajectories_per_step=8,
                         trajectories_per_step=32, reward_wait_s=0.2, step_idle_s=0.5)
    for _ in range(200):  # bounded wait for the three decisions
        overview = get(col, "/ui/api/overview", experiment="demo")
        if overview["index"]["held_spans"] == 0 and len(overview["steps"]) == 3 and all(s["trajectories"] == 8 for s in overview["steps"]):
            break
        time.sleep(0.1)
    rules = sorted({r for s in overview["steps"] for r in s["kept"]})
    assert rules
    with _browser() as pw:
        b = Page(pw, tmp_path, col.url)
        page = b.page
        try:
            page.goto(col.url + "/ui/")
            page.wait_for_selector("canvas[data-testid=kept-chart]")
            expect(page.locator("canvas[data-testid=kept-chart]")).to_have_attribute("width", re.compile(r"^[1-9]"))
            badges = page.locator("[data-testid=step-row][data-step='1'] .badge.rule").all_inner_texts()
            assert sorted(text.rsplit(" ", 1)[0] for text in badges) == sorted(overview["steps"][0]["kept"])
            b.shot("06-overview-kept-per-rule")
            page.goto(col.url + "/ui/#/list")
            page.wait_for_selector("[data-testid=traj-row]")
            page.locator("[data-testid=filter-form] select[name=kept_because]").select_option(rules[0])
            page.locator("[data-testid=apply-filters]").click()
            expect(page).to_have_url(re.compile("kept_because=" + re.escape(rules[0])))
            page.wait_for_selector("[data-testid=traj-row]")
            deadline = time.monotonic() + 15  # the unfiltered rows stay on screen until the filtered page lands
            kept = page.locator("[data-testid=traj-row] .badge.rule").all_inner_texts()
            while time.monotonic() < deadline and not (kept and set(kept) == {rules[0]}):
                time.sleep(0.1)
                kept = page.locator("[data-testid=traj-row] .badge.rule").all_inner_texts()
            assert kept and set(kept) == {rules[0]}
            b.shot("07-list-kept-because")
            b.check_clean()
        finally:
            b.close()
