"""How the ClickHouse read store reaches its engine: embedded chDB, or a ClickHouse server.

The store (viewer/clickhouse_store.py) speaks ClickHouse SQL with named, typed ``{pN:Type}``
placeholders and reads ``JSONEachRow``; the same statements run on either transport, the way W&B
Weave's trace server offers chDB beside a ClickHouse server:

* :class:`Embedded` (``TRACECAR_STORE=clickhouse``): chDB in this process, its data under
  ``TRACECAR_DATA_DIR/clickhouse``. chDB takes parameter values in ClickHouse's escaped text form.
* :class:`Server` (``TRACECAR_STORE_URL=clickhouse://user:password@host:8123/database``): a
  ClickHouse server over HTTP(S) through ``clickhouse-connect`` (``pip install 'tracecar[clickhouse]'``),
  which binds the same placeholders on the server (``param_pN``). No session (queries from several
  threads at once), ``TRACECAR_STORE_TIMEOUT_S`` to connect and per query, response compression as the
  URL asks (``?compress=true``). The URL's database (default ``tracecar``) is created if missing; the URL's
  password never reaches a log line, a metric or an error body (start errors name the host and port, a
  reader's 503 neither).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qs, unquote, urlsplit

from ..read_store import StoreStartError
from ..store_url import DEFAULT_DATABASE


class Transport(Protocol):
    """One engine: statements, ``JSONEachRow`` reads and inserts, with raw parameter values."""

    database: str
    describe: str  # what a reader's 503 may name: "chDB", or "server" (not its address)

    def select(self, sql: str, params: dict[str, Any]) -> bytes:
        """The statement's rows as ``JSONEachRow`` bytes."""
        ...

    def execute(self, sql: str, params: dict[str, Any] | None = None) -> None:
        """A statement without rows (DDL, ``TRUNCATE``, ``INSERT … VALUES``)."""
        ...

    def insert(self, table: str, rows: bytes) -> None:
        """``JSONEachRow`` lines into ``table``: one insert."""
        ...

    def close(self) -> None:
        ...


def chdb_value(value: Any) -> Any:
    """A parameter as chDB reads it: text in ClickHouse's escaped format, an array as a literal."""
    if type(value) is list:
        return "[" + ",".join("'" + _escaped(str(v)).replace("'", "\\'") + "'" for v in value) + "]"
    return _escaped(value) if type(value) is str else value


def _escaped(text: str) -> str:
    """A tab or a backslash in a worker's or an experiment's name must match itself, not end or change the value."""
    return text.translate(_ESCAPES)


_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r", "\0": "\\0"})


class Embedded:
    """chDB in this process (ClickHouse's engine as a library), on a data directory."""

    describe = "chDB"
    database = DEFAULT_DATABASE

    def __init__(self, path: Path) -> None:
        try:
            from chdb import session as chdb_session
        except ImportError:
            raise StoreStartError("TRACECAR_STORE=clickhouse needs chDB: pip install 'tracecar[clickhouse]'") from None
        path.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._session = chdb_session.Session(str(path))

    def _query(self, sql: str, params: dict[str, Any] | None) -> bytes:
        bound = {k: chdb_value(v) for k, v in params.items()} if params else None
        result = self._session.query(sql, "JSONEachRow", params=bound)
        return bytes(result.bytes()) if result is not None else b""

    def select(self, sql: str, params: dict[str, Any]) -> bytes:
        return self._query(sql, params)

    def execute(self, sql: str, params: dict[str, Any] | None = None) -> None:
        self._query(sql, params)

    def insert(self, table: str, rows: bytes) -> None:
        self._query(f"INSERT INTO {table} FORMAT JSONEachRow\n" + rows.decode(), None)

    def close(self) -> None:
        self._session.close()


class _QuietForServer(logging.Filter):
    """Drops urllib3's per-retry warnings about this server's connections only (each failed request would log
    one, unbounded: failures reach the store's own rate-limited log line and tracecar_store_errors_total);
    other libraries' connections (W&B, OTLP) keep theirs."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__()
        self._marks = (f"host='{host}', port={port}", f"{host}:{port}")

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(mark in text for mark in self._marks)


def start_reason(exc: BaseException, password: str | None) -> str:
    """Why the server could not be used, as one line (the innermost cause last: "Connection refused", a
    ClickHouse code), the password masked in whichever form it was given."""
    reason = " ".join(str(exc).split())[:600] or type(exc).__name__
    for form in {password, unquote(password)} if password else ():
        reason = reason.replace(form, "***")
    return reason


class Server:
    """A ClickHouse server over its HTTP interface (clickhouse-connect), shared by the store's threads."""

    def __init__(self, url: str, timeout_s: float, database: str | None = None) -> None:
        try:
            import clickhouse_connect
        except ImportError:
            raise StoreStartError("TRACECAR_STORE_URL needs clickhouse-connect: pip install 'tracecar[clickhouse]'") from None
        logging.getLogger("clickhouse_connect").setLevel(logging.ERROR)  # its warnings repeat per request, as urllib3's
        parts = urlsplit(url)
        self.database = database or parts.path.strip("/") or DEFAULT_DATABASE  # TRACECAR_STORE_DATABASE first
        self.describe = "server"  # what a reader's 503 may name: not the server's address (read_store.StoreUnavailable)
        # the URL's query: clickhouse-connect's options as text (?compress=true, ?secure=true, ?verify=false)
        options: dict[str, Any] = {k: v[0] for k, v in parse_qs(parts.query).items()}
        options.setdefault("compress", False)
        tls = parts.scheme == "https" or parts.port in (443, 8443) or str(options.pop("secure", "")).lower() in ("1", "true")
        port = parts.port or (8443 if tls else 8123)
        self.address = f"{parts.hostname}:{port}"  # for the operator (start errors), never a reader's 503
        logging.getLogger("urllib3.connectionpool").addFilter(_QuietForServer(str(parts.hostname), port))
        # the database is the store's own (created by the store): the client must not select it before it exists.
        # TLS by the scheme (clickhouse-connect itself reads only the port); no retries: one statement is bounded
        # by timeout_s, and a failed catch-up is retried by the next read anyway.
        try:
            self._client = clickhouse_connect.get_client(
                host=parts.hostname, port=port, username=unquote(parts.username) if parts.username else None,
                password=unquote(parts.password) if parts.password else "", interface="https" if tls else "http",
                secure=tls, connect_timeout=timeout_s, send_receive_timeout=timeout_s, query_retries=0,
                autogenerate_session_id=False, **options)
        except Exception as exc:  # noqa: BLE001 - unreachable, refused, a wrong password: said at start, in one line
            raise StoreStartError(f"TRACECAR_STORE_URL: the ClickHouse server at {self.address} cannot be used: "
                                  f"{start_reason(exc, parts.password)}") from None
        self._closed = threading.Event()

    def select(self, sql: str, params: dict[str, Any]) -> bytes:
        return bytes(self._client.raw_query(sql, parameters=params or None, fmt="JSONEachRow"))

    def execute(self, sql: str, params: dict[str, Any] | None = None) -> None:
        self._client.command(sql, parameters=params or None)

    def insert(self, table: str, rows: bytes) -> None:
        self._client.raw_insert(table, None, rows, fmt="JSONEachRow")

    def close(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            self._client.close()


def open_transport(settings: Any, path: Path | None = None) -> Transport:
    """The engine ``TRACECAR_STORE_URL`` names (a server), else chDB under ``path`` (default: the data dir's ``clickhouse``)."""
    url = settings.store_url.get_secret_value() if settings.store_url is not None else ""
    if url:
        return Server(url, settings.store_timeout_s, settings.store_database)
    return Embedded(path or Path(settings.data_dir) / "clickhouse")
