"""Sampling-decision rows are bounded (TRACECAR_DECISIONS_MAX_ROWS): the oldest go, the newest steps keep theirs.

Head budgets write one row per announced sample index and tail budgets one per decided
trajectory; without a bound both tables grow for the whole run.
"""

from __future__ import annotations

import asyncio
import re
import sqlite3
import time
from typing import Any

import httpx
import pytest

from tracecar.client import announce_step, rollout_trace_attr, rollout_trace_op
from tracecar.client import tracer as tracer_module
from tracecar.client.config import ClientConfig
from tracecar.collector.processors.sampling import sample_hash
from tracecar.collector.spool.store import Spool

pytestmark = pytest.mark.timeout(120)


@rollout_trace_op
async def generate(prompt_ids: list[int]) -> dict[str, Any]:
    await asyncio.sleep(0)
    return {"response_ids": prompt_ids[::-1]}


def metric(url: str, name: str, labels: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$", line)
        if m and m.group(1) == name and m.group(2) == labels:
            return float(m.group(3))
    return 0.0


@pytest.fixture(autouse=True)
def _shutdown_tracer():
    yield
    tracer_module.shutdown(5)


def test_head_decision_rows_are_trimmed_oldest_first_and_the_newest_step_keeps_its_budget(start_collector):
    col = start_collector(max_samples_per_step_per_worker=2, decisions_max_rows=1000)
    tracer = tracer_module.configure(ClientConfig(url=col.url, experiment="long", worker_id="w0", flush_interval_s=0.02))
    for step in range(1, 5):  # 4 steps x 400 announced indices = 1,600 rows
        announce_step(step, list(range(400)))
    assert tracer.flush(20)
    spool_file = str(col.settings.spool_path)

    def rows() -> dict[str, int]:
        with sqlite3.connect(spool_file) as conn:
            return {step: n for step, n in conn.execute(
                "SELECT substr(budget_key, instr(budget_key, char(31)) + 1, 1), COUNT(*) FROM sample_decisions GROUP BY 1")}

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and sum(rows().values()) > 1000:
        time.sleep(0.2)
    left = rows()
    assert sum(left.values()) <= 1000, left
    assert left.get("4") == 400 and "1" not in left, left  # oldest first; the newest step whole
    assert metric(col.url, "tracecar_decisions_evicted_total", '{table="sample_decisions"}') >= 600

    chosen = sorted(range(400), key=lambda i: sample_hash(0, "long", 4, i))[:2]  # step 4's announced choice
    others = [i for i in range(20) if i not in chosen][:8]

    async def main() -> None:  # ... still governs it after the trim
        for i in chosen + others:
            with rollout_trace_attr(sample_index=i, step=4, rollout_n=0, name="agent_loop"):
                await generate([i])

    asyncio.run(main())
    assert tracer.flush(20)
    got = httpx.get(col.url + "/v1/trajectories", params={"experiment": "long", "step": 4, "limit": 100}).json()
    assert sorted(t["sample_index"] for t in got["trajectories"]) == sorted(chosen)


def test_both_decision_tables_are_trimmed_to_the_bound(tmp_path):
    spool = Spool(tmp_path / "spool.db", local_only=True)
    try:
        with spool._transaction() as conn:  # rows as the samplers write them, oldest first
            conn.executemany("INSERT INTO sample_decisions (budget_key, sample_index, keep) VALUES (?,?,?)",
                             [(f"e\x1f{i // 100}\x1fw\x1f0", i, i % 2) for i in range(3000)])
            conn.executemany(
                "INSERT INTO trajectory_decisions (trace_id, experiment, validate, step, round, keep, has_error,"
                " nbytes, tokens, decided_at) VALUES (?,?,?,?,?,?,?,?,?,?)",
                [(f"{i:032x}", "e", 0, i // 100, 1, 1, 0, 10, 0, float(i)) for i in range(2500)])
        assert spool.trim_decisions(5000) == {}
        deleted = spool.trim_decisions(1000)
        assert deleted == {"sample_decisions": 2050, "trajectory_decisions": 1550}
        left = spool.query("SELECT MIN(sample_index) AS lo, COUNT(*) AS n FROM sample_decisions")[0]
        assert left == {"lo": 2050, "n": 950}
        left = spool.query("SELECT MIN(decided_at) AS lo, COUNT(*) AS n FROM trajectory_decisions")[0]
        assert left == {"lo": 1550.0, "n": 950}
    finally:
        spool.close()
