"""Issue 14's "done when": one VERL-shaped rollout with vLLM-shaped engine spans, traced once, lands
joined in the local store, Weave (weave's own trace server), Phoenix and MLflow at the same time,
and an outage of one of them is survived without loss or duplicates while the others keep taking —
also for three worker processes' rollouts sent during the outage (tests/engine_workload.py).

Every server is real and on 127.0.0.1: weave 0.52.42's SQLite trace server (``.venv-weave52``),
``phoenix serve`` (``.venv-phoenix``) and ``mlflow server`` (``.venv-mlflow``), the venvs
``tests/run.sh`` makes with ``TRACECAR_TEST_WEAVE_SERVER=1`` and ``TRACECAR_TEST_OTLP_SERVERS=1``.
The collector fans out with ``TRACECAR_EXPORTERS=weave,otlp,mlflow``.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import engine_workload as workload
from tests.mlflow_kit import MLFLOW_PYTHON
from tests.mlflow_kit import read_back as _read_back
from tests.support import free_port, stop_process
from tests.support.weave_stub import WeaveSqliteServer, weave_server_python
from tests.test_mlflow_export import mlflow_server  # noqa: F401 - a fixture
from tests.test_otlp_export import verl_rollout
from tests.test_otlp_receiver import VllmEngine
from tests.test_phoenix_export import PHOENIX_PYTHON

WEAVE_PYTHON = weave_server_python()
API_KEY = "k" * 36 + "SECR"
ENTITY, PROJECT = "ent", "verl_project"
SPANS_PER_ROLLOUT = 7  # agent_loop, run, 2 x generate, execute, 2 x llm_request
pytestmark = [
    pytest.mark.timeout(420),
    pytest.mark.skipif(not (PHOENIX_PYTHON and Path(PHOENIX_PYTHON).exists() and MLFLOW_PYTHON
                            and Path(MLFLOW_PYTHON).exists() and WEAVE_PYTHON),
                       reason="needs .venv-phoenix, .venv-mlflow and .venv-weave52 (tests/run.sh with "
                              "TRACECAR_TEST_OTLP_SERVERS=1 TRACECAR_TEST_WEAVE_SERVER=1)"),
]


class Phoenix:
    """``phoenix serve`` on a fixed port and working dir, so it can be stopped and started again."""

    def __init__(self, work: Path) -> None:
        self.work, self.port, self.grpc = work, free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        work.mkdir(parents=True, exist_ok=True)

    def start(self, timeout_s: float = 120) -> None:
        env = {**os.environ, "PHOENIX_WORKING_DIR": str(self.work), "PHOENIX_HOST": "127.0.0.1",
               "PHOENIX_PORT": str(self.port), "PHOENIX_GRPC_PORT": str(self.grpc), "PHOENIX_TELEMETRY_ENABLED": "false"}
        log = open(self.work / "phoenix.log", "ab")
        self.proc = subprocess.Popen([str(Path(PHOENIX_PYTHON).parent / "phoenix"), "serve"], cwd=self.work,
                                     stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(self.url + "/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError("phoenix did not start: " + (self.work / "phoenix.log").read_text()[-3000:])
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, grace_s=30)
            self.proc = None

    def spans(self, project: str = PROJECT) -> list[dict[str, Any]]:
        # tracecar's project is the Phoenix project (resource attribute openinference.project.name)
        r = httpx.get(f"{self.url}/v1/projects/{project}/spans", params={"limit": 1000}, timeout=10)
        if r.status_code == 404:  # the project is made with its first span
            return []
        assert r.status_code == 200, r.text[:2000]
        return r.json().get("data", [])


def _weave_calls(url: str, project: str = PROJECT) -> list[Any]:
    from weave.trace_server_bindings.remote_http_trace_server import RemoteHTTPTraceServer

    client = RemoteHTTPTraceServer(url)
    client.set_auth(("api", API_KEY))
    return list(client.calls_query_stream({"project_id": f"{ENTITY}/{project}"}))


def _until(what: str, check: Any, timeout_s: float = 90, every_s: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(every_s)


def _rollout(col_url: str, tracer: Any) -> str:
    """One rollout; the engine's spans reach the collector before the worker's (the harder order:
    in a real run vLLM's BatchSpanProcessor exports every 5 s, the client within its flush interval)."""
    engine = VllmEngine(col_url + "/v1/traces")
    trace_id = verl_rollout(engine)
    engine.flush()
    engine.close()
    assert tracer.flush(10)
    return trace_id


def _joined(spans: list[dict[str, Any]], name: Any, span_id: Any, parent: Any) -> None:
    """Each engine span's parent is one of the generate calls, one engine span per call."""
    generates = [s for s in spans if name(s).endswith("generate")]
    engines = [s for s in spans if name(s) == "llm_request"]
    assert len(generates) == 2 and sorted(parent(e) for e in engines) == sorted(span_id(g) for g in generates), spans


def test_one_rollout_lands_joined_everywhere_and_an_outage_of_one_costs_nothing(tmp_path, start_collector, tracer_to,
                                                                                  mlflow_server):  # noqa: F811
    phoenix = Phoenix(tmp_path / "phoenix")
    phoenix.start()
    try:
        with WeaveSqliteServer(WEAVE_PYTHON) as weave_server:
            col = start_collector(
                backend="weave", exporters=["weave", "otlp", "mlflow"], wandb_api_key=API_KEY, wandb_entity=ENTITY,
                wandb_project=PROJECT, weave_server_url=weave_server.url,
                otlp_endpoint=phoenix.url + "/v1/traces", otlp_content=True,
                mlflow_tracking_uri=mlflow_server,  # no experiment name: each trajectory to its project's, as VERL
                forward_retry_initial_s=0.2, forward_retry_max_s=1.0,
            )
            tracer = tracer_to(col.url, project=PROJECT)
            first = _rollout(col.url, tracer)

            # the local store: the whole trajectory with the engine spans under their generate calls
            tree = _until("the local store", lambda: (r := httpx.get(f"{col.url}/v1/trajectories/{first}").json())
                          and r.get("span_count", 0) >= SPANS_PER_ROLLOUT - 1 and r)
            assert tree["root"]["name"] == "agent_loop"
            # Phoenix (OTLP), MLflow, Weave: each has it, joined
            spans = _until("phoenix", lambda: len(s := phoenix.spans()) >= SPANS_PER_ROLLOUT and s)
            assert len(spans) == SPANS_PER_ROLLOUT and {s["context"]["trace_id"] for s in spans} == {first}
            _joined(spans, lambda s: s["name"], lambda s: s["context"]["span_id"], lambda s: s.get("parent_id"))
            traces = _until("mlflow", lambda: (t := _read_back(mlflow_server, PROJECT))
                            and sum(len(x["spans"]) for x in t) >= SPANS_PER_ROLLOUT and t, every_s=2)
            assert len(traces) == 1 and first in traces[0]["trace_id"]
            _joined(traces[0]["spans"], lambda s: s["name"], lambda s: s["span_id"], lambda s: s["parent_id"])
            calls = _until("weave", lambda: len(c := _weave_calls(weave_server.url)) >= SPANS_PER_ROLLOUT - 1 and c)
            # weave shows what VERL's backend shows: no call for rollout_trace_attr, the agent loop as root
            assert len(calls) == SPANS_PER_ROLLOUT - 1, [c.op_name for c in calls]
            by_id = {c.id: c for c in calls}
            engine_calls = [c for c in calls if "llm_request" in c.op_name]
            assert len(engine_calls) == 2 and all("generate" in by_id[c.parent_id].op_name for c in engine_calls)
            assert len({c.trace_id for c in calls}) == 1, [(c.op_name.split("/")[-1][:30], c.trace_id) for c in calls]

            # Phoenix goes down; weave and MLflow keep taking the next trajectory meanwhile, and three worker
            # processes' rollouts (engine spans first in half of them, two projects: tests/engine_workload.py)
            phoenix.stop()
            second = _rollout(col.url, tracer)
            manifest = workload.run_workers(col.url, 3, tmp_path / "workers")
            per_project = {p: sum(1 for t in manifest if t["project"] == p) for p in workload.PROJECTS}
            _until("weave, phoenix down", lambda: len(_weave_calls(weave_server.url)) >= 2 * (SPANS_PER_ROLLOUT - 1))
            _until("mlflow, phoenix down", lambda: len(_read_back(mlflow_server, PROJECT)) >= 2, every_s=2)
            ready = httpx.get(col.url + "/readyz").json()
            assert ready["exporters"]["otlp"]["pending"] >= SPANS_PER_ROLLOUT, ready["exporters"]
            assert ready["exporters"]["weave"]["pending"] == ready["exporters"]["mlflow"]["pending"] == 0

            # back: Phoenix gets what it missed, nobody gets anything twice
            phoenix.start()
            spans = _until("phoenix after the outage", lambda: len(s := phoenix.spans()) >= 2 * SPANS_PER_ROLLOUT and s,
                           timeout_s=120)
            time.sleep(2)  # anything sent twice would show up by now
            spans = phoenix.spans()
            assert len(spans) == 2 * SPANS_PER_ROLLOUT and len({s["context"]["span_id"] for s in spans}) == len(spans)
            assert {s["context"]["trace_id"] for s in spans} == {first, second}
            calls = _weave_calls(weave_server.url)
            assert len(calls) == 2 * (SPANS_PER_ROLLOUT - 1) and len({c.id for c in calls}) == len(calls)
            traces = _read_back(mlflow_server, PROJECT)
            assert len(traces) == 2 and sum(len(t["spans"]) for t in traces) == 2 * SPANS_PER_ROLLOUT
            for project, n in per_project.items():  # every worker process's spans, in its project, once, everywhere
                want = n * workload.SPANS_PER_TRAJECTORY
                got = _until(f"phoenix {project}", lambda p=project, w=want: len(s := phoenix.spans(p)) >= w and s, timeout_s=120)
                assert len(got) == want and len({s["context"]["span_id"] for s in got}) == want, (project, len(got), want)
                calls = _until(f"weave {project}", lambda p=project, w=want: len(c := _weave_calls(weave_server.url, p))
                               >= w - n and c)
                assert len(calls) == want - n and len({c.id for c in calls}) == len(calls)  # no call for rollout_trace_attr
                traces = _until(f"mlflow {project}", lambda p=project: len(t := _read_back(mlflow_server, p)) >= n and t,
                                every_s=2)
                assert len(traces) == n and sum(len(t["spans"]) for t in traces) == want
            workload.assert_engine_spans_came_first(col.url)
            workload.wait_delivered(col.url, 0)
            ready = httpx.get(col.url + "/readyz").json()
            assert all(e["pending"] == 0 for e in ready["exporters"].values()), ready["exporters"]
    finally:
        phoenix.stop()
