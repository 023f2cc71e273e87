"""A gateway's per-node watermarks (service/roles.py NodeMarks) decide when a step may close.

The cluster fault test found a 60 s gateway outage breaking the budgets' exactness: the restarted
gateway reloaded each node's marks as if just heard, took a step's barrier from them (what the nodes
had acknowledged long before the outage), and closed the step as soon as the first node to
reconnect moved on, while another node still held trajectories of it acknowledged during the outage.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from tracecar.collector.service.roles import NodeMarks


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def step(round_: int = 0) -> SimpleNamespace:
    return SimpleNamespace(key=("exp", False, 1), round=round_)


def test_a_step_closes_once_every_node_delivered_what_it_had_acknowledged(tmp_path: Path) -> None:
    clock = Clock()
    marks = NodeMarks(tmp_path / "cluster-nodes.json", silent_s=3.0, lost_s=300.0, clock=clock)
    marks.heard("a", (10, 10))
    marks.heard("b", (20, 15))  # b owes 16..20
    assert not marks.may_close(step())
    marks.heard("b", (25, 20))  # delivered through its barrier (20); what it acknowledged later is not waited for
    assert marks.may_close(step())


def test_a_restarted_gateway_waits_for_each_node_to_report_before_it_takes_a_barrier(tmp_path: Path) -> None:
    path = tmp_path / "cluster-nodes.json"
    clock = Clock()
    before = NodeMarks(path, silent_s=3.0, lost_s=300.0, clock=clock)
    before.heard("a", (10, 10))
    before.heard("b", (10, 10))  # saved: both nodes known, progress as of their first report
    clock.now += 60  # the gateway is down for 60 s; meanwhile b acknowledges through 40 and delivers nothing

    after = NodeMarks(path, silent_s=3.0, lost_s=300.0, clock=clock)
    after.heard("a", (50, 50))  # a reconnects first and moves on: the gateway wants to close the step
    assert not after.may_close(step()), "closed on b's stale marks, b still holds trajectories of the step"
    clock.now += 1
    assert not after.may_close(step())
    after.heard("b", (40, 12))  # b reports: it owes 13..40; the barrier is taken now
    assert not after.may_close(step())
    after.heard("b", (41, 40))
    assert after.may_close(step())


def test_a_silent_node_is_waited_for_until_lost_then_not(tmp_path: Path) -> None:
    clock = Clock()
    marks = NodeMarks(tmp_path / "cluster-nodes.json", silent_s=3.0, lost_s=30.0, clock=clock)
    marks.heard("a", (10, 10))
    marks.heard("b", (10, 10))
    clock.now += 5
    marks.heard("a", (12, 12))
    assert not marks.may_close(step())  # b is silent: it may have acknowledged more since
    clock.now += 30
    marks.heard("a", (12, 12))
    assert marks.may_close(step())  # b left the job: its late trajectories open later rounds
