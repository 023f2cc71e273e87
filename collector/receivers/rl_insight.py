"""RL-Insight's server discovery, answered by the collector: ``GET /api/v1/services``.

VERL's ``actor_rollout_ref.rollout.trace.enable_otel`` and RL-Insight's own SDK
(``rl_insight.server.http_api.get_server_services``) ask the server at ``RL_INSIGHT_SERVER_URL``
for its component ports, then send OTLP/HTTP spans to ``<scheme>://<that host>:<otlp_port>/v1/traces``
(``rl_insight.server.network.service_url_from_server_url``). Pointed at the collector, the
answer names the collector's own port, so those spans reach its ``/v1/traces`` and no VERL or
RL-Insight setting changes: only the URL.

The answer has RL-Insight 0.3.0's shape (``rl_insight/server/http_api.py``): ``status`` and
``otlp_port``, ``prometheus_port``, ``grafana_port`` (an int, or null for a component that is
off). tracecar runs neither Prometheus nor Grafana, so those two are null, as RL-Insight says
for its own disabled components. ``otlp_port`` is the port the caller reached the collector on
(the ``Host`` header's, so a port mapped by a Kubernetes Service or a proxy is the one answered),
else the scheme's default. Open like ``/healthz``: RL-Insight's client sends no token, and the
answer holds no data; ``/v1/traces`` itself stays behind the collector's token.

``POST /api/v1/prometheus/targets`` (RL-Insight registers metric endpoints there) is answered
501 with one clear line: the collector scrapes no metrics, and saying it did would hide that.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

API_PREFIX = "/api/v1"  # rl_insight.utils.constants.MonitorServer.API_PREFIX


def otlp_port(request: Request) -> int:
    """The port this request reached the collector on (its Host header's), else the scheme's default."""
    port = request.url.port
    if port is not None:
        return port
    return 443 if request.url.scheme == "https" else 80


def build_router() -> APIRouter:
    router = APIRouter()

    @router.get(API_PREFIX + "/services")
    async def services(request: Request) -> dict[str, Any]:
        """RL-Insight's service discovery: OTLP spans go to this collector's port."""
        return {"status": "ok", "otlp_port": otlp_port(request), "prometheus_port": None, "grafana_port": None}

    @router.post(API_PREFIX + "/prometheus/targets", include_in_schema=False)
    async def prometheus_targets() -> JSONResponse:
        return JSONResponse({"error": {"field": "targets", "reason": "tracecar does not scrape Prometheus metrics; "
                                       "it takes RL-Insight's spans only (OTLP at /v1/traces)"}}, status_code=501)

    return router
