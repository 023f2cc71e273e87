"""``tracecar proxy``: run the OpenAI-compatible capture proxy (tracecar.client.integrations.proxy_app).

A process of its own, beside the agents (or the inference server): it needs the thin client plus
uvicorn (``pip install 'tracecar[proxy]'``), not the collector's dependencies, and it keeps
forwarding while the collector restarts (spans wait in the sender's bounded queue and retries).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import replace
from typing import Any, NoReturn

from ..config import ClientConfig, default_worker_id
from ..loud import check_url


def _fail(message: str) -> NoReturn:
    print(f"tracecar proxy: {message}", file=sys.stderr)
    raise SystemExit(2)


def build_proxy(args: argparse.Namespace) -> tuple[Any, Any]:
    """(ProxyConfig, Tracer) from the flags over the environment; a misconfiguration is one line and exit 2."""
    from ..integrations.proxy_config import ProxyConfig, ProxyConfigError
    from ..tracer import Tracer

    try:
        config = ProxyConfig.from_env(upstream=args.upstream, host=args.host, port=args.port)
    except ProxyConfigError as exc:
        _fail(str(exc))
    collector = args.collector or os.environ.get("TRACECAR_URL")
    if not collector:
        _fail("no collector to record to: give --collector URL or set TRACECAR_URL (e.g. http://127.0.0.1:9470)")
    url, warning = check_url(collector.strip().rstrip("/"))
    if url is None:
        _fail(warning or f"{collector!r} is not a collector URL")
    if warning:
        print(f"tracecar proxy: {warning}", file=sys.stderr)
    overrides: dict[str, Any] = {"url": url}
    if args.experiment:
        overrides["experiment"] = args.experiment
    client = ClientConfig.from_env(**overrides)
    if client.worker_id is None:
        client = replace(client, worker_id=f"proxy:{default_worker_id()}")
    return config, Tracer(client)


def serve_proxy(config: Any, tracer: Any) -> None:
    try:
        import uvicorn

        from ..integrations.proxy_app import ProxyApp  # httptools: its upstream client's parser
    except ImportError as exc:
        _fail(f"needs uvicorn and httptools ({exc}): pip install 'tracecar[proxy]'")

    # the sender thread packs spans in this process: hand the GIL back to the event loop (the requests) within
    # 0.5 ms rather than Python's default 5 ms (bench/proxy.py)
    sys.setswitchinterval(0.0005)
    app = ProxyApp(config, tracer)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, lifespan="on", access_log=False,
                                           proxy_headers=False, server_header=False, date_header=False, log_level="warning"))
    print(f"tracecar proxy: http://{config.host}:{server.config.port} -> {config.upstream}, recording to {tracer.config.url} "
          f"(agents: base URL http://{config.host}:{config.port}/rollout/ROLLOUT_ID/v1)", file=sys.stderr, flush=True)
    server.run()


def cmd_proxy(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config, tracer = build_proxy(args)
    serve_proxy(config, tracer)


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("proxy", help="an OpenAI-compatible capture proxy: agents call it as their base URL "
                                     "(/rollout/ID/v1), it forwards to --upstream and records each request as a generate span")
    p.add_argument("--upstream", help="the inference server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1 "
                                      "(default $TRACECAR_PROXY_UPSTREAM)")
    p.add_argument("--host", help="bind address (default $TRACECAR_PROXY_HOST or 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default $TRACECAR_PROXY_PORT or 9480)")
    p.add_argument("--collector", help="collector URL to record to (default $TRACECAR_URL)")
    p.add_argument("--experiment", help="experiment name of the rollouts (default $TRACECAR_EXPERIMENT)")
    p.set_defaults(func=cmd_proxy)
