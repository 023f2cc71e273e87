"""Builders for the sampling tests: trajectories as the client emits them, rows, a fake clock."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from tracecar.collector.processors.sampling import Candidate, TailSelector
from tracecar.collector.settings import CollectorSettings
from tracecar.collector.spool.store import HELD, Spool, SpoolRow

_ids = itertools.count(1)


def new_id() -> str:
    return f"{next(_ids):032x}"


@dataclass
class Spec:
    """One trajectory to emit."""

    step: int
    sample_index: int
    rollout_n: int = 0
    worker: str = "w0"
    experiment: str = "exp"
    validate: bool = False
    children: int = 2
    error: bool = False
    reward: float | None = None
    root: bool = True
    payload: int = 100
    tokens: int = 0
    trace_id: str = ""
    policy_version: int | None = None  # fully-async VERL (step -1): the step is the policy version

    def __post_init__(self) -> None:
        if not self.trace_id:
            self.trace_id = new_id()


def spans_of(spec: Spec) -> list[dict[str, Any]]:
    """Children first (as they finish), then the root, then the reward annotation."""
    attrs = {"step": spec.step, "sample_index": spec.sample_index, "rollout_n": spec.rollout_n,
             "validate": spec.validate, "experiment_name": spec.experiment}
    if spec.policy_version is not None:
        attrs["policy_version"] = spec.policy_version
    base = {"worker": spec.worker, "project": None, "entity": None}
    out = []
    for i in range(spec.children):
        sid = f"{spec.trace_id}-c{i + 1}"
        out.append({**base, "span_id": sid, "trace_id": spec.trace_id, "parent_id": spec.trace_id, "name": "Tool.execute",
                    "kind": "op", "start_time": 1000.0 + i, "end_time": 1000.5 + i, "attributes": attrs,
                    "inputs": {"blob": "x" * spec.payload}, "output": {"token_ids": list(range(spec.tokens))} if i == 0 else None,
                    "exception": "ToolError: failed" if spec.error and i == 0 else None})
    if spec.root:
        out.append({**base, "span_id": spec.trace_id, "trace_id": spec.trace_id, "parent_id": None, "name": "agent_loop",
                    "kind": "trajectory", "start_time": 999.0, "end_time": 1010.0, "attributes": attrs, "inputs": {},
                    "output": None, "exception": None})
    if spec.reward is not None:
        out.append({**base, "span_id": f"{spec.trace_id}-reward", "trace_id": spec.trace_id, "parent_id": None,
                    "name": "annotation", "kind": "annotation", "start_time": 1011.0, "end_time": 1011.0,
                    "attributes": {"reward": spec.reward}, "inputs": {}, "output": None, "exception": None})
    return out


def row_of(span: dict[str, Any]) -> SpoolRow:
    output = span.get("output")
    tokens = len(output["token_ids"]) if isinstance(output, dict) and "token_ids" in output else 0
    return SpoolRow(span, orjson.dumps(span), None, tokens=tokens)


def candidate_of(spec: Spec) -> Candidate:
    """The summary the selector should build for ``spec`` (what decide() sees)."""
    spans = spans_of(spec)
    return Candidate(spec.trace_id, spec.worker, spec.sample_index, spec.rollout_n, spec.error, spec.reward,
                     sum(len(orjson.dumps(s)) for s in spans), spec.tokens if spec.children else 0, spec.root)


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def settings(tmp: Path, **overrides: Any) -> CollectorSettings:
    overrides.setdefault("reward_wait_s", 1.0)
    overrides.setdefault("step_idle_s", 10.0)
    overrides.setdefault("decision_wait_s", 100.0)
    return CollectorSettings(data_dir=tmp, backend="local", **overrides)


class Harness:
    """A TailSelector on a real spool file, fed rows directly, on a fake clock."""

    def __init__(self, tmp: Path, local_only: bool = False, **overrides: Any) -> None:
        self.tmp = tmp
        self.local_only = local_only
        self.settings = settings(tmp, **overrides)
        self.clock = Clock()
        self.open()

    def open(self) -> None:
        self.spool = Spool(self.settings.spool_path, local_only=self.local_only, sync="normal")
        self.selector = TailSelector(self.settings, self.spool, clock=self.clock)

    def restart(self) -> None:
        self.spool.close()
        self.open()

    def feed(self, spans: list[dict[str, Any]]) -> int:
        """Writes one batch; returns the spans dropped at routing."""
        return self.selector.write([row_of(s) for s in spans])[1]

    def settle(self, seconds: float = 10_000.0) -> int:
        self.clock.advance(seconds)
        return self.selector.tick()

    def rows(self) -> list[dict[str, Any]]:
        return self.spool.query("SELECT span_id, trace_id, parent_id, kind, state, nbytes, tokens, payload FROM spans")

    def kept_roots(self) -> dict[str, dict[str, Any]]:
        """trace_id -> forwarded root span (state pending/done), parsed."""
        return {r["trace_id"]: orjson.loads(r["payload"]) for r in self.rows()
                if r["span_id"] == r["trace_id"] and r["state"] != HELD}

    def close(self) -> None:
        self.spool.close()
