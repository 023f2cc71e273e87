"""One collector per Ray node (tracecar.client.ray_collectors) on a real local Ray cluster.

A single-node ``ray.init()``: the collector actor starts pinned to that node, a traced Ray task
reaches it through the helper's runtime_env, a second driver finds the same actors and traces
through the worker_process_setup_hook, and shutdown drains and removes everything.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # else ray writes a token under ~/.ray
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
try:
    import ray
except ImportError:  # the ray extra is not installed: only the ray-free test runs
    ray = None

from tests.support import free_port  # noqa: E402
from tracecar.client import ray_collectors  # noqa: E402


@pytest.fixture(scope="module")
def ray_cluster() -> Any:
    if ray is None:
        pytest.skip("ray is not installed (pip install 'tracecar[ray]')")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="tracecar-test")
    # Tasks defined in this test module travel by value (workers cannot import the test module).
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield ray.get_runtime_context()
    ray.shutdown()


def traced_rollouts(experiment: str, count: int) -> dict[str, Any]:
    """Runs inside a Ray worker: ``count`` trajectories with two traced ops each."""
    import tracecar.client as tc
    from tracecar.client import ray_collectors as rc

    @tc.rollout_trace_op
    def generate(prompt: str) -> dict[str, Any]:
        return {"response_text": prompt[::-1]}

    for i in range(count):
        with tc.rollout_trace_attr(step=1, sample_index=i, rollout_n=0, name="agent_loop"):
            generate(f"prompt {i}")
            generate(f"again {i}")
    tracer = tc.get_tracer()
    flushed = tc.flush(20)
    return {"env_url": os.environ.get("TRACECAR_URL"), "tracer_url": tracer.config.url if tracer else None,
            "node_local_url": rc.node_local_url(), "flushed": flushed,
            "node_id": ray.get_runtime_context().get_node_id(), "sent": tracer.stats()["sent"] if tracer else 0}


def wait_trajectories(url: str, experiment: str, expected: int, timeout: float = 20) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        page = httpx.get(url + "/v1/trajectories", params={"experiment": experiment, "limit": 100}, timeout=5).json()
        if page["total"] >= expected or time.monotonic() > deadline:
            return page
        time.sleep(0.1)


SECOND_DRIVER = textwrap.dedent("""
    import json, os, sys
    import ray
    from tracecar.client import ray_collectors as rc

    address, port, experiment = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    # Only the setup hook (no TRACECAR_URL): workers ask their node's collector actor for its URL.
    env = rc.runtime_env(base={"env_vars": {"TRACECAR_EXPERIMENT": experiment}}, via="hook")
    ray.init(address=address, namespace="another-driver", runtime_env=env, log_to_driver=False)
    found = rc.find_node_collectors()
    again = rc.start_node_collectors(port=port)  # idempotent across drivers

    @ray.remote(num_cpus=0)
    def work():
        import tracecar.client as tc
        from tracecar.client import ray_collectors as rc
        with tc.rollout_trace_attr(step=2, sample_index=0, rollout_n=0, name="agent_loop"):
            pass
        tracer = tc.get_tracer()
        return {"env_url": os.environ.get("TRACECAR_URL"), "tracer_url": tracer.config.url if tracer else None,
                "flushed": tc.flush(20)}

    print("RESULT " + json.dumps({"found": found.urls, "again": again.urls,
                                  "pids": [i["pid"] for i in again.infos.values()],
                                  "worker": ray.get(work.remote(), timeout=60)}))
""")


@pytest.mark.ray
@pytest.mark.timeout(180)
def test_one_collector_per_node_end_to_end(ray_cluster: Any, tmp_path: Path) -> None:
    started = time.monotonic()
    port = free_port()
    node_id = ray_cluster.get_node_id()
    nc = ray_collectors.start_node_collectors(
        port=port, data_dir=str(tmp_path / "{node_id}"), settings={"backend": "local", "shutdown_drain_s": 5},
    )
    try:
        url = f"http://127.0.0.1:{port}"
        assert nc.urls == {node_id: url}
        info = nc.infos[node_id]
        assert info["node_id"] == node_id and info["alive"]  # pinned to (and reporting from) that node
        assert info["started_in_main_thread"]  # PR_SET_PDEATHSIG follows the thread that forked
        assert info["data_dir"] == str(tmp_path / node_id)
        assert httpx.get(url + "/readyz", timeout=5).json()["ready"] is True

        # Idempotent: a second call finds the same actor and the same collector process.
        again = ray_collectors.start_node_collectors(port=port, data_dir=str(tmp_path / "{node_id}"))
        assert again.urls == nc.urls and again.infos[node_id]["pid"] == info["pid"]
        named = [a for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].startswith(ray_collectors.ACTOR_PREFIX)]
        assert named == [{"name": ray_collectors.actor_name(node_id), "namespace": ray_collectors.NAMESPACE}]

        # A traced Ray task with the helper's runtime_env (merged into a base env) reaches it.
        env = nc.runtime_env(base={"env_vars": {"TRACECAR_EXPERIMENT": "ray-env"}})
        assert env["env_vars"] == {"TRACECAR_EXPERIMENT": "ray-env", "TRACECAR_URL": url}
        task = ray.remote(num_cpus=0)(traced_rollouts)
        out = ray.get(task.options(runtime_env=env).remote("ray-env", 3), timeout=60)
        assert out == {"env_url": url, "tracer_url": url, "node_local_url": url, "flushed": True,
                       "node_id": node_id, "sent": 9}
        page = wait_trajectories(url, "ray-env", 3)
        assert page["total"] == 3
        assert sorted(t["sample_index"] for t in page["trajectories"]) == [0, 1, 2]
        assert all(t["span_count"] == 3 and t["step"] == 1 for t in page["trajectories"])

        # A second driver: finds the actors, start is idempotent, the setup hook configures workers.
        second = subprocess.run(
            [sys.executable, "-c", SECOND_DRIVER, ray_cluster.gcs_address, str(port), "ray-hook"],
            capture_output=True, text=True, timeout=120, env={**os.environ, "RAY_AUTH_MODE": "disabled"},
        )
        lines = [ln for ln in second.stdout.splitlines() if ln.startswith("RESULT ")]
        assert second.returncode == 0 and lines, second.stdout[-3000:] + second.stderr[-3000:]
        result = json.loads(lines[-1][len("RESULT "):])
        assert result["found"] == nc.urls and result["again"] == nc.urls and result["pids"] == [info["pid"]]
        assert result["worker"] == {"env_url": None, "tracer_url": url, "flushed": True}
        assert wait_trajectories(url, "ray-hook", 1)["total"] == 1
    finally:
        results = nc.shutdown(timeout_s=30)

    # Clean shutdown: the collector drained and exited 0, nothing left pending, the actor is gone.
    stopped = results[node_id]
    assert stopped["clean"] and not stopped["alive"] and not stopped["killed"], stopped
    assert stopped["returncode"] in (0, -signal.SIGTERM)  # uvicorn re-raises the SIGTERM after its drain
    assert stopped["drained"] and stopped["left_in_spool"] == 0, stopped
    import psutil

    assert not psutil.pid_exists(info["pid"])
    from tracecar.collector.spool.store import Spool

    spool = Spool(Path(info["data_dir"]) / "spool.sqlite3", local_only=True)
    try:
        assert spool.pending_count == 0
    finally:
        spool.close()
    deadline = time.monotonic() + 20
    while True:
        try:
            ray.get_actor(ray_collectors.actor_name(node_id), namespace=ray_collectors.NAMESPACE)
        except ValueError:
            break
        assert time.monotonic() < deadline, "collector actor still registered after shutdown"
        time.sleep(0.1)
    assert ray_collectors.find_node_collectors().actors == {}
    print(f"ray collectors e2e: {time.monotonic() - started:.1f} s")


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_actor_death_still_drains_the_collector(ray_cluster: Any, tmp_path: Path) -> None:
    """ray.kill of the actor (no shutdown call): PR_SET_PDEATHSIG sends the collector SIGTERM."""
    import psutil

    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux-only")
    nc = ray_collectors.start_node_collectors(port=free_port(), data_dir=str(tmp_path / "{node_id}"))
    (node_id, info), = nc.infos.items()
    collector = psutil.Process(info["pid"])
    ray.kill(nc.actors[node_id], no_restart=True)
    rc = collector.wait(timeout=30)  # exits on its own: SIGTERM -> drain -> exit
    log_lines = [json.loads(ln) for ln in Path(info["log_path"]).read_text().splitlines() if ln.startswith("{")]
    events = [e.get("event") for e in log_lines]
    assert "shutdown" in events and "drained" in events, (rc, events)
    nc.shutdown(timeout_s=5)


def test_runtime_env_merging_without_ray() -> None:
    base = {"env_vars": {"TOKENIZERS_PARALLELISM": "true"}, "working_dir": None}
    env = ray_collectors.runtime_env(9470, base, via="both")
    assert env == {"env_vars": {"TOKENIZERS_PARALLELISM": "true", "TRACECAR_URL": "http://127.0.0.1:9470"},
                   "working_dir": None, "worker_process_setup_hook": ray_collectors.SETUP_HOOK}
    assert base == {"env_vars": {"TOKENIZERS_PARALLELISM": "true"}, "working_dir": None}  # copied, not changed
    with pytest.raises(ValueError, match="worker_process_setup_hook"):
        ray_collectors.runtime_env(base={"worker_process_setup_hook": "tracecar.client.verl.install"}, via="hook")
    assert ray_collectors.settings_env({"token2text": True, "budgets": {"e": {"max_groups_per_step": 2}},
                                        "tokenizer": None}) == {
        "TRACECAR_TOKEN2TEXT": "true", "TRACECAR_BUDGETS": '{"e": {"max_groups_per_step": 2}}'}
    with pytest.raises(ValueError, match="port"):
        ray_collectors.settings_env({"port": 1})


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_a_collector_that_cannot_start_is_reported_and_removed(ray_cluster: Any, tmp_path: Path) -> None:
    """Port taken on the node: start_node_collectors raises with the collector's log, leaves no actor."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=r"exited with \d+:\n[\s\S]*already in use"):
            ray_collectors.start_node_collectors(port=port, data_dir=str(tmp_path / "{node_id}"), ready_timeout_s=30)
    deadline = time.monotonic() + 20
    while ray_collectors.find_node_collectors().actors:
        assert time.monotonic() < deadline, "failed collector actor still registered"
        time.sleep(0.1)
