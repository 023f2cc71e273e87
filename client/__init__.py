"""tracecar thin client: trace rollout workers without doing the tracing work in them.

Set ``TRACECAR_URL`` (e.g. ``http://127.0.0.1:9470``) and replace VERL's imports::

    from tracecar.client import rollout_trace_attr, rollout_trace_op

Unset, every decorated call runs untraced at the cost of one global read.
"""

from .config import ClientConfig
from .health import health, health_metrics, log_health
from .traceparent import trace_headers, traceparent
from .tracer import Tracer, configure, flush, get_tracer, shutdown
from .tracing import annotate, announce_step, current_trajectory_id, engine_request, rollout_trace_attr, rollout_trace_op

__all__ = [
    "ClientConfig", "Tracer", "annotate", "announce_step", "configure", "current_trajectory_id", "engine_request", "flush",
    "get_tracer", "health", "health_metrics", "log_health", "rollout_trace_attr", "rollout_trace_op", "shutdown",
    "trace_headers", "traceparent",
]
__version__ = "0.1.0"
