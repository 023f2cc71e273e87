"""ClickHouse's HTTP interface on 127.0.0.1, answered by ClickHouse's own engine (chDB), in its own process.

No ClickHouse server installs on these machines (no Docker, no binary in the package registry); chDB
is the same engine. This process speaks the part of the server's HTTP interface that
clickhouse-connect uses (https://clickhouse.com/docs/interfaces/http): the query in the ``query``
URL parameter (an insert's rows in the body) or in the body, ``param_NAME`` bindings for
``{NAME:Type}`` placeholders, ``GET /ping``, a user and password (HTTP basic or the
``X-ClickHouse-User``/``X-ClickHouse-Key`` headers; a wrong one is a 403 with code 516, as the
server answers), and a failed statement as a 500 whose body is the engine's ``Code: N. DB::Exception``
text and whose ``X-ClickHouse-Exception-Code`` header is N. Output is in the format the query names
(clickhouse-connect appends ``FORMAT Native`` or ``FORMAT JSONEachRow``), else TabSeparated. Settings
in the URL are ignored (the store puts what it needs into its SQL). It is a test's server, not a
product: the collector's store talks to it exactly as to a real server, through clickhouse-connect.

    python -m tests.support.clickhouse_http --port 8123 --path DIR [--user U --password P]
"""

from __future__ import annotations

import argparse
import base64
import http.server
import re
import sys
import threading
import urllib.parse
from typing import Any

_CODE = re.compile(r"Code: (\d+)")


def serve(port: int, path: str, user: str, password: str) -> None:
    from chdb import session as chdb_session

    engine = chdb_session.Session(path)
    lock = threading.Lock()  # one statement at a time: the test's load is small, and the answers stay simple

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _reply(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _authorised(self) -> bool:
            got_user, got_password = self.headers.get("X-ClickHouse-User"), self.headers.get("X-ClickHouse-Key")
            basic = self.headers.get("Authorization", "")
            if basic.startswith("Basic "):
                got_user, _, got_password = base64.b64decode(basic[6:]).decode().partition(":")
            return (got_user or "default") == user and (got_password or "") == password

        def _handle(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            query = dict(urllib.parse.parse_qsl(url.query, keep_blank_values=True))
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            if url.path == "/ping":
                return self._reply(200, b"Ok.\n")
            if not self._authorised():
                return self._reply(403, b"Code: 516. DB::Exception: Authentication failed: password is incorrect, or there is "
                                        b"no user with such name. (AUTHENTICATION_FAILED)\n", {"X-ClickHouse-Exception-Code": "516"})
            sql = query["query"] + ("\n" + body.decode() if body else "") if "query" in query else body.decode()
            params = {k[len("param_"):]: v for k, v in query.items() if k.startswith("param_")}
            try:
                with lock:
                    result = engine.query(sql, "TabSeparated", params=params or None)
                data = bytes(result.bytes()) if result is not None else b""
            except Exception as exc:  # noqa: BLE001 - the engine's error, as the server sends it
                text = str(exc)
                code = _CODE.search(text)
                return self._reply(500, text.encode(), {"X-ClickHouse-Exception-Code": code.group(1) if code else "1"})
            self._reply(200, data)

        do_GET = do_POST = _handle

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print(f"ready {server.server_address[1]}", flush=True)
    server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--path", required=True, help="chDB's data directory")
    parser.add_argument("--user", default="default")
    parser.add_argument("--password", default="")
    args = parser.parse_args()
    try:
        serve(args.port, args.path, args.user, args.password)
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()


class ClickHouseHttp:
    """This module's server as a child process of a test: ``url()`` with a user and password for the store."""

    def __init__(self, path: Any, user: str = "tracecar", password: str = "s3cret-pw") -> None:
        from pathlib import Path

        from tests.support import free_port

        self.path, self.user, self.password, self.port = Path(path), user, password, free_port()
        self.path.mkdir(parents=True, exist_ok=True)
        self.start()

    def start(self) -> None:
        """Starts the server (again, on the same port and data)."""
        import subprocess
        from pathlib import Path

        self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.clickhouse_http", "--path", str(self.path),
                                      "--port", str(self.port), "--user", self.user, "--password", self.password],
                                     stdout=subprocess.PIPE, text=True, cwd=str(Path(__file__).resolve().parents[2]))
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # "ready PORT" once chDB is up (or EOF if it failed)
        if not line.startswith("ready "):
            self.proc.kill()
            raise RuntimeError(f"the ClickHouse HTTP test server did not start: {line!r}")

    def url(self, database: str = "tracecar", password: str | None = None) -> str:
        return f"clickhouse://{self.user}:{self.password if password is None else password}@127.0.0.1:{self.port}/{database}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except Exception:  # noqa: BLE001 - a stuck child is killed
                self.proc.kill()
                self.proc.wait(timeout=20)
