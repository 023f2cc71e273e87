"""The root attributes the index keeps for ``attr=`` (collector/viewer/root_attributes.py), on a real spool and index:
payloads packed as the pipeline packs them (the head read by its offset), two roots of one trace in one chunk, and
the text of every JSON kind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tracecar.collector.spool.payload import pack_payload
from tracecar.collector.spool.store import Spool, SpoolRow
from tracecar.collector.trajectory_filter import TrajectoryFilter
from tracecar.collector.viewer.index import TrajectoryIndex


def root(trace_id: str, span_id: str, attributes: dict[str, Any], start: float) -> dict[str, Any]:
    return {"trace_id": trace_id, "span_id": span_id, "parent_id": None, "name": "agent_loop", "kind": "trajectory",
            "worker": "w0", "project": "p", "entity": None, "attributes": attributes, "exception": None,
            "start_time": start, "end_time": start + 1,
            "inputs": {"prompt_ids": list(range(2000)), "attributes": {"tag": "not-this"}}, "output": {"response_ids": [1, 2]}}


def packed(span: dict[str, Any]) -> SpoolRow:
    payload, inputs_at, output_at = pack_payload(span)
    return SpoolRow(span, payload, None, inputs_at=inputs_at, output_at=output_at)


def traces(index: TrajectoryIndex, *pairs: tuple[str, str]) -> set[str]:
    page = index.list(TrajectoryFilter(attributes=pairs), limit=100)
    return {t["trace_id"] for t in page["trajectories"]}


def test_attributes_are_read_from_the_packed_head_and_the_last_root_of_a_trace_wins(tmp_path: Path) -> None:
    path = tmp_path / "spool.sqlite3"
    spool = Spool(path, local_only=True, sync="normal")
    kinds = {"s": "x", "i": 7, "big": 2**63, "f": 0.1 + 0.2, "e": 1e20, "t": True, "n": None,
             "nested": {"deep": {"k-1": "v"}}, "list": [1, {"a": 2}], "dot.key": 1, "": 2}
    spool.write([packed(root("a" * 32, "a1", kinds, 1.0)),
                 # one trace, two parentless spans in one chunk: the index's row is the last one's; so are its attributes
                 packed(root("b" * 32, "b1", {"tag": "first", "only_first": 1}, 2.0)),
                 packed(root("b" * 32, "b2", {"tag": "second"}, 3.0))])
    spool.close()
    index = TrajectoryIndex(path, tmp_path / "index.sqlite3")
    assert index.refresh(budget_s=60)
    a = "a" * 32
    for key, text in (("s", "x"), ("i", "7"), ("big", "9.22337203685478e+18"), ("f", "0.3"), ("e", "1.0e+20"),
                      ("t", "true"), ("n", "null"), ("nested.deep.k-1", "v")):
        assert traces(index, (key, text)) == {a}, key
    for key, text in (("f", "0.30000000000000004"), ("list", "1"), ("list.a", "2"), ("nested", "x"), ("nested.deep", "x"),
                      ("tag", "not-this")):  # the inputs' "attributes" are not the root's
        assert traces(index, (key, text)) == set(), key
    assert traces(index, ("tag", "second")) == {"b" * 32}
    assert traces(index, ("tag", "first")) == traces(index, ("only_first", "1")) == set()
    index.close()
