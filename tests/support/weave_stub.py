"""A loopback fake of the Weave trace server, for tests that must not reach the network.

It is a real HTTP/1.1 server (stdlib ``ThreadingHTTPServer`` in a daemon thread, on
127.0.0.1 and a free port) so clients exercise their real transport: connection pooling,
status handling, Retry-After, dropped connections. Every request is recorded (method, path,
headers, parsed body). Faults are scripted per request::

    with WeaveStub() as stub:
        stub.fail_next(2, 503, retry_after="1.5")   # next two requests answer 503
        stub.drop_next(1)                           # then one connection is closed unanswered
        stub.refuse_call_ids = {call_id}            # 422 for any calls/complete batch holding it
        ...
        stub.completed_calls()                      # calls accepted at /v2/{e}/{p}/calls/complete

Routes answered (everything else answers 200 ``{}``): ``POST /v2/{entity}/{project}/calls/complete``
(the batch route weave 0.54 uses), ``GET /server_info``, ``POST /obj/create`` and
``POST /file/create`` (what weave's own client calls when it publishes an op),
``POST /calls/stream_query`` (answers no calls) and ``POST /graphql`` (the W&B viewer query,
answering :attr:`WeaveStub.default_entity`). Use the ``weave_stub`` fixture (tests/conftest.py) or the
context manager directly.

:class:`WeaveSqliteServer` is the other end of the scale: weave's *own* trace server (the
SQLite one that weave 0.52.42 still ships) served on loopback from a separate venv, so what a
client sends is validated by weave's server-side models and read back through weave's query API.
"""

from __future__ import annotations

import email.policy
import hashlib
import json
import os
import re
import socket
import subprocess
import tempfile
import threading
from collections import deque
from dataclasses import dataclass, field
from email.parser import BytesParser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

CALLS_COMPLETE_RE = re.compile(r"^/v2/(?P<entity>[^/]+)/(?P<project>[^/]+)/calls/complete$")


@dataclass
class RecordedRequest:
    """One request as the stub saw it, and what it answered (None: connection dropped)."""

    method: str
    path: str
    headers: dict[str, str]  # lower-cased names
    raw: bytes
    body: Any  # parsed JSON, or None when the body was empty or not JSON
    status: int | None = None
    form: dict[str, bytes] = field(default_factory=dict)  # multipart/form-data parts by name


@dataclass
class _Fault:
    status: int | None  # None: close the connection without answering
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


class WeaveStub:
    """Fake trace server; thread-safe; reusable across tests via :meth:`reset`."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._lock = threading.Lock()
        self._faults: deque[_Fault] = deque()
        self.requests: list[RecordedRequest] = []
        self.default_entity: str | None = "stub-entity"  # what /graphql says the viewer's entity is
        self.refuse_call_ids: set[str] = set()  # calls/complete batches holding one of these: 422
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, like the real server

            def log_message(self, format: str, *args: Any) -> None:  # quiet test output
                pass

            def do_GET(self) -> None:
                stub._handle(self)

            def do_POST(self) -> None:
                stub._handle(self)

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    # lifecycle ---------------------------------------------------------------------------
    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> WeaveStub:
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="weave-stub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> WeaveStub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # scripting ---------------------------------------------------------------------------
    def fail_next(
        self, n: int, status: int, *, retry_after: str | None = None, body: str | dict[str, Any] | None = None
    ) -> None:
        """Answer the next ``n`` requests with ``status`` (and Retry-After, body if given)."""
        headers = {"Retry-After": retry_after} if retry_after is not None else {}
        if body is None:
            body = {"detail": f"stub forced {status}"}
        raw = json.dumps(body).encode() if isinstance(body, dict) else body.encode()
        with self._lock:
            self._faults.extend(_Fault(status, headers, raw) for _ in range(n))

    def drop_next(self, n: int) -> None:
        """Close the connection, unanswered, for the next ``n`` requests."""
        with self._lock:
            self._faults.extend(_Fault(None) for _ in range(n))

    def reset(self) -> None:
        with self._lock:
            self._faults.clear()
            self.requests.clear()
            self.refuse_call_ids = set()

    # inspection --------------------------------------------------------------------------
    def requests_to(self, pattern: str) -> list[RecordedRequest]:
        """Recorded requests whose path matches the regular expression ``pattern``."""
        rx = re.compile(pattern)
        with self._lock:
            return [r for r in self.requests if rx.search(r.path)]

    def completed_calls(self) -> list[dict[str, Any]]:
        """Batch items of every calls/complete request the stub accepted (2xx)."""
        out: list[dict[str, Any]] = []
        for r in self.requests_to(CALLS_COMPLETE_RE.pattern):
            if r.status is not None and 200 <= r.status < 300 and isinstance(r.body, dict):
                out.extend(r.body.get("batch", []))
        return out

    # serving -----------------------------------------------------------------------------
    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        path = h.path.split("?", 1)[0]
        rec = RecordedRequest(h.command, path, {k.lower(): v for k, v in h.headers.items()}, raw, body)
        if (h.headers.get("Content-Type") or "").startswith("multipart/form-data"):
            rec.form = _parse_multipart(h.headers["Content-Type"], raw)
        with self._lock:
            self.requests.append(rec)
            fault = self._faults.popleft() if self._faults else None
        if fault is not None and fault.status is None:
            h.close_connection = True
            try:
                h.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        if fault is None and self.refuse_call_ids and CALLS_COMPLETE_RE.match(path) and isinstance(body, dict):
            bad = sorted({c.get("id") for c in body.get("batch", [])} & self.refuse_call_ids)
            if bad:
                fault = _Fault(422, {}, json.dumps({"detail": f"invalid calls: {bad}"}).encode())
        if fault is not None:
            status, headers, payload = fault.status, fault.headers, fault.body
        else:
            status, headers, payload = 200, {}, json.dumps(self._answer(path, rec)).encode()
        rec.status = status
        self._reply(h, status, headers, payload)

    @staticmethod
    def _reply(h: BaseHTTPRequestHandler, status: int, headers: dict[str, str], body: bytes) -> None:
        """Writes one JSON answer (shared with the fault-injecting subclass in conftest)."""
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        for k, v in headers.items():
            h.send_header(k, v)
        h.end_headers()
        h.wfile.write(body)

    def _answer(self, path: str, rec: RecordedRequest) -> Any:
        if path == "/graphql":  # W&B API: the DefaultEntity viewer query weave.init sends
            entity = {"name": self.default_entity} if self.default_entity else None
            return {"data": {"viewer": {"username": "stub-user", "defaultEntity": entity}}}
        if path == "/server_info":
            return {"min_required_weave_python_version": "0.0.0"}
        if path == "/file/create":  # digests as the real server computes them (shared helpers)
            from weave.trace.serialization.digest import compute_file_digest

            return {"digest": compute_file_digest(rec.form.get("file", b""))}
        if path == "/obj/create" and isinstance(rec.body, dict):
            from weave.trace.serialization.digest import compute_object_digest

            obj = rec.body.get("obj") or {}
            return {"digest": compute_object_digest(obj.get("val"), obj.get("builtin_object_class"))}
        if path == "/table/create":
            return {"digest": hashlib.sha256(rec.raw).hexdigest(), "row_digests": []}
        return {}


def _parse_multipart(content_type: str, raw: bytes) -> dict[str, bytes]:
    """Parts of a multipart/form-data body by field name (enough for /file/create)."""
    msg = BytesParser(policy=email.policy.HTTP).parsebytes(b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + raw)
    parts: dict[str, bytes] = {}
    for part in msg.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if name:
            parts[str(name)] = part.get_payload(decode=True) or b""
    return parts


# ------------------------------------------------------------- weave's own server ----
#: Packages weave 0.52.42's trace_server imports beyond the wheel's own dependencies.
WEAVE_SERVER_EXTRAS = ("emoji", "sqlparse", "redis", "clickhouse_connect", "ddtrace")

#: weave 0.52.42's SQLite trace server behind its external-id adapter (tests/support/weave_server.py),
#: run as a script by that venv's python.
WEAVE_SERVER = Path(__file__).with_name("weave_server.py")


def weave_server_python() -> str | None:
    """The python of a venv with weave 0.52.42 and :data:`WEAVE_SERVER_EXTRAS`, if any.

    ``TRACECAR_WEAVE_SERVER_PYTHON`` names it; else ``.venv-weave52`` in the repository (what
    ``TRACECAR_TEST_WEAVE_SERVER=1 bash tests/run.sh`` makes) or ``venv-weave52`` beside it.
    Make one with ``python -m venv V && V/bin/pip install weave==0.52.42 emoji sqlparse
    redis clickhouse_connect ddtrace``.
    """
    repo = Path(__file__).resolve().parents[2]
    candidates = [os.environ.get("TRACECAR_WEAVE_SERVER_PYTHON"),
                  str(repo / ".venv-weave52" / "bin" / "python"),
                  str(repo.parent / "venv-weave52" / "bin" / "python")]
    for c in candidates:
        if c and Path(c).is_file():
            return c
    return None


class WeaveSqliteServer:
    """weave's own trace server (SQLite, weave 0.52.42) on 127.0.0.1, in a child process."""

    def __init__(self, python: str, startup_timeout_s: float = 120.0) -> None:
        self.python, self.timeout = python, startup_timeout_s
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""

    def __enter__(self) -> WeaveSqliteServer:
        self._log = tempfile.TemporaryFile()  # a file, not a pipe: a chatty server never blocks
        self.proc = subprocess.Popen([self.python, str(WEAVE_SERVER)], stdout=subprocess.PIPE,
                                     stderr=self._log, text=True)
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(self.timeout)
        if not line or not line[0].strip().isdigit():
            self._log.seek(0)
            tail = self._log.read()[-2000:].decode(errors="replace")
            self.__exit__()
            raise RuntimeError(f"weave's trace server did not start:\n{tail}")
        self.url = f"http://127.0.0.1:{int(line[0])}"
        return self

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the server's stderr (unrouted requests, tracebacks)."""
        self._log.flush()
        self._log.seek(0)
        return self._log.read()[-chars:].decode(errors="replace")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.communicate(timeout=30)
            self.proc = None
            self._log.close()
