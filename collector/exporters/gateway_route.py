"""Which gateway a node forwards a span to, when it has several (the cluster tier, docs/cluster.md).

Tail budgets are decided per step, and a GRPO group lives inside its step, so every span of a
step must reach the same gateway: a span is routed by its trajectory's **route key**,
(experiment, validate, step), with rendezvous (highest-random-weight) hashing over the gateway
list. Every node computes the same owner from the same list, and adding a gateway moves only the
keys it now wins (about 1/(n+1) of them); removing one moves only its own.

A fully-async step (``step == -1``) is one key: its policy versions stay on one gateway.

A span without a step (an annotation, an engine span joined by trace id) goes where its
trajectory goes: the key of a span of the same trace this node holds (remembered, or read from its
spool); else the route an annotation carries (the VERL trainer's, posted from the driver's node:
VERL's batch carries each trajectory's route beside its id, client.integrations.verl_trainer);
else the trace id's own rendezvous owner (a trajectory without a step is whole on one gateway
that way too).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson

from ..gateway_names import exporter_name, gateway_identity
from ..lru import Lru

__all__ = ["GatewayRouter", "carried_route", "exporter_name", "gateway_identity", "lookup_route_keys", "owner",
           "route_key", "span_route_key"]

_KEY_TYPES = (str, int)


def route_key(experiment: Any, validate: Any, step: Any) -> str | None:
    """The route key of a trajectory (canonical JSON), or None when it has no int step."""
    if type(step) is not int:
        return None
    return orjson.dumps([experiment if type(experiment) in _KEY_TYPES else None, bool(validate), step]).decode()


def span_route_key(span: Mapping[str, Any]) -> str | None:
    attrs = span.get("attributes") or {}
    return route_key(attrs.get("experiment_name"), attrs.get("validate"), attrs.get("step"))


def owner(key: str, gateways: Sequence[str]) -> int:
    """Index of the gateway that owns ``key``: the highest hash of (gateway, key) — rendezvous hashing."""
    best, best_score = 0, b""
    for i, gateway in enumerate(gateways):
        score = hashlib.blake2b(f"{gateway}\x00{key}".encode(), digest_size=8).digest()
        if score > best_score:
            best, best_score = i, score
    return best


class GatewayRouter:
    """Routes spans to one of several gateways, keeping each step (and so each group) whole.

    ``lookup(trace_ids)``: the route keys of those traces from what this node holds (its spool),
    for spans that carry no step. Runs in the forwarders' worker threads, under one lock."""

    def __init__(self, gateways: Sequence[str], lookup: Callable[[list[str]], dict[str, str]] | None = None,
                 remember: int = 100_000) -> None:
        self.gateways = [gateway_identity(g) for g in gateways]
        self.lookup = lookup
        self._keys: Lru = Lru(remember)  # trace id -> route key
        # span id -> owner of a span without a step, as first decided: every sink of this process gets the same
        # answer even if the trajectory's spans arrive between two sinks' reads (a later read would differ)
        self._decided: Lru = Lru(remember)
        self._lock = threading.Lock()  # the forwarders call from worker threads

    def owners(self, spans: Sequence[Mapping[str, Any]]) -> list[int]:
        """The owning gateway's index for each span, in order."""
        with self._lock:
            return self._owners(spans)

    def _owners(self, spans: Sequence[Mapping[str, Any]]) -> list[int]:
        keys: list[str | None] = []
        for span in spans:
            key = span_route_key(span)
            if key is not None:
                self._keys.put(span["trace_id"], key)
            keys.append(key)
        unknown = sorted({s["trace_id"] for s, k in zip(spans, keys) if k is None and s["trace_id"] not in self._keys})
        if unknown and self.lookup is not None:
            for trace_id, key in self.lookup(unknown).items():
                self._keys.put(trace_id, key)
        out = []
        for span, key in zip(spans, keys):
            if key is not None:
                out.append(owner(key, self.gateways))
                continue
            decided = self._decided.get(span["span_id"])
            if decided is None:
                key = self._keys.get(span["trace_id"]) or carried_route(span)
                decided = owner(key if key is not None else "trace:" + str(span["trace_id"]), self.gateways)
                self._decided.put(span["span_id"], decided)
            out.append(decided)
        return out


def carried_route(span: Mapping[str, Any]) -> str | None:
    """The route an annotation carries for a trajectory this node may not hold (the VERL trainer's: its
    ``tracecar_route`` attribute, moved to the span's ``route`` at validation)."""
    value = span.get("route") if span.get("kind") == "annotation" else None
    if not isinstance(value, str):
        return None
    try:
        parts = orjson.loads(value)
    except orjson.JSONDecodeError:
        return None
    return route_key(*parts) if isinstance(parts, list) and len(parts) == 3 else None


def lookup_route_keys(spool: Any, trace_ids: list[str]) -> dict[str, str]:
    """Route keys of traces this node's spool holds a stepped span of (the spans' index columns)."""
    out: dict[str, str] = {}
    for i in range(0, len(trace_ids), 500):
        part = trace_ids[i:i + 500]
        rows = spool.query(f"SELECT trace_id, experiment, validate, step FROM spans WHERE step IS NOT NULL "
                           f"AND kind != 'annotation' AND trace_id IN ({','.join('?' * len(part))})", part)
        for row in rows:
            key = route_key(row["experiment"], row["validate"], row["step"])
            if key is not None:
                out[row["trace_id"]] = key
    return out
