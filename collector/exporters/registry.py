"""Exporter registry: each destination's name and the factory that builds its sink from settings.

Adding an exporter is one module (a sink with ``name``, ``send`` and ``aclose``, see
:class:`.forward.Sink`), one entry here, and its test. The name is the key users write in
``TRACECAR_EXPORTERS`` and the ``exporter`` label of its metrics; each sink's ``name`` equals it.
Factories import their module only when used, so a collector pays only for what it forwards to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tracecar.client.redact import RedactKeys

from .forward import NullSink, Sink


def make_weave_sink(settings: Any) -> Sink:
    """The ``weave`` sink: W&B Weave's trace server, with the key and entity from settings."""
    from .weave_sink import WeaveSink

    if settings.wandb_api_key is None:
        raise RuntimeError("exporter weave needs WANDB_API_KEY")
    if not settings.wandb_entity:
        raise RuntimeError("exporter weave needs TRACECAR_WANDB_ENTITY (the W&B entity of the project)")
    return WeaveSink(
        api_key=settings.wandb_api_key.get_secret_value(), entity=settings.wandb_entity,
        project=settings.wandb_project or "tracecar", server_url=settings.weave_server_url,
        wb_run_id=settings.wandb_run_id, redact=RedactKeys(settings.redact_keys),
    )


def make_otlp_sink(settings: Any) -> Sink:
    from .otlp_sink import make_otlp_sink as make

    return make(settings)


def make_mlflow_sink(settings: Any) -> Sink:
    from .otlp_sink import make_mlflow_sink as make

    return make(settings)


def make_gateway_sink(settings: Any) -> Sink:
    """The ``gateway`` sink of a node collector (TRACECAR_GATEWAY_URL; the cluster tier, docs/cluster.md)."""
    if not settings.gateway_url:
        raise RuntimeError("exporter gateway needs TRACECAR_GATEWAY_URL")
    return make_gateway_sinks(settings)[0]


def make_gateway_sinks(settings: Any) -> list[Sink]:
    """A node's sinks, one per gateway: ``gateway`` alone, or ``gateway@HOST:PORT`` each, every one owing
    only the spans routed to it (each its own delivery cursor; the spool owes each span to its owner:
    exporters/gateway_route.py, spool/deliveries.py)."""
    from .gateway_route import exporter_name
    from .gateway_sink import GatewaySink

    urls = settings.gateway_urls
    token = settings.gateway_token or settings.token
    return [GatewaySink(url, node=settings.effective_node_name, token=token.get_secret_value() if token is not None else None,
                        timeout_s=settings.gateway_timeout_s, batch_bytes=settings.gateway_batch_bytes,
                        name="gateway" if len(urls) == 1 else exporter_name(url))
            for url in urls]


EXPORTERS: dict[str, Callable[[Any], Sink]] = {
    "weave": make_weave_sink,
    "otlp": make_otlp_sink,
    "mlflow": make_mlflow_sink,
    "gateway": make_gateway_sink,
}
EXPORTER_NAMES: tuple[str, ...] = tuple(EXPORTERS)


def unknown_exporter(name: str) -> str:
    return f"TRACECAR_EXPORTERS: unknown exporter {name!r}; known: {', '.join(EXPORTER_NAMES)} (empty: the local store only)"


def make_sinks(settings: Any) -> list[Sink]:
    """One sink per configured exporter, in the configured order (empty: local store only)."""
    if getattr(settings, "role", "node") == "node" and getattr(settings, "gateway_url", None):
        return make_gateway_sinks(settings)  # a node forwards to its gateway(s) only (service/roles.py)
    sinks = []
    for name in settings.effective_exporters:
        if name not in EXPORTERS:
            raise RuntimeError(unknown_exporter(name))
        sink = EXPORTERS[name](settings)
        if sink.name != name:  # the name is the spool cursor's key: a mismatch would lose track
            raise RuntimeError(f"exporter {name!r} built a sink named {sink.name!r}")
        sinks.append(sink)
    return sinks


def make_sink(settings: Any) -> Sink:
    """The single sink of a one-exporter configuration (NullSink when there is none)."""
    sinks = make_sinks(settings)
    if len(sinks) > 1:
        raise RuntimeError("several exporters are configured: use make_sinks")
    return sinks[0] if sinks else NullSink()
