"""Tail: hold the spans of budgeted steps in the spool, decide each step once it closes.

Runs on the spool's single writer thread (ingest writes, decisions and the endpoint's snapshot
all queue there), so routing a span, committing it and deciding its step never race: a span is
either committed before a decision (and is part of it) or routed after it (and follows it).

Routing a span of a tail-budgeted experiment (one with an int ``step`` and an int or string
``sample_index``):

- its step is open → **held** (state HELD in the spool; a small summary in memory);
- its trajectory was decided → follows that verdict: kept → pending (a *late* span, counted
  against the step's volume limits in the same transaction, dropped as ``late_over_budget`` if
  it would exceed one), dropped → not stored;
- its step was decided but this trajectory is new → held in a new *round* of the step, decided
  later against what is left of the step's budget.

Annotations (kind ``annotation``, matched by trace id, no step attributes) join their held
trajectory, follow its verdict, or pass for a trajectory that was never held; one that arrives
before anything of its trajectory is held *loose* until the trajectory shows up, or dropped
(``orphan_annotation``) after ``decision_wait_s`` with nothing of its trajectory seen.

A decision commits, in one SQLite transaction: the ``trajectory_decisions`` rows, the kept
trajectories' rows moved to pending with ``kept_because`` written into each root (and
oversized ones truncated), the dropped trajectories' rows deleted. A restart rebuilds the open
steps from the held rows and later rounds' usage from the decision rows, so counting is exact
across restarts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from ...lru import Lru
from ...settings import CollectorSettings
from ...spool.store import Spool, SpoolRow, WriteResult
from ...types import Span
from .candidates import CANDIDATE, UNSENT_ATTR, choose, decomposable, learn
from .decide import KEPT_MARK_BYTES, Candidate, Prior, Unit, Verdict, decide
from .head import ASYNC_STEP, budget_step
from .policy import Policies
from .steps import Loose, OpenStep, StepKey, StepOrder, Traj, Waits, step_order
from .truncate import truncate_trajectory

log = logging.getLogger("tracecar.collector.selection")

HOLD, PASS, DROP, LATE = "hold", "pass", "drop", "late"
LOCAL = "local"  # a node's span of a trajectory it did not forward (not a candidate): stored here, not owed
_OPTS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY


def _step_key(attrs: dict[str, Any]) -> StepKey:
    """The step a routed span is budgeted under (its policy version only for step -1)."""
    where = budget_step(attrs)
    step, version = where if where is not None else (attrs["step"], None)
    return (attrs.get("experiment_name"), bool(attrs.get("validate")), step, version)


def _decision_row(step: OpenStep, v: Verdict, nbytes: int | None, truncated: bool, why: str,
                  now: float) -> tuple[Any, ...]:
    """One ``trajectory_decisions`` row: the gateway's verdict or a node's choice of candidates (same columns)."""
    experiment, validate, number, version = step.key
    traj = step.trajs[v.trace_id]
    return (v.trace_id, experiment, int(validate), number, step.round, traj.worker, traj.sample_index,
            traj.rollout_n, int(v.keep), v.rule, v.reason, traj.reward, int(traj.has_error),
            traj.nbytes if nbytes is None else nbytes, traj.tokens, int(truncated), why, now, version)


def _number(value: Any) -> float | None:
    return float(value) if type(value) in (int, float) else None


class TailSelector:
    """Holds, tracks and decides the steps of every tail-budgeted experiment."""

    tick_s = 0.2

    def __init__(self, settings: CollectorSettings, spool: Spool, metrics: Any = None,
                 clock: Callable[[], float] = time.time, policies: Policies | None = None) -> None:
        self.policies = policies or Policies(settings)
        self.spool = spool
        self.metrics = metrics
        self.clock = clock
        self.waits = Waits(settings.reward_wait_s, settings.step_idle_s, settings.decision_wait_s)
        # a gateway's guard (service/roles.py NodeMarks): may a step close on next_step / idle / shutdown
        # now, or is a node collector still delivering what it acknowledged? (count, decision_wait and
        # held_limit never wait for it)
        self.may_close: Callable[[OpenStep], bool] = lambda step: True
        self.max_held = settings.max_held_trajectories
        # a node collector sending its gateway candidates only (sampling/candidates.py): it holds the steps the
        # gateway's budget (learned from its heartbeat answers: learn()) decomposes, and forwards its candidates
        self.node_candidates = False
        self.keep_local = settings.keep_forwarded
        self.gateway = settings.role == "gateway"  # reads the candidates' unsent counts
        self.open: dict[StepKey, OpenStep] = {}
        self.trace_step: dict[str, OpenStep] = {}
        self.loose: dict[str, Loose] = {}
        self.latest: dict[tuple[Any, str], StepOrder] = {}
        self.verdicts = Lru(65536)  # trace_id -> kept, for recently decided trajectories
        self.rounds = Lru(4096)  # step key -> last decided round
        self.passed = Lru(65536)  # trace ids stored without holding (for their annotations)
        self._lock = threading.RLock()
        self._rebuild()

    @property
    def holds_any(self) -> bool:
        """Whether this selector may hold spans (a node sending candidates only: once a learned budget decomposes)."""
        return not self.node_candidates or bool(getattr(self.policies, "any_decomposable", False))

    def learn(self, description: Any) -> bool:
        """A node: the gateway's budgets (its heartbeat answer); True when they changed what this node holds."""
        learned = learn(description)
        if learned is None:
            return False
        with self._lock:
            old = getattr(self.policies, "description", None)
            self.policies = learned  # type: ignore[assignment]
        return old != learned.description

    def holding_report(self, progress: Callable[[], tuple[int, int]]) -> dict[str, Any]:
        """A node sending candidates only, for its heartbeat: the steps it holds and how far it has delivered
        *besides* them, read together under the lock its releases take (so no release falls between), and its
        workers' latest steps (the gateway's ``next_step`` sees workers whose trajectories stay here)."""
        with self._lock:
            acked, delivered = progress()
            holding = [list(key) for key in self.open]
            latest = [[experiment, worker, *order] for (experiment, worker), order in self.latest.items()]
        return {"acked": acked, "delivered": delivered, "holding": holding, "latest": latest}

    def merge_latest(self, latest: Any) -> None:
        """A gateway: a node's workers' latest steps (its heartbeat), as if their spans had come here."""
        if not isinstance(latest, list):
            return
        with self._lock:
            for entry in latest[:65536]:
                if not (isinstance(entry, list) and len(entry) == 5 and isinstance(entry[1], str)
                        and all(type(v) is int for v in entry[2:])):
                    continue
                key, order = (entry[0], entry[1]), (entry[2], entry[3], entry[4])
                current = self.latest.get(key)
                if current is None or current < order:
                    self.latest[key] = order
                    if len(self.latest) > 65536:
                        self.latest.pop(next(iter(self.latest)))

    # ---- ingest (writer thread) ----------------------------------------------------------
    def claims(self, span: Span) -> bool:
        """True for spans this selector routes (the rest go through the head sampler)."""
        if span["kind"] == "annotation":
            return self.holds_any
        attrs = span["attributes"]
        if type(attrs.get("step")) is not int or type(attrs.get("sample_index")) not in (int, str):
            return False
        budget = self.policies.get(attrs.get("experiment_name"), attrs.get("validate"))
        return decomposable(budget) if self.node_candidates else budget.mode == "tail"

    def write(self, rows: Sequence[SpoolRow], head_decisions: Sequence[tuple[str, int, bool]] = (),
              head_dropped: Sequence[str] = ()) -> tuple[WriteResult, int]:
        """Routes and commits one batch; returns the spool's result and the spans dropped.

        ``head_dropped``: trace ids the head sampler dropped from this batch, so that their
        annotations (which carry no step) are dropped with them.
        """
        with self._lock:
            now = self.clock()
            for trace_id in head_dropped:
                self.verdicts.put(trace_id, False)
            routes: list[str] = [""] * len(rows)
            batch_passed: set[str] = set()
            for i, row in enumerate(rows):  # trajectories first, so their annotations can follow them
                if row.span["kind"] != "annotation":
                    routes[i] = self._route(row.span) if self.claims(row.span) else PASS
                    if routes[i] == PASS:
                        batch_passed.add(row.span["trace_id"])
            for i, row in enumerate(rows):
                if row.span["kind"] == "annotation":
                    routes[i] = PASS if row.span["trace_id"] in batch_passed else self._route(row.span)
            late = [row for row, route in zip(rows, routes) if route == LATE]
            if self.node_candidates:  # the gateway counts them against its budget, not this node
                late_ids = {r.span["span_id"] for r in late}
            else:
                late_ids = {r.span["span_id"] for r in self._admit_late(late)} if late else set()
            late_dropped = len(late) - len(late_ids)
            dropped = routes.count(DROP)
            stored: list[SpoolRow] = []
            passed: set[int] = set()
            for row, route in zip(rows, routes):  # arrival order kept: it is the forwarding order
                if route == DROP or (route == LATE and row.span["span_id"] not in late_ids) or (
                        route == LOCAL and not self.keep_local):
                    continue
                row.held = route == HOLD
                row.local = route == LOCAL
                if route == PASS:
                    passed.add(id(row))
                stored.append(row)
            result = self.spool.write(stored, head_decisions, now=now, late=late_ids)
            dup = set(result.duplicate_ids)
            fresh = [r for r in stored if r.span["span_id"] not in dup]
            for row in sorted(fresh, key=lambda r: r.span["kind"] == "annotation"):  # trajectories before annotations
                span = row.span
                if not row.held:
                    if id(row) in passed and span["trace_id"] not in self.passed:
                        self.passed.put(span["trace_id"], True)
                    continue
                attrs = span["attributes"]
                where = budget_step(attrs)
                self._observe(
                    span["kind"], span["span_id"], span["trace_id"], span["parent_id"], span["worker"],
                    attrs.get("experiment_name"), attrs.get("validate"), attrs.get("step"), attrs.get("sample_index"),
                    attrs.get("rollout_n"), span["exception"] is not None, _number(attrs.get("reward")),
                    row.size, row.tokens, span["start_time"], now, None if where is None else where[1],
                    attrs.get(UNSENT_ATTR) if self.gateway and span["parent_id"] is None else None,
                )
            if dropped and self.metrics is not None:
                self.metrics.spans_sampled_out.labels(budget="tail").inc(dropped)
            return result, dropped + late_dropped

    def _route(self, span: Span) -> str:
        trace_id = span["trace_id"]
        if trace_id in self.trace_step:
            return HOLD
        verdict = self.verdicts.get(trace_id)
        if verdict is not None:
            return LOCAL if verdict == LOCAL else LATE if verdict else DROP
        if span["kind"] == "annotation":
            if trace_id in self.passed:
                return PASS
            verdict = self.spool.trace_verdict(trace_id)
            if verdict is not None:
                return LATE if verdict else LOCAL if self.node_candidates else DROP
            if self.node_candidates:  # its trajectory may be on another node (a trainer's annotation): the gateway's
                return PASS
            return PASS if self.spool.trace_seen_unheld(trace_id) else HOLD
        attrs = span["attributes"]
        key = _step_key(attrs)
        step = self.open.get(key)
        if step is not None and step.round == 1:
            return HOLD  # nothing of this step was decided yet
        if step is None and self._last_round(key) == 0:
            return HOLD
        verdict = self.spool.trace_verdict(trace_id)
        if verdict is None:
            return HOLD  # a trajectory new to a decided step: its next round
        if not verdict and self.node_candidates:  # a node's decision rows are its candidates; the rest stay here
            self.verdicts.put(trace_id, LOCAL)
            return LOCAL
        self.verdicts.put(trace_id, verdict)
        return LATE if verdict else DROP

    def _admit_late(self, rows: list[SpoolRow]) -> list[SpoolRow]:
        """The late spans of kept trajectories that fit their step's volume limits and the cap."""
        admitted = []
        usage: dict[Any, list[int]] = {}  # step key -> [kept bytes, kept tokens] incl. this batch
        traj_bytes: dict[str, int] = {}
        for row in rows:
            trace_id = row.span["trace_id"]
            known = self.spool.decided_usage(trace_id)
            if known is None:  # cannot happen (kept implies a decision row); forward it
                admitted.append(row)
                continue
            experiment, validate, step, version, nbytes, kept_bytes, kept_tokens = known
            budget = self.policies.get(experiment, validate)
            key = (experiment, validate, step, version)
            step_usage = usage.setdefault(key, [kept_bytes, kept_tokens])
            size = traj_bytes.setdefault(trace_id, nbytes)
            n = row.size
            if ((budget.max_bytes_per_step is not None and step_usage[0] + n > budget.max_bytes_per_step)
                    or (budget.max_tokens_per_step is not None and step_usage[1] + row.tokens > budget.max_tokens_per_step)
                    or (budget.max_trajectory_bytes is not None and size + n > budget.max_trajectory_bytes)):
                if self.metrics is not None:
                    self.metrics.spans_sampled_out.labels(budget="late_over_budget").inc()
                continue
            step_usage[0] += n
            step_usage[1] += row.tokens
            traj_bytes[trace_id] = size + n
            admitted.append(row)
        return admitted

    def _observe(self, kind: str, span_id: str, trace_id: str, parent_id: str | None, worker: str | None,
                 experiment: Any, validate: Any, step: Any, sample_index: Any, rollout_n: Any, has_error: bool,
                 reward: float | None, nbytes: int, tokens: int, start_time: float, now: float,
                 policy_version: int | None = None, unsent: Any = None) -> None:
        """Adds one committed held span to the in-memory summaries (live, or rebuilt on start)."""
        if kind == "annotation":
            key = (1, start_time, span_id)
            open_step = self.trace_step.get(trace_id)
            if open_step is not None:
                joined = open_step.trajs[trace_id]
                joined.nbytes += nbytes
                joined.spans += 1
                open_step.last_at = max(open_step.last_at, now)
                if reward is not None:
                    open_step.reward_arrived(joined, reward, key)
            else:
                waiting = self.loose.get(trace_id)
                if waiting is None:
                    waiting = self.loose[trace_id] = Loose(now)
                waiting.nbytes += nbytes
                waiting.spans += 1
                if reward is not None and (waiting.reward_key is None or key > waiting.reward_key):
                    waiting.reward, waiting.reward_key = reward, key
            return
        worker = worker or ""
        skey: StepKey = (experiment, bool(validate), step, policy_version)
        open_step = self.open.get(skey)
        if open_step is None:
            budget = self.policies.get(experiment, validate)
            open_step = self.open[skey] = OpenStep(skey, self._last_round(skey) + 1, now, budget.trajectories_per_step)
        traj = open_step.trajs.get(trace_id)
        if traj is None:
            traj = open_step.trajs[trace_id] = Traj(worker, sample_index, rollout_n if type(rollout_n) is int else None)
            self.trace_step[trace_id] = open_step
            loose = self.loose.pop(trace_id, None)
            if loose is not None:
                traj.nbytes += loose.nbytes
                traj.spans += loose.spans
                if loose.reward is not None and loose.reward_key is not None:
                    traj.set_reward(loose.reward, loose.reward_key)
        traj.nbytes += nbytes
        traj.tokens += tokens
        traj.spans += 1
        traj.has_error = traj.has_error or has_error
        open_step.workers.add(worker)
        open_step.last_at = max(open_step.last_at, now)
        if parent_id is None:
            traj.worker = worker
            if unsent is not None:  # a node's candidate: what its round did not send (sampling/candidates.py)
                open_step.take_report(unsent)
            if reward is not None:
                open_step.reward_arrived(traj, reward, (0, start_time, span_id))
            open_step.root_arrived(traj, now)
        wkey = (experiment, worker)
        previous = self.latest.get(wkey)
        order = step_order(step, policy_version)
        if previous is None or previous < order:
            self.latest[wkey] = order
            if len(self.latest) > 65536:
                self.latest.pop(next(iter(self.latest)))

    def _last_round(self, key: StepKey) -> int:
        last = self.rounds.get(key)
        if last is None:
            last = self.spool.step_last_round(*key)
            self.rounds.put(key, last)
        return last

    # ---- deciding (writer thread) --------------------------------------------------------
    def tick(self, shutdown: bool = False) -> int:
        """Decides every step that is ready; returns the spans released to forwarding.

        With ``shutdown`` a step is decided as soon as all its trajectories are complete (the
        collector is stopping); steps with incomplete trajectories stay held for the next start.
        """
        with self._lock:
            now = self.clock()
            ready: list[tuple[OpenStep, str]] = []
            for step in self.open.values():
                if shutdown:
                    why = "shutdown" if step.all_complete(now, self.waits) else None
                else:
                    why = step.ready(now, self.waits, self.latest)
                # what depends on what has arrived by now (a node may still hold it): the watermarks decide;
                # a count close too while it rests on the reward wait's expiry (rewards may sit in a node's spool)
                waits_for_arrivals = why in ("next_step", "idle", "shutdown") or (
                    why == "count" and step.rewarded_rooted < step.rooted)
                if waits_for_arrivals and not self.may_close(step):  # TRACECAR_DECISION_WAIT_S still closes it
                    why = "decision_wait" if now - step.last_at >= self.waits.decision_wait_s else None
                if why is not None:
                    ready.append((step, why))
            held = len(self.trace_step) + len(self.loose)
            if held > self.max_held:
                chosen = {id(s) for s, _ in ready}
                held -= sum(len(s.trajs) for s, _ in ready)
                for step in sorted(self.open.values(), key=lambda s: s.first_at):
                    if held <= self.max_held:
                        break
                    if id(step) not in chosen:
                        ready.append((step, "held_limit"))
                        held -= len(step.trajs)
            released = 0
            for step, why in ready:
                released += self._decide(step, why, now)
            released += self._sweep_loose(now, shutdown)
            return released

    def _decide(self, step: OpenStep, why: str, now: float) -> int:
        if self.node_candidates:
            return self._propose(step, why, now)
        experiment, validate, number, version = step.key
        budget = self.policies.get(experiment, validate)
        prior = self._prior(step.key, budget.group_unit) if step.round > 1 else None
        candidates = [traj.candidate(trace_id) for trace_id, traj in step.trajs.items()]
        # fully-async: the version is the step, for the sample hash too (as the head budget does)
        verdicts, _ = decide(candidates, budget, experiment, number if version is None else version, prior,
                             unsent=sum(step.unsent.values()))
        patches, sizes, truncated = self._marks(verdicts, step, budget.max_trajectory_bytes)
        rows = [_decision_row(step, v, sizes.get(v.trace_id), v.trace_id in truncated, why, now) for v in verdicts]
        # what the nodes kept to themselves (not candidates): dropped on the step's one limit, as one collector drops them
        unsent_reason = next(iter(budget.limits()), "not_candidate")
        for trace_id, worker, sample_index, rollout_n, reward, has_error, nbytes, tokens in step.unsent_rows.values():
            rows.append((trace_id, experiment, int(validate), number, step.round, worker, sample_index, rollout_n, 0, None,
                         unsent_reason, reward, int(bool(has_error)), nbytes, tokens, 0, why, now, version))
        kept = [v.trace_id for v in verdicts if v.keep]
        dropped = [v.trace_id for v in verdicts if not v.keep]
        moved, gone, _ = self.spool.release(kept, dropped, rows, patches)
        del self.open[step.key]
        for v in verdicts:
            self.trace_step.pop(v.trace_id, None)
            self.verdicts.put(v.trace_id, v.keep)
        self.rounds.put(step.key, step.round)
        m = self.metrics
        if m is not None:
            m.step_decisions.labels(closed_by=why).inc()
            for v in verdicts:
                if v.keep:
                    m.trajectories_kept.labels(rule=v.rule).inc()
                else:
                    m.trajectories_dropped.labels(reason=v.reason).inc()
            if step.unsent_rows:
                m.trajectories_dropped.labels(reason=unsent_reason).inc(len(step.unsent_rows))
            if truncated:
                m.trajectories_truncated.inc(len(truncated))
            if gone:
                m.spans_sampled_out.labels(budget="tail").inc(gone)
        log.info("step decided", extra={
            "event": "step_decided", "experiment": experiment, "validate": validate, "step": number,
            "policy_version": version, "round": step.round, "closed_by": why, "kept": len(kept), "dropped": len(dropped),
        })
        return moved

    def _marks(self, verdicts: list[Verdict], step: OpenStep, cap: int | None) -> tuple[list[tuple[str, bytes]], dict[str, int], set[str]]:
        """New root payloads carrying ``kept_because`` (and truncated spans over the cap).

        A kept trajectory that cannot be truncated under the cap turns into a drop (``too_large``).
        """
        rule_of = {v.trace_id: v.rule for v in verdicts if v.keep}
        if not rule_of:
            return [], {}, set()
        chance_of = {v.trace_id: v.inclusion_probability for v in verdicts if v.keep and v.inclusion_probability is not None}

        def mark(root: dict[str, Any], trace_id: str) -> None:
            attributes = root.setdefault("attributes", {})
            attributes.pop(UNSENT_ATTR, None)  # a node's report to this gateway (OpenStep.unsent), not the trajectory's
            attributes["kept_because"] = rule_of[trace_id]
            if trace_id in chance_of:  # a uniform fill's draw (decide.uniform_fill): its chance, for re-weighting
                attributes["inclusion_probability"] = chance_of[trace_id]

        big = [t for t in rule_of if cap is not None and step.trajs[t].nbytes + KEPT_MARK_BYTES > cap]
        big_set = set(big)
        small = [t for t in rule_of if t not in big_set]
        patches: list[tuple[str, bytes]] = []
        sizes: dict[str, int] = {}
        truncated: set[str] = set()
        for span_id, trace_id, payload in self.spool.held_payloads(small, roots_only=True):
            root = orjson.loads(payload)
            mark(root, trace_id)
            new = orjson.dumps(root, option=_OPTS)
            patches.append((span_id, new))
            sizes[trace_id] = step.trajs[trace_id].nbytes + len(new) - len(payload)
        if big:
            by_trace: dict[str, list[tuple[str, bytes]]] = {}
            for span_id, trace_id, payload in self.spool.held_payloads(big, roots_only=False):
                by_trace.setdefault(trace_id, []).append((span_id, payload))
            for trace_id in big:
                stored = by_trace.get(trace_id, [])
                spans = [orjson.loads(p) for _, p in stored]
                root = next((s for s in spans if s["span_id"] == trace_id), None)
                if root is None:
                    continue
                mark(root, trace_id)
                assert cap is not None
                original = {sid: p for sid, p in stored}
                measured = sum(len(orjson.dumps(s, option=_OPTS)) for s in spans)
                if measured <= cap:
                    new = orjson.dumps(root, option=_OPTS)
                    patches.append((trace_id, new))
                    sizes[trace_id] = step.trajs[trace_id].nbytes + len(new) - len(original[trace_id])
                    continue
                result = truncate_trajectory(spans, cap, trace_id)
                if result is None:
                    for v in verdicts:
                        if v.trace_id == trace_id:
                            v.keep, v.rule, v.reason = False, None, "too_large"
                    continue
                changed = result[0]
                size = sum(len(p) for sid, p in stored if sid not in changed) + sum(len(p) for p in changed.values())
                if size > cap:  # stored bytes are what counts; never exceed the cap
                    for v in verdicts:
                        if v.trace_id == trace_id:
                            v.keep, v.rule, v.reason = False, None, "too_large"
                    continue
                patches.extend(changed.items())
                sizes[trace_id] = size
                truncated.add(trace_id)
        return patches, sizes, truncated

    def _propose(self, step: OpenStep, why: str, now: float) -> int:
        """A node's round closed: its candidates go to the gateway (pending on its cursor), marked with what the
        round did not send; the rest stay in this node's store (done: not owed), or go with TRACECAR_KEEP_FORWARDED=false."""
        experiment, validate, number, version = step.key
        budget = self.policies.get(experiment, validate)
        candidates = [traj.candidate(trace_id) for trace_id, traj in step.trajs.items()]
        verdicts, unsent = choose(candidates, budget, experiment, number if version is None else version)
        sent = [v.trace_id for v in verdicts if v.keep]
        kept_here = [v.trace_id for v in verdicts if not v.keep]
        rest = [[c.trace_id, c.worker, c.sample_index, c.rollout_n, c.reward, int(c.has_error), c.nbytes, c.tokens]
                for c, v in zip(candidates, verdicts) if not v.keep]
        roots = self.spool.held_payloads(sent, roots_only=True)
        patches = []
        for i, (span_id, _, payload) in enumerate(roots):  # the summaries of what stays here, spread over the roots
            root = orjson.loads(payload)
            # one tag per node round (its least trace id): the gateway counts each round's n once
            root.setdefault("attributes", {})[UNSENT_ATTR] = {"tag": min(step.trajs), "n": unsent,
                                                              "rest": rest[i::len(roots)]}
            patches.append((span_id, orjson.dumps(root, option=_OPTS)))
        rows = [_decision_row(step, v, None, False, why, now) for v in verdicts]
        local, dropped = (kept_here, []) if self.keep_local else ([], kept_here)
        moved, gone, _ = self.spool.release(sent, dropped, rows, patches, local=local)
        del self.open[step.key]
        for v in verdicts:
            self.trace_step.pop(v.trace_id, None)
            self.verdicts.put(v.trace_id, True if v.keep else LOCAL)
        self.rounds.put(step.key, step.round)
        if self.metrics is not None:
            self.metrics.step_decisions.labels(closed_by=why).inc()
            self.metrics.node_candidates.labels(sent="true").inc(len(sent))
            self.metrics.node_candidates.labels(sent="false").inc(len(kept_here))
        log.info("node round proposed", extra={
            "event": "node_candidates", "experiment": experiment, "validate": validate, "step": number,
            "policy_version": version, "round": step.round, "closed_by": why, "sent": len(sent),
            "kept_here": len(kept_here), "rule": CANDIDATE,
        })
        return moved

    def _prior(self, key: StepKey, group_unit: bool) -> Prior:
        """What earlier rounds of this step kept, from the decision rows (exact after a restart)."""
        prior = Prior()
        rule_units: dict[str, set[Any]] = {}
        groups: dict[Any, bool] = {}
        for row in self.spool.step_decisions(key[0], key[1], key[2], key[3], any_version=False):
            c = Candidate(row["trace_id"], row["worker"] or "", row["sample_index"], row["rollout_n"],
                          bool(row["has_error"]), row["reward"], row["nbytes"], row["tokens"], True)
            if row["keep"]:
                unit = Unit([c], (), row["nbytes"], row["tokens"])
                prior.usage.add(unit)
                if row["rule"] == "error":
                    prior.error_usage.add(unit)
                rule_units.setdefault(row["rule"], set()).add(row["sample_index"] if group_unit else row["trace_id"])
                groups[row["sample_index"]] = True
            elif row["reason"] != "incomplete":
                groups.setdefault(row["sample_index"], False)
        prior.rule_units = {rule: len(units) for rule, units in rule_units.items()}
        prior.groups = groups if group_unit else {}
        return prior

    def _sweep_loose(self, now: float, shutdown: bool) -> int:
        """Settles held annotations whose trajectory turned out not to be held, or never came.

        One whose trajectory was stored without holding (no tail budget) is forwarded. One that
        waited ``decision_wait_s`` (or is among the oldest beyond ``max_held_trajectories``) with
        nothing of its trajectory seen is dropped (counted as ``orphan_annotation``): forwarding it
        could leak a reward of a trajectory dropped later, or bytes no budget counted. A trajectory
        is decided only after its loose annotations joined it, so a loose annotation never finds
        its trajectory already decided.
        """
        if not self.loose:
            return 0
        keep: list[str] = []
        drop: list[str] = []
        excess = len(self.loose) - self.max_held  # memory bound: the oldest go first
        for trace_id, loose in self.loose.items():
            if trace_id in self.passed:
                keep.append(trace_id)
            elif excess > 0 or now - loose.first_at >= self.waits.decision_wait_s:
                (keep if self.spool.trace_seen_unheld(trace_id) else drop).append(trace_id)
            excess -= 1
        if not keep and not drop:
            return 0
        moved, gone, _ = self.spool.release(keep, drop)
        for trace_id in keep + drop:
            del self.loose[trace_id]
        if gone and self.metrics is not None:
            self.metrics.spans_sampled_out.labels(budget="orphan_annotation").inc(gone)
        return moved

    # ---- restart and inspection ----------------------------------------------------------
    def _rebuild(self) -> None:
        """Rebuilds open steps and loose annotations from the spool's held rows."""
        for experiment, worker, step, version in self.spool.latest_decided_steps():
            if worker is not None and step is not None:
                order, current = step_order(step, version), self.latest.get((experiment, worker))
                if current is None or order > current:
                    self.latest[(experiment, worker)] = order
        rows = self.spool.held_rows()
        for want_annotations in (False, True):
            for (span_id, trace_id, parent_id, kind, worker, experiment, validate, step, sample_index, rollout_n,
                 has_error, reward, nbytes, tokens, received_at, start_time, policy_version) in rows:
                if (kind == "annotation") != want_annotations:
                    continue
                if kind != "annotation" and (step is None or sample_index is None):
                    continue  # not held by this selector's routing (cannot happen; be safe)
                self._observe(kind, span_id, trace_id, parent_id, worker, experiment, validate, step, sample_index,
                              rollout_n, bool(has_error), reward, nbytes, tokens or 0, start_time, received_at,
                              policy_version if step == ASYNC_STEP else None)
        if self.gateway and self.trace_step:  # the nodes' candidates' unsent counts live in their roots
            for _, trace_id, payload in self.spool.held_payloads(list(self.trace_step), roots_only=True):
                unsent = orjson.loads(payload).get("attributes", {}).get(UNSENT_ATTR)
                if unsent is not None:
                    self.trace_step[trace_id].take_report(unsent)
        if rows:
            log.info("held steps rebuilt", extra={"event": "held_rebuilt", "open_steps": len(self.open),
                                                  "held_trajectories": len(self.trace_step), "loose": len(self.loose)})

    def describe(self, experiment: Any, step: int, validate: bool | None) -> list[dict[str, Any]]:
        """The open (held, undecided) rounds of a step, for the decisions endpoint."""
        with self._lock:
            now = self.clock()
            out = []
            for key, open_step in self.open.items():
                if key[0] != experiment or key[2] != step or (validate is not None and key[1] != validate):
                    continue
                out.append({
                    "validate": key[1], "policy_version": key[3], "round": open_step.round, "held_trajectories": len(open_step.trajs),
                    "with_root": open_step.rooted, "with_reward": sum(t.reward is not None for t in open_step.trajs.values()),
                    "workers": sorted(open_step.workers), "idle_s": round(now - open_step.last_at, 3),
                    "held_spans": sum(t.spans for t in open_step.trajs.values()),
                    "held_bytes": sum(t.nbytes for t in open_step.trajs.values()),
                })
            return out

    @property
    def held_trajectories(self) -> int:
        return len(self.trace_step)
