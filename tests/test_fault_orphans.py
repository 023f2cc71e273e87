"""Issue 33: every process a collector starts ends with it, however it ends (SIGKILL included).

A real ``python -m tracecar.collector`` with ``TRACECAR_WORKERS=2`` (two spawned worker
processes decoding with a real tokenizer, and multiprocessing's resource tracker) is SIGKILLed
while a bounded load loop posts to it on 127.0.0.1. Its whole process tree, read with psutil
before the kill, must be gone within 5 s (before tracecar.client.lifeline, the workers and the
tracker lived on, re-parented to init, ~110 MiB each). A collector restarted on the same data
dir then serves normally, with exactly its own pool. A collector started as the quickstart and
the Ray helper start it (``--parent-pid``) drains and stops, pool included, when its starter is
SIGKILLed, even though the starter armed nothing itself.
"""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from tokenizers import Tokenizer

from tests.support.collector import scrape_metric
from tests.support.processes import pool_pids

pytestmark = pytest.mark.timeout(300)

TEXT = "<|im_start|>user why is the reward 0.5? é naïve 数字🙂 the step budget is per worker and step "


def _start(collector_process: Any, tokenizer: str) -> Any:
    col = collector_process(token2text=True, tokenizer=tokenizer, workers=2, log_level="warning").start()
    _wait_metric(col.url, "tracecar_workers", 2, timeout=90)  # the pool is warm: batches go to the workers
    return col


def _wait_metric(url: str, name: str, value: float, timeout: float, **labels: str) -> None:
    deadline = time.monotonic() + timeout
    while (got := scrape_metric(url, name, **labels)) < value:
        assert time.monotonic() < deadline, f"{name}{labels} = {got}, waited {timeout} s for {value}"
        time.sleep(0.1)


def _spans(kit: Any, ids: list[int], n: int) -> list[dict[str, Any]]:
    root = kit.new_id()
    attrs = {"step": 1, "sample_index": 0, "rollout_n": 0, "experiment_name": "orphans"}
    spans = [{"span_id": kit.new_id(), "trace_id": root, "parent_id": root, "name": "generate", "kind": "op",
              "start_time": 1.0, "end_time": 2.0, "attributes": attrs, "inputs": {"prompt_ids": ids[: 20 + i]},
              "output": {"token_ids": ids[i:]}, "exception": None} for i in range(n)]
    spans.append({"span_id": root, "trace_id": root, "parent_id": None, "name": "agent_loop", "kind": "trajectory",
                  "start_time": 1.0, "end_time": 3.0, "attributes": attrs, "inputs": {}, "output": None, "exception": None})
    return spans


class Load:
    """One thread posting decodable batches back to back: bounded in count (``max_posts``) and time."""

    def __init__(self, kit: Any, ids: list[int], url: str, max_posts: int = 2000) -> None:
        self.kit, self.ids, self.url, self.max_posts = kit, ids, url, max_posts
        self.acked = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            for _ in range(self.max_posts):
                if self.stop.is_set():
                    return
                try:
                    if self.kit.post(self.url, _spans(self.kit, self.ids, 12), client=client, timeout=10).status_code == 200:
                        self.acked += 1
                except httpx.HTTPError:  # the collector was killed under us: what this test does
                    self.stop.wait(0.05)

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join(30)


def _alive(procs: list[psutil.Process]) -> list[str]:
    """The processes of ``procs`` still running (a zombie has ended; is_running also rules out a reused pid)."""
    left = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return left


def _kinds(procs: list[psutil.Process]) -> dict[str, int]:
    kinds = {"worker": 0, "resource_tracker": 0, "other": 0}
    for proc in procs:
        cmd = " ".join(proc.cmdline())
        kind = "resource_tracker" if "resource_tracker" in cmd else "worker" if "multiprocessing" in cmd else "other"
        kinds[kind] += 1
    return kinds


def test_sigkill_under_load_leaves_no_process_of_the_collectors_tree(collector_process, kit, deepseek_tokenizer_path):
    tok = Tokenizer.from_file(deepseek_tokenizer_path)
    ids = tok.encode(TEXT * 4).ids
    col = _start(collector_process, deepseek_tokenizer_path)
    root = psutil.Process(col.proc.pid)
    tree = root.children(recursive=True)
    assert _kinds(tree) == {"worker": 2, "resource_tracker": 1, "other": 0}, [p.cmdline() for p in tree]

    with Load(kit, ids, col.url) as load:
        _wait_metric(col.url, "tracecar_worker_batches_total", 5, timeout=60, path="worker")  # the pool is working
        col.proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        col.proc.wait(timeout=30)
        while (left := _alive(tree)) and time.monotonic() - killed_at < 5:
            time.sleep(0.05)
        assert left == [], f"still running 5 s after the collector's SIGKILL: {left}"
        took = time.monotonic() - killed_at
    assert load.acked > 0

    # restarted on the same data dir: it serves (post + read back, decoded by its pool) with its own pool only
    again = _start(collector_process, deepseek_tokenizer_path)
    assert Path(again.env["TRACECAR_DATA_DIR"]) == Path(col.env["TRACECAR_DATA_DIR"])
    spans = _spans(kit, ids, 3)
    before = scrape_metric(again.url, "tracecar_worker_batches_total", path="worker")
    answer = kit.post(again.url, spans)
    assert answer.status_code == 200, answer.text
    assert answer.json()["accepted"] == len(spans)
    assert scrape_metric(again.url, "tracecar_worker_batches_total", path="worker") == before + 1
    got = httpx.get(f"{again.url}/v1/trajectories/{spans[-1]['trace_id']}", timeout=30)
    assert got.status_code == 200, got.text
    stored = {s["span_id"]: s for s in _flatten(got.json()["root"])}
    assert set(stored) == {s["span_id"] for s in spans}
    first = stored[spans[0]["span_id"]]
    assert first["output"]["response_text"] == tok.decode(spans[0]["output"]["token_ids"], skip_special_tokens=False)
    children = psutil.Process(again.proc.pid).children(recursive=True)
    assert _kinds(children) == {"worker": 2, "resource_tracker": 1, "other": 0}, [p.cmdline() for p in children]
    assert len(pool_pids(again.proc.pid)) == 2
    assert not {p.pid for p in children} & {p.pid for p in tree if p.is_running()}
    print(f"tree of {len(tree) + 1} processes gone {took:.2f} s after SIGKILL")


def _flatten(span: dict[str, Any]) -> list[dict[str, Any]]:
    """A span of a /v1/trajectories/{id} answer and every span under it."""
    return [span, *(s for child in span["children"] for s in _flatten(child))]


# Starts a collector as the quickstart and the Ray helper do (``--parent-pid``), but without
# setting PR_SET_PDEATHSIG itself: only the collector's own lifeline can notice this starter's death.
STARTER = """
import os, subprocess, sys, time
with open(sys.argv[1], "ab") as log:
    proc = subprocess.Popen([sys.executable, "-m", "tracecar.collector", "--parent-pid", str(os.getpid())], stderr=log)
print(proc.pid, flush=True)
time.sleep(300)
"""


def test_a_collector_whose_starter_is_sigkilled_drains_and_stops_with_its_pool(tmp_path, kit, deepseek_tokenizer_path):
    from tests.support.collector import collector_env, wait_ready
    from tests.support.processes import free_port

    port = free_port()
    data = tmp_path / "data"
    data.mkdir()
    env = collector_env(port, data, token2text=True, tokenizer=deepseek_tokenizer_path, workers=2)
    starter = subprocess.Popen([sys.executable, "-c", STARTER, str(data / "collector.log")], env=env,
                               stdout=subprocess.PIPE, text=True)
    collector = None
    try:
        collector = psutil.Process(int(starter.stdout.readline()))  # type: ignore[union-attr]
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, timeout=90)
        _wait_metric(url, "tracecar_workers", 2, timeout=90)
        tok = Tokenizer.from_file(deepseek_tokenizer_path)
        spans = _spans(kit, tok.encode(TEXT).ids, 3)
        assert kit.post(url, spans).status_code == 200
        tree = [collector, *collector.children(recursive=True)]
        assert _kinds(tree[1:]) == {"worker": 2, "resource_tracker": 1, "other": 0}

        starter.kill()  # SIGKILL: the starter can stop nothing
        starter.wait(30)
        killed_at = time.monotonic()
        while (left := _alive(tree)) and time.monotonic() - killed_at < 30:
            time.sleep(0.05)
        assert left == [], f"still running 30 s after the starter's SIGKILL: {left}"
        log = (data / "collector.log").read_text()
        assert re.search(r'"event":\s*"drained"', log), log[-2000:]  # it drained (SIGTERM), not died
        with sqlite3.connect(str(data / "spool.sqlite3")) as conn:
            stored = {r[0] for r in conn.execute("SELECT span_id FROM spans")}
        assert {s["span_id"] for s in spans} <= stored
    finally:
        starter.kill()
        starter.wait(30)
        if collector is not None and collector.is_running():
            collector.kill()


def test_a_parent_pid_that_is_not_the_parent_is_one_line_and_exit_2(tmp_path):
    from tests.support.collector import COLLECTOR_ARGV, collector_env
    from tests.support.processes import free_port

    not_parent = os.getppid()  # the test's own parent, not the collector's
    done = subprocess.run([*COLLECTOR_ARGV, "--parent-pid", str(not_parent)], env=collector_env(free_port(), tmp_path / "d"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == (f"tracecar: --parent-pid {not_parent} is not the process that started this one "
                                   f"(its parent is {os.getpid()})")
    assert not (tmp_path / "d" / "spool.sqlite3").exists()
