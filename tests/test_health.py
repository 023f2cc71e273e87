"""Tracing health in the trainer's W&B run: the client's drop totals travel in each batch header,
the collector counts them and serves every trust number on ``/v1/health``, and
``tracecar.client.log_health(step)`` logs them into a real (offline) wandb run."""

from __future__ import annotations

import glob
import json
import struct
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import free_port
from tracecar.client import flush, health, health_metrics, log_health, rollout_trace_op
from tracecar.client.cli import main as cli_main


@rollout_trace_op
def tool_call(i: int) -> int:
    return i


def _burst(n: int) -> None:
    """n root calls at once: with queue_max_spans=2 and a slow flush, all but 2 are queue_full drops."""
    for i in range(n):
        tool_call(i)


def _health(url: str) -> dict[str, Any]:
    response = httpx.get(url + "/v1/health", timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def test_client_drops_travel_in_batch_headers_and_are_counted_once(start_collector, tracer_to, kit, capsys):
    col = start_collector()
    tracer = tracer_to(col.url, queue_max_spans=2, flush_interval_s=30)
    _burst(10)
    assert tracer.stats()["dropped"] == {"queue_full": 8}
    assert flush(10)
    got = _health(col.url)
    assert got["client_dropped"] == {"queue_full": 8} and got["client_dropped_total"] == 8
    assert got["spans_accepted"] == 2 and got["spool_depth"] == 0
    assert list(got["client_dropped_by_worker"].values()) == [{"queue_full": 8}]
    _burst(10)  # the header now says 16 in all: the collector counts the increase, not 16 more
    assert flush(10)
    got = _health(col.url)
    assert got["client_dropped"] == {"queue_full": 16} and got["spans_accepted"] == 4
    assert kit.metrics(col.url, "tracecar_client_dropped_spans_total", reason="queue_full") == 16
    cli_main(["health", "--url", col.url])
    out = capsys.readouterr().out
    assert "client_dropped" in out and "queue_full=16" in out


def test_a_malformed_drop_report_is_ignored_and_never_costs_the_batch(start_collector, kit):
    col = start_collector()
    for bad in ({"Queue Full!": 3}, {"queue_full": -1}, {"queue_full": 1.5}, "lots", {f"r{i}": 1 for i in range(40)}):
        response = kit.post(col.url, kit.trajectory(children=1), dropped=bad)
        assert response.status_code == 200 and response.json()["accepted"] == 2, (bad, response.text)
    assert kit.metrics(col.url, "tracecar_client_reports_ignored_total") == 5
    assert _health(col.url)["client_dropped_total"] == 0


def _wandb_history(run_dir: Path, timeout_s: float = 30.0) -> dict[int, dict[str, Any]]:
    """History rows of a finished offline run, read once its .wandb file holds the exit record
    (wandb-core writes it behind ``finish()``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows, finished = _read_run_file(run_dir)
        if finished or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


def _read_run_file(run_dir: Path) -> tuple[dict[int, dict[str, Any]], bool]:
    """The .wandb file: W&B's leveldb-style log of protobuf Records (32 KiB blocks, 7-byte
    record headers, full/first/middle/last chunks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(str(run_dir / "run-*.wandb"))
    data = Path(path).read_bytes()
    finished = False
    assert data[:4] == b":W&B"
    rows: dict[int, dict[str, Any]] = {}
    pos, buf, block = 7, b"", 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (2, 3):
            buf = chunk if kind == 2 else buf + chunk
            continue
        if kind not in (1, 4):
            continue
        record = pb.Record()
        record.ParseFromString(buf + chunk if kind == 4 else chunk)
        finished = finished or record.WhichOneof("record_type") == "exit"
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            rows.setdefault(row["_step"], {}).update(row)
    return rows, finished


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    for key in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_RUN_ID", "WANDB_ENTITY", "WANDB_PROJECT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(mode="offline", dir=str(tmp_path), project="tracecar-health-test")
    yield run
    wandb.finish()


def test_log_health_puts_the_numbers_on_the_trainers_wandb_run_at_each_step(start_collector, tracer_to, kit, offline_wandb):
    import wandb

    run = offline_wandb
    col = start_collector()
    tracer_to(col.url, queue_max_spans=2, flush_interval_s=30)
    bad = kit.trajectory(children=1)
    bad[0]["span_id"] = "not a valid id!"
    kit.post(col.url, bad)  # one span rejected by the collector
    for step in (1, 2):
        _burst(10)
        assert flush(10)
        wandb.log({"actor/loss": 1.0 / step}, step=step)  # the trainer's own metrics of the step
        logged = log_health(step)
        assert logged is not None and logged["tracecar/client_dropped/queue_full"] == 8 * step
    assert log_health(3, background=True) is None  # returns at once; a daemon thread asks and logs
    assert kit.wait_for(lambda: not any(t.name == "tracecar-health" for t in threading.enumerate()), timeout=10)
    run_dir = Path(run.dir).parent
    wandb.finish()
    rows = _wandb_history(run_dir)
    assert rows[1]["actor/loss"] == 1.0 and rows[2]["actor/loss"] == 0.5
    assert rows[1]["tracecar/client_dropped/queue_full"] == 8 and rows[2]["tracecar/client_dropped/queue_full"] == 16
    assert rows[2]["tracecar/client_dropped_total"] == 16
    assert rows[2]["tracecar/rejected_total"] >= 1 and rows[2]["tracecar/spans_accepted"] == 5
    assert rows[2]["tracecar/spool_depth"] == 0 and rows[2]["tracecar/backend_unreachable"] == 0
    assert rows[3]["tracecar/client_dropped_total"] == 16  # the background call landed at its step
    assert health_metrics()["tracecar/client_dropped/queue_full"] == 16  # asked of the collector itself


def test_log_health_never_raises_into_the_trainer(offline_wandb, tracer_to, caplog):
    tracer_to(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    started = time.monotonic()
    assert log_health(1, timeout_s=1.0) is None  # logged a warning, returned
    assert time.monotonic() - started < 5
    assert "could not read the collector's health" in caplog.text
    with pytest.raises(httpx.HTTPError):
        health(timeout_s=1.0)  # the plain reader does raise: for callers that want the error
    assert health_metrics(timeout_s=1.0) == {}  # the form for VERL's metrics dict: empty, no raise


def test_health_metrics_flatten_every_group_with_a_total():
    answer = {"client_dropped": {"queue_full": 3, "span_too_large": 1}, "client_dropped_total": 4,
              "sampled_out": {}, "sampled_out_total": 0, "spool_depth": 7}
    flat = health_metrics(answer)
    assert flat["tracecar/client_dropped/queue_full"] == 3 and flat["tracecar/client_dropped_total"] == 4
    assert flat["tracecar/sampled_out_total"] == 0 and flat["tracecar/spool_depth"] == 7
    assert flat["tracecar/decode_failures_total"] == 0  # absent groups still appear: a chart starts at zero


def test_health_of_one_step_counts_stored_running_errors_and_the_trainer(start_collector, capsys):
    """/v1/health?step=N (and `tracecar health --step N`): the step's own numbers beside the totals."""
    from tests.test_groups_export import EXPERIMENT, LOSE, WIN, post, trainer_note, trajectory

    col = start_collector()
    spans = []
    for n, (turns, reward) in enumerate([(LOSE, 0.0), (WIN, 1.0), (WIN, 1.0)]):
        spans += trajectory(f"h3-n{n}", 3, 0, n, turns, reward=reward, kept_because="fill", t0=1000.0 + n)
    spans += trajectory("h4-n0", 4, 0, 0, WIN, reward=None, t0=2000.0)
    running = [s for s in trajectory("h3-run", 3, 1, 0, WIN, t0=time.time()) if s["parent_id"] is not None]  # no root yet
    post(col.url, spans + running)
    post(col.url, [trainer_note("h3-n1", trained=True), trainer_note("h3-n2", trained=False, filtered_by="zero_variance")])
    response = httpx.get(col.url + "/v1/health", params={"step": 3}, timeout=30)
    assert response.status_code == 200, response.text
    got = response.json()
    assert got["spans_accepted"] == len(spans) + len(running) + 2  # the totals are still there
    step = got["step"]
    assert (step["experiment"], step["step"], step["validate"]) == (EXPERIMENT, 3, None)  # the latest experiment
    assert (step["trajectories"], step["scored"], step["with_error"], step["running"]) == (3, 3, 1, 1)
    assert step["spans"] == sum(1 for s in spans if s["trace_id"].startswith("h3") and s["kind"] != "annotation")
    assert step["kept_by_rule"] == {"fill": 3} and step["held_spans"] == 0
    assert step["trainer"] == {"trained": 1, "dropped": 1, "filtered_by": {"zero_variance": 1}}
    assert step["sampling"]["mode"] == "pass" and step["sampling"]["dropped"] == 0
    other = httpx.get(col.url + "/v1/health", params={"step": 4, "experiment": EXPERIMENT, "validate": "false"}, timeout=30).json()
    assert (other["step"]["trajectories"], other["step"]["scored"], other["step"]["running"]) == (1, 0, 0)
    none = httpx.get(col.url + "/v1/health", params={"step": 3, "experiment": ""}, timeout=30).json()["step"]
    assert none["experiment"] == "" and none["trajectories"] == 0  # "": sent without an experiment name
    assert "step" not in _health(col.url)  # without step=: the totals only, as before
    bad = httpx.get(col.url + "/v1/health", params={"step": "x"}, timeout=10)
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "step"
    cli_main(["health", "--url", col.url, "--step", "3"])
    out = capsys.readouterr().out
    assert f"step 3 of {EXPERIMENT}" in out and "running now" in out and "zero_variance=1" in out
    stored = next(line for line in out.splitlines() if "trajectories stored" in line)
    assert stored.split()[2:4] == ["3", f"({step['spans']}"], stored


def test_health_failures_are_one_line_a_minute_with_their_count_and_no_secret(monkeypatch, caplog):
    """log_health runs every step: a collector that stays unreachable is one line a minute, counted."""
    import importlib

    health_module = importlib.import_module("tracecar.client.health")  # the package re-exports its function health()

    monkeypatch.setattr(health_module, "_warned_at", 0.0)
    monkeypatch.setattr(health_module, "_unsaid", 0)
    caplog.set_level("WARNING", logger="tracecar.client")
    for _ in range(3):
        health_module._warn("tracecar: could not log health metrics to W&B: ValueError: api_key='sk-abc123'")
    said = [r.getMessage() for r in caplog.records if "could not log health" in r.getMessage()]
    assert len(said) == 1 and "sk-abc123" not in said[0] and "(1 failure(s) since" in said[0], said
    monkeypatch.setattr(health_module, "_warned_at", time.monotonic() - 61)  # a minute later
    health_module._warn("tracecar: could not read the collector's health: ConnectError: refused")
    said = [r.getMessage() for r in caplog.records if "tracecar: could not" in r.getMessage()]
    assert len(said) == 2 and "(3 failure(s) since" in said[1], said  # the two unsaid, and this one
