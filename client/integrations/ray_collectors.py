"""One tracecar collector per Ray node, run as a Ray actor pinned to that node.

Rollout workers then post spans to ``http://127.0.0.1:PORT`` on their own node: no cross-node
hop on the hot path, and one collector per node rather than per worker.  Each collector is a
child process of its actor (``python -m tracecar.collector``: its own GIL, its own
SQLite spool under a per-node data dir), so the actor only starts, watches and stops it::

    import ray
    from tracecar.client import ray_collectors

    ray.init(runtime_env=ray_collectors.runtime_env(port=9470))   # TRACECAR_URL for every worker
    collectors = ray_collectors.start_node_collectors(port=9470)  # one per alive node, idempotent
    ...  # train
    collectors.shutdown()                                          # SIGTERM: drain, then exit

Many nodes, one gateway (docs/cluster.md): :func:`start_gateway` runs a gateway collector as an
actor on the head node, and ``start_node_collectors(gateway=...)`` makes every node's collector
forward to it (the tail budgets, the store, the viewer and the W&B credentials are the gateway's)::

    gateway = ray_collectors.start_gateway(port=9471, settings={"max_trajectories_per_step": 256})
    collectors = ray_collectors.start_node_collectors(port=9470, gateway=gateway)
    ...
    collectors.shutdown(); gateway.shutdown()   # nodes first: they drain into the gateway

Beyond one gateway's rate, :func:`start_gateways` runs several (one a node, the head's first), and
``start_node_collectors(gateway=gateways)`` lists them all on every node: each step goes whole to
one of them (rendezvous hashing, docs/cluster.md *Several gateways*)::

    gateways = ray_collectors.start_gateways(2, port=9471, settings={"max_trajectories_per_step": 256})
    collectors = ray_collectors.start_node_collectors(port=9470, gateway=gateways)
    ...
    collectors.shutdown(); [g.shutdown() for g in gateways]

Actors are named ``tracecar-collector-<node_id>`` in the ``tracecar`` namespace, so a second
driver (or a worker, through :func:`node_local_url`) finds them.  The collector is also tied to
its actor's process by ``PR_SET_PDEATHSIG`` (Linux) and ``--parent-pid`` (a thread watching it,
everywhere; :mod:`tracecar.client.lifeline`): if the actor dies without ``shutdown`` (driver
exit, ``ray.kill``), the collector still gets SIGTERM and drains.

``ray`` is imported inside functions only: importing this module needs no ray.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger("tracecar.ray")

DEFAULT_PORT = 9470
NAMESPACE = "tracecar"
ACTOR_PREFIX = "tracecar-collector-"
GATEWAY_ACTOR = "tracecar-gateway"
DEFAULT_GATEWAY_PORT = 9471
# a node collector with a gateway must not inherit W&B credentials: they belong on the gateway only
_GATEWAY_ONLY_ENV = ("WANDB_API_KEY", "TRACECAR_WANDB_API_KEY", "TRACECAR_EXPORTERS", "TRACECAR_BACKEND")
KV_NAMESPACE = "tracecar"
SETUP_HOOK = "tracecar.client.integrations.ray_collectors.configure_from_node"
# Set in the collector actors' own processes: the setup hook must not look itself up there.
IN_COLLECTOR_ENV = "TRACECAR_RAY_COLLECTOR_ACTOR"
# Settings the helper owns (one loopback port and one data dir per node).
_OWN_SETTINGS = {"host", "port", "data_dir"}

Via = Literal["env", "hook", "both"]


def actor_name(node_id: str) -> str:
    return ACTOR_PREFIX + node_id


def loopback_url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def runtime_env(port: int = DEFAULT_PORT, base: Mapping[str, Any] | None = None, *, via: Via = "env",
                namespace: str = NAMESPACE) -> dict[str, Any]:
    """A Ray ``runtime_env`` that points every worker at its own node's collector.

    ``via="env"`` sets ``TRACECAR_URL=http://127.0.0.1:PORT`` (the same on every node: each
    collector listens on its own node's loopback); ``"hook"`` sets the
    ``worker_process_setup_hook`` :func:`configure_from_node`, which finds the URL of the
    collector on the worker's node (for ports that differ per node); ``"both"`` does both.
    ``base`` (e.g. VERL's ``get_ppo_ray_runtime_env()``) is copied and kept; its ``env_vars``
    are merged.  Needs no running Ray, so it can go into ``ray.init(runtime_env=...)`` before
    the collectors start.  Ray honours the setup hook only in the job-level runtime_env.
    """
    env = copy.deepcopy(dict(base or {}))
    env_vars = dict(env.get("env_vars") or {})
    if via in ("env", "both"):
        env_vars["TRACECAR_URL"] = loopback_url(port)
    if via in ("hook", "both"):
        existing = env.get("worker_process_setup_hook")
        if existing not in (None, SETUP_HOOK):
            raise ValueError(f"the runtime_env already has worker_process_setup_hook={existing!r}; Ray runs one "
                             "hook per job (use via='env', or load tracecar.client.verl with model.external_lib)")
        env["worker_process_setup_hook"] = SETUP_HOOK
        if namespace != NAMESPACE:
            env_vars["TRACECAR_RAY_NAMESPACE"] = namespace
    if env_vars:
        env["env_vars"] = env_vars
    return env


def _env_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if hasattr(value, "model_dump"):
        value = value.model_dump(exclude_unset=True)
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value)
    if hasattr(value, "get_secret_value"):
        return value.get_secret_value()
    return str(value)


def settings_env(settings: Mapping[str, Any] | None) -> dict[str, str]:
    """Collector settings (CollectorSettings field names) as the TRACECAR_* env of ``tracecar serve``."""
    out: dict[str, str] = {}
    for key, value in (settings or {}).items():
        if key.lower() in _OWN_SETTINGS:
            raise ValueError(f"setting {key!r} is chosen by start_node_collectors (pass port=/data_dir=)")
        if value is not None:
            out["TRACECAR_" + key.upper()] = _env_value(value)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Runs in the child before it execs the collector: it is single-threaded there (a preexec_fn in
# the multi-threaded Ray worker could deadlock).  SIGTERM when the actor dies (the collector
# drains), through the helper every process tracecar starts uses (tracecar.client.lifeline).
_LAUNCH = (
    "import os, signal, sys\n"
    "from tracecar.client.lifeline import set_parent_death_signal\n"
    "set_parent_death_signal(signal.SIGTERM)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('tracecar: the collector actor exited before its collector started')\n"
    "os.execv(sys.executable, [sys.executable, '-m', 'tracecar.collector', '--parent-pid', sys.argv[1]])\n"
)


def _kv_key(namespace: str, node_id: str) -> str:
    return f"collector-url/{namespace}/{node_id}"


# Each actor publishes its URL in Ray's GCS key-value store once ready: a worker's setup hook
# can read it there, while submitting an actor task from inside the hook crashes the worker
# (ray 2.60: CoreWorker::OverrideTaskOrActorRuntimeEnvInfo, "Check failed").
def _kv_put(key: str, value: str) -> None:
    try:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(key, value, overwrite=True, namespace=KV_NAMESPACE)
    except Exception as e:  # an older/newer ray without it: node_local_url asks the actor instead
        log.debug("tracecar: cannot publish %s in ray's kv store: %s", key, e)


def _kv_get(key: str) -> str | None:
    try:
        from ray.experimental import internal_kv

        value = internal_kv._internal_kv_get(key, namespace=KV_NAMESPACE)
    except Exception:
        return None
    return value.decode() if value else None


def _kv_del(key: str) -> None:
    try:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(key, namespace=KV_NAMESPACE)
    except Exception:
        pass


class CollectorActor:
    """Owns one ``tracecar serve`` child process on this node (wrapped by ``ray.remote``)."""

    def __init__(self, port: int, env: dict[str, str], data_dir: str | None, namespace: str = NAMESPACE,
                 host: str = "127.0.0.1", publish: bool = True, drop_env: tuple[str, ...] = ()) -> None:
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()
        self.namespace = namespace
        self.publish = publish  # a node-local collector's URL goes to the kv store (the gateway's does not)
        if host == "node":  # the node's own address: reachable from the other nodes (the gateway)
            host = ray.util.get_node_ip_address()
        self.host = host
        self.port = port or _free_port()
        template = data_dir or str(Path(tempfile.gettempdir()) / "tracecar-ray" / "{port}")
        self.data_dir = Path(template.format(node_id=self.node_id, port=self.port)).expanduser()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.data_dir / "collector.log"
        self.url = loopback_url(self.port) if host == "127.0.0.1" else f"http://{host}:{self.port}"
        child_env = {k: v for k, v in os.environ.items() if k not in drop_env}
        child_env.update(env)
        child_env.update({"TRACECAR_HOST": host, "TRACECAR_PORT": str(self.port),
                          "TRACECAR_DATA_DIR": str(self.data_dir)})
        child_env.pop(IN_COLLECTOR_ENV, None)
        if sys.platform.startswith("linux"):
            argv = [sys.executable, "-c", _LAUNCH, str(os.getpid())]
        else:
            argv = [sys.executable, "-m", "tracecar.collector", "--parent-pid", str(os.getpid())]
        with self.log_path.open("ab") as log_file:
            # Own session: a signal to the Ray worker's process group does not skip the drain.
            self.proc = subprocess.Popen(argv, env=child_env, stdin=subprocess.DEVNULL, stdout=log_file,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.started_in_main_thread = threading.current_thread() is threading.main_thread()
        self.result: dict[str, Any] | None = None

    def info(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "url": self.url, "port": self.port, "pid": self.proc.pid,
                "data_dir": str(self.data_dir), "log_path": str(self.log_path), "alive": self.proc.poll() is None,
                "returncode": self.proc.returncode, "actor_pid": os.getpid(),
                "started_in_main_thread": self.started_in_main_thread}

    def get_url(self) -> str:
        return self.url

    def wait_ready(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """Polls /readyz until 200; raises with the log tail if the collector exits or stalls."""
        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tracecar collector on node {self.node_id} exited with {self.proc.returncode}:\n"
                                   + self.log_tail())
            try:
                if httpx.get(self.url + "/readyz", timeout=1.0).status_code == 200:
                    if self.publish:
                        _kv_put(_kv_key(self.namespace, self.node_id), self.url)
                    return self.info()
            except httpx.HTTPError:
                pass
            if time.monotonic() >= deadline:
                raise TimeoutError(f"tracecar collector on node {self.node_id} not ready at {self.url} after "
                                   f"{timeout_s} s:\n" + self.log_tail())
            time.sleep(0.1)

    def log_tail(self, max_bytes: int = 4000) -> str:
        try:
            with self.log_path.open("rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - max_bytes))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """SIGTERM (the collector turns unready, drains, exits); SIGKILL after ``timeout_s``."""
        if self.result is not None:
            return self.result
        if self.publish:
            _kv_del(_kv_key(self.namespace, self.node_id))
        started = time.monotonic()
        killed = False
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
                killed = True
        drained = self._drained_event()
        # uvicorn re-raises the SIGTERM it handled once the drain is done: -15 is a clean exit too.
        clean = not killed and drained is not None and self.proc.returncode in (0, -signal.SIGTERM)
        self.result = {**self.info(), "killed": killed, "stop_s": round(time.monotonic() - started, 3),
                       "drained": drained is not None, "clean": clean,
                       "left_in_spool": drained.get("left_in_spool") if drained else None}
        return self.result

    def _drained_event(self) -> dict[str, Any] | None:
        """The collector's last JSON log line with event=drained (written at the end of its drain)."""
        for line in reversed(self.log_tail(64_000).splitlines()):
            if '"drained"' in line:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if event.get("event") == "drained":
                    return event
        return None

    def __del__(self) -> None:  # best effort; PDEATHSIG covers a hard exit
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)


@dataclass
class NodeCollectors:
    """The collector actors of a cluster, by node id."""

    namespace: str
    actors: dict[str, Any]
    infos: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def urls(self) -> dict[str, str]:
        return {node: info["url"] for node, info in self.infos.items()}

    def runtime_env(self, base: Mapping[str, Any] | None = None, *, via: Via | None = None) -> dict[str, Any]:
        """:func:`runtime_env` for these collectors: ``TRACECAR_URL`` when every node uses one port,
        else (or with ``via="hook"``) the setup hook that looks up the node's own collector."""
        ports = {info["port"] for info in self.infos.values()}
        if via is None:
            via = "env" if len(ports) == 1 else "hook"
        if via in ("env", "both") and len(ports) != 1:
            raise ValueError(f"collectors listen on different ports {sorted(ports)}: TRACECAR_URL cannot fit every "
                             "node; use via='hook'")
        port = next(iter(ports)) if len(ports) == 1 else DEFAULT_PORT
        return runtime_env(port, base, via=via, namespace=self.namespace)

    def shutdown(self, timeout_s: float = 30.0) -> dict[str, dict[str, Any]]:
        """Stops every collector (SIGTERM, drain, SIGKILL after ``timeout_s``), then its actor.

        Returns what each stop reported: ``clean`` (drained, then exited on the SIGTERM),
        ``returncode``, ``drained``, ``left_in_spool`` (spans not yet forwarded), ``killed``.
        """
        import ray

        refs = {node: actor.stop.remote(timeout_s) for node, actor in self.actors.items()}
        results: dict[str, dict[str, Any]] = {}
        for node, ref in refs.items():
            try:
                results[node] = ray.get(ref, timeout=timeout_s + 60)
            except Exception as e:  # a dead actor: its collector got SIGTERM through PDEATHSIG
                results[node] = {"node_id": node, "error": repr(e)}
        for actor in self.actors.values():
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
        self.actors.clear()
        return results


def _alive_node_ids() -> list[str]:
    import ray

    return [n["NodeID"] for n in ray.nodes() if n.get("Alive")]


@dataclass
class GatewayCollector:
    """A gateway collector of the job (an actor, on the head node unless placed elsewhere); ``url`` is what the nodes post to."""

    namespace: str
    actor: Any
    info: dict[str, Any]
    token: str | None = None  # the gateway's TRACECAR_TOKEN, handed to the nodes as TRACECAR_GATEWAY_TOKEN

    @property
    def url(self) -> str:
        return str(self.info["url"])

    def shutdown(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """SIGTERM (drain to the exporters, then exit; SIGKILL after ``timeout_s``), then the actor.
        Stop the node collectors first: they drain into the gateway."""
        import ray

        try:
            result: dict[str, Any] = ray.get(self.actor.stop.remote(timeout_s), timeout=timeout_s + 60)
        except Exception as e:  # a dead actor: its collector got SIGTERM through PDEATHSIG
            result = {"node_id": self.info.get("node_id"), "error": repr(e)}
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:
            pass
        return result


def gateway_actor_name(index: int = 0) -> str:
    """The first gateway keeps the one name (``tracecar-gateway``); more are ``tracecar-gateway-1``, ..."""
    return GATEWAY_ACTOR if index == 0 else f"{GATEWAY_ACTOR}-{index}"


def _head_node_id() -> str:
    import ray

    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" in (node.get("Resources") or {}):
            return str(node["NodeID"])
    raise RuntimeError("no alive Ray head node found")


def start_gateway(
    port: int = DEFAULT_GATEWAY_PORT,
    settings: Mapping[str, Any] | None = None,
    data_dir: str | None = None,
    *,
    host: str = "node",
    node_id: str | None = None,
    num_cpus: float = 0,
    namespace: str = NAMESPACE,
    detached: bool = False,
    ready_timeout_s: float = 60.0,
    index: int = 0,
) -> GatewayCollector:
    """Starts (or finds) the gateway collector (``TRACECAR_ROLE=gateway``) as an actor on the head node.

    ``host``: the address it binds; ``"node"`` (default) is the head node's own IP, which the other
    nodes reach (set ``settings={"token": ...}``: the nodes get it as their gateway token).
    ``settings``: CollectorSettings fields: the tail budgets and the exporters (Weave, OTLP,
    MLflow) go here; W&B credentials in the head node's environment are inherited.
    ``data_dir``: default ``$TMPDIR/tracecar-ray/gateway-{port}`` (``gateway{index}-{port}`` for index > 0;
    ``{index}``, ``{port}`` and ``{node_id}`` are filled in). ``index``: which of several
    (:func:`start_gateways`, which also places them one a node): its actor's name. A fixed ``port`` takes
    one gateway a host.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not ray.is_initialized():
        raise RuntimeError("start_gateway needs ray.init() first")
    env = settings_env({**(settings or {}), "role": "gateway"})
    token = env.get("TRACECAR_TOKEN")
    target = node_id or _head_node_id()
    options: dict[str, Any] = dict(
        name=gateway_actor_name(index), namespace=namespace, get_if_exists=True, num_cpus=num_cpus, max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(target, soft=False),
        runtime_env={"env_vars": {"TRACECAR_URL": "", IN_COLLECTOR_ENV: "1", "RAY_kill_child_processes_on_worker_exit": "false"}},
    )
    if detached:
        options["lifetime"] = "detached"
    template = data_dir or str(Path(tempfile.gettempdir()) / "tracecar-ray" / ("gateway-{port}" if index == 0
                                                                             else "gateway{index}-{port}"))
    template = template.replace("{index}", str(index))
    actor: Any = ray.remote(CollectorActor).options(**options).remote(port, env, template, namespace, host, False)
    try:
        info: dict[str, Any] = ray.get(actor.wait_ready.remote(ready_timeout_s), timeout=ready_timeout_s + 120)
    except Exception as e:
        try:
            ray.get(actor.stop.remote(5), timeout=60)
        finally:
            ray.kill(actor, no_restart=True)
        raise RuntimeError(f"tracecar gateway failed to start: {getattr(e, 'cause', None) or e}") from None
    return GatewayCollector(namespace, actor, info, token)


def start_gateways(
    count: int,
    port: int = DEFAULT_GATEWAY_PORT,
    settings: Mapping[str, Any] | None = None,
    data_dir: str | None = None,
    *,
    node_ids: Sequence[str] | None = None,
    **options: Any,
) -> list[GatewayCollector]:
    """Starts (or finds) ``count`` gateways, one a node: the head node's first, then the other alive nodes in
    node-id order (or ``node_ids``). Every one runs the same ``settings`` (the tail budgets must agree: the
    nodes check). Pass the list to ``start_node_collectors(gateway=...)``. ``options``: as :func:`start_gateway`.

    A gateway already running under its name (``tracecar-gateway-N``) is found and kept as it runs (its
    settings, node and port are not changed); if a later one fails to start, only those this call started
    are stopped. ``data_dir``: put ``{index}`` or ``{node_id}`` in it when it is on a shared file system."""
    import ray

    if count < 1:
        raise ValueError("start_gateways needs count >= 1")
    if not ray.is_initialized():
        raise RuntimeError("start_gateways needs ray.init() first")
    if node_ids is None:
        head = _head_node_id()
        node_ids = [head, *sorted(n for n in _alive_node_ids() if n != head)]
    if len(node_ids) < count:
        raise ValueError(f"{count} gateways need {count} nodes ({len(node_ids)} given or alive): one gateway a node")
    namespace = options.get("namespace", NAMESPACE)
    gateways: list[GatewayCollector] = []
    started: list[GatewayCollector] = []
    try:
        for i, node_id in enumerate(node_ids[:count]):
            found = _actor_exists(gateway_actor_name(i), namespace)
            gateways.append(start_gateway(port, settings, data_dir, node_id=node_id, index=i, **options))
            if not found:
                started.append(gateways[-1])
    except BaseException:
        for gateway in started:
            gateway.shutdown(timeout_s=10)
        raise
    return gateways


def _actor_exists(name: str, namespace: str) -> bool:
    import ray

    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    return True


def _gateway_env(gateway: GatewayCollector | str | Sequence[GatewayCollector | str]) -> dict[str, str]:
    """TRACECAR_GATEWAY_URL (and the gateways' one token) for every node collector."""
    one = isinstance(gateway, str) or hasattr(gateway, "url")  # a GatewayCollector, or anything with its url
    gateways: list[Any] = [gateway] if one else list(gateway)  # type: ignore[arg-type]
    if not gateways:
        raise ValueError("gateway: an empty list")
    env = {"TRACECAR_ROLE": "node", "TRACECAR_GATEWAY_URL": ",".join(g if isinstance(g, str) else g.url for g in gateways)}
    tokens: set[str] = {g.token for g in gateways if not isinstance(g, str) and getattr(g, "token", None)}
    if len(tokens) > 1:
        raise ValueError("the gateways have different tokens: a node sends one (TRACECAR_GATEWAY_TOKEN)")
    if tokens:
        env["TRACECAR_GATEWAY_TOKEN"] = tokens.pop()
    return env


def start_node_collectors(
    port: int = DEFAULT_PORT,
    settings: Mapping[str, Any] | None = None,
    data_dir: str | None = None,
    *,
    num_cpus: float = 0,
    namespace: str = NAMESPACE,
    detached: bool = False,
    ready_timeout_s: float = 60.0,
    node_ids: list[str] | None = None,
    gateway: GatewayCollector | str | Sequence[GatewayCollector | str] | None = None,
) -> NodeCollectors:
    """Starts (or finds) one collector actor on every alive Ray node and waits until all are ready.

    ``port``: loopback port on each node (0: each picks a free one; then use the setup hook).
    ``settings``: CollectorSettings fields (``{"backend": "weave", "wandb_entity": ...}``), passed
    as TRACECAR_* env; anything already in the nodes' environment (``WANDB_API_KEY``) is inherited.
    ``data_dir``: spool directory on each node; ``{node_id}`` and ``{port}`` are filled in
    (default ``$TMPDIR/tracecar-ray/{port}``, stable across runs so a spool left behind is
    forwarded at the next start).  ``detached``: the actors outlive this driver (stop them with
    ``find_node_collectors().shutdown()``); otherwise they end with this job.
    Calling it again (from any driver) returns the running actors and starts only missing ones.
    ``gateway`` (a :func:`start_gateway` result, or the gateway's URL; or a list of them,
    :func:`start_gateways`): every node collector forwards to it (``TRACECAR_GATEWAY_URL``, named by
    its node id; several: each step to one of them), and W&B credentials in the nodes' environment
    are not passed on to them (the gateway holds them).
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not ray.is_initialized():
        raise RuntimeError("start_node_collectors needs ray.init() first")
    env = settings_env(settings)
    drop_env: tuple[str, ...] = ()
    if gateway is not None:
        wired = _gateway_env(gateway)
        if "TRACECAR_GATEWAY_TOKEN" in env:  # a token in the settings wins over the gateways' own
            wired.pop("TRACECAR_GATEWAY_TOKEN", None)
        env.update(wired)
        drop_env = _GATEWAY_ONLY_ENV
    remote_cls = ray.remote(CollectorActor)
    actors: dict[str, Any] = {}
    for node_id in node_ids or _alive_node_ids():
        options: dict[str, Any] = dict(
            name=actor_name(node_id), namespace=namespace, get_if_exists=True, num_cpus=num_cpus,
            max_restarts=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            # The job's TRACECAR_URL (or setup hook) must not make the actor trace to itself.
            # Ray SIGKILLs a dying worker's children; this worker leaves that to PR_SET_PDEATHSIG
            # (SIGTERM), so a collector whose actor died without shutdown() still drains.
            runtime_env={"env_vars": {"TRACECAR_URL": "", IN_COLLECTOR_ENV: "1",
                                      "RAY_kill_child_processes_on_worker_exit": "false"}},
        )
        if detached:
            options["lifetime"] = "detached"
        node_env = {**env, "TRACECAR_NODE_NAME": env.get("TRACECAR_NODE_NAME", node_id)} if gateway is not None else env
        actors[node_id] = remote_cls.options(**options).remote(port, node_env, data_dir, namespace, "127.0.0.1", True, drop_env)
    collectors = NodeCollectors(namespace, actors)
    refs = {node: actor.wait_ready.remote(ready_timeout_s) for node, actor in actors.items()}
    failed: dict[str, str] = {}
    for node, ref in refs.items():  # scheduling + runtime_env setup come on top of the collector's start
        try:
            collectors.infos[node] = ray.get(ref, timeout=ready_timeout_s + 120)
        except Exception as e:  # a RayTaskError carries the actor's own exception as .cause
            failed[node] = str(getattr(e, "cause", None) or e)
    if failed:  # stop only the ones that failed; the ready ones stay for a retry to find
        NodeCollectors(namespace, {n: actors.pop(n) for n in failed}).shutdown(timeout_s=5)
        raise RuntimeError("tracecar collectors failed to start on " + "; ".join(
            f"node {node}: {error}" for node, error in failed.items()))
    for node, info in collectors.infos.items():
        if port and info["port"] != port:
            log.warning("tracecar: node %s already runs a collector on port %s (asked %s); keeping it",
                        node, info["port"], port)
    return collectors


def find_node_collectors(namespace: str = NAMESPACE) -> NodeCollectors:
    """The collector actors already running (e.g. from another driver), without starting any."""
    import ray

    actors: dict[str, Any] = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == namespace and entry["name"].startswith(ACTOR_PREFIX):
            actors[entry["name"][len(ACTOR_PREFIX):]] = ray.get_actor(entry["name"], namespace=namespace)
    collectors = NodeCollectors(namespace, actors)
    for node, actor in actors.items():
        collectors.infos[node] = ray.get(actor.info.remote(), timeout=60)
    return collectors


def node_local_url(namespace: str | None = None, timeout_s: float = 60.0) -> str:
    """URL of the collector on the node this code runs on (inside a Ray worker or driver).

    Raises LookupError when the node has no collector actor.
    """
    return _node_local_url(namespace, timeout_s, ask_actor=True)


def _node_local_url(namespace: str | None, timeout_s: float, *, ask_actor: bool) -> str:
    import ray

    namespace = namespace or os.environ.get("TRACECAR_RAY_NAMESPACE") or NAMESPACE
    node_id = ray.get_runtime_context().get_node_id()
    try:  # a GCS lookup: a dead actor's name is released, so a stale kv entry is not trusted
        actor = ray.get_actor(actor_name(node_id), namespace=namespace)
    except ValueError as e:
        raise LookupError(f"no tracecar collector actor on node {node_id} (namespace {namespace!r})") from e
    url = _kv_get(_kv_key(namespace, node_id))
    if url:
        return url
    if ask_actor:  # not published (yet): the actor answers once its collector is ready
        return ray.get(actor.get_url.remote(), timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.2)
        url = _kv_get(_kv_key(namespace, node_id))
        if url:
            return url
    raise LookupError(f"the tracecar collector on node {node_id} published no URL within {timeout_s} s")


def configure_from_node() -> Any:
    """``worker_process_setup_hook``: trace to this node's collector. Never raises.

    Returns the tracer, or None (no collector on this node: whatever TRACECAR_URL says applies).
    """
    if os.environ.get(IN_COLLECTOR_ENV):
        return None
    try:
        url = _node_local_url(None, 30.0, ask_actor=False)  # no actor task from inside the hook
    except Exception as e:
        log.warning("tracecar: no node-local collector found (%s); tracing as TRACECAR_URL says", e)
        return None
    from .. import tracer

    return tracer.configure(url=url)
