"""The collector's two roles (the cluster tier, docs/cluster.md): what each may be configured with.

A **node** sits beside the workers: validation, prompt-delta rebuilding, decoding, the durable
spool, VERL's per-worker head budget and its local viewer. With ``TRACECAR_GATEWAY_URL`` it
forwards everything its head budget keeps (or, where the gateway's tail budget decomposes, its
candidates only: processors/sampling/candidates.py), decoded, to the gateway (exporter ``gateway``,
exporters/gateway_sink.py); without one it is the single collector it always was.

A **gateway** takes node collectors' batches (receivers/forwarded.py), decides the global tail
budgets over the whole job, stores, serves the viewer and every read API, and fans out to Weave,
OTLP and MLflow: the W&B credentials live there only.

Each rule below is one line for the user and exit 2 (``tracecar serve``, ``tracecar config``).
"""

from __future__ import annotations

import functools
import logging
import threading
import urllib.parse
from typing import Any

from ..exporters.gateway_sink import NODE_HEADER, PROGRESS_HEADER

log = logging.getLogger("tracecar.collector.roles")

__all__ = ["NODE_HEADER", "PROGRESS_HEADER", "RoleError", "check_role", "BudgetsAgreement", "gateway_url_problem", "read_token_ends",
           "wire_gateway_sinks", "GatewayIntake", "NodeMarks", "heartbeat_loop", "gateway_sinks", "read_progress",
           "parse_progress"]


class RoleError(ValueError):
    """A role misconfiguration; ``str()`` is the one line the user sees."""


def gateway_url_problem(url: str) -> str | None:
    """Why ``url`` is not a gateway base URL (``http(s)://HOST[:PORT]`` with no query), or None."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # raises on a port that is not a number or out of range
    except ValueError as exc:
        return f"is not a URL ({exc})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "is not an http(s)://HOST:PORT URL"
    if parts.username is not None or parts.password is not None:
        return "must not carry a user or password (give the token in TRACECAR_GATEWAY_TOKEN)"
    if parts.query or parts.fragment:
        return "must not carry a query or fragment"
    if parts.path not in ("", "/"):
        return "must be the gateway's base URL (no path; the node posts to <it>/v1/spans)"
    del port
    return None


def check_role(settings: Any) -> None:
    """Raises RoleError (one line) when the role and the settings contradict each other."""
    from ..processors.sampling.policy import Policies

    url = settings.gateway_url
    if settings.role == "gateway":
        if url:
            raise RoleError("TRACECAR_GATEWAY_URL is set on a gateway (TRACECAR_ROLE=gateway): it is a node's setting "
                            "(the gateway it forwards to); unset it here, or run this collector as TRACECAR_ROLE=node")
        policies = Policies(settings)
        if any(policies.get(e, v).mode == "head" for e in (None, *settings.budgets) for v in (False, True)):
            raise RoleError("TRACECAR_MAX_SAMPLES_PER_STEP_PER_WORKER is set on a gateway: VERL's per-worker budget is "
                            "decided by the node collectors (set it there), the gateway decides the tail budgets "
                            "(or set TRACECAR_TAIL_SAMPLING=true to decide it here, over the whole job)")
        return
    if settings.exporters is not None and "gateway" in settings.exporters and not url:
        raise RoleError("TRACECAR_EXPORTERS includes gateway but TRACECAR_GATEWAY_URL is not set: give the gateway's "
                        "http(s)://HOST:PORT")
    if not url:
        return
    urls = settings.gateway_urls
    if not urls:
        raise RoleError("TRACECAR_GATEWAY_URL names no gateway: give the gateway's http(s)://HOST:PORT (several: comma-separated)")
    for one in urls:
        problem = gateway_url_problem(one)
        if problem:
            shown = f" ({one})" if len(urls) > 1 else ""
            raise RoleError(f"TRACECAR_GATEWAY_URL{shown} {problem}: give the gateway's http(s)://HOST:PORT")
    if len(urls) > 1:
        from ..gateway_names import exporter_name

        names = [exporter_name(u) for u in urls]
        if len(set(names)) != len(names):
            raise RoleError("TRACECAR_GATEWAY_URL lists one gateway twice (the same host and port): list each once")
    if settings.exporters is not None and list(settings.exporters) not in ([], ["gateway"]):
        raise RoleError("TRACECAR_EXPORTERS is set on a node with a gateway: the gateway fans out to the exporters; "
                        "unset TRACECAR_EXPORTERS here and configure them on the gateway")
    if settings.backend not in ("auto", "local"):
        raise RoleError(f"TRACECAR_BACKEND={settings.backend} on a node with a gateway: the gateway fans out to the "
                        "backends; unset TRACECAR_BACKEND here and configure it on the gateway")
    if settings.wandb_api_key is not None:
        raise RoleError("WANDB_API_KEY is set on a node with a gateway: W&B credentials belong on the gateway only "
                        "(it forwards to Weave); unset it here")
    tail = Policies(settings).any_tail
    if tail:
        raise RoleError("a tail budget (TRACECAR_MAX_TRAJECTORIES_PER_STEP, …_GROUPS_…, …_BYTES_…, …_TOKENS_…, "
                        "TRACECAR_TAIL_SAMPLING, TRACECAR_BUDGETS) is set on a node with a gateway: the gateway "
                        "decides the global budgets over the whole job; set them there")


def read_token_ends(spool: Any, span_ids: list[str]) -> dict[str, list[int]]:
    """Each response token's end offset in its decoded text, as the node's token view has it
    (forwarded with the span, so the gateway's token view needs no tokenizer)."""
    from ..processors.token_arrays import TokenArrays

    out: dict[str, list[int]] = {}
    for i in range(0, len(span_ids), 500):
        part = span_ids[i:i + 500]
        rows = spool.query(f"SELECT span_id, token_arrays FROM spans WHERE token_arrays IS NOT NULL AND span_id IN "
                           f"({','.join('?' * len(part))})", part)
        for row in rows:
            try:
                arrays = TokenArrays.unpack(row["token_arrays"])
            except (ValueError, KeyError):
                continue
            if arrays.ends is not None:
                out[row["span_id"]] = arrays.ends
    return out


def gateway_sinks(sinks: list[Any]) -> list[Any]:
    from ..exporters.gateway_sink import GatewaySink

    return [s for s in sinks if isinstance(s, GatewaySink)]


def gateway_routing(sinks: list[Any]) -> Any:
    """A node with several gateways: the spool's routing, which owes each span to one of them (None otherwise)."""
    from ..exporters.gateway_route import GatewayRouter

    several = gateway_sinks(sinks)
    return GatewayRouter([s.url for s in several]) if len(several) > 1 else None


def wire_gateway_sinks(sinks: list[Any], spool: Any, selection: Any = None) -> None:
    """A node's gateway sink reads its token offsets and its progress from this node's spool (and, sending
    candidates only, the steps it holds: its heartbeat's body)."""
    for sink in gateway_sinks(sinks):
        sink.token_ends = functools.partial(read_token_ends, spool)
        sink.progress = functools.partial(read_progress, spool, exporter=sink.name)
        if selection is not None and selection.node_candidates:
            sink.holding = functools.partial(selection.holding_report,
                                             functools.partial(read_progress, spool, 0, False, sink.name))


class BudgetsAgreement:
    """A node with several gateways learns their budgets (heartbeat answers) once all answered, while they agree.

    Each gateway decides its own steps, so the node's candidates must be chosen under the budgets
    every gateway applies; gateways configured apart would each see candidates chosen for another's
    rules. While they differ the node keeps what it last learned and says so (log, rate-limited)."""

    def __init__(self, names: list[str], learn: Any) -> None:
        from ..loudness import RateLimited

        self.names = names
        self.learn = learn
        self.latest: dict[str, Any] = {}
        self._loud = RateLimited(60.0)
        self._lock = threading.Lock()  # heartbeats of several gateways answer on worker threads
        self.disagree = False

    def heard(self, name: str, description: Any) -> None:
        with self._lock:
            self._heard(name, description)

    def _heard(self, name: str, description: Any) -> None:
        self.latest[name] = description
        if set(self.latest) != set(self.names):
            return  # learned once every gateway has answered: one answer is not an agreement
        values = list(self.latest.values())
        if any(v != values[0] for v in values[1:]):
            self.disagree = True
            if self._loud.hit() is not None:
                log.error("the gateways answer different budgets (%s): this node keeps the budgets it last learned; "
                          "configure every gateway of TRACECAR_GATEWAY_URL with the same tail budgets",
                          ", ".join(sorted(self.latest)), extra={"event": "gateway_budgets_disagree"})
            return
        self.disagree = False
        self.learn(description)


class GatewayIntake:
    """Which receiver a ``/v1/spans`` request gets: a node's forwarded batch (``X-Tracecar-Node``)
    is taken by a gateway only; anywhere else it is answered 421, which the node retries (and says
    why in its /readyz), so nothing is lost to a node pointed at a collector that is not a gateway."""

    MAX_NODE_LABELS = 1024  # distinct node labels on the metric; later new names count as "other"

    def __init__(self, settings: Any, redact: Any, received: Any) -> None:
        self.settings = settings
        self.redact = redact
        self.received = received  # Counter tracecar_gateway_spans_received{node}
        self._labels: set[str] = set()
        self.marks: NodeMarks | None = None
        if settings.role == "gateway":
            self.marks = NodeMarks(settings.data_dir / "cluster-nodes.json", settings.node_silent_s, settings.node_lost_s)

    def delivered(self, node: str | None, progress: str | None, holding: Any = None) -> None:
        """A node's batch (or heartbeat) was committed: how far it has now delivered (and, a heartbeat of a
        node sending candidates only, what it holds)."""
        if node is not None and self.marks is not None and 0 < len(node) <= 256:
            self.marks.heard(node, parse_progress(progress))
            if isinstance(holding, dict):
                self.marks.holding(node, holding)

    def receiver(self, node: str | None) -> tuple[Any, tuple[int, dict[str, Any]] | None]:
        """(receiver or None for a worker's batch, or the refusal to answer)."""
        if node is None:
            return None, None
        if self.settings.role != "gateway":
            return None, (421, {"error": {"field": NODE_HEADER, "reason": "a node collector forwarded this batch, but this "
                                          "collector is not a gateway (TRACECAR_ROLE=gateway): check the node's "
                                          "TRACECAR_GATEWAY_URL"}})
        if not 0 < len(node) <= 256:
            return None, (400, {"error": {"field": NODE_HEADER, "reason": "must be 1 to 256 characters"}})
        from ..receivers.forwarded import ForwardedRequest

        label = node if node in self._labels or len(self._labels) < self.MAX_NODE_LABELS else "other"
        self._labels.add(label)
        counter = self.received.labels(node=label)
        s = self.settings
        return ForwardedRequest(node, s.max_decompressed_bytes, s.max_batch_spans, self.redact, on_spans=counter.inc), None


# ---- how far each node has delivered: a gateway's steps wait for a node that is behind ----------------
def read_progress(spool: Any, delivered: int, held_owed: bool = True, exporter: str | None = None) -> tuple[int, int]:
    """(acknowledged through, delivered through) of a node's spool, as sequence numbers: the highest seq it
    ever committed, and the highest seq below which nothing is owed once the oldest ``delivered`` pending
    spans are delivered (the forwarder sends oldest first). A held span (a node sending candidates only
    holds its steps until its view of them closes) is owed too, unless ``held_owed`` is false: then the
    caller reports the steps it holds beside it (TailSelector.holding_report).

    With several gateways (``exporter``: one of them, the spool keeping a delivery cursor each), what that
    gateway's cursor still owes: the spool owes each span to one of them (spool/deliveries.py)."""
    if exporter is not None and getattr(spool, "multi", False):
        owed_sql, params = "SELECT seq FROM deliveries WHERE exporter = ? ORDER BY seq LIMIT 1 OFFSET ?", [exporter, max(0, delivered)]
    else:
        owed_sql, params = "SELECT seq FROM spans WHERE state = 0 ORDER BY seq LIMIT 1 OFFSET ?", [max(0, delivered)]
    row = spool.query("SELECT (SELECT seq FROM sqlite_sequence WHERE name = 'spans') AS acked, "
                      f"({owed_sql}) AS next_owed, "
                      f"(SELECT seq FROM spans WHERE state = 3 AND {int(held_owed)} ORDER BY seq LIMIT 1) AS next_held",
                      params)[0]
    acked = int(row["acked"] or 0)
    owed = [int(row[k]) for k in ("next_owed", "next_held") if row[k] is not None]
    return acked, (min(owed) - 1 if owed else acked)


def parse_progress(value: str | None) -> tuple[int, int] | None:
    if not value:
        return None
    try:
        acked, delivered = (int(part) for part in value.split(","))
    except ValueError:
        return None
    return (acked, delivered) if 0 <= delivered <= acked else None


class NodeMarks:
    """Per node collector: how far it has acknowledged (A) and delivered (D), and when it was last heard.

    The gateway's tail selector asks :meth:`may_close` before deciding a step on ``next_step``,
    ``idle`` or ``shutdown`` (the rules that depend on what has arrived by now): the first time it
    asks about a step, the barrier is each live node's A; the step may close once every live node
    has reported D at or past its barrier, and was heard within ``silent_s`` (a silent node may have
    acknowledged more since). So a step never closes while a node still holds trajectories it
    acknowledged before the gateway wanted to close — what one collector that saw the workers
    directly would already have had. No barrier is taken while a live node is silent (its last A may be
    stale), nor from the marks a restarted gateway reloads before each node reports again. A node not
    heard from for ``lost_s`` is no longer waited for.
    ``count`` and ``decision_wait`` close steps whatever the nodes do. The nodes' names and marks are
    kept in ``cluster-nodes.json`` in the data dir, so a restarted gateway waits for the nodes it
    knew until they report again.
    """

    def __init__(self, path: Any, silent_s: float, lost_s: float, clock: Any = None) -> None:
        import json
        import time

        self.path = path
        self.silent_s = silent_s
        self.lost_s = lost_s
        self.clock = clock or time.monotonic
        self.marks: dict[str, list[float]] = {}  # node -> [acked, delivered, last heard (clock)]
        # node sending candidates only -> (delivered besides the held steps, the steps it holds), its latest heartbeat's
        self.held: dict[str, tuple[int, set[tuple[Any, ...]]]] = {}
        self._lock = threading.Lock()  # heard() on the event loop, may_close() on the spool's writer thread
        self.barriers: dict[tuple[Any, int], dict[str, int]] = {}
        self._saved: set[str] = set()
        try:
            known = json.loads(path.read_text())
        except (OSError, ValueError):
            known = {}
        now = self.clock()
        for node, (acked, delivered) in known.items() if isinstance(known, dict) else ():
            # waited for (within lost_s) but not heard: what it acknowledged while this gateway was down is
            # unknown until it reports again, so no step closes on its stale marks (a 60 s outage did that)
            self.marks[str(node)] = [int(acked), int(delivered), now - silent_s]
        self._saved = set(self.marks)

    def heard(self, node: str, progress: tuple[int, int] | None) -> None:
        with self._lock:
            mark = self.marks.get(node)
            now = self.clock()
            if mark is None:
                mark = self.marks[node] = [0, 0, now]
            if progress is not None:
                mark[0], mark[1] = max(mark[0], progress[0]), max(mark[1], progress[1])
            mark[2] = now
            new = node not in self._saved
        if new:
            self._save()

    def holding(self, node: str, report: dict[str, Any]) -> None:
        """A node's heartbeat: the steps it holds (sending candidates only) and how far it has delivered besides
        them, read together (replaced, not maxed: a release makes held spans owed below that mark)."""
        delivered, steps = report.get("delivered"), report.get("holding")
        if type(delivered) is not int or not isinstance(steps, list):
            return
        held = {tuple(s) for s in steps if isinstance(s, list) and len(s) == 4}
        with self._lock:
            self.held[node] = (delivered, held)

    def _save(self) -> None:
        import json

        with self._lock:
            known = {n: [int(m[0]), int(m[1])] for n, m in self.marks.items()}
        try:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(known))
            tmp.replace(self.path)
            self._saved = set(known)
        except OSError:
            pass

    def may_close(self, step: Any) -> bool:
        now = self.clock()
        with self._lock:
            live = {n: list(m) for n, m in self.marks.items() if now - m[2] < self.lost_s}
        key = (step.key, step.round)
        barrier = self.barriers.get(key)
        if barrier is None:
            if any(now - m[2] >= self.silent_s for m in live.values()):
                return False  # a barrier from a silent node's last report would be too low: wait until it reports
            barrier = self.barriers[key] = {n: int(m[0]) for n, m in live.items()}
            if len(self.barriers) > 100_000:  # steps decided by count/decision_wait leave theirs: bounded
                self.barriers.pop(next(iter(self.barriers)))
        for node, mark in live.items():
            if now - mark[2] >= self.silent_s:
                return False
            if mark[1] < barrier.get(node, 0):  # not all delivered: unless what is left is held for other steps
                delivered, held = self.held.get(node, (-1, set()))
                if delivered < barrier.get(node, 0) or step.key in held:
                    return False
        self.barriers.pop(key, None)
        return True

    def snapshot(self) -> dict[str, Any]:
        now = self.clock()
        with self._lock:
            return {n: {"acknowledged_through": int(m[0]), "delivered_through": int(m[1]),
                        "heard_s_ago": round(now - m[2], 3)} for n, m in self.marks.items()}


async def heartbeat_loop(sink: Any, every_s: float) -> None:
    """A node's progress to its gateway every ``every_s`` (the batches carry it too)."""
    import asyncio

    while True:
        await sink.heartbeat()
        await asyncio.sleep(every_s)
