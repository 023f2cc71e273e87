"""Trained or dropped (issue 15 §3): annotate(advantage, trained, filtered_by, versions), filters, VERL trainer hook."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import types
from typing import Any

import httpx
import numpy as np
import pytest

from tracecar.client import verl_trainer
from tracecar.client.tracing import annotate, rollout_trace_attr


def get(url: str, path: str, **params: Any) -> Any:
    response = httpx.get(url + path, params=params, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def trajectories(n: int, step: int = 1) -> list[str]:
    async def one(i: int) -> str:
        with rollout_trace_attr(sample_index=i // 2, step=step, rollout_n=i % 2, name="agent_loop") as record:
            await asyncio.sleep(0)
        annotate(record, reward=float(i))
        return record.span_id

    async def all_of() -> list[str]:
        return list(await asyncio.gather(*(one(i) for i in range(n))))

    return asyncio.run(all_of())


def test_annotations_are_stored_filtered_and_listed(start_collector, tracer_to):
    col = start_collector()
    tracer = tracer_to(col.url, experiment="trainer")
    ids = trajectories(4)
    annotate(ids[0], advantage=0.75, trained=True, policy_version=3, trained_on_version=5)
    annotate(ids[1], advantage=0.0, trained=False, filtered_by="dynamic_sampling")
    annotate(ids[2], trained=True)
    annotate(ids[2], trained=False, filtered_by="overlong")  # a later note wins
    assert tracer.flush(30)

    rows = {t["trace_id"]: t for t in get(col.url, "/v1/trajectories")["trajectories"]}
    assert rows[ids[0]]["advantage"] == 0.75 and rows[ids[0]]["trained"] is True
    assert rows[ids[0]]["policy_version"] == 3 and rows[ids[0]]["trained_on_version"] == 5
    assert rows[ids[1]]["trained"] is False and rows[ids[1]]["filtered_by"] == "dynamic_sampling"
    assert rows[ids[2]]["filtered_by"] == "overlong" and rows[ids[2]]["trained"] is False
    assert rows[ids[3]]["trained"] is None and rows[ids[3]]["reward"] == 3.0  # the reward note is still read
    dropped = get(col.url, "/v1/trajectories", trained="false")
    assert {t["trace_id"] for t in dropped["trajectories"]} == {ids[1], ids[2]} and dropped["total"] == 2
    assert [t["trace_id"] for t in get(col.url, "/v1/trajectories", filtered_by="overlong")["trajectories"]] == [ids[2]]
    assert {t["trace_id"] for t in get(col.url, "/v1/trajectories", trained="true")["trajectories"]} == {ids[0]}

    # the viewer's index: same values, same filters, counted in the facets
    listed = {t["trace_id"]: t for t in get(col.url, "/ui/api/trajectories")["trajectories"]}
    assert listed[ids[0]]["advantage"] == 0.75 and listed[ids[1]]["filtered_by"] == "dynamic_sampling"
    assert listed[ids[2]]["trained"] is False and listed[ids[3]]["trained"] is None
    assert {t["trace_id"] for t in get(col.url, "/ui/api/trajectories", trained="false")["trajectories"]} == {ids[1], ids[2]}
    assert [t["trace_id"] for t in get(col.url, "/ui/api/trajectories", filtered_by="dynamic_sampling")["trajectories"]] == [ids[1]]
    facets = get(col.url, "/ui/api/facets")["trainer"]
    assert {(f["trained"], f["filtered_by"], f["trajectories"]) for f in facets} == {
        (True, None, 1), (False, "dynamic_sampling", 1), (False, "overlong", 1)}
    summary = get(col.url, f"/ui/api/trajectories/{ids[0]}")["summary"]
    assert summary["trained"] is True and summary["trained_on_version"] - summary["policy_version"] == 2

    out = subprocess.run([sys.executable, "-m", "tracecar.client.cli", "trajectories", "--url", col.url, "--trained", "false"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "2 trajectories" in out.stdout and "dropped (dynamic_sampling)" in out.stdout and "dropped (overlong)" in out.stdout


@pytest.mark.parametrize(("values", "field"), [
    ({"trained": "yes"}, "attributes.trained"), ({"advantage": "high"}, "attributes.advantage"),
    ({"filtered_by": 3}, "attributes.filtered_by"), ({"policy_version": 1.5}, "attributes.policy_version"),
])
def test_a_wrong_trainer_value_is_refused_by_name_and_costs_nothing_else(start_collector, kit, values, field):
    col = start_collector()
    spans = kit.trajectory(children=1)
    note = {"span_id": kit.new_id(), "trace_id": spans[-1]["span_id"], "parent_id": None, "name": "annotation",
            "kind": "annotation", "start_time": spans[-1]["start_time"], "end_time": spans[-1]["start_time"],
            "attributes": values, "inputs": {}, "output": None, "exception": None}
    response = kit.post(col.url, [*spans, note])
    body = response.json()
    assert response.status_code == 200, body
    assert body["accepted"] == len(spans) and [r["field"] for r in body["rejected"]] == [f"spans[{len(spans)}].{field}"]
    stored = col.collector.spool.query("SELECT COUNT(*) AS n FROM spans WHERE trace_id = ?", [spans[-1]["span_id"]])[0]["n"]
    assert stored == len(spans)


# ---- VERL's trainer, shaped as in verl.trainer.ppo.ray_trainer (fit -> compute_advantage) ----------


class FakeBatch(dict):
    """Stands for DataProto.batch (a TensorDict): keys() and item access."""


class FakeDataProto:
    def __init__(self, batch: dict[str, Any], non_tensor_batch: dict[str, Any], meta_info: dict[str, Any] | None = None):
        self.batch = FakeBatch(batch)
        self.non_tensor_batch = non_tensor_batch
        self.meta_info = meta_info or {}


def fake_ray_trainer() -> types.ModuleType:
    module = types.ModuleType("fake_ray_trainer")

    def compute_advantage(data: FakeDataProto, adv_estimator: str = "grpo", **kwargs: Any) -> FakeDataProto:
        scores = data.batch["token_level_rewards"].sum(-1)
        uid = data.non_tensor_batch["uid"]
        adv = np.zeros_like(scores)
        for group in set(uid):
            members = uid == group
            adv[members] = (scores[members] - scores[members].mean()) / (scores[members].std() + 1e-6)
        data.batch["advantages"] = adv[:, None] * data.batch["response_mask"]
        return data

    module.compute_advantage = compute_advantage

    class RayPPOTrainer:
        global_steps = 7

        def fit_one(self, batch: FakeDataProto) -> FakeDataProto:
            return module.compute_advantage(batch, adv_estimator="grpo", num_repeat=2)  # looked up at call time, as VERL does

    module.RayPPOTrainer = RayPPOTrainer
    return module


def test_hook_trainer_annotates_each_traced_trajectory_after_compute_advantage(start_collector, tracer_to):
    col = start_collector()
    tracer = tracer_to(col.url, experiment="verl-trainer")
    ids = trajectories(4, step=7)
    module = fake_ray_trainer()
    assert verl_trainer.hook_trainer(module) and verl_trainer.hook_trainer(module)  # idempotent
    length = 6
    mask = np.ones((5, length), dtype=np.int64)
    mask[1, 3:] = 0  # a tool output at the end: outside the loss mask
    mask[3, :] = 0  # nothing left to train on (e.g. rollout correction rejected it)
    rewards = np.zeros((5, length), dtype=np.float32)
    rewards[[0, 2], -1] = 1.0
    batch = FakeDataProto(
        {"token_level_rewards": rewards, "response_mask": mask},
        {"uid": np.array(["a", "a", "b", "b", "c"], dtype=object),
         verl_trainer.TRACE_KEY: np.array([ids[0], ids[1], ids[2], ids[3], None], dtype=object),  # the last was not traced
         "min_global_steps": np.array([6, 6, 7, 7, None], dtype=object)},
    )
    out = module.RayPPOTrainer().fit_one(batch)
    assert "advantages" in out.batch
    assert tracer.flush(30)
    rows = {t["trace_id"]: t for t in get(col.url, "/v1/trajectories")["trajectories"]}
    assert rows[ids[0]]["advantage"] == pytest.approx(1.0, abs=1e-3) and rows[ids[1]]["advantage"] == pytest.approx(-1.0, abs=1e-3)
    assert rows[ids[0]]["trained"] is True and rows[ids[0]]["trained_on_version"] == 7 and rows[ids[0]]["policy_version"] == 6
    assert rows[ids[3]]["trained"] is False and rows[ids[3]]["filtered_by"] == "loss_mask" and rows[ids[3]]["advantage"] is None
    assert {t["trace_id"] for t in get(col.url, "/v1/trajectories", trained="true")["trajectories"]} == {ids[0], ids[1], ids[2]}
    verl_trainer.unhook_trainer(module)
    assert not getattr(module.compute_advantage, "__tracecar_trainer_hook__", False)


def test_hook_trainer_never_breaks_the_training_step():
    module = fake_ray_trainer()
    assert verl_trainer.hook_trainer(module)
    odd = FakeDataProto({"token_level_rewards": np.zeros((2, 3)), "response_mask": np.ones((2, 3))},
                        {"uid": np.array(["a", "a"], dtype=object), verl_trainer.TRACE_KEY: np.array([1, 2])})  # not ids
    assert "advantages" in module.compute_advantage(odd).batch
    assert verl_trainer.hook_trainer(types.ModuleType("no_trainer_here")) is False


def test_numpy_scalars_from_a_trainer_are_sent_as_plain_values(start_collector, tracer_to):
    col = start_collector()
    tracer = tracer_to(col.url, experiment="numpy")
    [trace_id] = trajectories(1)
    annotate(trace_id, advantage=np.float32(0.25), trained=np.bool_(True), trained_on_version=np.int64(4))
    assert tracer.flush(30)
    [row] = get(col.url, "/v1/trajectories")["trajectories"]
    assert (row["advantage"], row["trained"], row["trained_on_version"]) == (0.25, True, 4)
