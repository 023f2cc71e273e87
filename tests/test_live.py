"""Live rollouts: a trajectory whose root has not arrived is listed with its spans so far
(``/v1/live``, ``tracecar live``), and nothing partial reaches Weave as if it were whole."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tracecar.client import rollout_trace_attr, rollout_trace_op
from tracecar.client.cli import main as cli_main
from tracecar.collector.exporters.weave_sink import WeaveSink


class Agent:
    """VERL's shape: trajectory → run (top-level call) → generate, tool, then a tool that hangs."""

    def __init__(self, release: threading.Event) -> None:
        self.release = release

    @rollout_trace_op
    def generate(self, prompt: str) -> str:
        return prompt + " -> call search"

    @rollout_trace_op
    def search(self, query: str) -> str:
        return "result for " + query

    @rollout_trace_op
    def stuck_tool(self, query: str) -> str:
        assert self.release.wait(60), "the test never released the stuck tool"
        return "finally"

    @rollout_trace_op
    def run(self, prompt: str) -> str:
        self.generate(prompt)
        self.search(prompt)
        return self.stuck_tool(prompt)


@pytest.fixture
def rollout() -> Iterator[Any]:
    """Starts one trajectory on a thread (step 3, sample 7, rollout 1); it hangs until released."""
    release = threading.Event()
    threads: list[threading.Thread] = []

    def start(experiment_step: int = 3) -> None:
        def body() -> None:
            with rollout_trace_attr(sample_index=7, step=experiment_step, rollout_n=1, name="agent_loop"):
                Agent(release).run("2+2?")

        t = threading.Thread(target=body, daemon=True)
        t.start()
        threads.append(t)

    start.release = release  # type: ignore[attr-defined]
    yield start
    release.set()
    for t in threads:
        t.join(10)


def _live(url: str, **params: Any) -> dict[str, Any]:
    response = httpx.get(url + "/v1/live", params=params, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def _wait_live(url: str, spans: int, kit: Any, **params: Any) -> dict[str, Any]:
    return kit.wait_for(lambda: next((t for t in _live(url, **params)["trajectories"] if t["spans"] == spans), None), timeout=20)


def test_a_running_trajectory_is_listed_with_its_spans_so_far_then_leaves_when_done(start_collector, tracer_to, rollout, kit, capsys):
    col = start_collector()
    tracer_to(col.url, experiment="exp-live")
    rollout()
    running = _wait_live(col.url, 2, kit, experiment="exp-live", step=3)
    assert (running["step"], running["sample_index"], running["rollout_n"], running["experiment"]) == (3, 7, 1, "exp-live")
    assert [s["name"] for s in running["span_list"]] == ["Agent.generate", "Agent.search"]
    assert running["last_span"]["name"] == "Agent.search"  # what ran last: the call after it is the stuck one
    # the workers' open markers name what is running: the trajectory, its agent loop and the tool that hangs
    print("DBG", running, kit.metrics(col.url, "tracecar_open_calls"))
    assert [c["name"] for c in running["open_calls"]] == ["agent_loop", "Agent.run", "Agent.stuck_tool"]
    assert running["stuck_call"]["name"] == "Agent.stuck_tool" and running["stuck_call"]["running_s"] >= 0
    assert running["age_s"] >= 0 and running["idle_s"] >= 0 and running["errors"] == 0
    time.sleep(0.5)
    again = _live(col.url, step=3)["trajectories"][0]
    assert again["idle_s"] >= running["idle_s"] + 0.4  # idle grows while nothing arrives
    assert _live(col.url, step=4)["total"] == 0  # filters apply
    # not a finished trajectory yet: the store's list does not show it
    assert httpx.get(col.url + "/v1/trajectories", timeout=10).json()["total"] == 0
    cli_main(["live", "--url", col.url, "--step", "3"])
    out = capsys.readouterr().out
    assert "1 running trajectory" in out and running["trace_id"] in out and "Agent.stuck_tool" in out

    rollout.release.set()
    kit.wait_for(lambda: _live(col.url)["total"] == 0, timeout=20)
    done = httpx.get(col.url + "/v1/trajectories", timeout=10).json()
    assert done["total"] == 1 and done["trajectories"][0]["trace_id"] == running["trace_id"]
    assert done["trajectories"][0]["span_count"] == 5
    assert kit.metrics(col.url, "tracecar_open_calls") == 0  # every marker left with its span
    stored = httpx.get(col.url + f"/v1/trajectories/{running['trace_id']}", timeout=10).text
    assert ".open" not in stored  # markers are never stored


class Hangs:
    def __init__(self, release: threading.Event) -> None:
        self.release = release

    @rollout_trace_op
    def generate(self, prompt: str) -> str:
        assert self.release.wait(60)
        return prompt


def test_a_trajectory_whose_first_call_hangs_is_listed_by_its_open_markers(start_collector, tracer_to, kit):
    col = start_collector()
    tracer_to(col.url, experiment="exp-live")
    release = threading.Event()

    def body() -> None:
        with rollout_trace_attr(sample_index="uuid-1", step=9, rollout_n=0, name="agent_loop"):
            Hangs(release).generate("hello")

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    try:
        found = kit.wait_for(lambda: _live(col.url, step=9, sample_index="uuid-1")["trajectories"], timeout=20)
        assert len(found) == 1 and found[0]["spans"] == 0 and found[0]["last_span"] is None
        assert found[0]["sample_index"] == "uuid-1" and found[0]["stuck_call"]["name"] == "Hangs.generate"
        assert _live(col.url, step=8)["total"] == 0
        assert kit.metrics(col.url, "tracecar_open_calls") == 2
        assert httpx.get(col.url + "/v1/trajectories", timeout=10).json()["total"] == 0
    finally:
        release.set()
        thread.join(10)
    kit.wait_for(lambda: _live(col.url)["total"] == 0, timeout=20)
    assert kit.metrics(col.url, "tracecar_open_calls") == 0


def test_without_open_markers_a_stuck_call_shows_as_idle_since_the_last_span(start_collector, tracer_to, rollout, kit):
    col = start_collector()
    tracer = tracer_to(col.url, experiment="exp-live", open_markers=False)
    rollout()
    running = _wait_live(col.url, 2, kit)
    assert running["open_calls"] == [] and running["stuck_call"] is None and running["last_span"]["name"] == "Agent.search"
    assert tracer.stats()["open_markers_skipped"] == 0


def test_the_live_view_answers_on_the_viewer_route_and_rejects_bad_parameters(start_collector, tracer_to, rollout, kit):
    col = start_collector(token="s3cret-token-live")
    tracer_to(col.url, experiment="exp-live", token="s3cret-token-live")
    rollout()
    auth = {"Authorization": "Bearer s3cret-token-live"}
    kit.wait_for(lambda: httpx.get(col.url + "/ui/api/live", headers=auth, timeout=10).json()["total"] == 1, timeout=20)
    assert httpx.get(col.url + "/v1/live", timeout=10).status_code == 401
    bad = httpx.get(col.url + "/v1/live", params={"step": "x"}, headers=auth, timeout=10)
    assert bad.status_code == 422 and "step" in bad.text
    assert httpx.get(col.url + "/v1/live", params={"limit": 0}, headers=auth, timeout=10).status_code == 422


def test_a_running_trajectory_is_not_forwarded_under_a_tail_budget_and_is_once_complete(
        start_collector, tracer_to, rollout, kit, faulty_weave_stub):
    stub = faulty_weave_stub
    sink = WeaveSink(api_key=kit.WANDB_KEY, entity="ent", project="proj", server_url=stub.url)
    col = start_collector(sink=sink, backend="weave", max_trajectories_per_step=10, step_idle_s=0.2, reward_wait_s=0,
                          decision_wait_s=600, forward_retry_initial_s=0.05)
    tracer_to(col.url, experiment="exp-live")
    rollout()
    running = _wait_live(col.url, 2, kit)
    assert running["held"] == 2  # held in the spool awaiting the step's decision
    time.sleep(1.5)  # many times step_idle_s: an idle step with a running trajectory stays undecided
    assert stub.completed_calls() == []
    undecided = httpx.get(col.url + "/v1/decisions", params={"step": 3, "experiment": "exp-live"}, timeout=10).json()
    assert undecided["mode"] == "tail" and undecided["decisions"] == [] and undecided["open"]

    rollout.release.set()
    kit.wait_for(lambda: len(stub.delivered()) == 4, timeout=30)  # run, generate, search, stuck_tool (root elided)
    time.sleep(0.5)
    calls = stub.completed_calls()
    assert len(calls) == 4  # no open marker is ever forwarded
    roots = [c for c in calls if c["parent_id"] is None]
    assert [c["op_name"].split("/")[-1].split(":")[0] for c in roots] == ["Agent.run"]
    assert _live(col.url)["total"] == 0


def test_without_a_budget_no_weave_root_is_sent_before_it_is_whole(start_collector, tracer_to, rollout, kit, faulty_weave_stub):
    """Pass mode forwards each finished call at once (as VERL's weave backend does); the trace's
    root call (the agent loop) only once it has finished, so Weave never lists a partial trace."""
    stub = faulty_weave_stub
    sink = WeaveSink(api_key=kit.WANDB_KEY, entity="ent", project="proj", server_url=stub.url)
    col = start_collector(sink=sink, backend="weave", forward_retry_initial_s=0.05)
    tracer_to(col.url, experiment="exp-live")
    rollout()
    running = _wait_live(col.url, 2, kit)
    kit.wait_for(lambda: len(stub.delivered()) == 2, timeout=20)
    early = stub.completed_calls()
    assert all(c["parent_id"] is not None for c in early)  # children of a call Weave has not got yet
    assert running["held"] == 0

    rollout.release.set()
    kit.wait_for(lambda: len(stub.delivered()) == 4, timeout=30)
    roots = [c for c in stub.completed_calls() if c["parent_id"] is None]
    assert len(roots) == 1 and roots[0]["ended_at"] >= max(c["ended_at"] for c in early)


def test_page_shows_running_trajectories_and_updates_without_reloading(start_collector, tracer_to, rollout, kit, tmp_path):
    from tests.test_viewer import Page, _browser, expect
    from tests.test_viewer_lookfeel import doc_shot

    col = start_collector()
    tracer_to(col.url, experiment="exp-live")
    with rollout_trace_attr(sample_index=0, step=3, rollout_n=0, name="agent_loop"):  # a finished one of the same step
        Agent(threading.Event()).generate("done already")
    rollout()
    running = _wait_live(col.url, 2, kit)
    with _browser() as pw:
        b = Page(pw, tmp_path, col.url)
        page = b.page
        try:
            page.goto(col.url + "/ui/#/live")
            row = page.locator("[data-testid=live-row]")
            expect(row).to_have_count(1)
            assert row.get_attribute("data-trace-id") == running["trace_id"]
            expect(row.locator("[data-testid=live-last-span]")).to_have_text("Agent.search")
            expect(row.locator("[data-testid=live-waiting] code")).to_have_text("Agent.stuck_tool")
            expect(row.locator("[data-testid=live-span-count]")).to_have_text("2")
            row.click()
            expect(page.locator("[data-testid=live-spans] li")).to_have_count(2)
            expect(page.locator("[data-testid=live-open-calls] code")).to_have_text(["agent_loop", "Agent.run", "Agent.stuck_tool"])
            b.shot("20-live-running")
            doc_shot(page, "live")
            page.goto(col.url + "/ui/#/list?experiment=exp-live&step=3")
            expect(page.locator("[data-testid=live-panel] [data-testid=live-row]")).to_have_count(1)
            expect(page.locator("[data-testid=traj-row]")).to_have_count(1)  # only the finished one is listed
            b.shot("21-step-list-with-running")
            url = page.url
            rollout.release.set()
            # no reload: the panel's poll sees it finish, hides itself and the list re-reads
            expect(page.locator("[data-testid=traj-row]")).to_have_count(2, timeout=20_000)
            expect(page.locator("[data-testid=live-panel]")).to_be_hidden()
            assert page.url == url
            page.goto(col.url + "/ui/#/live")
            expect(page.locator("[data-testid=live-empty]")).to_be_visible()
            b.shot("22-live-nothing-running")
            b.check_clean()
        finally:
            b.close()


def test_the_live_query_reads_only_the_newest_rows(tmp_path):
    """EXPLAIN QUERY PLAN: the candidates come from a rowid range (the window), never a walk of
    the whole store; and the window's start is found by binary search on arrival time."""
    import sqlite3

    import orjson

    from tracecar.collector.spool.live import candidates_sql, first_seq_since
    from tracecar.collector.spool.store import Spool, SpoolRow
    from tracecar.collector.trajectory_filter import TrajectoryFilter as LiveFilter

    spool = Spool(tmp_path / "spool.sqlite3", local_only=True)
    for i, at in enumerate((100.0, 200.0, 300.0, 400.0)):
        span = {"span_id": f"s{i}", "trace_id": f"t{i}", "parent_id": f"p{i}", "name": "op", "kind": "op", "worker": "w",
                "start_time": at, "end_time": at, "attributes": {"step": 1}, "exception": None}
        spool.write([SpoolRow(span, orjson.dumps(span), None)], now=at)
    assert [first_seq_since(spool, t) for t in (0, 150, 300, 301, 999)] == [1, 2, 3, 4, 5]
    db = sqlite3.connect(tmp_path / "spool.sqlite3")
    for flt in (LiveFilter(), LiveFilter(experiment="e", step=3, validate=False, worker="w", sample_index="7")):
        sql, params = candidates_sql(flt, 3)
        plan = " | ".join(row[3] for row in db.execute("EXPLAIN QUERY PLAN " + sql, params))
        assert "INTEGER PRIMARY KEY (rowid>?)" in plan and "spans_trace" not in plan, plan
    assert {r["trace_id"] for r in spool.query(*candidates_sql(LiveFilter(), 3))} == {"t2", "t3"}
    spool.close()
