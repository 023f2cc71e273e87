"""Shared helpers for the bench scripts: loopback services, weave set-up, payloads, statistics.

Every service a bench starts is a subprocess bound to 127.0.0.1 and stopped by its pid when the
bench ends. Weave is only ever initialised against the loopback stub (bench/sink_stub.py), with a
dummy key, stdin closed and its PyPI version check and error reporting switched off, so no bench
sends a byte off this machine.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
PY = sys.executable
DUMMY_WANDB_KEY = "0123456789abcdef0123456789abcdef01234567"  # 40 chars, like a real key; never valid
WEAVE_PROJECT = "bench-project"
WEAVE_ENTITY = "bench-entity"  # what bench/sink_stub.py answers as the viewer's default entity
DEAD_PROXY = "http://127.0.0.1:9"  # any stray non-loopback HTTP request fails here, on this machine
VOCAB = 100_000  # below the deepseek tokenizer's 129k vocabulary


# ---- processes -------------------------------------------------------------------------
# One implementation of ports, waiting and terminate-wait-kill for tests and benches: tests/support.
sys.path.insert(0, str(REPO))
from tests.support.collector import collector_env, launch_collector, scrape_metric  # noqa: E402, F401  (scrape_metric: for bench scripts)
from tests.support.processes import Service, free_port, pool_pids, start_service  # noqa: E402, F401  (bench scripts import them from here)
from tests.support.processes import clean_env as _clean_env  # noqa: E402


def pin(cpus: set[int] | None) -> Any:
    """A preexec_fn that pins a child (and every thread it starts) to ``cpus``; None: no pinning."""
    if not cpus or not hasattr(os, "sched_setaffinity") or max(cpus) >= (os.cpu_count() or 1):
        return None
    return lambda: os.sched_setaffinity(0, cpus)


WORKER_CPUS, SIDECAR_CPUS = {0}, {1}  # on 2 cores: the traced worker on one, collector and stub on the other
_BENCH_DROPS = ("TRACECAR_", "WANDB_", "WF_", "WEAVE_")


def clean_env(**extra: Any) -> dict[str, str]:
    """This environment without TRACECAR_/WANDB_/WF_/WEAVE_ settings, plus ``extra``."""
    return _clean_env(_BENCH_DROPS, **extra)


def start_stub(rate: float | None = None, workdir: Path | None = None, cpus: set[int] | None = None) -> Service:
    """bench/sink_stub.py in its own process; ``rate`` caps calls/complete at that many calls/s."""
    port = free_port()
    args = [PY, str(BENCH / "sink_stub.py"), "--port", str(port)]
    if rate:
        args += ["--rate", str(rate)]
    log = (workdir or Path(tempfile.mkdtemp(prefix="tracecar-bench-"))) / f"stub-{port}.log"
    return start_service("stub", args, f"http://127.0.0.1:{port}/server_info", log, env=clean_env(), preexec_fn=pin(cpus))


def start_collector(data_dir: Path, cpus: set[int] | None = None, **settings: Any) -> Service:
    """``python -m tracecar.collector`` with TRACECAR_* settings (keys without the prefix)."""
    port = free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    env = collector_env(port, data_dir, drop=_BENCH_DROPS, TRACECAR_LOG_LEVEL="warning", NO_PROXY="127.0.0.1,localhost",
                        **settings)
    return launch_collector(env, data_dir / f"collector-{port}.log", cwd=str(REPO), preexec_fn=pin(cpus))


@contextlib.contextmanager
def services(*started: Service) -> Iterator[None]:
    try:
        yield
    finally:
        for s in reversed(started):
            s.stop()


# ---- weave ---------------------------------------------------------------------------
def weave_env(stub_url: str) -> dict[str, str]:
    """Environment that points weave (and W&B's GraphQL) at the loopback stub."""
    return {
        "WANDB_BASE_URL": stub_url, "WF_TRACE_SERVER_URL": stub_url, "WANDB_API_KEY": DUMMY_WANDB_KEY,
        "WEAVE_PRINT_CALL_LINK": "false", "WEAVE_LOG_LEVEL": "WARNING", "WANDB_ERROR_REPORTING": "false",
        "WEAVE_USE_SERVER_CACHE": "false", "WANDB_SILENT": "true",
        "HTTP_PROXY": DEAD_PROXY, "HTTPS_PROXY": DEAD_PROXY, "NO_PROXY": "127.0.0.1,localhost",
    }


def init_weave_like_verl(project: str = WEAVE_PROJECT) -> Any:
    """``weave.init(project)`` as VERL's RolloutTraceConfig.init calls it, made safe to run here.

    Refuses unless weave would talk to loopback with a key already set (a bare ``weave.init``
    prompts for a key on stdin), closes stdin anyway, and turns off the one request weave makes
    elsewhere (its PyPI version check in the init message).
    """
    for name in ("WANDB_BASE_URL", "WF_TRACE_SERVER_URL"):
        if not os.environ.get(name, "").startswith("http://127.0.0.1:"):
            raise RuntimeError(f"{name} must point at the loopback stub before weave.init")
    if len(os.environ.get("WANDB_API_KEY", "")) != 40:
        raise RuntimeError("WANDB_API_KEY (dummy, 40 chars) must be set before weave.init")
    sys.stdin = open(os.devnull)  # noqa: SIM115 - a prompt must fail, never block
    import weave
    from weave.trace import init_message

    init_message._print_version_check = lambda: None  # the PyPI lookup: not loopback, not per call
    return weave.init(project)


# ---- payloads -------------------------------------------------------------------------
def token_ids(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def tool_call(rng: random.Random) -> dict[str, Any]:
    return {"name": "python_interpreter", "arguments": {"code": f"print(sum(range({rng.randint(1, 10_000)})))",
                                                       "timeout_s": 10}, "id": f"call_{rng.getrandbits(48):012x}"}


# ---- statistics -----------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of ``values`` (q in 0..100)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[k]


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def ratio(a: float, b: float) -> float:
    return a / b if b else math.inf


def alternating_cpu(paths: Mapping[str, Callable[[], Any]], rounds: int, per: int) -> dict[str, list[float]]:
    """This thread's CPU µs per item (``per`` items a run) of each path, one run a round, in order on even
    rounds and reversed on odd ones (ABBA), after one unrecorded warm-up round: every baseline measured
    interleaved with its candidates, never once."""
    cpu: dict[str, list[float]] = {name: [] for name in paths}
    for r in range(rounds + 1):
        for name in (list(paths) if r % 2 == 0 else list(paths)[::-1]):
            t0 = time.thread_time()
            paths[name]()
            if r:
                cpu[name].append((time.thread_time() - t0) * 1e6 / per)
    return cpu


def print_against(cpu: Mapping[str, Sequence[float]], baseline: str, width: int = 9) -> None:
    """One line a path: its median, and its ratio to ``baseline`` round by round (median, spread)."""
    for name, values in cpu.items():
        ratios = sorted(c / b for c, b in zip(values, cpu[baseline]))
        print(f"{name:{width}s} {statistics.median(values):8.1f}  {statistics.median(ratios):.2f}× ({ratios[0]:.2f}–{ratios[-1]:.2f})")


def table(rows: list[Sequence[Any]], headers: Sequence[str]) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(row, widths))) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def machine_note() -> str:
    """Cores and load: on a shared machine other processes take cores from the bench."""
    import psutil

    load = os.getloadavg()
    return (f"machine: {os.cpu_count()} cores, load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1/5/15 min), "
            f"CPU busy {psutil.cpu_percent(interval=0.5):.0f}% just now; python {sys.version.split()[0]}")


def header(title: str) -> None:
    print(f"\n=== {title} ===", flush=True)


# ---- collector metrics -----------------------------------------------------------------
@dataclass
class Metrics:
    """A /metrics scrape: samples by name, with their labels."""

    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)

    def total(self, name: str, **labels: str) -> float:
        return sum(v for lab, v in self.samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))

    def by_label(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for lab, v in self.samples.get(name, []):
            out[lab.get(label, "")] = out.get(lab.get(label, ""), 0.0) + v
        return out


def scrape(url: str) -> Metrics:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    m = Metrics()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            m.samples.setdefault(s.name, []).append((dict(s.labels), s.value))
    return m


def tree_cpu(process: int | Any) -> float:
    """CPU seconds (user + system) of a process (a pid or psutil.Process), the children it reaped, and its
    live children (worker pools): what a collector costs, whatever it runs in."""
    import psutil

    proc = process if isinstance(process, psutil.Process) else psutil.Process(process)
    total = sum(proc.cpu_times()[:4])
    for child in proc.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.Error:
            pass
    return total
