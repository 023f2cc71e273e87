"""weave's own trace server (weave 0.52.42's SQLite one) on 127.0.0.1, for the read-back tests.

Run as a script by the python of a venv with weave 0.52.42 (the last wheel that ships the SQLite
server) and the packages it imports (``WEAVE_SERVER_EXTRAS`` in weave_stub.py); tests start it
through :class:`tests.support.weave_stub.WeaveSqliteServer`. It serves the routes the weave 0.54
client and tracecar's sink use, behind weave's external-id adapter, validating each calls/complete
batch with the server's request model and ClickHouse insert validators, and prints the port it
listens on as its first line of stdout. Nothing here runs on import.
"""

from __future__ import annotations

import base64
import email.policy
import json
import os
import re
import sys
import tempfile
import threading
import types
from email.parser import BytesParser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

VIEWER = "parity"  # the user the API key belongs to (W&B's viewer query; the author of feedback)
COMPLETE = re.compile(r"^/v2/([^/]+)/([^/]+)/calls/complete$")

#: More of weave's routes: one request model, one server method each.
JSON_ROUTES = {
    "/calls/query_stats": ("CallsQueryStatsReq", "calls_query_stats"),
    "/call/read": ("CallReadReq", "call_read"),
    "/obj/read": ("ObjReadReq", "obj_read"),
    "/table/create": ("TableCreateReq", "table_create"),
    "/table/query": ("TableQueryReq", "table_query"),
    "/refs/read_batch": ("RefsReadBatchReq", "refs_read_batch"),
    "/feedback/create": ("FeedbackCreateReq", "feedback_create"),
    "/feedback/batch/create": ("FeedbackCreateBatchReq", "feedback_create_batch"),
    "/feedback/query": ("FeedbackQueryReq", "feedback_query"),
}


def build_server() -> tuple[Any, Any, Any]:
    """(server, tsi, validation): weave's SQLite server in a fresh temp dir, with external ids."""
    # The SQLite server imports its evaluation worker, which needs weave[scorers] (numpy, LLM
    # libraries); ingest and query never use it, so a stand-in module takes its place.
    ev = types.ModuleType("weave.trace_server.workers.evaluate_model_worker.evaluate_model_worker")
    ev.EvaluateModelDispatcher = object  # type: ignore[attr-defined]
    sys.modules.setdefault(ev.__name__, ev)

    from weave.trace_server import trace_server_interface as tsi
    from weave.trace_server import validation
    from weave.trace_server.external_to_internal_trace_server_adapter import ExternalTraceServer, IdConverter
    from weave.trace_server.sqlite_trace_server import SqliteTraceServer

    class B64Ids(IdConverter):
        """entity/project <-> base64, as W&B maps external project ids to internal ones."""

        def ext_to_int_project_id(self, p: str) -> str:
            return base64.b64encode(p.encode()).decode()

        def int_to_ext_project_id(self, p: str) -> str:
            return base64.b64decode(p).decode()

        def ext_to_int_run_id(self, r: str) -> str:
            return r

        def int_to_ext_run_id(self, r: str) -> str:
            return r

        def ext_to_int_user_id(self, u: str) -> str:
            return u

        def int_to_ext_user_id(self, u: str) -> str:
            return u

    internal = SqliteTraceServer(os.path.join(tempfile.mkdtemp(), "weave.db"))
    internal.setup_tables()
    return ExternalTraceServer(internal, B64Ids()), tsi, validation


def make_handler(server: Any, tsi: Any, validation: Any) -> type[BaseHTTPRequestHandler]:
    """The HTTP handler: one request at a time into ``server`` (SQLite), errors as weave answers them."""
    lock = threading.Lock()

    def handle(path: str, headers: Any, raw: bytes) -> tuple[str, bytes] | None:
        if m := COMPLETE.match(path):
            req = tsi.CallsUpsertCompleteReq.model_validate_json(raw)  # the server's request model
            for c in req.batch:  # and the ClickHouse insert validators (clickhouse_schema.py)
                if c.project_id != m.group(1) + "/" + m.group(2):
                    raise ValueError("project_id does not match the route")
                validation.call_id_validator(c.id)
                validation.trace_id_validator(c.trace_id)
                validation.parent_id_validator(c.parent_id)
                validation.display_name_validator(c.display_name)
                if not c.op_name.startswith("weave:///"):  # refs are checked once made internal
                    validation.op_name_validator(c.op_name)
            server.calls_complete(req)
            return "application/json", b"{}"
        if path == "/obj/create":
            res = server.obj_create(tsi.ObjCreateReq.model_validate_json(raw))
            return "application/json", res.model_dump_json().encode()
        if path == "/file/create":
            msg = BytesParser(policy=email.policy.HTTP).parsebytes(
                b"Content-Type: " + headers["Content-Type"].encode() + b"\r\n\r\n" + raw)
            parts = {p.get_param("name", header="content-disposition"): p for p in msg.iter_parts()}
            req = tsi.FileCreateReq(project_id=parts["project_id"].get_payload(decode=True).decode(),
                                    name=parts["file"].get_filename(), content=parts["file"].get_payload(decode=True))
            return "application/json", server.file_create(req).model_dump_json().encode()
        if path == "/calls/stream_query":
            req = tsi.CallsQueryReq.model_validate_json(raw)
            lines = [c.model_dump_json() for c in server.calls_query_stream(req)]
            return "application/jsonl", "".join(line + "\n" for line in lines).encode()
        if path == "/objs/query":
            return "application/json", server.objs_query(tsi.ObjQueryReq.model_validate_json(raw)).model_dump_json().encode()
        if path in JSON_ROUTES:
            model, method = JSON_ROUTES[path]
            req = getattr(tsi, model).model_validate_json(raw)
            for item in getattr(req, "batch", None) or [req]:  # W&B's server sets the feedback's author from the API key
                if path.startswith("/feedback/") and hasattr(item, "wb_user_id") and item.wb_user_id is None:
                    item.wb_user_id = VIEWER
            res = getattr(server, method)(req)
            return "application/json", res.model_dump_json().encode()
        if path == "/threads/stream_query":
            req = tsi.ThreadsQueryReq.model_validate_json(raw)
            lines = [t.model_dump_json() for t in server.threads_query_stream(req)]
            return "application/jsonl", "".join(line + "\n" for line in lines).encode()
        if path == "/agents/otel/v1/traces":  # weave.init's OTel exporter (conversation SDK): not calls
            return "application/x-protobuf", b""
        if path == "/graphql":  # W&B's API, as weave.init asks it: the viewer, the project (it exists)
            body = json.loads(raw or b"{}")
            variables = body.get("variables") or {}
            name = variables.get("name") or variables.get("project") or "project"
            entity = variables.get("entityName") or variables.get("entity") or "entity"
            model = {"name": name, "entity": {"name": entity}}
            data = {"viewer": {"username": VIEWER, "defaultEntity": {"name": os.environ.get("WEAVE_SERVER_DEFAULT_ENTITY", "entity")}},
                    "project": model, "upsertModel": {"model": model}}
            return "application/json", json.dumps({"data": data}).encode()
        return None

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] != "/server_info":
                self.send_error(404)
                return
            data = b'{"min_required_weave_python_version": "0.0.0"}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                with lock:
                    out = handle(self.path, self.headers, raw)
                if out is None:
                    print(f"weave server: no route {self.path}", file=sys.stderr, flush=True)
                status, (ctype, data) = (404, ("application/json", b'{"detail": "no route"}')) if out is None else (200, out)
            except Exception as e:  # validation errors answer 422, like the real server
                status = 422 if isinstance(e, ValueError) else 500
                ctype, data = "application/json", json.dumps({"detail": f"{type(e).__name__}: {e}"}).encode()
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


def main() -> None:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(*build_server()))
    print(httpd.server_address[1], flush=True)
    httpd.serve_forever(0.05)


if __name__ == "__main__":
    main()
