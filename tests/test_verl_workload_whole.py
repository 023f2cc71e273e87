"""A VERL-shaped workload from several worker processes under a budget: every trajectory is kept
or dropped whole, the choice is the announced seeded one, and every counter is exact.

Three worker processes (tests/verl_workload_worker.py, the real client over HTTP) each run two
training steps with int indices (announced, ``rollout_n`` = 2), a validation pass reusing step 2
with string indices, fully-async rollouts (``step = -1``) under two policy versions, a
``trace=False`` sample, failing tools and reward annotations, with trajectories finishing out of
order. The collector (real, on 127.0.0.1) budgets ``max_samples_per_step_per_worker = 2``, once
head-based (at ingest, with the announced memberships) and once tail-based (held, decided per step).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import pytest

from tracecar.collector.processors.sampling import sample_hash

pytestmark = pytest.mark.timeout(180)

WORKER = Path(__file__).with_name("verl_workload_worker.py")
N, SEED, WORKERS = 2, 42, 3


def metrics(url: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for line in httpx.get(url + "/metrics").text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] += float(m.group(3))
    return out


@pytest.mark.parametrize("mode", ["head", "tail"])
def test_several_workers_every_trajectory_whole_and_exact_metrics(start_collector, tmp_path, mode):
    """head: VERL's budget at ingest (announced steps: the seeded choice; step -1 per policy version).
    tail: the same limit decided on whole held steps (step -1 per policy version there too)."""
    extra = {} if mode == "head" else {"tail_sampling": True, "step_idle_s": 0.5, "reward_wait_s": 0.2}
    col = start_collector(max_samples_per_step_per_worker=N, sampling_seed=SEED, **extra)
    procs = []
    for k in range(WORKERS):
        path = tmp_path / f"manifest-{k}.json"
        procs.append((k, path, subprocess.Popen([sys.executable, str(WORKER), col.url, str(k), str(path)],
                                                stderr=subprocess.PIPE, text=True)))
    manifest: list[dict[str, Any]] = []
    for k, path, proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        for item in json.loads(path.read_text()):
            manifest.append({**item, "worker": f"worker-{k}"})

    # 3 workers x (2 steps x 5 samples x 2 rollouts + 4 validation + 2 x 3 async) = 3 x 30 trajectories
    assert len(manifest) == WORKERS * 30

    if mode == "tail":  # held steps are decided once idle: wait until nothing is held
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (metrics(col.url)["tracecar_held_spans"] or metrics(col.url)["tracecar_open_steps"]):
            time.sleep(0.2)
        assert metrics(col.url)["tracecar_held_spans"] == 0

    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for t in manifest:
        version = t["policy_version"]
        groups[(t["worker"], t["step"], t["validate"], version)].append(t)

    kept_spans = dropped_spans = 0
    for key, members in groups.items():
        worker, step, validate, version = key
        kept_indices, dropped_indices = set(), set()
        for t in members:
            answer = httpx.get(col.url + f"/v1/trajectories/{t['trace_id']}")
            if answer.status_code == 404:
                dropped_indices.add(t["sample_index"])
                dropped_spans += t["spans"]
                continue
            tree = answer.json()
            # whole: the root, every one of its 4 ops, and its reward
            assert tree["root"]["name"] == "agent_loop" and tree["span_count"] == t["spans"] - 1, t
            assert len(tree["annotations"]) == 1 and "reward" in tree["annotations"][0]["attributes"]
            assert tree["root"]["attributes"]["sample_index"] == t["sample_index"]  # type kept (int or str)
            kept_indices.add(t["sample_index"])
            kept_spans += t["spans"]
        assert not kept_indices & dropped_indices, f"{key}: a sample group split"
        assert len(kept_indices) == N, key
        if step != -1 and mode == "head":  # announced: exactly the seeded hash choice over the announced indices
            indices = sorted({t["sample_index"] for t in members}, key=str)
            expected = set(sorted(indices, key=lambda i: sample_hash(SEED, "multi", step, i))[:N])
            assert kept_indices == expected, key

    listed = httpx.get(col.url + "/v1/trajectories", params={"experiment": "multi", "limit": 1000}).json()["total"]
    assert listed == sum(1 for t in manifest if httpx.get(col.url + f"/v1/trajectories/{t['trace_id']}").status_code == 200)
    assert not [r for r in httpx.get(col.url + "/v1/trajectories", params={"limit": 1000, "step": 3}).json()["trajectories"]]

    m = metrics(col.url)
    assert m["tracecar_spans_received_total"] == kept_spans + dropped_spans == WORKERS * 30 * 6
    # head: decided before the commit, so only kept spans are accepted; tail: every span is
    # acknowledged (held in the spool), the decision then deletes the dropped ones
    assert m["tracecar_spans_accepted_total"] == (kept_spans if mode == "head" else kept_spans + dropped_spans)
    sampled_out = sum(v for k, v in m.items() if k.startswith("tracecar_spans_sampled_out_total{"))
    assert sampled_out == dropped_spans
    if mode == "head":
        assert m['tracecar_spans_sampled_out_total{budget="max_samples_per_step_per_worker"}'] == dropped_spans
    else:
        assert m['tracecar_spans_sampled_out_total{budget="tail"}'] == dropped_spans
    assert sum(v for k, v in m.items() if k.startswith("tracecar_spans_rejected_total")) == 0
    assert m["tracecar_spans_duplicate_total"] == 0
    assert m["tracecar_memberships_received_total"] == WORKERS * 3  # steps 1, 2 and the validation pass
    assert m['tracecar_spans_forwarded_total{backend="local",exporter="local"}'] == kept_spans  # what reached the store
