"""GRPO group view (/v1/groups, `tracecar groups`) and dataset export (/v1/export, `tracecar export`).

Everything runs against a real collector on 127.0.0.1 fed over HTTP; exported files are read
back with the `datasets` library from local files only (offline: nothing reaches the hub).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import time
import tracemalloc
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tracecar.client import cli
from tracecar.collector.spool.store import Spool, SpoolRow
from tracecar.collector.viewer.groups import GroupStats, build_groups, diff_turns, order_groups

pytestmark = pytest.mark.timeout(240)

os.environ["HF_DATASETS_OFFLINE"] = "1"  # `datasets` reads these when imported: nothing goes to the hub
os.environ["HF_HUB_OFFLINE"] = "1"

EXPERIMENT = "grpo"


def trajectory(trace: str, step: int, sample_index: Any, rollout_n: int, turns: list[tuple[str, dict[str, Any] | None]], *,
               reward: float | None = None, advantage: float | None = None, kept_because: str | None = None,
               validate: bool = False, t0: float = 1000.0) -> list[dict[str, Any]]:
    """One trajectory as the client sends it: a turn per (response text, tool arguments or None), the
    tool call after its turn, the root last, then an annotation with the reward (as VERL scores after the loop)."""
    attrs: dict[str, Any] = {"step": step, "sample_index": sample_index, "rollout_n": rollout_n, "validate": validate,
                             "experiment_name": EXPERIMENT}
    base = {"worker": "w0", "project": None, "entity": None, "exception": None, "attributes": attrs}
    spans = []
    for i, (text, tool_args) in enumerate(turns):
        at = t0 + 10 * i
        spans.append({**base, "span_id": f"{trace}-t{i}", "trace_id": trace, "parent_id": trace, "name": "Loop.generate",
                      "kind": "op", "start_time": at, "end_time": at + 1, "inputs": {"prompt_ids": [1, 2, 3]},
                      "output": {"prompt_text": f"<|user|>question {sample_index}<|assistant|>", "response_text": text,
                                 "token_ids": [100 + i, len(text)]}})
        if tool_args is not None:
            failed = tool_args.get("expression") == "bad"
            spans.append({**base, "span_id": f"{trace}-x{i}", "trace_id": trace, "parent_id": trace,
                          "name": "CalculatorTool.execute", "kind": "op", "start_time": at + 2, "end_time": at + 3,
                          "inputs": {"instance_id": "i", "parameters": tool_args},
                          "output": None if failed else {"result": 42},
                          "exception": "ValueError: cannot evaluate 'bad'" if failed else None})
    root_attrs = {**attrs, **({"kept_because": kept_because} if kept_because else {})}
    spans.append({**base, "attributes": root_attrs, "span_id": trace, "trace_id": trace, "parent_id": None,
                  "name": "agent_loop", "kind": "trajectory", "start_time": t0, "end_time": t0 + 100,
                  "inputs": {}, "output": None})
    if reward is not None:
        values: dict[str, Any] = {"reward": reward}
        if advantage is not None:
            values["advantage"] = advantage
        spans.append({"worker": "w0", "project": None, "entity": None, "exception": None, "span_id": f"{trace}-a", "trace_id": trace, "parent_id": None,
                      "name": "annotation", "kind": "annotation", "start_time": t0 + 200, "end_time": t0 + 200,
                      "attributes": values, "inputs": {}, "output": None})
    return spans


WIN = [("call calc", {"expression": "6*7"}), ("The answer is 42.", None)]
LOSE = [("call calc", {"expression": "bad"}), ("I could not compute it.", None), ("Giving up.", None)]
WIN_OTHER_END = [("call calc", {"expression": "6*7"}), ("It is 42.", None)]


def step_spans() -> list[dict[str, Any]]:
    """Step 3: sample 0 a spread group (with trainer advantages), sample 1 all equal, sample 2 unscored;
    step 4: one more group (only the export selects it)."""
    spans = []
    for n, (turns, reward, adv) in enumerate([(LOSE, 0.0, -1.2), (WIN, 1.0, 0.9), (WIN_OTHER_END, 0.5, 0.1), (WIN, 1.0, 0.9)]):
        spans += trajectory(f"s0-n{n}", 3, 0, n, turns, reward=reward, advantage=adv,
                            kept_because="reward_extremes" if reward != 0.5 else None, t0=1000.0 + n)
    for n in range(3):
        spans += trajectory(f"s1-n{n}", 3, 1, n, WIN, reward=1.0, t0=2000.0 + n)
    for n in range(2):
        spans += trajectory(f"s2-n{n}", 3, 2, n, WIN, reward=None, t0=3000.0 + n)
    for n in range(2):
        spans += trajectory(f"s9-n{n}", 4, 0, n, WIN, reward=0.25 * (n + 1), t0=4000.0 + n)
    return spans


def post(url: str, spans: list[dict[str, Any]]) -> None:
    body = orjson.dumps({"v": 1, "worker": "w0", "project": None, "entity": None, "tokenizer": None, "spans": spans})
    response = httpx.post(url + "/v1/spans", content=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["accepted"] == len(spans), response.text


def get(url: str, path: str, **params: Any) -> Any:
    response = httpx.get(url + path, params=params, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture
def fed(start_collector: Any) -> Any:
    col = start_collector()
    post(col.url, step_spans())
    return col


# ---- groups ---------------------------------------------------------------------------------------
def test_groups_rank_rollouts_compute_stats_flag_zero_spread_and_diff_against_the_best(fed):
    page = get(fed.url, "/v1/groups", experiment=EXPERIMENT, step=3)
    assert page["experiment"] == EXPERIMENT and page["step"] == 3 and page["validate"] is False
    assert page["total_groups"] == 3 and page["trajectories"] == 9
    assert page["all_equal_groups"] == 1 and page["unscored_groups"] == 1
    by_key = {g["sample_index"]: g for g in page["groups"]}
    assert [g["sample_index"] for g in page["groups"]] == [0, 1, 2]

    spread = by_key[0]
    rewards = [0.0, 1.0, 0.5, 1.0]
    assert spread["n"] == spread["scored"] == 4
    assert spread["mean"] == pytest.approx(statistics.mean(rewards))
    assert spread["std"] == pytest.approx(statistics.stdev(rewards))  # Bessel-corrected, as GRPO's torch.std
    assert (spread["min"], spread["max"], spread["spread"], spread["all_equal"]) == (0.0, 1.0, 1.0, False)
    # ranked by reward, ties by the trainer's advantage then rollout number; the advantage comes from the annotation
    assert [(r["trace_id"], r["rank"], r["reward"], r["advantage"]) for r in spread["rollouts"]] == [
        ("s0-n1", 1, 1.0, 0.9), ("s0-n3", 2, 1.0, 0.9), ("s0-n2", 3, 0.5, 0.1), ("s0-n0", 4, 0.0, -1.2)]
    assert spread["best"] == "s0-n1" and spread["rollouts"][0]["is_best"] and spread["rollouts"][0]["diff"] is None
    assert spread["prompt_preview"] == "<|user|>question 0<|assistant|>"
    mean, std = statistics.mean(rewards), statistics.stdev(rewards)
    assert spread["rollouts"][3]["group_advantage"] == pytest.approx((0.0 - mean) / (std + 1e-6))

    twin, other_end, loser = (r["diff"] for r in spread["rollouts"][1:])
    assert twin["identical"] and twin["first_differing_turn"] is None
    assert [t["status"] for t in twin["turns"]] == ["same", "same"]
    assert not other_end["identical"] and other_end["first_differing_turn"] == 2
    assert other_end["turns"][0] == {"turn": 1, "response": "same", "common_prefix_chars": len("call calc"),
                                     "tool_calls": "same", "tool_results": "same", "status": "same"}
    assert other_end["turns"][1]["response"] == "different" and other_end["turns"][1]["tool_calls"] == "same"
    assert other_end["turns"][1]["common_prefix_chars"] == 0  # "It is 42." vs "The answer is 42."
    assert loser["first_differing_turn"] == 1
    assert loser["turns"][0]["response"] == "same" and loser["turns"][0]["tool_calls"] == "different"
    assert loser["turns"][0]["tool_results"] == "different"  # the loser's tool call failed
    assert loser["turns"][2] == {"turn": 3, "status": "extra"}
    assert spread["rollouts"][3]["has_error"] is True and spread["rollouts"][3]["tool_errors"] == 1

    equal = by_key[1]
    assert equal["all_equal"] is True and equal["spread"] == 0.0 and equal["std"] == 0.0 and equal["mean"] == 1.0
    unscored = by_key[2]
    assert unscored["scored"] == 0 and unscored["mean"] is None and unscored["all_equal"] is False
    assert unscored["best"] is None and all("diff" not in r for r in unscored["rollouts"])


def test_groups_sort_filter_page_and_are_the_viewers_too(fed):
    def order(**p: Any) -> list[Any]:
        return [g["sample_index"] for g in get(fed.url, "/v1/groups", step=3, diff="false", **p)["groups"]]

    assert order(sort="spread") == [0, 1, 2]  # widest first, unscored last
    assert order(sort="zero_spread") == [1, 0, 2]  # the groups GRPO learns nothing from, first
    assert order(sort="mean") == [1, 0, 2]
    assert order(sort="spread", limit=1, offset=1) == [1]
    assert order(sample_index="1") == [1]  # an opaque key: matched as text
    no_diff = get(fed.url, "/v1/groups", step=3, diff="false")
    assert all("diff" not in r for g in no_diff["groups"] for r in g["rollouts"])
    with_diff = get(fed.url, "/v1/groups", step=3)
    for light, full in zip(no_diff["groups"], with_diff["groups"]):  # the same ranking and advantages, read lighter
        assert [(r["trace_id"], r["advantage"]) for r in light["rollouts"]] == [(r["trace_id"], r["advantage"]) for r in full["rollouts"]]
    # the default experiment is the latest, as on the overview; the viewer's route answers the same
    assert get(fed.url, "/v1/groups", step=3)["experiment"] == EXPERIMENT
    api, ui = get(fed.url, "/v1/groups", step=3), get(fed.url, "/ui/api/groups", step=3)
    api.pop("index"), ui.pop("index")
    assert api == ui
    assert get(fed.url, "/v1/groups", step=99)["groups"] == []
    for bad in ({"sort": "random"}, {}, {"limit": 0}):
        params = {"step": 3, **bad} if bad != {} else {}
        response = httpx.get(fed.url + "/v1/groups", params=params, timeout=10)
        assert response.status_code == 422, (bad, response.text)


def test_a_huge_finite_reward_costs_no_500_and_its_stats_stay_exact(start_collector):
    """Any finite reward is accepted; its square may not be (1e200² overflows a double): the group
    statistics go exact instead of answering 500 for the whole step."""
    col = start_collector()
    spans = []
    for n, reward in enumerate((0.0, 1e200, -1.7e308, 1.7e308)):
        spans += trajectory(f"h-n{n}", 6, n // 2, n, WIN, reward=reward, t0=5000.0 + n)
    post(col.url, spans)
    for path in ("/v1/groups", "/ui/api/groups"):
        for sort in ("spread", "zero_spread", "mean", "sample_index"):
            groups = {g["sample_index"]: g for g in get(col.url, path, step=6, sort=sort)["groups"]}
            assert groups[0]["mean"] == 5e199 and groups[0]["std"] == pytest.approx(7.0710678118654755e199)
            assert groups[1]["mean"] == 0.0 and groups[1]["std"] is None  # past a double: no number to give
    assert GroupStats.of(2, [0.0, 1e200]).spread == 1e200


def test_group_keys_are_opaque_ints_or_strings():
    rows = [{"trace_id": f"t{i}", "sample_index": key, "reward": reward, "rollout_n": i}
            for i, (key, reward) in enumerate([("q-b", 1.0), (3, 0.0), ("q-b", 0.0), (3, 0.0), ("q-a", None)])]
    page = build_groups(rows, lambda _: None, diff=False)
    assert [g["sample_index"] for g in page["groups"]] == [3, "q-a", "q-b"]  # ints, then strings
    assert [g["sample_index"] for g in build_groups(rows, lambda _: None, sort="zero_spread")["groups"]] == [3, "q-b", "q-a"]
    assert build_groups(rows, lambda _: None, sample_index="3")["groups"][0]["n"] == 2
    stats = {"a": GroupStats.of(2, [1.0, 1.0 + 1e-12]), "b": GroupStats.of(1, [0.5])}
    assert stats["a"].all_equal and stats["b"].std is None and order_groups(stats, "spread") == ["a", "b"]
    assert diff_turns([], [])["identical"]


def test_cli_groups_prints_the_table_and_json(fed, capsys):
    cli.main(["groups", "--url", fed.url, "--step", "3", "--sort", "zero_spread"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith(f"step 3 of experiment '{EXPERIMENT}' (train): 3 groups, 9 trajectories; 1 with zero spread")
    assert out.index("sample 1:") < out.index("sample 0:") < out.index("sample 2:")
    assert "ZERO SPREAD" in next(line for line in lines if line.startswith("sample 1:"))
    assert any("s0-n1" in line and line.rstrip().endswith("best") for line in lines)
    assert any("s0-n3" in line and line.rstrip().endswith("same as best") for line in lines)
    assert any("s0-n2" in line and "turn 2 differs: response (response departs at char 0)" in line for line in lines)
    assert any("s0-n0" in line and "turn 1 differs: tool calls, tool results; 1 more turn" in line for line in lines)
    cli.main(["groups", "--url", fed.url, "--step", "3", "--json"])
    printed = json.loads(capsys.readouterr().out)
    api = get(fed.url, "/v1/groups", step=3)
    printed.pop("index"), api.pop("index")
    assert printed == api


# ---- export ---------------------------------------------------------------------------------------
def load(path: Path, fmt: str) -> Any:
    """The exported file through `datasets`, from local files only: the hub switched off (set when
    this module is imported, before anything imports `datasets`) and any non-loopback connect fails."""
    import datasets

    assert datasets.config.HF_DATASETS_OFFLINE
    attempts: list[Any] = []
    real_connect = socket.socket.connect

    def loopback_only(sock: socket.socket, address: Any) -> Any:
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in ("127.0.0.1", "::1", "localhost"):
            attempts.append(address)
            raise OSError(f"test: no network beyond 127.0.0.1 (tried {address})")
        return real_connect(sock, address)

    socket.socket.connect = loopback_only  # type: ignore[method-assign]
    try:
        ds = datasets.load_dataset("json" if fmt == "jsonl" else "parquet", data_files=str(path), split="train",
                                   cache_dir=str(path.parent / "hf-cache"))
    finally:
        socket.socket.connect = real_connect  # type: ignore[method-assign]
    assert attempts == []
    return ds


def export_bytes(url: str, **params: Any) -> bytes:
    with httpx.stream("GET", url + "/v1/export", params=params, timeout=60) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-disposition"].startswith("attachment")
        return b"".join(response.iter_bytes())


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_export_loads_with_datasets_as_chat_with_tool_calls(fed, tmp_path, fmt):
    path = tmp_path / f"all.{fmt}"
    path.write_bytes(export_bytes(fed.url, format=fmt, experiment=EXPERIMENT, token_ids="true"))
    ds = load(path, fmt)
    assert ds.num_rows == 11
    rows = {r["trace_id"]: r for r in ds}
    loser = rows["s0-n0"]
    assert (loser["experiment"], loser["step"], loser["rollout_n"], loser["reward"], loser["advantage"]) == (EXPERIMENT, 3, 0, 0.0, -1.2)
    assert str(loser["sample_index"]) == "0"  # Parquet holds the opaque key as text, JSONL as sent
    assert loser["kept_because"] == "reward_extremes" and loser["has_error"] is True and loser["turns"] == 3
    assert [m["role"] for m in loser["messages"]] == ["user", "assistant", "tool", "assistant", "assistant"]
    user, call, result, *_ = loser["messages"]
    assert user["content"] == "<|user|>question 0<|assistant|>" == loser["prompt"]
    assert call["content"] == "call calc" and call["token_ids"] == [100, len("call calc")]
    [tool_call] = call["tool_calls"]
    assert tool_call["type"] == "function" and tool_call["function"]["name"] == "CalculatorTool"
    assert json.loads(tool_call["function"]["arguments"]) == {"expression": "bad"}
    assert result["tool_call_id"] == tool_call["id"] == "s0-n0-x0" and result["content"].startswith("error: ValueError")
    assert loser["final_response"] == "Giving up."
    assert json.loads(loser["attributes"])["kept_because"] == "reward_extremes"
    assert loser["prompt_ids"] == [1, 2, 3] and loser["response_ids"] == [100, 9, 101, 23, 102, 10]
    winner = rows["s0-n1"]
    assert json.loads(winner["messages"][2]["content"]) == {"result": 42} and winner["messages"][3]["tool_calls"] == []
    assert rows["s2-n0"]["reward"] is None  # unscored trajectories are exported with a null reward


def test_export_filters_match_the_trajectory_list(fed, tmp_path):
    def exported(**params: Any) -> list[str]:
        lines = export_bytes(fed.url, experiment=EXPERIMENT, **params).splitlines()
        return sorted(orjson.loads(line)["trace_id"] for line in lines)

    assert exported(step=4) == ["s9-n0", "s9-n1"]
    assert exported(step_min=3, step_max=3, reward_min=0.5) == ["s0-n1", "s0-n2", "s0-n3", "s1-n0", "s1-n1", "s1-n2"]
    assert exported(reward_max=0.3) == ["s0-n0", "s9-n0"]
    assert exported(kept_because="reward_extremes") == ["s0-n0", "s0-n1", "s0-n3"]
    assert exported(step=3, sample_index="1") == ["s1-n0", "s1-n1", "s1-n2"]
    assert exported(step=3, sample_index="1", limit=2) == ["s1-n0", "s1-n1"]
    assert exported(step=99) == []
    listed = get(fed.url, "/v1/trajectories", experiment=EXPERIMENT, step_min=3, reward_min=0.5, limit=100)
    assert exported(step_min=3, reward_min=0.5) == sorted(t["trace_id"] for t in listed["trajectories"])
    line = orjson.loads(export_bytes(fed.url, step=4, limit=1).splitlines()[0])
    assert "prompt_ids" not in line and "token_ids" not in line["messages"][1]  # token ids only when asked
    bad = httpx.get(fed.url + "/v1/export", params={"format": "csv"}, timeout=10)
    assert bad.status_code == 422 and "format" in bad.text


def test_cli_export_writes_files_datasets_loads(fed, tmp_path, capsys):
    out = tmp_path / "kept.parquet"
    cli.main(["export", "--url", fed.url, "-o", str(out), "--experiment", EXPERIMENT, "--kept-because", "reward_extremes"])
    assert capsys.readouterr().out.startswith(f"wrote 3 trajectories, {out.stat().st_size} bytes of parquet to {out}")
    assert sorted(load(out, "parquet")["trace_id"]) == ["s0-n0", "s0-n1", "s0-n3"]
    jsonl = tmp_path / "step4.jsonl"
    cli.main(["export", "--url", fed.url, "-o", str(jsonl), "--step", "4", "--token-ids"])
    assert "wrote 2 trajectories" in capsys.readouterr().out
    assert load(jsonl, "jsonl")["response_ids"] == [[100, 9, 101, 17]] * 2
    assert not (tmp_path / "step4.jsonl.partial").exists()
    with pytest.raises(SystemExit) as failed:  # an HTTP error: no file, the collector's reason
        cli.main(["export", "--url", fed.url, "-o", str(tmp_path / "x.jsonl"), "--limit", "0"])
    assert "422" in str(failed.value) and not (tmp_path / "x.jsonl").exists()


def trainer_note(trace: str, **values: Any) -> dict[str, Any]:
    """What client.annotate(traj, trained=..., filtered_by=...) sends: an annotation span on the trajectory."""
    return {"worker": "w0", "project": None, "entity": None, "exception": None, "span_id": f"{trace}-trainer",
            "trace_id": trace, "parent_id": None, "name": "annotation", "kind": "annotation", "start_time": 9000.0,
            "end_time": 9000.0, "attributes": values, "inputs": {}, "output": None}


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_export_selects_by_what_the_trainer_did_as_the_list_does(fed, tmp_path, fmt):
    """trained= and filtered_by= (and q=) select in /v1/export and `tracecar export` as in /v1/trajectories;
    the records say what the trainer did, and load with `datasets`."""
    notes = [trainer_note(f"s1-n{n}", trained=False, filtered_by="zero_variance") for n in range(3)]  # the all-equal group
    notes += [trainer_note(f"s0-n{n}", trained=True, policy_version=2, trained_on_version=3) for n in range(4)]
    notes.append(trainer_note("s9-n0", trained=False, filtered_by="overlong"))
    post(fed.url, notes)
    cases = [({"trained": "false"}, ["s1-n0", "s1-n1", "s1-n2", "s9-n0"]),
             ({"trained": "true"}, ["s0-n0", "s0-n1", "s0-n2", "s0-n3"]),
             ({"filtered_by": "zero_variance"}, ["s1-n0", "s1-n1", "s1-n2"]),
             ({"trained": "false", "step": 4}, ["s9-n0"]),
             ({"filtered_by": "nothing"}, []),
             ({"q": "giving up"}, ["s0-n0"])]
    for i, (params, expected) in enumerate(cases):
        path = tmp_path / f"sel{i}.{fmt}"
        path.write_bytes(export_bytes(fed.url, format=fmt, experiment=EXPERIMENT, **params))
        if not expected:
            assert fmt == "parquet" or path.read_bytes() == b"", params
            continue
        ds = load(path, fmt)
        assert sorted(ds["trace_id"]) == expected, params
        listed = get(fed.url, "/v1/trajectories", experiment=EXPERIMENT, limit=100, **params)
        assert sorted(t["trace_id"] for t in listed["trajectories"]) == expected, params  # the list agrees
    ds = load(tmp_path / f"sel1.{fmt}", fmt)
    row = next(r for r in ds if r["trace_id"] == "s0-n0")
    assert (row["trained"], row["filtered_by"], row["policy_version"], row["trained_on_version"]) == (True, None, 2, 3)
    row = next(r for r in load(tmp_path / f"sel0.{fmt}", fmt) if r["trace_id"] == "s9-n0")
    assert (row["trained"], row["filtered_by"]) == (False, "overlong")
    out = tmp_path / f"cli.{fmt}"
    cli.main(["export", "--url", fed.url, "-o", str(out), "--experiment", EXPERIMENT, "--trained", "false",
              "--filtered-by", "zero_variance"])
    assert sorted(load(out, fmt)["trace_id"]) == ["s1-n0", "s1-n1", "s1-n2"]


# ---- constant memory ------------------------------------------------------------------------------
def write_store(path: Path, trajectories: int) -> int:
    """A store written straight into the spool (fast): trajectories of 4 turns, 2 tool calls, ~4 KiB of text."""
    spool = Spool(path, local_only=True)
    text = "lorem ipsum dolor sit amet " * 40
    written = 0
    batch: list[dict[str, Any]] = []
    for i in range(trajectories):
        turns = [(f"{text} {i} {k}", {"expression": f"{k}+{i}"} if k % 2 == 0 else None) for k in range(4)]
        batch += trajectory(f"m{i:06d}", i // 64, i % 16, (i // 16) % 4, turns, reward=(i % 7) / 7, t0=10.0 + i)
        if len(batch) >= 5000:
            spool.write([SpoolRow(s, orjson.dumps(s), None) for s in batch])
            written += len(batch)
            batch = []
    spool.write([SpoolRow(s, orjson.dumps(s), None) for s in batch])
    written += len(batch)
    spool.close()
    return written


def peak_while_exporting(url: str, dest: Path, **params: Any) -> tuple[int, int]:
    """(tracemalloc peak bytes of the whole process, collector and client, while streaming; rows written)."""
    tracemalloc.start()
    try:
        with httpx.stream("GET", url + "/v1/export", params=params, timeout=120) as response, dest.open("wb") as out:
            assert response.status_code == 200
            for chunk in response.iter_bytes():
                out.write(chunk)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    if params.get("format") == "parquet":
        import pyarrow.parquet as pq

        return peak, pq.ParquetFile(dest).metadata.num_rows
    with dest.open("rb") as f:
        return peak, sum(1 for _ in f)


def test_export_streams_a_big_store_in_bounded_memory(start_collector, tmp_path):
    trajectories = 4000
    data = tmp_path / "big"
    data.mkdir()
    spans = write_store(data / "spool.sqlite3", trajectories)
    assert spans == trajectories * 8
    col = start_collector(data_dir=data)
    started = time.monotonic()
    deadline = started + 120
    while not get(col.url, "/ui/api/status")["index"]["caught_up"]:  # index the store first (not measured)
        assert time.monotonic() < deadline, "trajectory index did not catch up"
        time.sleep(0.2)
    for fmt in ("jsonl", "parquet"):
        small_peak, small_rows = peak_while_exporting(col.url, tmp_path / f"small.{fmt}", format=fmt, limit=trajectories // 8)
        full_peak, full_rows = peak_while_exporting(col.url, tmp_path / f"full.{fmt}", format=fmt)
        assert (small_rows, full_rows) == (trajectories // 8, trajectories)
        size = (tmp_path / f"full.{fmt}").stat().st_size
        print(f"{fmt}: {full_rows} trajectories, {size >> 20} MiB written; peak traced "
              f"{small_peak >> 20} MiB for {small_rows}, {full_peak >> 20} MiB for {full_rows}")
        # 8x the data, about the same memory: nothing grows with the selection
        assert full_peak < 1.5 * small_peak + (4 << 20), (fmt, small_peak, full_peak)
        assert full_peak < 64 << 20
        if fmt == "jsonl":
            assert size > 8 * full_peak  # the output is far bigger than what was held at once
    assert time.monotonic() - started < 200


# ---- the groups page, in Chromium --------------------------------------------------------------------
def test_groups_page_from_the_overview_and_from_a_trajectory(fed, tmp_path):
    from tests.test_viewer import Page, _browser, expect
    from tests.test_viewer_lookfeel import doc_shot

    with _browser() as pw:
        b = Page(pw, tmp_path, fed.url)
        page = b.page
        try:
            page.goto(fed.url + "/ui/#/")
            page.wait_for_selector("[data-testid=step-row][data-step='3']")
            page.locator("[data-testid=step-row][data-step='3'] [data-testid=groups-zero]").click()  # one click
            page.wait_for_selector("[data-testid=group]")
            groups = page.locator("[data-testid=group]")
            assert groups.evaluate_all("gs => gs.map(g => g.dataset.sampleIndex)") == ["1", "0", "2"]
            assert groups.first.locator("[data-testid=zero-spread]").count() == 1
            assert page.locator("[data-testid=zero-spread]").count() == 1
            assert "1 with zero spread" in page.locator("[data-testid=groups-summary]").inner_text()
            b.shot("groups-01-zero-spread-first")

            page.locator("[data-testid=groups-sort]").select_option("spread")
            expect(groups.first).to_have_attribute("data-sample-index", "0")
            spread = groups.first
            rows = spread.locator("[data-testid=rollout-row]")
            assert rows.count() == 4
            assert [rows.nth(i).locator("td").nth(2).inner_text() for i in range(4)] == ["1.000", "1.000", "0.500", "0.000"]
            assert rows.nth(1).locator("[data-testid=same-as-best]").count() == 1
            chips = rows.nth(3).locator("[data-testid=turn-chip]")
            assert chips.all_inner_texts() == ["▸1", "2", "3"]
            assert "tool calls differ" in chips.first.get_attribute("title")
            b.shot("groups-02-widest-spread-first")
            doc_shot(page, "groups")
            rows.nth(3).locator("[data-testid=compare-with-best]").click()
            page.wait_for_selector("[data-testid=compare-grid]")
            cols = page.locator("[data-testid=compare-col]")
            assert [cols.nth(i).get_attribute("data-trace-id") for i in range(cols.count())] == ["s0-n1", "s0-n0"]

            page.goto(fed.url + "/ui/#/t/s0-n2")
            page.locator("[data-testid=its-group]").click()
            page.wait_for_selector("[data-testid=group]")
            assert page.locator("[data-testid=group]").evaluate_all("gs => gs.map(g => g.dataset.sampleIndex)") == ["0"]
            b.shot("groups-03-from-a-trajectory")
            b.check_clean()
        finally:
            b.close()


def test_groups_and_export_of_trajectories_sent_by_the_real_client(start_collector, tracer_to, tmp_path):
    """The client's rollout_trace_attr / rollout_trace_op / annotate(advantage=...) end to end."""
    import asyncio

    from tracecar.client import annotate, rollout_trace_attr, rollout_trace_op

    @rollout_trace_op
    async def generate(prompt_ids: list[int], reply: str) -> dict[str, Any]:
        return {"response_text": reply, "token_ids": [len(reply)]}

    async def rollouts() -> None:
        for sample in range(2):
            for n in range(3):
                with rollout_trace_attr(sample_index=sample, step=7, rollout_n=n, name="agent_loop") as traj:
                    await generate([1, 2], "right" if n == 0 else "wrong")
                reward = 1.0 if n == 0 and sample == 0 else 0.0
                annotate(traj, reward=reward, advantage=reward - 1 / 3 if sample == 0 else 0.0)

    col = start_collector()
    tracer = tracer_to(col.url, experiment="client-exp")
    asyncio.run(rollouts())
    assert tracer.flush(30)
    page = get(col.url, "/v1/groups", step=7, experiment="client-exp", sort="zero_spread")
    assert [(g["sample_index"], g["all_equal"], g["n"]) for g in page["groups"]] == [(1, True, 3), (0, False, 3)]
    winner = page["groups"][1]["rollouts"][0]
    assert (winner["rollout_n"], winner["reward"], winner["advantage"]) == (0, 1.0, pytest.approx(2 / 3))
    loser = page["groups"][1]["rollouts"][1]
    assert loser["diff"]["first_differing_turn"] == 1 and loser["diff"]["turns"][0]["response"] == "different"
    path = tmp_path / "client.jsonl"
    path.write_bytes(export_bytes(col.url, experiment="client-exp", sample_index="0"))
    ds = load(path, "jsonl")
    assert sorted(zip(ds["rollout_n"], ds["reward"], ds["final_response"])) == [(0, 1.0, "right"), (1, 0.0, "wrong"), (2, 0.0, "wrong")]


def test_export_undoes_the_chat_template_when_only_the_decoded_prompt_exists(start_collector, tracer_to, tmp_path):
    """A loop that records token ids only: the export reads the messages back out of the templated text
    (here Llama 3's), and a loop that takes ``messages`` (any chat-shaped input) has them exported as given."""
    import asyncio

    from tracecar.client import rollout_trace_attr, rollout_trace_op

    templated = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                 "<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")

    @rollout_trace_op
    async def generate(prompt_ids: list[int]) -> dict[str, Any]:
        return {"prompt_text": templated, "response_text": "4.<|eot_id|>", "token_ids": [7, 8]}

    @rollout_trace_op
    async def chat_loop(conversation: list[dict[str, Any]], **options: Any) -> dict[str, Any]:
        return await generate([1, 2, 3])

    async def rollouts() -> None:
        with rollout_trace_attr(sample_index=0, step=1, rollout_n=0, name="agent_loop"):
            await generate([1, 2, 3])
        with rollout_trace_attr(sample_index=1, step=1, rollout_n=0, name="agent_loop"):
            await chat_loop([{"role": "user", "content": "What is 2+2, exactly?"}], temperature=0.5)

    col = start_collector()
    tracer = tracer_to(col.url, experiment="templated")
    asyncio.run(rollouts())
    assert tracer.flush(30)
    rows = {r["sample_index"]: r for r in map(orjson.loads, export_bytes(col.url, experiment="templated").splitlines())}
    assert [(m["role"], m["content"]) for m in rows[0]["messages"]] == [("system", "Be brief."), ("user", "2+2?"), ("assistant", "4.")]
    assert rows[0]["prompt"] == templated  # the decoded text itself stays in its own column
    assert [(m["role"], m["content"]) for m in rows[1]["messages"]] == [("user", "What is 2+2, exactly?"), ("assistant", "4.")]


def test_groups_page_script_ships_and_names_no_other_origin():
    from tracecar.collector.viewer import routes as viewer

    assert "groups.js" in viewer._static_files()
    text = (viewer.STATIC / "groups.js").read_text()
    assert "http://" not in text and "https://" not in text and "//cdn" not in text
    assert 'src="static/groups.js"' in (viewer.STATIC / "index.html").read_text()
