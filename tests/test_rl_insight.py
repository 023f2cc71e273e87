"""RL-Insight's Agent Loop protocol in: its own SDK, pointed at the collector, makes tracecar trajectories.

The sending side is the real ``rl-insight`` package (0.3.0): ``rl_insight.init`` starts its Ray hub
actor (a real local Ray), which asks ``GET /api/v1/services`` for the OTLP port (the collector
answers as RL-Insight's server does) and exports every span over OTLP/HTTP; the agent runtime's
side is the protocol as ``docs/monitor/agent_loop_protocol.md`` and RL-Insight's own smoke test
write it: ``agent_loop_session``, ``trace_span("agent_task", ...)``, ``trace_span("gateway_generation",
...)``, ``session.finish(...)``. Two prompts (samples) of one step, two sessions (rollouts) each; one
session finishes before its task span is sent, one generation fails. Read back from the store, the
viewer's API, the RL views (``/v1/groups``), the dataset export, and every exporter (Weave's own
trace server, Phoenix, MLflow) where their venvs exist.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("rl_insight.agent_loop")
ray = pytest.importorskip("ray")

from tests.mlflow_kit import MLFLOW_PYTHON  # noqa: E402
from tests.mlflow_kit import mlflow_server as start_mlflow_server  # noqa: E402
from tests.mlflow_kit import read_back as mlflow_read_back  # noqa: E402
from tests.support import free_port, serve_in_thread  # noqa: E402
from tests.support.weave_stub import WeaveSqliteServer, weave_server_python  # noqa: E402
from tests.test_all_backends import API_KEY, ENTITY, Phoenix  # noqa: E402
from tests.test_phoenix_export import PHOENIX_PYTHON  # noqa: E402

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # else ray writes a token under ~/.ray
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

pytestmark = [pytest.mark.timeout(600)]
PROJECT, EXPERIMENT, STEP = "insight-proj", "insight-exp", 7
REWARDS = {(0, 0): 1.0, (0, 1): 0.0, (1, 0): 0.5, (1, 1): 0.5}  # (sample, session) -> the task's reward
ROOT_FIRST = (1, 0)  # this session finishes before its task span is sent
FAILED = (0, 1)  # this session's second generation fails
WEAVE_PYTHON = weave_server_python()
HAVE_EXPORTERS = bool(PHOENIX_PYTHON and Path(PHOENIX_PYTHON).exists() and MLFLOW_PYTHON and Path(MLFLOW_PYTHON).exists()
                      and WEAVE_PYTHON)


@dataclass(frozen=True)
class Trajectory:
    """What ``session.finish(trajectories=...)`` reads (RL-Insight's protocol: chain_id, reward_score, num_turns)."""

    chain_id: int
    reward_score: float
    num_turns: int


def emit_agent_loop_runs() -> None:
    """The agent runtime's side of the protocol, with RL-Insight's own SDK."""
    from rl_insight import agent_loop_session, trace_span
    from rl_insight.agent_loop import agent_loop_lane_id

    for (sample, session_index), reward in REWARDS.items():
        session = agent_loop_session(project=PROJECT, experiment_name=EXPERIMENT, sample=sample, session=session_index,
                                     traj=0, uid=f"uid-{sample}-{session_index}", global_steps=STEP,
                                     session_id=f"session-{sample}-{session_index}")
        identity = session.identity

        def task() -> None:
            now = time.time_ns()
            trace_span(name="agent_task", start_time_ns=now - 5_000_000, end_time_ns=now, attributes={  # noqa: B023
                **identity, "monitor.trace_source": "task", "task_name": "add-numbers",  # noqa: B023
                "image_ref": "python:3.12", "prompt_hash": f"hash-{sample}", "status": "success",  # noqa: B023
                "reward": reward, "accuracy": reward, "finished": True, "reward_posted": True, "error": ""})  # noqa: B023

        for turn in (1, 2):
            failed = (sample, session_index) == FAILED and turn == 2
            start = time.time_ns()
            trace_span(name="gateway_generation", start_time_ns=start, end_time_ns=start + 2_000_000, attributes={
                **identity, "monitor.trace_source": "gateway",
                "state_lane_id": agent_loop_lane_id(EXPERIMENT, sample, session_index, 0), "traj": 0, "chain_id": 1,
                "turn": turn, "type": "llm", "tools": "" if turn == 2 else '["add"]',
                "content": "" if failed else f"answer {sample}.{session_index}.{turn}",
                "prompt_tokens": 16 * turn, "completion_tokens": 0 if failed else 4 + turn,
                "finish_reason": "" if failed else "stop", "status": "error" if failed else "success",
                "error": "gateway timeout after 30 s" if failed else ""})
        if (sample, session_index) != ROOT_FIRST:
            task()
        session.finish(trajectories=[Trajectory(chain_id=1, reward_score=reward, num_turns=2)], status="success",
                       runner_name="task", reward_source="reward_info", finished=True)
        if (sample, session_index) == ROOT_FIRST:
            time.sleep(1.0)  # the hub exports the finished session before the task span is even made
            task()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A collector (fanning out to Weave, Phoenix and MLflow where their venvs exist), Ray, RL-Insight's SDK."""
    from rl_insight.api import finish, init
    from rl_insight.client.ray_monitor_client import _current_job_actor_name
    from rl_insight.utils.constants import MonitorRayActor

    from tracecar.collector.settings import CollectorSettings

    work = tmp_path_factory.mktemp("rl-insight")
    servers: dict[str, Any] = {}
    cleanups: list[Any] = []
    settings: dict[str, Any] = {"backend": "local"}
    if HAVE_EXPORTERS:
        phoenix = Phoenix(work / "phoenix")
        phoenix.start()
        cleanups.append(phoenix.stop)
        weave = WeaveSqliteServer(WEAVE_PYTHON).__enter__()
        cleanups.append(lambda: weave.__exit__(None, None, None))
        mlflow = start_mlflow_server(work / "mlflow")
        servers["mlflow"] = mlflow.__enter__()
        cleanups.append(lambda: mlflow.__exit__(None, None, None))
        servers.update(phoenix=phoenix, weave=weave.url)
        settings = dict(backend="weave", exporters=["weave", "otlp", "mlflow"], wandb_api_key=API_KEY,
                        wandb_entity=ENTITY, wandb_project=PROJECT, weave_server_url=weave.url,
                        otlp_endpoint=phoenix.url + "/v1/traces", otlp_content=True, mlflow_tracking_uri=servers["mlflow"])
    col = serve_in_thread(CollectorSettings(host="127.0.0.1", port=free_port(), data_dir=work / "data", **settings))
    cleanups.append(col.stop)
    os.environ["RL_INSIGHT_SERVER_URL"] = col.url
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "200"  # the hub's BatchSpanProcessor: export within 0.2 s, not 5 s
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace=MonitorRayActor.NAMESPACE)
    try:
        init(project=PROJECT, experiment_name=EXPERIMENT, config={"prometheus": {"metrics_report_port": free_port()}})
        hub = ray.get_actor(_current_job_actor_name(), namespace=MonitorRayActor.NAMESPACE)
        status = ray.get(hub.get_status.remote(), timeout=120)
        assert status["otel_traces_enabled"] is True  # the hub found the collector's OTLP port through discovery
        emit_agent_loop_runs()
        ray.get(hub.get_status.remote(), timeout=60)  # every event above reached the hub (an actor runs them in order)
        _until("every session in the store", lambda: len(_list(col.url)) == len(REWARDS)
               and all(t["reward"] is not None for t in _list(col.url)))
        yield {"col": col, **servers}
    finally:
        finish()
        ray.shutdown()
        for cleanup in reversed(cleanups):
            cleanup()
        os.environ.pop("RL_INSIGHT_SERVER_URL", None)
        os.environ.pop("OTEL_BSP_SCHEDULE_DELAY", None)  # other tests' engines keep the SDK's own schedule


def _until(what: str, check: Any, timeout_s: float = 90, every_s: float = 0.3) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(every_s)


def _list(url: str) -> list[dict[str, Any]]:
    page = httpx.get(url + "/v1/trajectories", params={"experiment": EXPERIMENT, "limit": 100}, timeout=10).json()
    return page["trajectories"]


def _spans(node: dict[str, Any]) -> list[dict[str, Any]]:
    out = [node]
    for child in node.get("children", []):
        out.extend(_spans(child))
    return out


def test_each_agent_session_is_a_scored_trajectory_in_the_store_and_the_viewer(run):
    col = run["col"]
    listed = {(t["sample_index"], t["rollout_n"]): t for t in _list(col.url)}
    assert set(listed) == set(REWARDS)  # sample -> sample_index, session -> rollout_n (ints again)
    for key, summary in listed.items():
        assert summary["step"] == STEP and summary["reward"] == REWARDS[key] and summary["name"] == "agent_session"
        tree = httpx.get(f"{col.url}/v1/trajectories/{summary['trace_id']}", timeout=10).json()
        root = tree["root"]
        assert root["span_id"] == root["trace_id"] == summary["trace_id"] and root["kind"] == "trajectory"
        assert root["output"] == {"status": "success", "num_trajectories": 1, "finished": True, "runner_name": "task",
                                  "reward_source": "reward_info"}
        assert root["attributes"]["state_lane_id"] == f"experiment={EXPERIMENT}/sample={key[0]}/session={key[1]}/traj=0"
        children = {(c["name"], c["inputs"].get("turn")): c for c in root["children"]}
        assert set(children) == {("agent_task", None), ("gateway_generation", 1), ("gateway_generation", 2)}
        task = children[("agent_task", None)]
        assert task["inputs"] == {"task_name": "add-numbers", "image_ref": "python:3.12", "prompt_hash": f"hash-{key[0]}"}
        assert task["output"]["reward"] == REWARDS[key] and task["output"]["accuracy"] == REWARDS[key]
        assert task["output"]["status"] == "success" and task["exception"] is None
        second = children[("gateway_generation", 2)]
        assert second["inputs"] == {"turn": 2, "traj": 0, "chain_id": 1, "type": "llm", "tools": ""}
        if key == FAILED:
            assert second["exception"] == "gateway timeout after 30 s" and second["output"]["status"] == "error"
        else:
            assert second["exception"] is None
            assert second["output"] == {"response_text": f"answer {key[0]}.{key[1]}.2", "finish_reason": "stop",
                                        "prompt_tokens": 32, "completion_tokens": 6, "status": "success", "error": ""}
        assert {s["worker"] for s in _spans(root)} == {"rl-insight:rl_insight_monitor"}  # one worker: one budget key
        # the viewer: the conversation, turn by turn, with the task's reward
        view = httpx.get(f"{col.url}/ui/api/trajectories/{summary['trace_id']}", timeout=10).json()
        assert [t["response_text"] for t in view["turns"]][:1] == [f"answer {key[0]}.{key[1]}.1"]
        assert len(view["turns"]) == 2 and view["reward"] == REWARDS[key]
        assert view["summary"]["reward"] == REWARDS[key] and view["summary"]["has_error"] == (key == FAILED)
    stored = run["col"].collector.spool.query(
        "SELECT project, COUNT(*) AS n FROM spans WHERE experiment = ? GROUP BY project", [EXPERIMENT])
    assert stored == [{"project": PROJECT, "n": 5 * len(REWARDS)}]  # root, task, 2 generations, the reward annotation


def test_sessions_group_by_sample_in_the_rl_views_and_export(run):
    col = run["col"]
    groups = httpx.get(col.url + "/v1/groups", params={"step": STEP, "experiment": EXPERIMENT}, timeout=10).json()
    by_sample = {g["sample_index"]: g for g in groups["groups"]}
    assert set(by_sample) == {0, 1}
    assert [r["reward"] for r in by_sample[0]["rollouts"]] == [1.0, 0.0]  # ranked by reward
    assert by_sample[1]["all_equal"] is True and by_sample[0]["all_equal"] is False
    lines = httpx.get(col.url + "/v1/export", params={"format": "jsonl", "step": STEP, "experiment": EXPERIMENT},
                      timeout=30).text.splitlines()
    assert len(lines) == len(REWARDS)
    assert all('"answer ' in line for line in lines)


@pytest.mark.skipif(not HAVE_EXPORTERS, reason="needs .venv-phoenix, .venv-mlflow and .venv-weave52 (tests/run.sh with "
                                              "TRACECAR_TEST_OTLP_SERVERS=1 TRACECAR_TEST_WEAVE_SERVER=1)")
def test_every_exporter_has_each_session_whole_under_its_root(run):
    trace_ids = {t["trace_id"] for t in _list(run["col"].url)}
    spans_per_session = 4  # root, task, two generations (the reward annotation merges upstream)
    phoenix = _until("phoenix", lambda: len(s := _phoenix_spans(run["phoenix"].url)) >= spans_per_session * len(REWARDS) and s)
    assert {s["context"]["trace_id"] for s in phoenix} == trace_ids
    assert sorted(s["name"] for s in phoenix if s.get("parent_id") is None) == ["agent_session"] * len(REWARDS)
    traces = _until("mlflow", lambda: (t := mlflow_read_back(run["mlflow"], PROJECT)) and len(t) >= len(REWARDS) and t,
                    every_s=2)
    assert len(traces) == len(REWARDS) and all(len(t["spans"]) == spans_per_session for t in traces)
    for trace in traces:
        by_id = {s["span_id"]: s for s in trace["spans"]}
        [root] = [s for s in trace["spans"] if s["parent_id"] is None]
        assert root["name"] == "agent_session" and all(s["parent_id"] in (None, root["span_id"]) for s in by_id.values())
    calls = _until("weave", lambda: len(c := _weave_calls(run["weave"])) >= spans_per_session * len(REWARDS) and c)
    assert len(calls) == spans_per_session * len(REWARDS)
    by_id = {c.id: c for c in calls}
    roots = [c for c in calls if c.parent_id is None]
    assert sorted(c.op_name.rsplit("/", 1)[-1].split(":")[0] for c in roots) == ["agent_session"] * len(REWARDS)
    assert all(by_id[c.parent_id] in roots for c in calls if c.parent_id is not None)
    tasks = [c for c in calls if "agent_task" in c.op_name]
    assert sorted(c.output["reward"] for c in tasks) == sorted(REWARDS.values())
    generations = [c for c in calls if "gateway_generation" in c.op_name]
    assert sum(c.exception is not None for c in generations) == 1 and len(generations) == 2 * len(REWARDS)
    # every exporter but Weave took everything; weave 0.52's own SQLite server refuses feedback (the reward
    # annotation) without a wb_user_id, which W&B's server takes from the API key: those dead letters only
    letters = httpx.get(run["col"].url + "/v1/dead-letters", timeout=10).json()["dead_letters"]
    assert {(d["exporter"], d["name"]) for d in letters} <= {("weave", "annotation")}


def _weave_calls(url: str) -> list[Any]:
    """The calls of the session's project, through weave's own client."""
    from weave.trace_server_bindings.remote_http_trace_server import RemoteHTTPTraceServer

    client = RemoteHTTPTraceServer(url)
    client.set_auth(("api", API_KEY))
    return list(client.calls_query_stream({"project_id": f"{ENTITY}/{PROJECT}"}))


def _phoenix_spans(url: str) -> list[dict[str, Any]]:
    """The spans of Phoenix's project named after the session's project (OpenInference's project name)."""
    r = httpx.get(f"{url}/v1/projects/{PROJECT}/spans", params={"limit": 1000}, timeout=10)
    return [] if r.status_code == 404 else r.json().get("data", [])
