"""Whatever is accepted is exportable (issue 28, item 3).

A real collector process stores trajectories whose values the export's typed columns cannot
take as they are: a prompt of mixed ids (``[1, "x", 3]``, accepted with a warning), ids past
int64, a numeric response text. ``GET /v1/export`` (JSONL and Parquet, with token ids) answers a
whole file every time: a value that does not fit its column is left out of that column (a
token-id list is such only if every element is an int64), and a trajectory that still cannot be
written costs only its row, counted in ``tracecar_export_rows_skipped_total`` and named in the
log. Before, the Parquet export answered 200 and closed mid-body (``shape.int_list`` checked the
first and last element only), so no dataset could be exported from the store at all.
"""

from __future__ import annotations

import io
import json
import time

import httpx
import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.timeout(120)


def _turn(kit, root: str, prompt_ids, response_ids, response_text="ok") -> dict:
    t0 = time.time()
    return {"span_id": kit.new_id(), "trace_id": root, "parent_id": root, "name": "AsyncLLMServerManager.generate",
            "kind": "op", "start_time": t0, "end_time": t0 + 0.1, "attributes": {"step": 3, "sample_index": 0},
            "inputs": {"prompt_ids": prompt_ids},
            "output": {"token_ids": response_ids, "response_text": response_text}, "exception": None}


def _trajectory(kit, i: int, prompt_ids, response_ids, response_text="ok") -> list[dict]:
    root = kit.new_id()
    t0 = time.time()
    attrs = {"step": 3, "sample_index": i, "rollout_n": 0, "validate": False, "experiment_name": "exp-rows"}
    return [_turn(kit, root, prompt_ids, response_ids, response_text),
            {"span_id": root, "trace_id": root, "parent_id": None, "name": "agent_loop", "kind": "trajectory",
             "start_time": t0, "end_time": t0 + 1, "attributes": attrs, "inputs": {}, "output": None, "exception": None}]


def test_one_stored_value_never_tears_the_export_and_a_bad_row_costs_only_itself(collector_process, kit):
    pc = collector_process().start()
    good = [_trajectory(kit, i, [10, 11, 12], [20, 21]) for i in range(4)]
    mixed = _trajectory(kit, 10, [1, "x", 3], [20, 21])  # the red team's: accepted with a warning
    middle = _trajectory(kit, 11, [10, 11, 12], [20, True, 21])  # a bool inside: not an id list either
    huge = _trajectory(kit, 12, [10, 2**63, 12], [20, 21])  # past int64: not a Parquet int64 list
    odd = _trajectory(kit, 13, [10, 11, 12], [20, 21], response_text=12345)  # a number where text goes
    for batch in [*good, mixed, middle, huge, odd]:
        r = kit.post(pc.url, batch)
        assert r.status_code == 200 and r.json()["accepted"] == 2, r.text
    every = {b[0]["trace_id"] for b in [*good, mixed, middle, huge, odd]}

    left_out = 0.0
    for fmt in ("parquet", "jsonl"):
        r = httpx.get(pc.url + "/v1/export", params={"format": fmt, "token_ids": "true", "experiment": "exp-rows"}, timeout=60)
        assert r.status_code == 200, r.text[:300]
        if fmt == "parquet":
            rows = pq.read_table(io.BytesIO(r.content)).to_pylist()  # the whole file: footer and all
        else:
            rows = [json.loads(line) for line in r.content.splitlines()]
        skipped = kit.metrics(pc.url, "tracecar_export_rows_skipped_total", format=fmt)
        left_out += skipped
        by_trace = {row["trace_id"]: row for row in rows}
        print(f"\n{fmt}: {len(rows)} rows of {len(every)}, skipped {skipped:.0f}; mixed prompt_ids -> "
              f"{by_trace.get(mixed[0]['trace_id'], {}).get('prompt_ids')!r}")
        # every trajectory is in the file or counted (and logged) as left out; nothing else is lost
        assert set(by_trace) <= every and len(every) - len(by_trace) == skipped
        for batch in [*good, mixed, middle, huge]:  # whose only fault is a list that is not int64 ids: kept whole
            assert batch[0]["trace_id"] in by_trace, (fmt, batch[0]["inputs"])
        assert by_trace[good[0][0]["trace_id"]]["prompt_ids"] == [10, 11, 12]
        assert by_trace[mixed[0]["trace_id"]]["prompt_ids"] is None  # not an id list: no column value, no torn file
        assert by_trace[middle[0]["trace_id"]]["response_ids"] is None
        if fmt == "parquet":
            assert by_trace[huge[0]["trace_id"]]["prompt_ids"] is None
    if left_out:
        assert odd[0]["trace_id"] in pc.log_text()  # a row left out is named
