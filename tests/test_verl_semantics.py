"""VERL semantics the collector must keep (issue 10, items 7-11), over a real collector on 127.0.0.1.

- string ``sample_index`` (VERL passes ``extra_info.index`` through; uuid datasets exist):
  accepted, budgeted, stored as a string, filtered by the API, the viewer and the CLI, forwarded
  to Weave as a string; ints stay ints;
- a head budget drops the reward annotations of the trajectories it samples out, with exact
  counters, and a dropped trajectory answers 404;
- with the step's sample indices announced, the kept set is the seeded-hash choice whatever the
  arrival order;
- fully-async rollouts (``step = -1``) are budgeted per policy version, not once per run;
- empty ``response_ids`` decode to ``""``; local mode counts ``spans_forwarded{backend="local"}``;
  ``tracecar show`` prints the reward.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest

from tests.support.weave_stub import WeaveStub
from tracecar.client import annotate, announce_step, rollout_trace_attr, rollout_trace_op
from tracecar.client import tracer as tracer_module
from tracecar.client.config import ClientConfig
from tracecar.collector.processors.sampling import sample_hash

pytestmark = pytest.mark.timeout(120)

UUIDS = ["3f2c9a1e-0b7d-4c1e-9a55-1d2e3f4a5b6c", "a0b1c2d3-e4f5-4a6b-8c7d-9e0f1a2b3c4d",
         "7e6d5c4b-3a29-4817-a6b5-c4d3e2f1a0b9", "0f1e2d3c-4b5a-4968-8776-5a4b3c2d1e0f",
         "c0ffee00-1234-4abc-8def-0123456789ab"]


@rollout_trace_op
async def generate(prompt_ids: list[int]) -> dict[str, Any]:
    await asyncio.sleep(0)
    return {"response_ids": prompt_ids[::-1]}


@rollout_trace_op
async def tool(name: str) -> str:
    await asyncio.sleep(0)
    return name.upper()


async def trajectory(step: int, index: int | str, n: int = 0, *, validate: bool = False, reward: float | None = None,
                     extra: dict[str, Any] | None = None) -> str:
    """One VERL-shaped trajectory (3 spans + the root), its reward annotated as VERL's adapter does."""
    with rollout_trace_attr(sample_index=index, step=step, rollout_n=n, name="agent_loop", validate=validate,
                            **(extra or {})) as traj:
        await generate([1, 2, 3, n])
        await tool(f"t{index}")
        await generate([n] * 3)
        if reward is not None:
            annotate(reward=reward)  # inside the trajectory, as the adapter's _compute_score hook
    return traj.span_id


def metric(url: str, name: str, labels: str | None = None) -> float:
    """Sum of a metric's samples (every label set, or only ``labels`` such as '{budget="x"}')."""
    total = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$", line)
        if m and m.group(1) == name and (labels is None or m.group(2) == labels):
            total += float(m.group(3))
    return total


def listing(url: str, **params: Any) -> list[dict[str, Any]]:
    return httpx.get(url + "/v1/trajectories", params={**params, "limit": 1000}).json()["trajectories"]


def configure(url: str, worker: str, experiment: str, **kw: Any) -> Any:
    return tracer_module.configure(ClientConfig(url=url, experiment=experiment, worker_id=worker,
                                                flush_interval_s=0.02, **kw))


@pytest.fixture(autouse=True)
def _shutdown_tracer():
    yield
    tracer_module.shutdown(5)


# ---- item 7: string sample indices ---------------------------------------------------------


def test_string_sample_index_is_accepted_budgeted_stored_and_filtered(start_collector):
    col = start_collector(max_samples_per_step_per_worker=2)
    tracer = configure(col.url, "w0", "uuid-exp")

    async def main() -> None:
        for index in UUIDS:  # arrival order: the first two announced win only without membership
            await trajectory(3, index, reward=1.0)
        await trajectory(4, 7, reward=0.5)  # an int index: stays an int
        await trajectory(5, "7")  # the string "7" is a different value than the int 7

    asyncio.run(main())
    assert tracer.flush(20)
    assert metric(col.url, "tracecar_spans_rejected_total") == 0
    rows = listing(col.url, experiment="uuid-exp", step=3)
    # the budget applies to string indices too (it used to exempt every non-int index)
    assert sorted(r["sample_index"] for r in rows) == sorted(UUIDS[:2])
    assert all(r["span_count"] == 4 for r in rows)

    by_uuid = listing(col.url, sample_index=UUIDS[1])
    assert [r["sample_index"] for r in by_uuid] == [UUIDS[1]]
    sevens = listing(col.url, sample_index="7")  # a query parameter is text: matches the int and the string
    assert sorted((r["step"], type(r["sample_index"]).__name__) for r in sevens) == [(4, "int"), (5, "str")]

    tree = httpx.get(col.url + f"/v1/trajectories/{by_uuid[0]['trace_id']}").json()
    assert tree["root"]["attributes"]["sample_index"] == UUIDS[1]

    viewer = httpx.get(col.url + "/ui/api/trajectories", params={"sample_index": UUIDS[1]}).json()
    assert [t["sample_index"] for t in viewer["trajectories"]] == [UUIDS[1]]

    out = subprocess.run([sys.executable, "-m", "tracecar.client.cli", "trajectories", "--url", col.url,
                          "--sample-index", UUIDS[1], "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert [t["sample_index"] for t in json.loads(out.stdout)["trajectories"]] == [UUIDS[1]]


def test_bad_sample_index_types_are_rejected_by_name(start_collector):
    col = start_collector()
    base = {"span_id": "s1", "trace_id": "s1", "name": "agent_loop", "kind": "trajectory", "start_time": 1.0, "end_time": 2.0}
    body = {"worker": "w", "spans": [
        {**base, "attributes": {"sample_index": 1.5}},
        {**base, "span_id": "s2", "trace_id": "s2", "attributes": {"sample_index": ""}},
        {**base, "span_id": "s3", "trace_id": "s3", "attributes": {"sample_index": "ok-uuid"}},
    ]}
    answer = httpx.post(col.url + "/v1/spans", json=body).json()
    assert answer["accepted"] == 1
    assert [(r["field"], r["reason"]) for r in answer["rejected"]] == [
        ("spans[0].attributes.sample_index", "must be an integer or a string, got float"),
        ("spans[1].attributes.sample_index", "must be 1 to 256 characters, got 0"),
    ]


def test_step_announcements_are_bounded_like_sample_indices(start_collector):
    """Each announced index becomes a decision row: the list and its elements have sample_index's bounds."""
    col = start_collector(max_samples_per_step_per_worker=1)
    base = {"name": "membership", "kind": "membership", "start_time": 1.0, "end_time": 1.0}
    body = {"worker": "w", "spans": [
        {**base, "span_id": "m1", "trace_id": "m1", "attributes": {"step": 1, "sample_indices": list(range(65537))}},
        {**base, "span_id": "m2", "trace_id": "m2", "attributes": {"step": 1, "sample_indices": ["x" * 100_000]}},
        {**base, "span_id": "m3", "trace_id": "m3", "attributes": {"step": 1, "sample_indices": [0, 1, "uuid-2"]}},
    ]}
    answer = httpx.post(col.url + "/v1/spans", json=body, timeout=60).json()
    assert [(r["span_id"], r["field"]) for r in answer["rejected"]] == [
        ("m1", "spans[0].attributes.sample_indices"), ("m2", "spans[1].attributes.sample_indices")]
    assert "more than 65536" in answer["rejected"][0]["reason"] and "1 to 256 characters" in answer["rejected"][1]["reason"]
    assert metric(col.url, "tracecar_memberships_received_total") == 1


def test_string_sample_index_reaches_weave_as_a_string(start_collector, weave_stub: WeaveStub):
    col = start_collector(backend="weave", wandb_api_key="k" * 40, wandb_entity="team", wandb_project="rl",
                          weave_server_url=weave_stub.url)
    tracer = configure(col.url, "w0", "weave-uuid")
    asyncio.run(trajectory(2, UUIDS[0]))
    asyncio.run(trajectory(2, 11))
    assert tracer.flush(20)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(weave_stub.completed_calls()) < 6:
        time.sleep(0.1)
    indices = {c["attributes"].get("sample_index") for c in weave_stub.completed_calls()}
    assert indices == {UUIDS[0], 11}


# ---- item 8: annotations of sampled-out trajectories -----------------------------------------


def test_head_budget_drops_rewards_of_sampled_out_trajectories_with_exact_counters(start_collector):
    col = start_collector(max_samples_per_step_per_worker=2)
    tracer = configure(col.url, "w0", "orphans")

    async def main() -> list[str]:
        return [await trajectory(1, i, reward=float(i)) for i in range(6)]

    trace_ids = asyncio.run(main())
    assert tracer.flush(20)
    kept = {r["trace_id"] for r in listing(col.url, experiment="orphans")}
    assert len(kept) == 2
    for trace_id in trace_ids:
        answer = httpx.get(col.url + f"/v1/trajectories/{trace_id}")
        if trace_id in kept:
            tree = answer.json()
            assert tree["root"]["name"] == "agent_loop" and tree["span_count"] == 4 and len(tree["annotations"]) == 1
        else:
            assert answer.status_code == 404  # nothing of it stored, its reward included
    # 6 trajectories x (root + 3 ops + 1 reward annotation) = 30 spans; 2 kept
    assert metric(col.url, "tracecar_spans_received_total") == 30
    assert metric(col.url, "tracecar_spans_accepted_total") == 10
    assert metric(col.url, "tracecar_spans_sampled_out_total", '{budget="max_samples_per_step_per_worker"}') == 20
    stored = httpx.get(col.url + "/v1/trajectories", params={"limit": 1000}).json()["total"]
    assert stored == 2


# ---- item 9: a kept set independent of arrival order ------------------------------------------


def _run_order(col_url: str, worker: str, order: list[int], announce: bool) -> None:
    tracer = configure(col_url, worker, "order")

    async def main() -> None:
        if announce:
            announce_step(5, [i for i in range(10) for _ in range(2)])  # as VERL's index column: each index n times
        for index in order:
            for n in range(2):
                await trajectory(5, index, n)

    asyncio.run(main())
    assert tracer.flush(20)


def test_announced_step_keeps_the_seeded_hash_choice_whatever_the_arrival_order(start_collector):
    seed = 1234
    expected = set(sorted(range(10), key=lambda i: sample_hash(seed, "order", 5, i))[:3])
    kept_sets = []
    for order in (list(range(10)), list(reversed(range(10))), [4, 9, 0, 7, 2, 5, 1, 8, 3, 6]):
        col = start_collector(max_samples_per_step_per_worker=3, sampling_seed=seed)
        _run_order(col.url, "w0", order, announce=True)
        rows = listing(col.url, experiment="order")
        kept_sets.append({r["sample_index"] for r in rows})
        assert len(rows) == 6  # 3 samples x rollout_n 2, whole groups
    assert kept_sets == [expected] * 3
    # a different seed picks differently (the choice is the hash's, not a fixed prefix)
    other = set(sorted(range(10), key=lambda i: sample_hash(99, "order", 5, i))[:3])
    assert other != expected


def test_unannounced_step_falls_back_to_first_come(start_collector):
    col = start_collector(max_samples_per_step_per_worker=3)
    _run_order(col.url, "w0", [9, 8, 7, 6, 5], announce=False)
    assert {r["sample_index"] for r in listing(col.url, experiment="order")} == {9, 8, 7}
    assert metric(col.url, "tracecar_memberships_received_total") == 0


def test_membership_survives_a_restart(start_collector, tmp_path):
    data = tmp_path / "restart"
    col = start_collector(max_samples_per_step_per_worker=2, data_dir=data)
    tracer = configure(col.url, "w0", "order")
    announce_step(8, list(range(6)))
    assert tracer.flush(20)
    assert metric(col.url, "tracecar_memberships_received_total") == 1
    col.stop()
    col2 = start_collector(max_samples_per_step_per_worker=2, data_dir=data)
    tracer = configure(col2.url, "w0", "order")

    async def main() -> None:
        for i in range(6):
            await trajectory(8, i)

    asyncio.run(main())
    assert tracer.flush(20)
    expected = set(sorted(range(6), key=lambda i: sample_hash(0, "order", 8, i))[:2])
    assert {r["sample_index"] for r in listing(col2.url, experiment="order")} == expected


# ---- item 10: fully-async rollouts (step -1) -------------------------------------------------


@pytest.mark.parametrize("mode", ["head", "tail"])
def test_step_minus_one_is_budgeted_per_policy_version(start_collector, mode):
    """Head budgets (VERL's) and tail-based budgets alike: each policy version is a step."""
    tail = {"tail_sampling": True, "step_idle_s": 0.5, "reward_wait_s": 0.2} if mode == "tail" else {}
    col = start_collector(max_samples_per_step_per_worker=2, **tail)
    tracer = configure(col.url, "w0", "async")

    async def main() -> None:
        for version in (0, 1, 2):
            for i in range(5):
                await trajectory(-1, f"s{version}-{i}", extra={"policy_version": version})
        for i in range(4):  # before any version is known: one bucket
            await trajectory(-1, f"early-{i}")

    asyncio.run(main())
    assert tracer.flush(20)
    if mode == "tail":  # versions 0 and 1 close as next_step, 2 and the early bucket when idle
        deadline = time.monotonic() + 30
        page: dict[str, Any] = {}
        while time.monotonic() < deadline:
            page = httpx.get(col.url + "/v1/decisions", params={"experiment": "async", "step": -1}).json()
            if not page["open"] and len(page["decisions"]) == 19:
                break
            time.sleep(0.2)
        assert len(page["decisions"]) == 19 and not page["open"], page.get("open")
        versions = {(d["policy_version"], d["keep"]) for d in page["decisions"]}
        assert versions == {(v, k) for v in (0, 1, 2, None) for k in (True, False)}
        assert sum(d["keep"] for d in page["decisions"]) == 8
        closed = {d["policy_version"]: d["closed_by"] for d in page["decisions"]}
        assert closed[0] == closed[1] == "next_step", closed
    rows = listing(col.url, experiment="async")
    per_version: dict[Any, int] = {}
    for r in rows:
        tree = httpx.get(col.url + f"/v1/trajectories/{r['trace_id']}").json()
        version = tree["root"]["attributes"].get("policy_version")
        per_version[version] = per_version.get(version, 0) + 1
        assert r["step"] == -1 and r["span_count"] == 4
    assert per_version == {0: 2, 1: 2, 2: 2, None: 2}


# ---- item 11: smaller --------------------------------------------------------------------------


def test_empty_response_ids_decode_to_empty_text(start_collector, small_bpe_path):
    col = start_collector(token2text=True, tokenizer=small_bpe_path)
    tracer = configure(col.url, "w0", "empty")

    @rollout_trace_op
    async def silent_generate(prompt_ids: list[int]) -> dict[str, Any]:
        return {"token_ids": []}

    async def main() -> str:
        with rollout_trace_attr(sample_index=0, step=0, name="agent_loop") as traj:
            await silent_generate([5, 6, 7])
        return traj.span_id

    trace_id = asyncio.run(main())
    assert tracer.flush(20)
    tree = httpx.get(col.url + f"/v1/trajectories/{trace_id}").json()
    (call,) = tree["root"]["children"]
    assert call["output"]["response_text"] == ""
    assert isinstance(call["output"]["prompt_text"], str) and call["output"]["prompt_text"]
    turns = httpx.get(col.url + f"/ui/api/trajectories/{trace_id}").json()["turns"]
    assert len(turns) == 1 and turns[0]["response_text"] == ""


def test_local_mode_counts_spans_forwarded_to_the_local_store(start_collector):
    col = start_collector()
    assert 'tracecar_spans_forwarded_total{backend="local",exporter="local"} 0.0' in httpx.get(col.url + "/metrics").text
    tracer = configure(col.url, "w0", "local")
    asyncio.run(trajectory(0, 0, reward=1.0))
    assert tracer.flush(20)
    assert metric(col.url, "tracecar_spans_forwarded_total", '{backend="local",exporter="local"}') == 5


def test_local_mode_counts_tail_released_spans_as_forwarded(start_collector):
    col = start_collector(max_trajectories_per_step=1, step_idle_s=0.2, reward_wait_s=0.1)
    tracer = configure(col.url, "w0", "local-tail")
    asyncio.run(trajectory(0, 0))
    asyncio.run(trajectory(0, 1))
    assert tracer.flush(20)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and metric(col.url, "tracecar_spans_forwarded_total", '{backend="local",exporter="local"}') < 4:
        time.sleep(0.1)
    time.sleep(0.5)
    assert metric(col.url, "tracecar_spans_forwarded_total", '{backend="local",exporter="local"}') == 4  # one trajectory kept


def test_cli_show_prints_the_reward(start_collector):
    col = start_collector()
    tracer = configure(col.url, "w0", "show")
    trace_id = asyncio.run(trajectory(0, 0, reward=0.75))
    assert tracer.flush(20)
    out = subprocess.run([sys.executable, "-m", "tracecar.client.cli", "show", trace_id, "--url", col.url],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "annotation: reward=0.75" in out.stdout
    assert "annotation: {}" not in out.stdout


def test_announced_choice_uses_the_experiments_own_seed(start_collector):
    col = start_collector(budgets={"seeded": {"max_samples_per_step_per_worker": 2, "sampling_seed": 7}})
    tracer = configure(col.url, "w0", "seeded")

    async def main() -> None:
        announce_step(1, list(range(8)))
        for i in range(8):
            await trajectory(1, i)

    asyncio.run(main())
    assert tracer.flush(20)
    expected = set(sorted(range(8), key=lambda i: sample_hash(7, "seeded", 1, i))[:2])
    assert {r["sample_index"] for r in listing(col.url, experiment="seeded")} == expected


def test_decisions_show_the_job_budget_the_batches_brought(start_collector):
    """No budget in the collector, VERL's max_samples_per_step_per_worker sent with the batches: not "sampling is off"."""
    col = start_collector()
    spans = []
    for index in range(3):
        sid = f"t{index}"
        spans.append({"span_id": sid, "trace_id": sid, "name": "agent_loop", "kind": "trajectory", "start_time": 1.0,
                      "end_time": 2.0, "attributes": {"step": 9, "sample_index": index, "rollout_n": 0,
                                                      "experiment_name": "jobbudget"}})
    body = {"worker": "w0", "max_samples_per_step_per_worker": 1, "spans": spans}
    answer = httpx.post(col.url + "/v1/spans", json=body).json()
    assert answer["accepted"] == 1 and answer["sampled_out"] == 2, answer
    page = httpx.get(col.url + "/v1/decisions", params={"step": 9, "experiment": "jobbudget"}).json()
    assert page["mode"] == "head" and len(page["head"]) == 1
    assert len(page["head"][0]["kept"]) == 1 and len(page["head"][0]["dropped"]) == 2 and page["head"][0]["worker"] == "w0"
    out = subprocess.run([sys.executable, "-m", "tracecar.client.cli", "decisions", "--step", "9", "--experiment", "jobbudget"],
                         env={**os.environ, "TRACECAR_URL": col.url}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "kept 1 sample indices, dropped 2" in out.stdout and "sampling is off" not in out.stdout, out.stdout
