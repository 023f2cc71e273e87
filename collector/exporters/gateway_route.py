"""Which gateway a node owes a span to, when it has several (the cluster tier, docs/cluster.md).

Tail budgets are decided per step, and a GRPO group lives inside its step, so every span of a
step must reach the same gateway: a span is routed by its trajectory's **route key**,
(experiment, step), with rendezvous (highest-random-weight) hashing over the gateway list. A
step's training and validation rollouts (two budget keys) go to the same gateway, so that one
gateway answers for the whole step (viewer/federation.py). Every node computes the same owner from
the same list, and adding a gateway moves only the keys it now wins (about 1/(n+1) of them);
removing one moves only its own.

The owner is decided **once, when the span is owed** (the spool's write, or the release of a held
or awaiting span: spool/deliveries.py), and kept as that gateway's delivery row: a restart, an
eviction or a trajectory arriving later never re-decides it, so each span reaches exactly one
gateway.

A fully-async step (``step == -1``) is one key: its policy versions stay on one gateway.

A span without a step (an annotation, a span of a non-VERL trace) goes where its trajectory goes:
the key of a stepped span of the same trace (remembered, or read from the spool's spans or tail
decisions); else the route an annotation carries (the VERL trainer's, posted from the driver's
node: VERL's batch carries each trajectory's route beside its id, client.integrations.verl_trainer);
else the trace id's own rendezvous owner (a trajectory without a step is whole on one gateway that
way too).
"""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Sequence
from typing import Any

import orjson

from ..gateway_names import exporter_name, gateway_identity
from ..lru import Lru

__all__ = ["GatewayRouter", "carried_route", "exporter_name", "gateway_identity", "owner", "route_key"]

_KEY_TYPES = (str, int)

# (seq, trace_id, kind, experiment, validate, step, payload of a stepless annotation or None): a span as owed
OwedRow = tuple[int, str, str, Any, Any, Any, "bytes | None"]


def route_key(experiment: Any, validate: Any, step: Any) -> str | None:
    """The route key of a trajectory (canonical JSON), or None when it has no int step. ``validate`` does not split
    a step: its training and validation rollouts share the key (taken so every caller names the whole column)."""
    if type(step) is not int:
        return None
    return orjson.dumps([experiment if type(experiment) in _KEY_TYPES else None, step]).decode()


def owner(key: str, gateways: Sequence[str]) -> int:
    """Index of the gateway that owns ``key``: the highest hash of (gateway, key) — rendezvous hashing."""
    best, best_score = 0, b""
    for i, gateway in enumerate(gateways):
        score = hashlib.blake2b(f"{gateway}\x00{key}".encode(), digest_size=8).digest()
        if score > best_score:
            best, best_score = i, score
    return best


class GatewayRouter:
    """The spool's routing over several gateways (spool.deliveries.Routing): one owner a span.

    Called inside the spool's write transactions (under its write lock), with that connection."""

    def __init__(self, gateways: Sequence[str], remember: int = 100_000) -> None:
        self.gateways = [gateway_identity(g) for g in gateways]
        self.names = [exporter_name(g) for g in gateways]
        self.routed = frozenset(self.names)
        self._keys: Lru = Lru(remember)  # trace id -> route key, from its stepped spans
        self._owners: Lru = Lru(4096)  # route key -> exporter name (a handful of steps in flight)

    def owner_of(self, key: str) -> str:
        name = self._owners.get(key)
        if name is None:
            name = self.names[owner(key, self.gateways)]
            self._owners.put(key, name)
        return name

    def owners(self, conn: sqlite3.Connection, rows: Sequence[OwedRow]) -> list[str]:
        """The owning gateway's exporter name for each row, in order."""
        keys: list[str | None] = []
        batch_keys: dict[tuple[Any, Any, Any], str | None] = {}  # a batch holds a step or two: one key each
        seen: set[str] = set()
        for _, trace_id, kind, experiment, validate, step, _payload in rows:
            column = (experiment, validate, step)
            key = batch_keys[column] if column in batch_keys else batch_keys.setdefault(column, route_key(*column))
            if key is not None and kind != "annotation" and trace_id not in seen:
                seen.add(trace_id)
                self._keys.put(trace_id, key)
            keys.append(key)
        # looked up again at each batch while none is known (not remembered: a held stepped span may arrive
        # without passing here, and a stale "none" would send the rest of its trajectory apart)
        unknown = sorted({r[1] for r, k in zip(rows, keys) if k is None and r[1] not in self._keys})
        if unknown:
            for trace_id, key in lookup_route_keys(conn, unknown).items():
                self._keys.put(trace_id, key)
        out = []
        for row, key in zip(rows, keys):
            if key is None:
                key = self._keys.get(row[1]) or carried_route(row[6]) or "trace:" + str(row[1])
            out.append(self.owner_of(key))
        return out


def carried_route(payload: bytes | None) -> str | None:
    """The route an annotation carries for a trajectory this node may not hold (the VERL trainer's: its
    ``tracecar_route`` attribute, moved to the span's ``route`` at validation)."""
    if payload is None:
        return None
    try:
        value = orjson.loads(payload).get("route")
        parts = orjson.loads(value) if isinstance(value, str) else None
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return route_key(*parts) if isinstance(parts, list) and len(parts) == 3 else None


def lookup_route_keys(conn: sqlite3.Connection, trace_ids: list[str]) -> dict[str, str]:
    """Route keys of traces this node's spool knows a step of: a stepped span it holds, else the trajectory's
    tail decision (which outlives its spans)."""
    out: dict[str, str] = {}
    for i in range(0, len(trace_ids), 400):  # bound twice: within SQLite's oldest limit of 999 variables
        part = trace_ids[i:i + 400]
        marks = ",".join("?" * len(part))
        rows = conn.execute(f"SELECT trace_id, experiment, validate, step FROM trajectory_decisions WHERE trace_id IN ({marks})"
                            f" UNION ALL SELECT trace_id, experiment, validate, step FROM spans WHERE step IS NOT NULL"
                            f" AND kind != 'annotation' AND trace_id IN ({marks})", part + part).fetchall()
        for trace_id, experiment, validate, step in rows:
            key = route_key(experiment, validate, step)
            if key is not None:
                out.setdefault(trace_id, key)
    return out
