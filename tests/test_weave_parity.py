"""Switching VERL's ``trace.backend`` from ``weave`` to ``tracecar`` changes nothing a user sees in Weave.

The same VERL-shaped workload runs twice through VERL's own, unmodified agent-loop code, each
time in three worker processes at once (as a VERL job's AgentLoopWorkers are Ray actors, one
process each; tests/verl_parity_workload.py ``run_processes``)
(``AgentLoopWorker`` → ``ToolAgentLoop`` / ``SingleTurnAgentLoop`` → ``LLMServerClient``, the
Hermes tool parser and ``BaseTool`` tools; tool calls, a failing tool, nested sync and async
ops, typed outputs, a secret in the tools' kwargs, a validation batch):

(a) traced by VERL's real ``verl.utils.rollout_trace`` weave backend: weave 0.54 in each worker
    process, pointed at a loopback trace server;
(b) traced by tracecar (``trace.backend=tracecar``): the client in each worker process → one
    real collector over HTTP → its Weave sink.

Both land in weave's *own* trace server (weave 0.52.42's SQLite server, in its own venv, see
``weave_stub.WeaveSqliteServer``), in two projects, and are read back through weave's query API
(``calls_query_stream``, ``calls_query_stats``). The tests diff what a user sees: roots, op
names, tree shape, attributes, statuses, filter counts (structure), and inputs, outputs,
exceptions and typed values (values), and that no secret is stored, ignoring ids, timings,
tracecar's own attributes (``attributes.tracecar``, ``kept_because``, weave's ``attributes.weave``
block), threads, run links and feedback.

Needs the real ``verl`` (``TRACECAR_TEST_VERL=1 bash tests/run.sh`` builds ``.venv-verl``) and
weave's server venv (``TRACECAR_WEAVE_SERVER_PYTHON`` or ``.venv-weave52``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("verl")
pytest.importorskip("verl.experimental.agent_loop.tool_agent_loop")
pytest.importorskip("hydra")
pytest.importorskip("weave")

from tests.support.weave_stub import WeaveSqliteServer, weave_server_python

if weave_server_python() is None:
    pytest.skip("needs a venv with weave==0.52.42 (see weave_stub.weave_server_python)", allow_module_level=True)

from tests.test_verl_adapter import (  # noqa: E402  (the adapter tests' tiny model and VERL config)
    CHAT_TEMPLATE,  # noqa: F401
    model_dir,  # noqa: F401  (a fixture)
)
from tests.verl_parity_workload import (  # noqa: E402
    PROCESSES,
    PROMPTS,
    SECRET,
    STEP,
    diff,
    normalized,
    run_processes,
    start_collector,
)

pytestmark = [pytest.mark.timeout(600)]

ENTITY = "parity"
VERL_PROJECT, TRACECAR_PROJECT = "verl-weave", "verl-tracecar"
EXPERIMENT = "exp-verl"  # test_verl_adapter.verl_config's trainer.experiment_name
API_KEY = "p" * 40


# ---------------------------------------------------------------------------------------------
# the two runs, read back from weave's own server
# ---------------------------------------------------------------------------------------------


def _run_verl_weave(server_url: str, model_dir: Path) -> None:
    """(a): VERL's own weave backend, in each of the worker processes."""
    run_processes("weave", f"{ENTITY}/{VERL_PROJECT}", model_dir, dict(
        WANDB_BASE_URL=server_url, WF_TRACE_SERVER_URL=server_url, WANDB_API_KEY=API_KEY,
        WEAVE_DISABLED="false", WEAVE_PRINT_CALL_LINK="false", WEAVE_IMPLICITLY_PATCH_INTEGRATIONS="false",
        WANDB_ERROR_REPORTING="false"))  # weave reports its own errors to Sentry otherwise: no traffic off loopback


def _run_tracecar(server_url: str, model_dir: Path, data_dir: Path) -> dict[str, Any]:
    """(b): the same workload with trace.backend=tracecar in each worker process -> one real collector -> its Weave sink."""
    url, server, thread = start_collector(
        data_dir, backend="weave", wandb_api_key=API_KEY, wandb_entity=ENTITY, wandb_project="unused",
        weave_server_url=server_url, token2text=True, tokenizer=str(model_dir))
    try:
        reports = run_processes("tracecar", f"{ENTITY}/{TRACECAR_PROJECT}", model_dir, dict(
            TRACECAR_URL=url, TRACECAR_FLUSH_INTERVAL_S="0.02", WEAVE_DISABLED="true", WANDB_RUN_ID=None))
        deadline = time.monotonic() + 120
        while "tracecar_spool_depth 0.0" not in httpx.get(url + "/metrics").text:
            assert time.monotonic() < deadline, "the collector did not forward everything"
            time.sleep(0.2)
        metrics = httpx.get(url + "/metrics").text
        dead = httpx.get(url + "/v1/dead-letters").json()
        return {"clients": [r["client"] for r in reports], "metrics": metrics, "dead": dead}
    finally:
        server.should_exit = True
        thread.join(30)


class Project:
    """One Weave project as weave's query API returns it."""

    def __init__(self, client: Any, name: str) -> None:
        self.client, self.project_id = client, f"{ENTITY}/{name}"
        self.calls = list(client.calls_query_stream({"project_id": self.project_id}))
        self.by_id = {c.id: c for c in self.calls}

    def count(self, **req: Any) -> int:
        return self.client.calls_query_stats({"project_id": self.project_id, **req}).count

    def op_ref(self, op: str) -> str:
        return f"weave:///{self.project_id}/op/{op}:*"


@pytest.fixture(scope="module")
def projects(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from weave.trace_server_bindings.remote_http_trace_server import RemoteHTTPTraceServer

    python = weave_server_python()
    assert python is not None
    with WeaveSqliteServer(python) as server:
        try:
            _run_verl_weave(server.url, model_dir)
            collector = _run_tracecar(server.url, model_dir, tmp_path_factory.mktemp("parity-collector"))
        except BaseException:
            print(server.log_tail())
            raise
        client = RemoteHTTPTraceServer(server.url)
        client.set_auth(("api", API_KEY))
        yield {"verl": Project(client, VERL_PROJECT), "tracecar": Project(client, TRACECAR_PROJECT),
               "collector": collector, "server_log": server.log_tail()}


# ---------------------------------------------------------------------------------------------
# what a user sees, as comparable data
# ---------------------------------------------------------------------------------------------

IGNORED_ATTRIBUTES = ("weave", "tracecar", "kept_because")


def op_of(call: Any) -> str:
    """The op's name as the UI lists it: the name in the op ref, else the plain op_name."""
    name = call.op_name.split("/op/", 1)[1].rsplit(":", 1)[0] if call.op_name.startswith("weave:///") else call.op_name
    return call.display_name or name


def user_attributes(call: Any) -> dict[str, Any]:
    return {k: v for k, v in (call.attributes or {}).items() if k not in IGNORED_ATTRIBUTES}


def exception_of(call: Any) -> Any:
    if call.exception is None:
        return None
    try:
        exc = json.loads(call.exception)
    except ValueError:
        return {"raw": call.exception}
    return {"type": exc.get("type"), "message": exc.get("message"), "has_traceback": bool(exc.get("traceback"))}


def status_of(call: Any) -> Any:
    return ((call.summary or {}).get("weave") or {}).get("status")


def forest(project: Project, *, values: bool) -> list[dict[str, Any]]:
    """Every trace as a tree of what the UI shows, ids and timings left out.

    Roots sort by their attributes; siblings by op name, then start order (same-op siblings run
    one after the other; different tools may run concurrently).
    """
    children: dict[str | None, list[Any]] = {}
    for c in project.calls:
        children.setdefault(c.parent_id, []).append(c)

    def node(call: Any, depth: int = 0) -> dict[str, Any]:
        kids = sorted(children.get(call.id, []), key=lambda c: (op_of(c), c.started_at))
        out: dict[str, Any] = {"op": op_of(call), "attributes": user_attributes(call), "status": status_of(call),
                               "root": call.parent_id is None,
                               "children": [node(k, depth + 1) for k in kids]}
        if values:
            out.update(inputs=normalized(call.inputs), output=normalized(call.output), exception=exception_of(call))
        else:
            out["exception_type"] = (exception_of(call) or {}).get("type")
        return out

    roots = [node(c) for c in children.get(None, [])]
    return sorted(roots, key=lambda r: json.dumps([r["attributes"], r["op"]], sort_keys=True, default=str))


def where(tree: list[dict[str, Any]], d: str) -> str:
    """Names the root op and attributes a difference path starts in."""
    try:
        i = int(d[1:d.index("]")])
        return f"{tree[i]['op']} {tree[i]['attributes']}: {d}"
    except (ValueError, IndexError):
        return d


# ---------------------------------------------------------------------------------------------
# the comparisons
# ---------------------------------------------------------------------------------------------


def test_the_workload_is_what_it_claims(projects: dict[str, Any]) -> None:
    """Sanity of the baseline: VERL's weave backend traced tools, a failure, nesting, validation."""
    verl = projects["verl"]
    ops = {op_of(c) for c in verl.calls}
    assert {"ToolAgentLoop.run", "SingleTurnAgentLoop.run", "LLMServerClient.generate", "HermesToolParser.extract_tool_calls",
            "AddTool.execute", "SearchTool.execute", "SearchTool.lookup", "SearchTool.rank", "ExplodeTool.execute"} <= ops
    assert any(exception_of(c) and exception_of(c)["type"] == "RuntimeError" for c in verl.calls)
    assert {c.attributes.get("validate") for c in verl.calls} == {True, False}
    assert len(verl.calls) > 50 * PROCESSES and all(c["dropped_total"] == 0 for c in projects["collector"]["clients"])
    # one worker process per AgentLoopWorker: each process's rollouts, in both projects
    indices = {c.attributes.get("sample_index") for c in verl.calls}
    assert indices == {c.attributes.get("sample_index") for c in projects["tracecar"].calls} == set(range(PROMPTS * PROCESSES))
    assert 'tracecar_spans_dead_lettered_total{exporter="weave"} 0.0' in projects["collector"]["metrics"], projects["collector"]["dead"]


def test_same_roots_ops_tree_attributes_and_statuses(projects: dict[str, Any]) -> None:
    """No extra root per trajectory: the agent loops are the roots, with the same trees under them."""
    verl, ours = forest(projects["verl"], values=False), forest(projects["tracecar"], values=False)
    assert [(r["op"], r["attributes"]) for r in ours] == [(r["op"], r["attributes"]) for r in verl]
    assert all(r["root"] for r in ours) and all(r["root"] for r in verl)
    assert {r["op"] for r in verl} == {"ToolAgentLoop.run", "SingleTurnAgentLoop.run"}
    problems = [where(verl, d) for d in diff(verl, ours)]
    assert problems == [], "\n".join(problems[:40])


def test_same_ops_list_and_filter_counts(projects: dict[str, Any]) -> None:
    """The Ops list and the counts behind the Traces tab's filters match call for call."""
    verl, ours = projects["verl"], projects["tracecar"]
    assert sorted({op_of(c) for c in ours.calls}) == sorted({op_of(c) for c in verl.calls})

    def eq(field: str, value: Any) -> dict[str, Any]:
        return {"$eq": [{"$getField": field}, {"$literal": value}]}

    filters: dict[str, dict[str, Any]] = {
        "all calls": {},
        "trace roots": {"filter": {"trace_roots_only": True}},
        "step==7 && sample_index==1": {"query": {"$expr": {"$and": [eq("attributes.step", STEP), eq("attributes.sample_index", 1)]}}},
        "experiment_name": {"query": {"$expr": eq("attributes.experiment_name", EXPERIMENT)}},
        "validate": {"query": {"$expr": eq("attributes.validate", True)}},
        "rollout_n==1 roots": {"filter": {"trace_roots_only": True}, "query": {"$expr": eq("attributes.rollout_n", 1)}},
    }
    for op in sorted({op_of(c) for c in verl.calls}):
        filters[f"op {op}"] = {"filter": {"op_names": [verl.op_ref(op)]}}
    counts = {}
    for name, req in filters.items():
        theirs = verl.count(**req)
        if "op_names" in req.get("filter", {}):
            req = {"filter": {"op_names": [ours.op_ref(name[3:])]}}
        counts[name] = (theirs, ours.count(**req))
    assert {k: v for k, v in counts.items() if v[0] != v[1]} == {}
    assert counts["all calls"][0] == len(verl.calls) and counts["validate"][0] > 0


def test_same_inputs_outputs_exceptions_and_typed_values(projects: dict[str, Any]) -> None:
    verl, ours = forest(projects["verl"], values=True), forest(projects["tracecar"], values=True)
    problems = [where(verl, d) for d in diff(verl, ours)]
    assert problems == [], f"{len(problems)} differences:\n" + "\n".join(problems[:60])


def test_no_secret_in_verls_project(projects: dict[str, Any]) -> None:
    """weave redacts api_key values before sending (the baseline tracecar must match)."""
    assert SECRET not in json.dumps([c.model_dump(mode="json") for c in projects["verl"].calls])


def test_no_secret_in_tracecars_project(projects: dict[str, Any]) -> None:
    assert SECRET not in json.dumps([c.model_dump(mode="json") for c in projects["tracecar"].calls])


def test_tracecar_adds_threads_and_verl_has_none(projects: dict[str, Any]) -> None:
    """Beyond VERL: weave's Threads view lists each trajectory, its agent loop's children as turns."""
    verl, ours = projects["verl"], projects["tracecar"]
    client = ours.client
    assert list(client.threads_query_stream({"project_id": verl.project_id})) == []
    threads = {t.thread_id: t for t in client.threads_query_stream({"project_id": ours.project_id})}
    roots = [c for c in ours.calls if c.parent_id is None]
    assert len(threads) == len(roots) > 0
    for root in roots:
        thread = threads[root.attributes["tracecar"]["trace_id"]]
        assert thread.turn_count == sum(1 for c in ours.calls if c.parent_id == root.id)
