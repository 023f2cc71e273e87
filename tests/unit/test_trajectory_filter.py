"""The one trajectory filter (collector/trajectory_filter.py): its SQL and its in-memory predicate
say the same thing, on the spool's spans and the viewer index alike, for every filter."""

from __future__ import annotations

import sqlite3
from typing import Any

import pytest

from tracecar.client.cli import LIST_SORTS
from tracecar.collector.trajectory_filter import TrajectoryFilter
from tracecar.collector.viewer.index import SORTS

ROWS: list[dict[str, Any]] = [
    {"experiment": "e", "step": 1, "sample_index": 7, "rollout_n": 0, "validate": 0, "kept_because": "fill",
     "reward": 0.5, "has_error": 0, "worker": "w0", "trained": 1, "filtered_by": None},
    {"experiment": None, "step": 2, "sample_index": "7", "rollout_n": 1, "validate": 1, "kept_because": None,
     "reward": None, "has_error": 1, "worker": "w1", "trained": 0, "filtered_by": "overlong"},
    {"experiment": "", "step": 3, "sample_index": "uuid-1", "rollout_n": 2, "validate": None, "kept_because": "error",
     "reward": 1.0, "has_error": 0, "worker": "w0", "trained": None, "filtered_by": None},
]
FILTERS = [
    TrajectoryFilter(), TrajectoryFilter(experiment="e"), TrajectoryFilter(experiment=""),
    TrajectoryFilter(step=2), TrajectoryFilter(step_min=2), TrajectoryFilter(step_max=1), TrajectoryFilter(sample_index="7"),
    TrajectoryFilter(sample_index=7), TrajectoryFilter(sample_index="uuid-1"), TrajectoryFilter(rollout_n=1),
    TrajectoryFilter(validate=True), TrajectoryFilter(validate=False), TrajectoryFilter(kept_because="fill"),
    TrajectoryFilter(reward_min=0.6), TrajectoryFilter(reward_max=0.5), TrajectoryFilter(has_error=True),
    TrajectoryFilter(worker="w0"), TrajectoryFilter(worker=""), TrajectoryFilter(trained=False),
    TrajectoryFilter(filtered_by="overlong"), TrajectoryFilter(filtered_by=""), TrajectoryFilter(kept_because=""),
    TrajectoryFilter(experiment="e", step_min=1, step_max=1, trained=True, worker="w0"),
]


@pytest.fixture(scope="module")
def table() -> sqlite3.Connection:
    conn = sqlite3.connect(":memory:")
    columns = list(ROWS[0])
    conn.execute(f"CREATE TABLE t (i INTEGER, {', '.join(columns)})")
    conn.executemany(f"INSERT INTO t VALUES (?, {', '.join('?' * len(columns))})",
                     [(i, *row.values()) for i, row in enumerate(ROWS)])
    return conn


@pytest.mark.parametrize("flt", FILTERS, ids=repr)
def test_sql_and_the_in_memory_predicate_select_the_same_rows(table, flt):
    where, params = flt.where()
    by_sql = [r[0] for r in table.execute(f"SELECT i FROM t {'WHERE ' + where if where else ''} ORDER BY i", params)]
    assert by_sql == [i for i, row in enumerate(ROWS) if flt.matches(row)], (where, params)


def test_meanings_every_path_shares():
    assert TrajectoryFilter(experiment="").where() == ("experiment IS NULL", [])  # "": sent without a name
    assert TrajectoryFilter(worker="", filtered_by="", kept_because="", q="").where() == ("", [])  # blank: no filter
    assert TrajectoryFilter(q="?!").where() == ("", [])  # no word: no filter, never an FTS syntax error
    where, params = TrajectoryFilter(sample_index="7").where()
    assert where == "sample_index IN (?,?)" and params == [7, "7"]


def test_a_filter_the_table_cannot_answer_is_refused_not_ignored():
    with pytest.raises(ValueError, match="trained"):
        TrajectoryFilter(step=1, trained=False).where(allowed=("experiment", "step"))
    assert TrajectoryFilter(step=1, worker="").where(allowed=("step",)) == ("step = ?", [1])
    with pytest.raises(ValueError, match="q="):
        TrajectoryFilter(q="words").matches({})


def test_a_live_marker_without_validate_passes_a_validate_filter():
    assert TrajectoryFilter(validate=False).matches({"validate": None}, unknown_passes=("validate",))
    assert not TrajectoryFilter(validate=False).matches({"validate": None})


def test_the_cli_offers_the_lists_sorts():
    assert set(LIST_SORTS) == set(SORTS)
