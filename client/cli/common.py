"""What every ``tracecar`` subcommand shares: the collector's URL and token, one GET with errors
said as sentences, ``--json`` or the command's own table, and the one-line failure.

Its own module so the subcommands import it and the parser (command.py) imports them: no cycle.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import httpx

DEFAULT_URL = "http://127.0.0.1:9470"


def collector_url(args: argparse.Namespace) -> str:
    """The collector URL as the client would use it (``host:port`` gets ``http://``, said once)."""
    from ..loud import check_url

    raw = (args.url or os.environ.get("TRACECAR_URL") or DEFAULT_URL).strip().rstrip("/")
    url, warning = check_url(raw)
    if url is None:
        fail((warning or "").removeprefix("tracecar: ").replace("tracing is off", "give --url or TRACECAR_URL as http://HOST:PORT"))
    if warning and args.url:  # from TRACECAR_URL, the client said it already when it was imported
        print(warning.replace("TRACECAR_URL=", "--url "), file=sys.stderr)
    return url


def auth_headers() -> dict[str, str]:
    token = os.environ.get("TRACECAR_TOKEN")
    return {"Authorization": f"Bearer {token}"} if token else {}


def need_collector() -> None:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        sys.exit("tracecar: this command needs the collector's dependencies: pip install '.[collector]' in the tracecar "
                 "repository, or 'tracecar-*.whl[collector]' (README: Installing into a VERL image)")


def fail(message: str, code: int = 1) -> NoReturn:
    print(f"tracecar: {message}", file=sys.stderr)
    sys.exit(code)


def describe_http_error(response: httpx.Response) -> str:
    """An error answer as a sentence: the status, the field and the reason, and what to do."""
    status = response.status_code
    try:
        body = response.json()
    except ValueError:
        body = None
    detail = None
    if isinstance(body, dict):
        err = body.get("error", body.get("detail"))
        if isinstance(err, dict):
            field, reason = err.get("field"), err.get("reason")
            detail = f"{field}: {reason}" if field and reason else reason or field
        elif isinstance(err, list):  # FastAPI's query validation: [{"loc": [...], "msg": ...}]
            detail = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', [])[1:]) or 'request'}: {e.get('msg')}"
                               for e in err if isinstance(e, dict))
        elif err is not None:
            detail = str(err)
    if detail is None:
        detail = (response.text or response.reason_phrase or "").strip()[:200] or "no details"
    hint = {401: " (set TRACECAR_TOKEN to the collector's token)", 403: " (set TRACECAR_TOKEN to the collector's token)",
            404: "", 503: " (the collector is starting, draining, or full: retry shortly)"}.get(status, "")
    return f"the collector answered HTTP {status} {response.reason_phrase}: {detail}{hint}"


def describe_transport_error(url: str, exc: Exception) -> str:
    """Why a request never got an answer, with the fix."""
    if isinstance(exc, (httpx.UnsupportedProtocol, httpx.InvalidURL)) or "://" not in url:
        return f"{url!r} is not a collector URL: give it as http://HOST:PORT (--url or TRACECAR_URL)"
    if isinstance(exc, httpx.ConnectError):
        return (f"cannot reach the collector at {url} ({exc or 'connection refused'}): is it running? "
                "Start one with `tracecar serve`, or point --url / TRACECAR_URL at it")
    if isinstance(exc, httpx.TimeoutException):
        return f"the collector at {url} did not answer in time ({type(exc).__name__}): is it overloaded or behind a firewall?"
    return f"request to the collector at {url} failed: {type(exc).__name__}: {exc}"


def get_json(args: argparse.Namespace, path: str, params: dict[str, Any] | None = None) -> Any:
    base = collector_url(args)
    try:
        response = httpx.get(base + path, params=params, headers=auth_headers(), timeout=30)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        fail(describe_transport_error(base, exc))
    if response.status_code >= 400:
        fail(describe_http_error(response))
    try:
        return response.json()
    except ValueError:
        fail(f"the server at {base} answered {path} with something that is not JSON: is it a tracecar collector?")


def show(args: argparse.Namespace, page: dict[str, Any], printer: Callable[[dict[str, Any]], None]) -> None:
    """``--json`` prints the API's answer as is; otherwise the command's own table."""
    if args.json:
        print(json.dumps(page, indent=2))
    else:
        printer(page)
