"""Steps: what the collector knows, in memory, about steps whose spans are held.

A step is (experiment, validate, step, policy version): validation steps reuse training step
numbers, so they are budgeted apart, and fully-async VERL rolls out with step -1 for the whole
run, so there the policy version (the trajectory's ``policy_version`` attribute) is the step;
for every other step the version is None. Per held trajectory only a small summary lives here (:class:`Traj`, a few
slots: ~250 bytes with its dict entry); the spans themselves are rows in the spool. Everything
here is rebuilt from the spool's held rows on start, so nothing is lost with the process.

When a step closes (:meth:`OpenStep.ready`), first match wins:

- ``count``: ``trajectories_per_step`` is set and that many trajectories are complete (at a gateway,
  with those its nodes reported complete and did not send: :attr:`OpenStep.unsent`);
- ``next_step``: every worker that sent spans of the step has since sent a later step of the
  same experiment, and every trajectory is complete;
- ``idle``: no span for ``step_idle_s`` and every trajectory is complete;
- ``decision_wait``: no span for ``decision_wait_s``, complete or not (incomplete ones drop);
- ``held_limit`` / ``shutdown`` are decided by the caller (memory bound, collector stopping).

A trajectory is complete when its root has arrived and either its reward has too or
``reward_wait_s`` has passed since the root (rewards usually come afterwards as annotations).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .decide import Candidate

StepKey = tuple[Any, bool, int, "int | None"]  # (experiment, validate, step, policy version of step -1)
StepOrder = tuple[int, int, int]


def step_order(step: int, version: int | None) -> StepOrder:
    """Sorts a worker's steps: by step, and within step -1 by policy version (none first)."""
    return (step, 0, 0) if version is None else (step, 1, version)


class Traj:
    """Summary of one held trajectory."""

    __slots__ = ("worker", "sample_index", "rollout_n", "has_error", "reward", "reward_key",
                 "root_at", "nbytes", "tokens", "spans")

    def __init__(self, worker: str, sample_index: int | str, rollout_n: int | None) -> None:
        self.worker = worker
        self.sample_index = sample_index
        self.rollout_n = rollout_n
        self.has_error = False
        self.reward: float | None = None
        self.reward_key: tuple[Any, ...] | None = None
        self.root_at: float | None = None
        self.nbytes = 0
        self.tokens = 0
        self.spans = 0

    def set_reward(self, reward: float, key: tuple[Any, ...]) -> bool:
        """Keeps the reward with the greatest key (annotations over the root, then the latest);
        the result does not depend on arrival order. True if the trajectory had no reward."""
        fresh = self.reward is None
        if self.reward_key is None or key > self.reward_key:
            self.reward, self.reward_key = reward, key
        return fresh

    def candidate(self, trace_id: str) -> Candidate:
        return Candidate(trace_id, self.worker, self.sample_index, self.rollout_n, self.has_error,
                         self.reward, self.nbytes, self.tokens, self.root_at is not None)


@dataclass
class Waits:
    reward_wait_s: float
    step_idle_s: float
    decision_wait_s: float


class OpenStep:
    """A step (or a later round of one) whose trajectories are held, awaiting its decision."""

    __slots__ = ("key", "round", "trajs", "workers", "first_at", "last_at", "rooted",
                 "rewarded_rooted", "last_root_at", "expected", "unsent", "unsent_rows")

    def __init__(self, key: StepKey, round_: int, now: float, expected: int | None) -> None:
        self.key = key
        self.round = round_
        self.trajs: dict[str, Traj] = {}
        self.workers: set[str] = set()
        self.first_at = now
        self.last_at = now
        self.rooted = 0
        self.rewarded_rooted = 0
        self.last_root_at = 0.0
        self.expected = expected
        # node collectors sending candidates only (sampling/candidates.py): per node round (its tag), the
        # complete trajectories it did not forward; they count toward ``count`` and a uniform fill's n
        self.unsent: dict[str, int] = {}
        # ... and their summaries (trace id -> [trace id, worker, sample index, rollout, reward, error, bytes, tokens]):
        # one collector would have dropped each on the step's limit; the gateway records that decision too
        self.unsent_rows: dict[str, list[Any]] = {}

    def take_report(self, report: Any) -> None:
        """A node's candidate root's report (sampling/candidates.py UNSENT_ATTR); malformed ones are ignored."""
        if not (isinstance(report, dict) and isinstance(report.get("tag"), str) and type(report.get("n")) is int
                and report["n"] >= 0):
            return
        self.unsent[report["tag"]] = report["n"]
        for row in report.get("rest") or ():
            if isinstance(row, list) and len(row) == 8 and isinstance(row[0], str) and row[0] not in self.trajs:
                self.unsent_rows[row[0]] = row
                if isinstance(row[1], str):  # its worker ran this step: next_step waits for it too
                    self.workers.add(row[1])

    def root_arrived(self, traj: Traj, at: float) -> None:
        if traj.root_at is None:
            traj.root_at = at
            self.rooted += 1
            self.rewarded_rooted += traj.reward is not None
            self.last_root_at = max(self.last_root_at, at)

    def reward_arrived(self, traj: Traj, reward: float, key: tuple[Any, ...]) -> None:
        if traj.set_reward(reward, key) and traj.root_at is not None:
            self.rewarded_rooted += 1

    def rewards_done(self, now: float, waits: Waits) -> bool:
        return self.rewarded_rooted == self.rooted or now - self.last_root_at >= waits.reward_wait_s

    def all_complete(self, now: float, waits: Waits) -> bool:
        return self.rooted == len(self.trajs) and self.rewards_done(now, waits)

    def ready(self, now: float, waits: Waits, latest: dict[tuple[Any, str], StepOrder]) -> str | None:
        """Why the step should be decided now, or None to keep holding it."""
        if self.expected is not None and self.rooted + sum(self.unsent.values()) >= self.expected and self.rewards_done(now, waits):
            return "count"
        complete = self.all_complete(now, waits)
        if complete:
            experiment, _, step, version = self.key
            order = step_order(step, version)
            if all(latest.get((experiment, w), order) > order for w in self.workers):
                return "next_step"
            if now - self.last_at >= waits.step_idle_s:
                return "idle"
        if now - self.last_at >= waits.decision_wait_s:
            return "decision_wait"
        return None


class Loose:
    """A held annotation whose trajectory has not been seen (yet)."""

    __slots__ = ("reward", "reward_key", "nbytes", "spans", "first_at")

    def __init__(self, now: float) -> None:
        self.reward: float | None = None
        self.reward_key: tuple[Any, ...] | None = None
        self.nbytes = 0
        self.spans = 0
        self.first_at = now
