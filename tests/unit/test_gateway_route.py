"""Rendezvous routing of a node's spans over several gateways (collector/exporters/gateway_route.py)."""

from __future__ import annotations

import sqlite3
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest

from tracecar.collector.exporters.gateway_route import GatewayRouter, exporter_name, gateway_identity, owner, route_key
from tracecar.collector.spool.store import Spool, SpoolRow

GATEWAYS = [f"http://10.0.0.{i}:4318" for i in range(1, 5)]
KEYS = [route_key(f"exp{e}", False, s) for e in range(5) for s in range(-1, 120)]


def test_a_steps_training_and_validation_rollouts_share_one_gateway() -> None:
    """One gateway answers for a whole step (viewer/federation.py): validate does not split the key."""
    assert route_key("exp", True, 3) == route_key("exp", False, 3) != route_key("exp", False, 4)
    assert route_key("exp", True, 3) != route_key("other", True, 3)


def test_adding_a_gateway_moves_only_the_keys_it_wins_and_about_its_share() -> None:
    before = {k: GATEWAYS[owner(k, GATEWAYS)] for k in KEYS}
    grown = [*GATEWAYS, "http://10.0.0.9:4318"]
    after = {k: grown[owner(k, grown)] for k in KEYS}
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(after[k] == grown[-1] for k in moved)  # a key moves to the new gateway or stays
    assert 0.1 < len(moved) / len(KEYS) < 0.3  # about 1/5 of them
    removed = GATEWAYS[1:]
    shrunk = {k: removed[owner(k, removed)] for k in KEYS}
    assert all(shrunk[k] == before[k] for k in KEYS if before[k] != GATEWAYS[0])  # only the removed one's keys move
    assert min(Counter(before.values()).values()) > len(KEYS) / len(GATEWAYS) / 2  # balanced enough


def test_the_order_and_spelling_of_the_list_do_not_change_owners() -> None:
    shuffled = [GATEWAYS[2], GATEWAYS[0], GATEWAYS[3], GATEWAYS[1]]
    spelled = [g.upper().replace("HTTP", "http") + "/" for g in shuffled]
    for key in KEYS:
        want = GATEWAYS[owner(key, GATEWAYS)]
        assert shuffled[owner(key, shuffled)] == want
        assert gateway_identity(spelled[owner(key, [gateway_identity(g) for g in spelled])]) == gateway_identity(want)
    assert exporter_name("HTTP://GW-1.example:4318/") == "gateway@gw-1.example:4318"


def _span(span_id: str, trace: str, kind: str = "op", route: str | None = None, **attrs: object) -> SpoolRow:
    s: dict[str, Any] = {"span_id": span_id, "trace_id": trace, "parent_id": None, "name": "agent_loop", "kind": kind,
                         "start_time": 1.0, "end_time": 2.0, "attributes": attrs, "inputs": {}, "output": None,
                         "exception": None, "worker": "w0", "project": "p", "entity": "e"}
    if route is not None:
        s["route"] = route
    return SpoolRow(s, orjson.dumps(s), None)  # type: ignore[arg-type]


def _spool(path: Path, gateways: list[str], *others: str) -> Spool:
    router = GatewayRouter(gateways)
    return Spool(path, local_only=False, exporters=[*router.names, *others], routing=router)


def _owed(spool: Spool) -> dict[str, list[str]]:
    """span id -> the exporters that owe it (sorted)."""
    out: dict[str, list[str]] = {}
    for r in spool.query("SELECT s.span_id, d.exporter FROM deliveries d JOIN spans s ON s.seq = d.seq ORDER BY d.exporter"):
        out.setdefault(r["span_id"], []).append(r["exporter"])
    return out


def _name(key: str, gateways: list[str]) -> str:
    return exporter_name(gateways[owner(key, [gateway_identity(g) for g in gateways])])


STEP3 = {"experiment_name": "exp", "validate": False, "step": 3}


def test_a_step_stays_whole_and_spans_without_a_step_follow_their_trajectory(tmp_path: Path) -> None:
    spool = _spool(tmp_path / "s.db", GATEWAYS, "weave")
    spool.write([_span("old-root", "t-old", experiment_name="exp", validate=False, step=7)])
    spool.write([_span("t1-root", "t1", **STEP3), _span("t2-root", "t2", **STEP3), _span("t1-ann", "t1", "annotation", reward=1.0),
                 _span("t-old-ann", "t-old", "annotation", reward=0.5),
                 _span("carried", "t-away", "annotation", route=orjson.dumps(["exp", True, 9]).decode()),
                 _span("none-ann", "t-none", "annotation"), _span("none-op", "t-none")])
    owed = _owed(spool)
    step3 = _name(route_key("exp", False, 3) or "", GATEWAYS)
    assert owed["t1-root"] == owed["t2-root"] == owed["t1-ann"] == [step3, "weave"]  # a step, its annotation
    assert owed["t-old-ann"] == [_name(route_key("exp", False, 7) or "", GATEWAYS), "weave"]  # read from the spool
    assert owed["carried"] == [_name(route_key("exp", True, 9) or "", GATEWAYS), "weave"]  # the trainer's route
    assert owed["none-ann"] == owed["none-op"] == [_name("trace:t-none", GATEWAYS), "weave"]  # by its trace id, whole
    assert route_key("exp", None, 3) == route_key("exp", False, 3) and route_key("exp", True, "3") is None


def test_an_owner_is_decided_once_whatever_arrives_or_restarts_later(tmp_path: Path) -> None:
    """A span without a step, owed before its trajectory arrived, keeps its owner: a later span, a restart,
    the trajectory's spans leaving the spool never send it to a second gateway, or to none."""
    path = tmp_path / "s.db"
    spool = _spool(path, GATEWAYS)
    trace = next(f"t{i}" for i in range(100)
                 if _name(f"trace:t{i}", GATEWAYS) != _name(route_key("exp", False, 3) or "", GATEWAYS))
    spool.write([_span("early", trace, "annotation", reward=1.0)])
    spool.write([_span("root", trace, **STEP3), _span("late", trace, "annotation", reward=2.0)])
    before = _owed(spool)
    assert before["early"] == [_name(f"trace:{trace}", GATEWAYS)]  # all it could know when owed
    assert before["root"] == before["late"] == [_name(route_key("exp", False, 3) or "", GATEWAYS)]
    taken = {name: [r[0] for r in spool.next_pending(100, name)] for name in spool.exporters}
    assert sorted(seq for seqs in taken.values() for seq in seqs) == [1, 2, 3]  # each span to one gateway
    owner_of_root = before["root"][0]
    spool.mark_forwarded(taken[owner_of_root], keep=False, exporter=owner_of_root)  # the trajectory leaves the spool
    reopened = _spool(path, list(reversed(GATEWAYS)))  # a restart, the list in another order
    assert _owed(reopened) == {"early": before["early"]}
    assert reopened.pending_count == 1 and reopened.owed_count(before["early"][0]) == 1


def test_a_changed_gateway_list_owes_each_pending_span_again_to_one_owner(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    spool = _spool(path, GATEWAYS, "weave")
    spool.write([_span(f"s{step}", f"t{step}", experiment_name="exp", validate=False, step=step) for step in range(40)])
    gone = exporter_name(GATEWAYS[0])
    first = [r[0] for r in spool.next_pending(5, gone)]
    spool.mark_forwarded(first, keep=True, exporter=gone)  # five delivered to the gateway that leaves
    delivered = {r["span_id"] for r in spool.query(f"SELECT span_id FROM spans WHERE seq IN ({','.join('?' * 5)})", first)}
    shrunk = [*GATEWAYS[1:], "http://10.0.0.9:4318"]
    reopened = _spool(path, shrunk, "weave")
    owed = _owed(reopened)
    for step in range(40):
        want = _name(route_key("exp", False, step) or "", shrunk)
        if f"s{step}" in delivered:
            assert owed[f"s{step}"] == ["weave"]  # the gone gateway had it: not sent to another
        else:
            assert owed[f"s{step}"] == sorted([want, "weave"])  # one owner in the new list
    moved = [s for s in range(40) if _name(route_key("exp", False, s) or "", GATEWAYS) == gone and f"s{s}" not in delivered]
    assert moved  # the gone gateway still owed these: now its survivors or the new one do
    counts = Counter(name for names in owed.values() for name in names)
    assert {name: reopened.owed_count(name) for name in reopened.exporters} == {n: counts.get(n, 0) for n in reopened.exporters}


def test_a_span_is_dead_when_its_owner_and_every_other_exporter_refused_it(tmp_path: Path) -> None:
    spool = _spool(tmp_path / "s.db", GATEWAYS[:2])
    spool.write([_span("a", "ta", **STEP3)])
    name = _owed(spool)["a"][0]
    (seq, *_), = spool.next_pending(10, name)
    spool.mark_dead([(seq, "a", "ta", "agent_loop", "refused")], name, keep=True)
    assert spool.query("SELECT state FROM spans")[0]["state"] == 2  # dead: its one gateway refused it
    assert spool.pending_count == 0


def test_names_and_urls_a_node_refuses_or_folds() -> None:
    from tracecar.collector.service.roles import gateway_url_problem

    assert exporter_name("http://gw") == exporter_name("http://GW:80/") == "gateway@gw:80"  # one gateway, one cursor
    assert gateway_identity("http://gw") == gateway_identity("http://gw:80")
    assert "user or password" in (gateway_url_problem("http://user:secret@gw:1") or "")


def test_a_node_learns_budgets_once_every_gateway_answered_the_same() -> None:
    from tracecar.collector.service.roles import BudgetsAgreement

    learned: list[object] = []
    agreement = BudgetsAgreement(["gateway@a:1", "gateway@b:1"], learned.append)
    agreement.heard("gateway@a:1", {"k": 1})
    assert learned == []  # one answer is not an agreement
    agreement.heard("gateway@b:1", {"k": 2})
    assert learned == [] and agreement.disagree
    agreement.heard("gateway@b:1", {"k": 1})
    assert learned == [{"k": 1}] and not agreement.disagree


def test_held_and_awaiting_spans_are_owed_to_their_steps_gateway_when_released(tmp_path: Path) -> None:
    """A tail budget's held spans and an engine span awaiting its trajectory are owed when released, to the
    gateway of the step they then carry (an engine span joined to its call takes the call's step)."""
    from tracecar.collector.spool.store import PENDING

    spool = _spool(tmp_path / "s.db", GATEWAYS, "weave")
    steps = [s for s in range(40) if _name(route_key("exp", False, s) or "", GATEWAYS) != _name("trace:engine", GATEWAYS)]
    held_step, joined_step = steps[0], steps[1]
    spool.write([SpoolRow({**_span("h-root", "th", experiment_name="exp", validate=False, step=held_step).span},
                          _span("h-root", "th").payload, None, held=True),
                 SpoolRow(_span("h-ann", "th", "annotation").span, _span("h-ann", "th", "annotation").payload, None, held=True),
                 SpoolRow(_span("engine", "tengine").span, _span("engine", "tengine").payload, None, awaiting=True)])
    assert _owed(spool) == {}  # neither is owed yet
    spool.release(["th"], [])

    def joined(payload: dict[str, Any]) -> tuple[tuple[Any, ...], bytes, int, int]:
        payload.update(trace_id="tj", attributes={"experiment_name": "exp", "validate": False, "step": joined_step})
        return ("tj", None, "w0", "p", "e", "exp", joined_step, None, None, 0), orjson.dumps(payload), 0, 0

    spool.settle_awaiting("tengine", PENDING, joined)
    owed = _owed(spool)
    held_gateway = _name(route_key("exp", False, held_step) or "", GATEWAYS)
    assert owed["h-root"] == owed["h-ann"] == [held_gateway, "weave"]
    assert owed["engine"] == [_name(route_key("exp", False, joined_step) or "", GATEWAYS), "weave"]  # not its own trace's
    counts = Counter(name for names in owed.values() for name in names)
    assert {name: spool.owed_count(name) for name in spool.exporters} == {n: counts.get(n, 0) for n in spool.exporters}


def test_a_gateway_down_holds_back_only_its_own_share(tmp_path: Path) -> None:
    spool = _spool(tmp_path / "s.db", GATEWAYS[:2])
    spool.write([_span(f"s{step}", f"t{step}", experiment_name="exp", validate=False, step=step) for step in range(30)])
    down, up = spool.exporters
    while rows := spool.next_pending(7, up):
        spool.mark_forwarded([r[0] for r in rows], keep=False, exporter=up)
    assert spool.owed_count(up) == 0 and spool.owed_count(down) == spool.pending_count > 0  # the rest is the down one's
    assert spool.pending_count == sum(1 for s in range(30) if _name(route_key("exp", False, s) or "", GATEWAYS[:2]) ==
                                      down)


def test_from_two_gateways_to_one_the_spans_either_took_are_not_sent_again(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    spool = _spool(path, GATEWAYS[:2], "weave")
    spool.write([_span(f"s{step}", f"t{step}", experiment_name="exp", validate=False, step=step) for step in range(30)])
    taken = {r[0] for r in spool.next_pending(100, spool.exporters[1])}
    spool.mark_forwarded(sorted(taken), keep=True, exporter=spool.exporters[1])  # still pending: weave owes them
    one = Spool(path, local_only=False, exporters=["gateway", "weave"])  # TRACECAR_GATEWAY_URL lists one now
    owed_to_one = {r["seq"] for r in one.query("SELECT seq FROM deliveries WHERE exporter = 'gateway'")}
    assert owed_to_one and not owed_to_one & taken
    assert one.owed_count("gateway") == 30 - len(taken) and one.owed_count("weave") == 30


def test_a_spool_of_read_time_routing_keeps_each_spans_owner_row_alone(tmp_path: Path) -> None:
    """Spools written by 6489206–6a1227e owed every span to every gateway (each forwarder passed over the
    others'): reopened, a span keeps its owner's row, or none when its owner took it already."""
    from tracecar.collector.spool import deliveries

    path = tmp_path / "s.db"
    names = [exporter_name(g) for g in GATEWAYS[:2]]
    old = Spool(path, local_only=False, exporters=[*names, "weave"])  # no routing: every exporter owes every span
    old.write([_span(f"s{step}", f"t{step}", experiment_name="exp", validate=False, step=step) for step in range(20)])
    first = names[0]
    mine = [r[0] for r in old.next_pending(100, first)
            if _name(route_key("exp", False, r[0] - 1) or "", GATEWAYS[:2]) == first][:3]
    old.mark_forwarded(mine, keep=True, exporter=first)  # the owner delivered three
    old.query("SELECT 1")  # (reads still work)
    old._write.execute("DELETE FROM spool_meta WHERE key = ?", (deliveries.ONE_GATEWAY_A_SPAN,))  # as that code left it
    reopened = _spool(path, GATEWAYS[:2], "weave")
    owed = _owed(reopened)
    for step in range(20):
        gateways = [n for n in owed[f"s{step}"] if n != "weave"]
        want = [] if step + 1 in mine else [_name(route_key("exp", False, step) or "", GATEWAYS[:2])]
        assert gateways == want, step


@pytest.mark.skipif(not hasattr(sqlite3.Connection, "setlimit"), reason="Connection.setlimit: Python 3.11+")
def test_batches_of_many_stepless_traces_stay_within_sqlites_oldest_variable_limit(tmp_path: Path) -> None:
    spool = _spool(tmp_path / "s.db", GATEWAYS)
    spool._write.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 999)  # SQLite before 3.32
    spool.write([_span(f"a{i}", f"t{i}", "annotation") for i in range(1200)])
    assert sum(spool.owed_count(n) for n in spool.exporters) == 1200
