"""Weave out from many worker processes, read back from weave's own trace server.

The shared workload of the exporter tests (tests/engine_workload.py): three worker processes, each
the real client plus a vLLM-shaped engine exporting ``llm_request`` spans (some before anything of
their trajectory), projects alternating between processes, into one collector process with
``backend=weave`` (``token2text`` on), run twice: decoding in the ingest process
(``TRACECAR_WORKERS=1``) and in two worker processes (``TRACECAR_WORKERS=2``). Read back through weave's own query API
(``calls_query_stream``, ``feedback_query``) from weave 0.52.42's SQLite trace server
(tests/support/weave_server.py, ``TRACECAR_WEAVE_SERVER_PYTHON``; tests/run.sh makes
``.venv-weave52`` with ``TRACECAR_TEST_WEAVE_SERVER=1``): every call present, every call id unique
across processes, every parent right (engine calls under their ``generate``, the first ones
included), every trajectory in its own project and nothing anywhere else.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from tests import engine_workload as workload
from tests.support.collector import scrape_metric
from tests.support.weave_stub import WeaveSqliteServer, weave_server_python

WEAVE_PYTHON = weave_server_python()
API_KEY = "w" * 40
ENTITY = "team"
UNUSED = "not-a-batch-project"  # TRACECAR_WANDB_PROJECT: only for batches that name none (these all do)
WORKERS = 3
CALLS_PER_TRAJECTORY = workload.SPANS_PER_TRAJECTORY - 1  # as VERL's weave backend: no call for rollout_trace_attr
pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(WEAVE_PYTHON is None, reason="needs weave's server venv: TRACECAR_WEAVE_SERVER_PYTHON (tests/run.sh "
                                                    "makes .venv-weave52 with TRACECAR_TEST_WEAVE_SERVER=1)"),
]
# each op's parent op (None: a trace root, as VERL's agent loop is)
PARENT_OP = {"ToolAgentLoop.run": None, "LLMServerClient.generate": "ToolAgentLoop.run",
             "HermesToolParser.extract_tool_calls": "ToolAgentLoop.run", "SearchTool.execute": "ToolAgentLoop.run",
             "SearchTool.lookup": "SearchTool.execute", "ToolAgentLoop.format_tool_response": "ToolAgentLoop.run",
             "llm_request": "LLMServerClient.generate"}


def op_of(call: Any) -> str:
    return call.op_name.split("/op/", 1)[1].rsplit(":", 1)[0] if call.op_name.startswith("weave:///") else call.op_name


def read_back(url: str, project: str) -> tuple[list[Any], list[Any]]:
    """(calls, feedback) of ``ENTITY/project`` through weave's own client."""
    from weave.trace_server_bindings.remote_http_trace_server import RemoteHTTPTraceServer

    client = RemoteHTTPTraceServer(url)
    client.set_auth(("api", API_KEY))
    calls = list(client.calls_query_stream({"project_id": f"{ENTITY}/{project}"}))
    feedback = client.feedback_query({"project_id": f"{ENTITY}/{project}"}).result
    return calls, feedback


@pytest.fixture(scope="module", params=[1, 2], ids=["workers=1", "workers=2"])
def weave_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, deepseek_tokenizer_path: str) -> Any:
    """weave's server, a collector (TRACECAR_WORKERS=param) forwarding to it, three worker processes' rollouts."""
    workers = request.param
    work = tmp_path_factory.mktemp(f"weave-run-{workers}")
    with WeaveSqliteServer(WEAVE_PYTHON) as server:  # type: ignore[arg-type]
        col = workload.collector_process(work / "collector", backend="weave", wandb_api_key=API_KEY, wandb_entity=ENTITY,
                                         wandb_project=UNUSED, weave_server_url=server.url, workers=workers,
                                         token2text=True, tokenizer=deepseek_tokenizer_path)  # the pool starts with the collector
        try:
            deadline = time.monotonic() + 90  # the pool warm, so batches really go through worker processes
            while workers > 1 and scrape_metric(col.url, "tracecar_workers") < workers:
                assert time.monotonic() < deadline, col.log_text()[-3000:]
                time.sleep(0.2)
            manifest = workload.run_workers(col.url, WORKERS, work / "workers")
            workload.wait_delivered(col.url, len(manifest) * workload.SPANS_PER_TRAJECTORY)
            workload.assert_engine_spans_came_first(col.url)
            in_workers = scrape_metric(col.url, "tracecar_batches_parsed_total", where="worker")
            dead = scrape_metric(col.url, "tracecar_spans_dead_lettered_total", exporter="weave")
            letters = httpx.get(col.url + "/v1/dead-letters", timeout=30).json() if dead else None
        finally:
            col.terminate()
        read = {p: read_back(server.url, p) for p in (*workload.PROJECTS, UNUSED, "tracecar")}
        yield {"workers": workers, "manifest": manifest, "read": read, "batches_in_workers": in_workers, "dead": dead,
               "letters": letters, "server_log": server.log_tail()}


def test_every_call_of_every_worker_process_reaches_weave_in_its_project(weave_run: dict[str, Any]) -> None:
    manifest, read = weave_run["manifest"], weave_run["read"]
    assert weave_run["dead"] == 0, (str(weave_run["letters"]["dead_letters"][0])[:3000], weave_run["server_log"])
    assert (weave_run["batches_in_workers"] > 0) == (weave_run["workers"] > 1)  # TRACECAR_WORKERS=2 did the work
    assert read[UNUSED] == ([], []) and read["tracecar"] == ([], [])  # nothing without its destination, engine spans first included
    every_id: list[str] = []
    for project in workload.PROJECTS:
        calls, feedback = read[project]
        mine = {t["trace_id"]: t for t in manifest if t["project"] == project}
        assert {t["worker"] for t in mine.values()} == {f"worker-{k}" for k in range(WORKERS) if workload.project_of(k) == project}
        assert len(calls) == len(mine) * CALLS_PER_TRAJECTORY, sorted(op_of(c) for c in calls)  # 100 %
        every_id += [c.id for c in calls]
        by_id = {c.id: c for c in calls}
        by_trajectory: dict[str, list[Any]] = {}
        for c in calls:  # each call names its trajectory, and that trajectory is one of this project's
            by_trajectory.setdefault(c.attributes["tracecar"]["trace_id"], []).append(c)
        assert set(by_trajectory) == set(mine)
        for trace_id, family in by_trajectory.items():
            assert sorted(op_of(c) for c in family) == sorted([*PARENT_OP, "LLMServerClient.generate", "llm_request"])
            [root] = [c for c in family if c.parent_id is None]
            assert op_of(root) == "ToolAgentLoop.run" and root.trace_id == root.id
            for c in family:  # parents right: the expected op, in the same weave trace and trajectory
                assert c.trace_id == root.id, (op_of(c), c.trace_id, root.id)
                if c.parent_id is not None:  # the trajectory as a thread: the calls under its agent loop
                    assert c.thread_id == trace_id, (op_of(c), c.thread_id)
                    parent = by_id[c.parent_id]
                    assert op_of(parent) == PARENT_OP[op_of(c)], (op_of(c), op_of(parent))
                    assert parent.attributes["tracecar"]["trace_id"] == trace_id
            expected = mine[trace_id]
            assert {k: root.attributes[k] for k in ("step", "sample_index", "rollout_n", "experiment_name")} == {
                "step": 1, "sample_index": expected["sample_index"], "rollout_n": 0, "experiment_name": workload.EXPERIMENT}
            failed = sorted(op_of(c) for c in family if c.exception is not None)
            assert failed == (["LLMServerClient.generate", "llm_request"] if expected["failed_turn"] else []), failed
            engines = [c for c in family if op_of(c) == "llm_request"]
            assert all(e.attributes["gen_ai.request.id"].startswith(f"req-{expected['worker'][-1]}-") for e in engines)
        # the rewards, as feedback on each trajectory's top-level call
        rewards = {f["weave_ref"].rsplit("/", 1)[1]: f["payload"]["reward"] for f in feedback}
        assert rewards == {c.id: mine[c.attributes["tracecar"]["trace_id"]]["reward"] for c in calls if c.parent_id is None}
    assert len(set(every_id)) == len(every_id) == len(manifest) * CALLS_PER_TRAJECTORY  # unique across processes
    assert json.dumps(API_KEY) not in json.dumps([str(c) for p in workload.PROJECTS for c in read[p][0]])

