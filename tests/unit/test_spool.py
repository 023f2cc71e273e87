"""collector/spool/store.py: write once (dedupe), pending -> done / deleted / dead, counters that follow the commits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from tracecar.collector.spool.store import Spool, SpoolRow


def span(span_id: str, **attributes: Any) -> dict[str, Any]:
    return {"span_id": span_id, "trace_id": span_id, "parent_id": None, "name": "agent_loop", "kind": "trajectory",
            "start_time": 1.0, "end_time": 2.0, "attributes": attributes, "inputs": {}, "output": None, "exception": None,
            "worker": "w0", "project": "p", "entity": "e"}


def row(span_id: str, **attributes: Any) -> SpoolRow:
    s = span(span_id, **attributes)
    return SpoolRow(s, orjson.dumps(s), None)


def states(spool: Spool) -> dict[str, int]:
    return {r["span_id"]: r["state"] for r in spool.query("SELECT span_id, state FROM spans")}


def test_a_span_id_is_written_once_and_the_duplicates_are_named(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s.db", local_only=False)
    first = spool.write([row("a"), row("b")])
    again = spool.write([row("b"), row("c")])
    assert (first.inserted, first.duplicates) == (2, 0)
    assert (again.inserted, again.duplicates, again.duplicate_ids) == (1, 1, ["b"])
    assert spool.pending_count == 3 and spool.pending_bytes == sum(len(row(s).payload) for s in "abc")


def test_pending_rows_come_oldest_first_and_leave_as_done_deleted_or_dead(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s.db", local_only=False)
    spool.write([row(s) for s in "abcd"])
    pending = spool.next_pending(10)
    seqs = [seq for seq, *_ in pending]
    assert [orjson.loads(p)["span_id"] for _, p, *_ in pending] == ["a", "b", "c", "d"] and seqs == sorted(seqs)
    spool.mark_forwarded(seqs[:1], keep=True)   # a: forwarded, kept in the store
    spool.mark_forwarded(seqs[1:2], keep=False)  # b: forwarded, deleted
    spool.mark_dead([(seqs[2], "c", "c", "agent_loop", "422: invalid call")])
    assert states(spool) == {"a": 1, "c": 2, "d": 0}
    assert [r["span_id"] for r in spool.dead_letters()] == ["c"] and spool.dead_count() == 1
    assert spool.dead_letters()[0]["reason"] == "422: invalid call"
    assert [orjson.loads(p)["span_id"] for _, p, *_ in spool.next_pending(10)] == ["d"]
    assert spool.pending_count == 1


def test_finishing_twice_changes_nothing_the_second_time(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s.db", local_only=False)
    spool.write([row("a"), row("b")])
    seqs = [seq for seq, *_ in spool.next_pending(10)]
    spool.mark_forwarded(seqs, keep=True)
    spool.mark_forwarded(seqs, keep=False)  # no longer pending: neither deleted nor counted again
    assert states(spool) == {"a": 1, "b": 1} and spool.pending_count == 0 and spool.pending_bytes == 0


def test_the_local_store_stores_done_and_counts_survive_a_reopen(tmp_path: Path) -> None:
    local = Spool(tmp_path / "local.db", local_only=True)
    local.write([row("a", step=3, sample_index=1)])
    assert states(local) == {"a": 1} and local.pending_count == 0 and local.next_pending(10) == []
    (indexed,) = local.query("SELECT step, sample_index, worker FROM spans")
    assert indexed == {"step": 3, "sample_index": 1, "worker": "w0"}
    local.close()

    forwarding = Spool(tmp_path / "fwd.db", local_only=False)
    forwarding.write([row("x"), row("y")])
    counts = (forwarding.pending_count, forwarding.pending_bytes)
    forwarding.close()
    reopened = Spool(tmp_path / "fwd.db", local_only=False)
    assert (reopened.pending_count, reopened.pending_bytes) == counts and counts[0] == 2


def test_a_deleted_span_stays_a_duplicate_within_the_forgotten_ids_bound(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s.db", local_only=False)
    spool.write([row(s) for s in ("a", "b", "c")])
    spool.mark_forwarded([seq for seq, *_ in spool.next_pending(10)], keep=False)  # forwarded, then deleted
    assert states(spool) == {}
    again = spool.write([row("a"), row("d")])
    assert (again.inserted, again.duplicate_ids) == (1, ["a"])  # a resend is no new span
    assert spool.trim_forgotten(2) == 1  # above the bound the oldest id goes (5 % of the bound more, here none)
    assert spool.write([row("a")]).inserted == 1 and spool.write([row("c")]).duplicates == 1


def test_a_trajectorys_head_decision_is_kept_apart_from_the_per_sample_ones(tmp_path: Path) -> None:
    from tracecar.collector.spool.store import TRACE_DECISIONS

    spool = Spool(tmp_path / "s.db", local_only=False)
    spool.write([row("a")], [("exp\x1f1\x1fw0", 0, True), (TRACE_DECISIONS, "t-kept", True), (TRACE_DECISIONS, "t-dropped", False)])
    assert spool.load_decisions("exp\x1f1\x1fw0") == {0: True} and spool.load_decisions(TRACE_DECISIONS) == {}
    assert (spool.load_trace_decision("t-kept"), spool.load_trace_decision("t-dropped"), spool.load_trace_decision("t-new")) == (
        True, False, None)
    spool.close()
