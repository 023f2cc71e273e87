"""Switching VERL's ``trace.backend`` from ``mlflow`` to ``tracecar`` changes nothing a user sees in MLflow.

The same VERL workload (tests/verl_parity_workload.py: VERL's own agent loops, tools, a failing
tool, nested sync and async ops, a validation batch) runs twice, each time in three worker
processes at once (as a VERL job's AgentLoopWorkers are Ray actors, one process each):

(a) traced by VERL's real ``verl.utils.rollout_trace`` mlflow backend: MLflow's SDK
    (``mlflow-skinny``) in each worker process, ``MLFLOW_TRACKING_URI`` = a real ``mlflow server``;
(b) traced by tracecar (``trace.backend=tracecar``): the client in each worker process -> one real
    collector over HTTP (``TRACECAR_WORKERS=2``) -> its ``mlflow`` exporter (OTLP to the server's
    ``/v1/traces``).

Both land in one ``mlflow server`` (SQLite, 127.0.0.1), each in the experiment VERL's
``mlflow.set_experiment(project_name)`` names, and are read back with MLflow's own client
(``search_traces`` / ``get_trace``, tests/mlflow_kit.py). The tests diff what a user sees: the
experiment, trace count, trace tags (``step``, ``sample_index``, ``rollout_n``, ``validate``,
``experiment_name``), state, the span tree, span names, types, statuses, inputs, outputs and
exceptions, ignoring ids, timings and what tracecar adds (``tracecar.*`` attributes, listed in
``TRACECAR_ONLY``). The differences that remain are in ``KNOWN_DIFFERENCES`` and docs/exporters.md.

Needs the real ``verl`` with ``mlflow-skinny`` (``.venv-verl``, ``TRACECAR_TEST_VERL=1``) and MLflow's
server venv (``TRACECAR_MLFLOW_SERVER_PYTHON``, ``TRACECAR_TEST_OTLP_SERVERS=1``).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("verl")
pytest.importorskip("verl.experimental.agent_loop.tool_agent_loop")
pytest.importorskip("hydra")
pytest.importorskip("mlflow", reason="VERL's mlflow backend needs mlflow in this venv (tests/run.sh installs mlflow-skinny)")

from tests.mlflow_kit import NO_TELEMETRY, have_mlflow, mlflow_server, read_back  # noqa: E402

if not have_mlflow():
    pytest.skip("needs MLflow's server venv: TRACECAR_MLFLOW_SERVER_PYTHON (tests/run.sh makes .venv-mlflow "
                "with TRACECAR_TEST_OTLP_SERVERS=1)", allow_module_level=True)

from tests.test_verl_adapter import (  # noqa: E402  (the adapter tests' tiny model and VERL config)
    model_dir,  # noqa: F401  (a fixture)
)
from tests.verl_parity_workload import (  # noqa: E402
    PROCESSES,
    PROMPTS,
    SECRET,
    Env,
    diff,
    normalized,
    run_processes,
    start_collector,
)

pytestmark = [pytest.mark.timeout(600)]

VERL_PROJECT, TRACECAR_PROJECT = "verl-mlflow", "verl-tracecar"
EXPERIMENT = "exp-verl"  # test_verl_adapter.verl_config's trainer.experiment_name


# ---------------------------------------------------------------------------------------------
# the two runs, into one mlflow server
# ---------------------------------------------------------------------------------------------


def _run_verl_mlflow(url: str, model_dir: Path) -> None:
    """(a): VERL's own mlflow backend, in each of the worker processes."""
    from mlflow import MlflowClient

    # each process's mlflow.set_experiment(project_name) creates the experiment when it finds none:
    # three at once race (one is refused RESOURCE_ALREADY_EXISTS), so it exists before they start
    with Env(**NO_TELEMETRY):
        MlflowClient(tracking_uri=url).create_experiment(VERL_PROJECT)
    # MLflow's SDK exports each trace from a background queue, which on a loaded 2-core machine
    # left 3 to 5 of the 12 traces unread after 90 s; exporting as each root span ends changes
    # when a trace is sent, not what
    run_processes("mlflow", VERL_PROJECT, model_dir, dict(MLFLOW_TRACKING_URI=url, MLFLOW_ENABLE_ASYNC_TRACE_LOGGING="false",
                                                          **NO_TELEMETRY))


def _run_tracecar(url: str, model_dir: Path, data_dir: Path) -> dict[str, Any]:
    """(b): the same workload with trace.backend=tracecar in each worker process -> one real collector
    (decoding in two worker processes of its own, TRACECAR_WORKERS=2) -> its mlflow exporter."""
    collector_url, server, thread = start_collector(
        data_dir, backend="mlflow", mlflow_tracking_uri=url, token2text=True, tokenizer=str(model_dir), workers=2)
    try:
        reports = run_processes("tracecar", TRACECAR_PROJECT, model_dir, dict(
            TRACECAR_URL=collector_url, TRACECAR_FLUSH_INTERVAL_S="0.02", WANDB_RUN_ID=None))
        deadline = time.monotonic() + 120
        while "tracecar_spool_depth 0.0" not in httpx.get(collector_url + "/metrics").text:
            assert time.monotonic() < deadline, "the collector did not forward everything"
            time.sleep(0.2)
        metrics = httpx.get(collector_url + "/metrics").text
        dead = httpx.get(collector_url + "/v1/dead-letters").json()
        return {"clients": [r["client"] for r in reports], "metrics": metrics, "dead": dead}
    finally:
        server.should_exit = True
        thread.join(30)


TRAJECTORIES = 12 * PROCESSES  # per worker process two batches (train, validate) of three prompts x n=2


def _settled(url: str, experiment: str) -> list[dict[str, Any]]:
    """The experiment's traces once all trajectories are there and two reads agree (VERL's
    backend logs asynchronously, and the server may store after its 2xx)."""
    deadline = time.monotonic() + 90
    last: list[dict[str, Any]] | None = None
    while True:
        traces = read_back(url, experiment)
        count = sum(len(t["spans"]) for t in traces)
        if len(traces) >= TRAJECTORIES and last is not None and count == sum(len(t["spans"]) for t in last):
            return traces
        if time.monotonic() > deadline:
            return traces
        last = traces
        time.sleep(0.5)


@pytest.fixture(scope="module")
def experiments(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    started = time.monotonic()
    with mlflow_server(tmp_path_factory.mktemp("mlflow-parity")) as url:
        up = time.monotonic()
        _run_verl_mlflow(url, model_dir)
        verl = _settled(url, VERL_PROJECT)
        verl_done = time.monotonic()
        collector = _run_tracecar(url, model_dir, tmp_path_factory.mktemp("parity-collector"))
        ours = _settled(url, TRACECAR_PROJECT)
        print(f"mlflow parity: server up {up - started:.1f} s, VERL's run + read-back {verl_done - up:.1f} s, "
              f"tracecar's {time.monotonic() - verl_done:.1f} s")
        Path("/tmp/mlflow-parity-dump.json").write_text(json.dumps({"verl": verl, "tracecar": ours}, indent=1, default=str))
        yield {"verl": verl, "tracecar": ours, "collector": collector}


# ---------------------------------------------------------------------------------------------
# what a user sees, as comparable data
# ---------------------------------------------------------------------------------------------

# What differs, and why (docs/exporters.md, "What an mlflow user sees"):
KNOWN_DIFFERENCES = {
    "tags": "tracecar's traces carry service.name=tracecar (MLflow's OTLP ingest makes resource attributes trace tags)",
    "attributes": "tracecar adds its own span attributes, all under tracecar.* (step, worker, project, kind...); "
                  "its root also lists the trace tags as mlflow.traceTag.* (how MLflow's OTLP ingest takes tags)",
    "secrets": "VERL's backend stores tool kwargs' secrets (api_key) in clear; tracecar redacts them in the worker",
    "non-JSON values": "a numpy array or scalar shows as its repr (as in Weave), where MLflow's encoder writes str()",
    "sync ops": "a sync op is named by its qualified name (SearchTool.lookup); VERL's backend, going through "
                "mlflow.trace, names it lookup and adds mlflow.spanFunctionName",
    "stacktrace": "the failing op's stack trace is the op's own frames, without VERL's and MLflow's wrappers",
}
TRACECAR_TAGS = frozenset({"service.name"})
# span attributes compared as what they are (inputs, outputs, type) or ids
SHOWN_OTHERWISE = frozenset({"mlflow.spanInputs", "mlflow.spanOutputs", "mlflow.spanType", "mlflow.traceRequestId"})
# trace tags MLflow's server derives from where it stored the trace
SERVER_TAGS = frozenset({"mlflow.artifactLocation", "mlflow.trace.spansLocation"})
SYNC_OPS = {"lookup": "SearchTool.lookup"}  # the workload's sync ops: VERL's mlflow name -> qualified name
_NUMPY_SCALAR = re.compile(r"^np\.\w+\((.*)\)$")
_NUMPY_ARRAY = re.compile(r"^array\((.*), dtype=\w+\)$", re.S)


def as_compared(value: Any) -> Any:
    """A value with the known differences above taken out: the secret, numpy reprs."""
    if isinstance(value, dict):
        return {k: as_compared(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_compared(v) for v in value]
    if isinstance(value, str):
        if value == SECRET:
            return "REDACTED"
        for pattern in (_NUMPY_SCALAR, _NUMPY_ARRAY):
            if m := pattern.match(value):
                return m.group(1)
    return value


def span_name(span: dict[str, Any]) -> str:
    if "mlflow.spanFunctionName" in span["attributes"]:  # VERL's sync op, through mlflow.trace
        return SYNC_OPS.get(span["name"], span["name"])
    return span["name"]


def user_attributes(span: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in span["attributes"].items()
            if k not in SHOWN_OTHERWISE and k != "mlflow.spanFunctionName"
            and not k.startswith(("tracecar.", "mlflow.traceTag."))}


def events_of(span: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for e in span["events"]:
        attrs = e["attributes"]
        out.append({"name": e["name"], "type": attrs.get("exception.type"), "message": attrs.get("exception.message"),
                    "has_stacktrace": bool(attrs.get("exception.stacktrace"))})
    return out


def tags_of(trace: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in sorted(trace["tags"].items()) if k not in SERVER_TAGS | TRACECAR_TAGS}


def forest(traces: list[dict[str, Any]], *, values: bool) -> list[dict[str, Any]]:
    """Every trace as its tags plus a tree of what MLflow's trace view shows, ids and timings left out.

    Traces sort by their tags; siblings by name, then start (same-name siblings run in order).
    """
    out = []
    for trace in traces:
        children: dict[str | None, list[dict[str, Any]]] = {}
        for s in trace["spans"]:
            children.setdefault(s["parent_id"], []).append(s)

        def node(span: dict[str, Any]) -> dict[str, Any]:
            kids = sorted(children.get(span["span_id"], []), key=lambda s: (span_name(s), s["start_ns"]))
            n: dict[str, Any] = {"name": span_name(span), "span_type": span["span_type"], "status": span["status"],
                                 "attributes": user_attributes(span), "events": [e["name"] for e in span["events"]],
                                 "children": [node(k) for k in kids]}
            if values:
                n.update(inputs=as_compared(normalized(span["inputs"])), outputs=as_compared(normalized(span["outputs"])),
                         status_message=span["status_message"], events=events_of(span))
            return n

        roots = [node(s) for s in children.get(None, [])]
        out.append({"tags": tags_of(trace), "state": trace["state"], "request_preview": trace["request_preview"],
                    "response_preview": trace["response_preview"], "roots": roots})
    return sorted(out, key=lambda t: json.dumps(t["tags"], sort_keys=True))


def where(tree: list[dict[str, Any]], d: str) -> str:
    try:
        i = int(d[1:d.index("]")])
        return f"trace {tree[i]['tags']}: {d}"
    except (ValueError, IndexError):
        return d


# ---------------------------------------------------------------------------------------------
# the comparisons
# ---------------------------------------------------------------------------------------------


def test_the_workload_is_what_it_claims(experiments: dict[str, Any]) -> None:
    """Sanity of the baseline: VERL's mlflow backend traced tools, a failure, nesting, validation."""
    verl = experiments["verl"]
    names = {s["name"] for t in verl for s in t["spans"]}
    assert {"agent_loop", "ToolAgentLoop.run", "SingleTurnAgentLoop.run", "LLMServerClient.generate",
            "HermesToolParser.extract_tool_calls", "AddTool.execute", "SearchTool.execute", "SearchTool.rank",
            "lookup", "ExplodeTool.execute"} <= names, names
    assert any(s["status"] == "SpanStatusCode.ERROR" for t in verl for s in t["spans"])
    assert {t["tags"].get("validate") for t in verl} == {"True", "False"}
    assert len(verl) == TRAJECTORIES and sum(len(t["spans"]) for t in verl) > 60 * PROCESSES  # 2 batches x 6 trajectories
    assert all(c["dropped_total"] == 0 for c in experiments["collector"]["clients"])
    # one worker process per AgentLoopWorker: each process's rollouts, in both experiments
    indices = {t["tags"].get("sample_index") for t in verl}
    assert indices == {t["tags"].get("sample_index") for t in experiments["tracecar"]} == {
        str(i) for i in range(PROMPTS * PROCESSES)}
    in_workers = re.search(r'^tracecar_batches_parsed_total\{where="worker"\} (\S+)$', experiments["collector"]["metrics"], re.M)
    assert in_workers and float(in_workers.group(1)) > 0  # TRACECAR_WORKERS=2 did the work
    # (with or without the fan-out's exporter label)
    dead = re.findall(r"^tracecar_spans_dead_lettered_total(?:\{[^}]*\})? (\S+)$", experiments["collector"]["metrics"], re.M)
    assert dead and all(float(v) == 0 for v in dead), experiments["collector"]["dead"]


def test_one_trace_per_trajectory_in_the_experiment_named_by_the_project(experiments: dict[str, Any]) -> None:
    """VERL's mlflow.set_experiment(project_name): tracecar picks the same experiment with no setting."""
    verl, ours = experiments["verl"], experiments["tracecar"]
    assert len(ours) == len(verl) == TRAJECTORIES
    assert len({t["experiment_id"] for t in ours}) == 1 and {t["experiment_id"] for t in ours} != {t["experiment_id"] for t in verl}
    assert all(len([s for s in t["spans"] if s["parent_id"] is None]) == 1 for t in ours + verl)


def test_same_tags_tree_names_types_and_statuses(experiments: dict[str, Any]) -> None:
    verl, ours = forest(experiments["verl"], values=False), forest(experiments["tracecar"], values=False)
    assert [t["tags"] for t in ours] == [t["tags"] for t in verl]
    assert {t["tags"]["mlflow.traceName"] for t in verl} == {"agent_loop"}
    problems = [where(verl, d) for d in diff(verl, ours)]
    assert problems == [], "\n".join(problems[:40])


def test_same_inputs_outputs_and_exceptions(experiments: dict[str, Any]) -> None:
    verl, ours = forest(experiments["verl"], values=True), forest(experiments["tracecar"], values=True)
    problems = [where(verl, d) for d in diff(verl, ours)]
    assert problems == [], f"{len(problems)} differences:\n" + "\n".join(problems[:60])


def test_the_known_differences_are_what_they_say(experiments: dict[str, Any]) -> None:
    """Each entry of KNOWN_DIFFERENCES holds (so the list stays true as VERL, MLflow or tracecar change)."""
    verl, ours = experiments["verl"], experiments["tracecar"]
    assert SECRET in json.dumps(verl) and SECRET not in json.dumps(ours)
    assert {t["tags"].get("service.name") for t in ours} == {"tracecar"}
    assert all("service.name" not in t["tags"] for t in verl)
    extra = {k for t in ours for s in t["spans"] for k in s["attributes"]} - {k for t in verl for s in t["spans"] for k in s["attributes"]}
    assert extra and all(k.startswith(("tracecar.", "mlflow.traceTag.")) for k in extra), extra
    assert {s["name"] for t in ours for s in t["spans"]} - {s["name"] for t in verl for s in t["spans"]} == {"SearchTool.lookup"}
    assert any("np.int64(" in json.dumps(s["inputs"]) for t in ours for s in t["spans"])
