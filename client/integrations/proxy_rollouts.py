"""The proxy's open rollouts: one trajectory root per rollout id, closed by its reward or when idle.

A rollout's trace id is derived from the experiment and the rollout id (and attempt), so a reward
posted to another proxy replica, or after a proxy restart, lands on the same trajectory. The root
span is sent when the rollout closes — on its reward, after ``idle_s`` without a request, when
``max_open`` rollouts are open (the least recently active goes), or at shutdown — so, as with
VERL's ``rollout_trace_attr``, it reaches the collector after its ``generate`` spans. Everything
here runs on the proxy's event loop; emitting is an append to the sender's bounded queue.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from ..spans import KIND_ANNOTATION, KIND_TRAJECTORY, SpanRecord
from ..tracing import _TraceRef

ROOT_NAME = "rollout"
MAX_ID_CHARS = 256
#: request headers that describe the rollout (also accepted in the reward's JSON body, without the prefix)
META_HEADERS = {b"x-tracecar-step": "step", b"x-tracecar-sample-index": "sample_index", b"x-tracecar-rollout-n": "rollout_n",
                b"x-tracecar-validate": "validate"}
ROLLOUT_HEADER = b"x-tracecar-rollout"
ATTEMPT_HEADER = b"x-tracecar-attempt"
_INT64 = (-(2**63), 2**63 - 1)


def rollout_trace_id(experiment: str | None, rollout_id: str, attempt: str | None) -> str:
    """32 hex characters (also a W3C trace id), the same in every proxy of the experiment."""
    digest = hashlib.blake2b(digest_size=16, person=b"tracecar-proxy")
    for part in (experiment or "", rollout_id, attempt or ""):
        digest.update(part.encode("utf-8", "surrogatepass") + b"\0")
    return digest.hexdigest()


class MetaError(ValueError):
    """A rollout attribute or reward value that cannot be recorded; ``field`` names it."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def check_value(key: str, value: Any) -> Any:
    """One value of a reward body or a rollout header, as the collector will accept it."""
    if key in ("step", "rollout_n", "policy_version", "trained_on_version"):
        if type(value) is not int or not _INT64[0] <= value <= _INT64[1]:
            raise MetaError(key, "must be a signed 64-bit integer")
    elif key == "sample_index":
        if type(value) is str:
            if not 0 < len(value) <= MAX_ID_CHARS:
                raise MetaError(key, f"must be 1 to {MAX_ID_CHARS} characters")
        elif type(value) is not int or not _INT64[0] <= value <= _INT64[1]:
            raise MetaError(key, "must be an integer or a string")
    elif key in ("validate", "trained", "done"):
        if type(value) is not bool:
            raise MetaError(key, "must be a boolean")
    elif key in ("reward", "advantage"):
        if type(value) not in (int, float) or not math.isfinite(value):
            raise MetaError(key, "must be a finite number")
    elif key == "filtered_by":
        if not isinstance(value, str) or not 0 < len(value) <= 256:
            raise MetaError(key, "must be a string of 1 to 256 characters")
    elif value is not None and (type(value) not in (str, int, float, bool) or (type(value) is float and not math.isfinite(value))
                                or (type(value) is str and len(value) > 1024)):
        raise MetaError(key, "must be a string (at most 1024 characters), a finite number or a boolean")
    return value


def header_meta(headers: Iterable[tuple[bytes, bytes]]) -> tuple[dict[str, Any], list[str]]:
    """The rollout attributes a request's ``X-Tracecar-*`` headers carry, and the ones ignored (why)."""
    meta: dict[str, Any] = {}
    ignored = []
    for name, raw in headers:
        key = META_HEADERS.get(name)
        if key is None:
            continue
        text = raw.decode("latin-1").strip()
        value: Any
        if key == "validate":
            value = {"true": True, "1": True, "false": False, "0": False}.get(text.lower(), text)
        else:  # an integer when it reads as one (a sample index may also be a string)
            value = int(text) if text.lstrip("-").isdigit() else text
        try:
            meta[key] = check_value(key, value)
        except MetaError as exc:
            ignored.append(f"header {name.decode('latin-1')}: {exc.reason}")
    return meta, ignored


class Rollout:
    """One open rollout: its root record and what is in flight."""

    __slots__ = ("root", "child_attributes", "in_flight", "last_active", "requests")

    def __init__(self, root: SpanRecord) -> None:
        self.root = root
        self.child_attributes = self._children_see(root)
        self.in_flight = 0
        self.last_active = time.monotonic()
        self.requests = 0

    @staticmethod
    def _children_see(root: SpanRecord) -> dict[str, Any]:
        attributes = {k: v for k, v in (root.attributes or {}).items() if k != "tracecar"}
        attributes["tracecar"] = {"top": True}  # a top-level call of the trajectory (Weave: a trace root)
        return attributes

    def apply(self, meta: dict[str, Any]) -> None:
        attributes = self.root.attributes
        assert attributes is not None
        changed = False
        for key, value in meta.items():
            if attributes.get(key) != value:
                attributes[key] = value
                changed = True
        if changed:
            self.child_attributes = self._children_see(self.root)


class Rollouts:
    """Open rollouts by trace id, least recently active first (so the idle sweep pops from the front)."""

    def __init__(self, emit: Callable[[SpanRecord], None], experiment: str | None, idle_s: float, max_open: int) -> None:
        self.emit = emit
        self.experiment = experiment
        self.idle_s = idle_s
        self.max_open = max_open
        self.open: OrderedDict[str, Rollout] = OrderedDict()
        self.closed: Counter[str] = Counter()  # by reason: reward, idle, evicted, shutdown
        self.rewards = 0

    def touch(self, rollout_id: str, attempt: str | None, meta: dict[str, Any]) -> Rollout:
        """The rollout a request belongs to (opened on its first request), marked active now."""
        trace_id = rollout_trace_id(self.experiment, rollout_id, attempt)
        rollout = self.open.get(trace_id)
        if rollout is None:
            rollout = self._open(trace_id, rollout_id, attempt)
        else:
            self.open.move_to_end(trace_id)
            rollout.last_active = time.monotonic()
        if meta:
            rollout.apply(meta)
        return rollout

    def _open(self, trace_id: str, rollout_id: str, attempt: str | None) -> Rollout:
        while len(self.open) >= self.max_open:
            _, oldest = self.open.popitem(last=False)
            self._emit_root(oldest, "evicted")
        attributes: dict[str, Any] = {"rollout_id": rollout_id, "validate": False, "tracecar": {"trajectory": True}}
        if attempt is not None:
            attributes["attempt_id"] = attempt
        if self.experiment is not None:
            attributes["experiment_name"] = self.experiment
        root = SpanRecord(ROOT_NAME, KIND_TRAJECTORY, time.time(), None, attributes)
        root._sid = trace_id
        root.prefix = ""  # its id is not the process prefix + counter: short ids (wire v3) leave it whole
        rollout = self.open[trace_id] = Rollout(root)
        return rollout

    def _emit_root(self, rollout: Rollout, reason: str) -> None:
        rollout.root.end = time.time()
        self.emit(rollout.root)
        self.closed[reason] += 1

    def sweep(self, now: float | None = None, limit: int = 10_000) -> int:
        """Closes rollouts idle for ``idle_s`` (none with a request in flight); at most ``limit`` looked at."""
        now = time.monotonic() if now is None else now
        closed = looked = 0
        while self.open and looked < limit:
            trace_id, rollout = next(iter(self.open.items()))
            if now - rollout.last_active < self.idle_s:
                break
            looked += 1
            if rollout.in_flight:
                self.open.move_to_end(trace_id)  # a long request: looked at again after the others
                continue
            del self.open[trace_id]
            self._emit_root(rollout, "idle")
            closed += 1
        return closed

    def close_all(self, reason: str = "shutdown") -> int:
        n = len(self.open)
        while self.open:
            _, rollout = self.open.popitem(last=False)
            self._emit_root(rollout, reason)
        return n

    def reward(self, rollout_id: str, attempt: str | None, body: Any) -> dict[str, Any]:
        """``POST /rollout/{id}/reward``: records the reward (an annotation of the trajectory) and,
        unless ``done`` is false, closes the rollout. Raises :class:`MetaError` naming a bad field."""
        if not isinstance(body, dict):
            raise MetaError("body", "must be a JSON object, e.g. {\"reward\": 1.0}")
        if "reward" not in body:
            raise MetaError("reward", "is required")
        values = {str(k): check_value(str(k), v) for k, v in body.items()}
        done = values.pop("done", True)
        meta: dict[str, Any] = {k: values.pop(k) for k in ("step", "sample_index", "rollout_n", "validate") if k in values}
        trace_id = rollout_trace_id(self.experiment, rollout_id, attempt)
        rollout = self.open.get(trace_id)
        state = "open" if rollout is not None else "unknown"
        if rollout is None:  # never seen here (another replica, a restart, or no request at all): a root of its own
            rollout = self._open(trace_id, rollout_id, attempt)
            done = True
        rollout.apply(meta)
        if done:
            del self.open[trace_id]
            self._emit_root(rollout, "reward")
            state = "closed" if state == "open" else state
        note = SpanRecord("annotation", KIND_ANNOTATION, time.time(), None, {k: v for k, v in values.items() if v is not None})
        note.trace = _TraceRef(trace_id)  # type: ignore[assignment]
        note.end = note.start
        self.emit(note)
        self.rewards += 1
        return {"trace_id": trace_id, "rollout": state}
