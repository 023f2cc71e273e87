"""One contract, two read stores: every read API answers the same on SQLite and on ClickHouse (issue 26, item 4).

Three collector processes on 127.0.0.1, one with ``TRACECAR_STORE=sqlite`` (the default), one
with ``TRACECAR_STORE=clickhouse`` (embedded chDB) and one with ``TRACECAR_STORE_URL`` naming a
ClickHouse server (ClickHouse's HTTP interface served by chDB in its own process,
tests/support/clickhouse_http.py, reached through clickhouse-connect), take the same VERL-shaped workload
(tests/cluster_workload.py: 4 experiments × 2 steps × 10 prompts × 4 rollouts over 8 workers,
tail budgets with every rule, decoded with a real tokenizer, rewards and advantages as trainer
annotations, some trainer verdicts). Then every read API is asked the same questions on each:
``/v1/trajectories`` with each filter, each sort in both orders and pages, ``q=`` search,
``/v1/groups`` of every step, one trajectory, its tokens, ``/v1/export`` (JSONL), the per-step
``/v1/health``, and the viewer's facets and overview. Answers must be equal (the stores' own
progress, ``index``, aside). The ClickHouse collector must really answer from chDB: its lists say
``store: clickhouse`` and its data dir holds the table's parts; a restart resumes (nothing lost,
nothing doubled) from the index's change cursor.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.cluster_workload import EXPERIMENTS, PER_STEP, STEPS, TAIL_BUDGETS, Trajectory, batches, post, workload
from tests.support import ProcessCollector, stop_process
from tests.support.clickhouse_http import ClickHouseHttp
from tests.support.cluster import process_collector, wait_until

pytestmark = pytest.mark.timeout(420)

SORTS = ("start", "reward", "turns", "duration", "step", "sample_index", "rollout_n", "tools", "tokens", "spans", "advantage")


WORDS = ("tool", "call", "reward", "prompt", "answer", "step", "rollout", "calculator", "sum", "é", "数字")


def worded(small_bpe_path: str) -> list[Trajectory]:
    """The workload with each turn's ids the tokenizer's encoding of a few words (what search and previews show);
    every third trajectory's second turn extends the first exactly (the others drift: their prompt starts again), and
    roots carry attributes of every JSON kind (``attr=``)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(small_bpe_path)
    out = workload()
    for n, t in enumerate(out):
        context: list[int] = []
        for i, span in enumerate(s for s in t.spans if s["name"] == "AsyncLLMServerManager.generate"):
            words = [WORDS[(n * 3 + i * 5 + k * 7) % len(WORDS)] + ("" if k else str(n % 13)) for k in range(4)]
            ids = tokenizer.encode(" ".join(words)).ids
            prompt = context if i and n % 3 == 0 else tokenizer.encode(f"question {n} about {WORDS[n % len(WORDS)]}").ids
            span["output"] = {**span["output"], "response_ids": ids, "response_logprobs": [-0.5] * len(ids)}
            span["inputs"] = {**span["inputs"], "prompt_ids": prompt}
            context = prompt + ids
        root = next(s for s in t.spans if s["parent_id"] is None)
        root["attributes"] = {**root["attributes"], "data_source": ("gsm8k", "math")[n % 2], "flag": n % 4 == 0,
                              "temperature": (0.1, 0.2, 0.1 + 0.2)[n % 3],  # 0.30000000000000004: matched as 0.3
                              "meta": {"level": n % 3, "tags": ["a", "b"], "note": None}, "odd key": 1}
    return out


def trainer_row(t: Trajectory, shift: float, same_ids: bool) -> dict[str, str]:
    """The trainer's batch row of a two-turn trajectory whose second turn extends the first (tests/test_viewer_truth.py's
    packing): the first prompt, both responses, masked as generated; ``shift`` added to some old log-probabilities."""
    import base64
    import struct

    first, second = [s for s in t.spans if s["name"] == "AsyncLLMServerManager.generate"]
    response = first["output"]["response_ids"] + second["output"]["response_ids"]
    if not same_ids:
        response = response[::-1]
    old = [-0.5 + (shift if j % 3 == 0 else 0.0) for j in range(len(response))]

    def b64(kind: str, values: list[Any]) -> str:
        return base64.b64encode(struct.pack(f"<{len(values)}{kind}", *values)).decode()

    return {"prompt_ids": b64("i", first["inputs"]["prompt_ids"]), "response_ids": b64("i", response),
            "mask": b64("B", [1] * len(response)), "old_log_probs": b64("f", old)}


def verdicts(trajectories: list[Trajectory]) -> list[tuple[str, list[dict[str, Any]]]]:
    """The trainer's side, as client.annotate and the VERL hooks send it: verdicts (trained or filtered, and why) and
    reward components for some trajectories, fates and refills for others, and trainer rows (the tokens trained on,
    some not the ones generated, some with log-probabilities apart) for two-turn trajectories that extend."""
    out = []
    for i, t in enumerate(trajectories):
        attrs: dict[str, Any] = {}
        if t.experiment == "exp-traj" and i % 3 == 0:
            attrs = {"trained": i % 2 == 0} | ({} if i % 2 == 0 else {"filtered_by": "all_equal"})
        if i % 4 == 1:
            attrs["reward_extra_info"] = {"acc": i % 8 == 1, "format": (0.0, 0.5, 1.0)[i % 3], "pred": "41"}
        if i % 5 == 2:
            attrs |= ({"fate": "evicted", "fate_reason": "stale"}, {"fate": "filtered", "fate_reason": "dapo"},
                      {"fate": "trained"}, {"refill_of": f"g{i}"})[i % 4]
        output = {"trainer_tokens": trainer_row(t, 0.3 * (i % 2), i % 4 != 3)} if i % 3 == 0 and i % 7 < 4 else None
        if attrs or output:
            out.append((t.worker, [{"span_id": f"{t.trace_id}-v", "trace_id": t.trace_id, "parent_id": None,
                                    "name": "trainer", "kind": "annotation", "start_time": 1_800_000_000.0,
                                    "end_time": 1_800_000_000.0, "attributes": attrs, "output": output}]))
    return out


def decided(url: str) -> bool:
    for experiment in EXPERIMENTS:
        for step in STEPS:
            answer = httpx.get(url + "/v1/decisions", params={"experiment": experiment, "step": step}, timeout=30).json()
            if len(answer["decisions"]) != PER_STEP or answer["open"]:
                return False
    return True


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory, small_bpe_path: str) -> Iterator[dict[str, ProcessCollector]]:
    """The three collectors (SQLite, embedded chDB, a ClickHouse server over HTTP), fed the same workload, every
    step decided."""
    root = tmp_path_factory.mktemp("contract")
    server = ClickHouseHttp(root / "clickhouse-server")
    common = dict(tokenizer=small_bpe_path, log_level="warning", store_batch_rows=64, token2text=True, **TAIL_BUDGETS)
    made = {store: process_collector(root / store, store=store, **common) for store in ("sqlite", "clickhouse")}
    made["server"] = process_collector(root / "server", store="clickhouse", store_url=server.url(), **common)
    try:
        for pc in made.values():
            pc.start()
        trajectories = worded(small_bpe_path)
        with httpx.Client() as client:
            for worker, spans in [*batches(trajectories), *verdicts(trajectories)]:
                for pc in made.values():
                    post(client, pc.url, worker, spans)
        for pc in made.values():
            wait_until(lambda pc=pc: decided(pc.url), 120, "every step decided")
        yield made
    finally:
        for pc in made.values():
            if pc.proc is not None and pc.proc.poll() is None:
                stop_process(pc.proc, grace_s=20)
        server.stop()


def _get(url: str, path: str, **params: Any) -> Any:
    r = httpx.get(url + path, params=params, timeout=60)
    assert r.status_code == 200, (path, params, r.text[:500])
    if r.headers["content-type"].startswith("application/json"):
        answer = r.json()
        if isinstance(answer, dict):
            answer.pop("index", None)  # each store's own progress
        return answer
    return r.content


def same(stores: dict[str, ProcessCollector], path: str, **params: Any) -> Any:
    """The answer of every store to one request, asserted equal to SQLite's; returns it."""
    want = _get(stores["sqlite"].url, path, **params)
    for name in ("clickhouse", "server"):
        got = _get(stores[name].url, path, **params)
        assert got == want, (name, path, params)
    return want


def test_lists_filters_sorts_and_pages_answer_the_same(stores: dict[str, ProcessCollector]) -> None:
    for name in ("clickhouse", "server"):
        state = httpx.get(stores[name].url + "/v1/trajectories", params={"limit": 1}, timeout=30).json()["index"]
        assert state["store"] == "clickhouse" and state["store_pending"] == 0, (name, state)
    # the server's collector keeps no chDB of its own: its rows are the server's (its data dir holds the claim only)
    server_dir = Path(stores["server"].env["TRACECAR_DATA_DIR"])
    assert not (server_dir / "clickhouse").exists() and (server_dir / "clickhouse-owner").exists()
    everything = same(stores, "/v1/trajectories", limit=1000)
    kept = everything["total"]
    assert 0 < kept < len(EXPERIMENTS) * len(STEPS) * PER_STEP  # the budgets chose
    assert any(t["prompt_preview"] for t in everything["trajectories"])  # decoded texts, previewed
    assert any(t["trained"] is False for t in everything["trajectories"])  # the trainer's verdicts
    # the promoted inclusion probability: the uniform draw's chance (k of n, from the shared workload's budget) where
    # it is one, on both stores
    chance = {t["experiment"]: set() for t in everything["trajectories"]}
    for t in everything["trajectories"]:
        chance[t["experiment"]].add(t["inclusion_probability"])
    uniform = orjson.loads(TAIL_BUDGETS["budgets"])["exp-uniform"]["max_trajectories_per_step"] / PER_STEP
    assert chance["exp-uniform"] == {uniform} and chance["exp-traj"] == {None}, chance
    for sort, order in itertools.product(SORTS, ("asc", "desc")):
        first = same(stores, "/v1/trajectories", sort=sort, order=order, limit=1000)
        assert first["total"] == kept
        paged = [same(stores, "/v1/trajectories", sort=sort, order=order, limit=7, offset=off)["trajectories"]
                 for off in (0, 7, kept - 3)]
        assert [t["trace_id"] for t in paged[0] + paged[1]] == [t["trace_id"] for t in first["trajectories"][:14]]
    row = everything["trajectories"][0]
    filters: list[dict[str, Any]] = [
        {"experiment": "exp-group"}, {"experiment": ""}, {"step": 2}, {"step_min": 2}, {"step_max": 1},
        {"sample_index": "3"}, {"rollout_n": 1}, {"validate": "false"}, {"kept_because": row["kept_because"]},
        {"reward_min": 0.5}, {"reward_max": 0.25}, {"has_error": "true"}, {"has_error": "false"}, {"worker": "w3"},
        {"trained": "false"}, {"trained": "true"}, {"filtered_by": "all_equal"},
        {"experiment": "exp-traj", "step": 1, "sort": "reward", "order": "asc"},
    ]
    # the root's attributes (answered from the mirrored attributes column on ClickHouse, the root's payload on SQLite)
    matching = [{"attr": "data_source=math"}, {"attr": "flag=true"}, {"attr": "meta.level=2"},
                {"attr": "temperature=0.3"}, {"attr": "temperature=0.1"}, {"attr": ["data_source=gsm8k", "flag=false"]},
                {"attr": "step=2"}, {"attr": "experiment_name=exp-topk", "step": 1}, {"attr": "meta.note=null"}]
    nothing = [{"attr": "meta=x"}, {"attr": "meta.tags=a"}, {"attr": 'meta.tags=["a","b"]'}, {"attr": "meta.tags.0=a"},
               {"attr": 'meta={"level":0}'}, {"attr": "meta.note=x"}, {"attr": "no_such=1"},
               {"attr": "temperature=0.30000000000000004"}, {"attr": "data_source="}]
    # the training truth (the mirrored truth columns on ClickHouse, the index's truth tables on SQLite)
    matching += [{"drift": "true"}, {"drift": "false"}, {"where": "acc=1"}, {"where": "format>=0.5,acc=0"},
                 {"where": "acc!=1"}, {"fate": "trained"}, {"fate": "filtered"}, {"fate": "evicted"},
                 {"fate": "not_reached"}, {"refill": "true"}, {"refill": "false"}, {"trained_other": "true"},
                 {"trained_other": "false"}, {"lp_delta_min": 0.2}, {"drift": "false", "attr": "data_source=gsm8k"}]
    nothing += [{"where": "pred=41"}, {"where": "no_such>0"}, {"lp_delta_min": 5}]
    for flt in filters + matching + nothing:
        answer = same(stores, "/v1/trajectories", limit=1000, **flt)
        assert (answer["total"] > 0) == (flt not in [{"experiment": ""}, *nothing]), (flt, answer["total"])
        if flt in matching:  # the same filters on a step's groups and on export
            for path, params in (("/v1/groups", {"experiment": "exp-traj", "step": 1, "limit": 1000}),
                                 ("/v1/export", {"format": "jsonl"})):
                same(stores, path, **{**params, **flt})
    texts = " ".join(f"{t['prompt_preview']} {t['response_preview']}" for t in everything["trajectories"])
    assert "calculator" in texts and "数字" in texts, texts[:300]
    # a word with a number (as "rollout5"), taken from what the budgets kept (the shared workload's budgets change)
    numbered = next(w for w in texts.split() if w.rstrip(".,").startswith("rollout") and w.rstrip(".,")[7:].isdigit())
    for q in ("calculator", "calcul", "Reward answer", numbered.rstrip(".,"), "数字", "E", "no-such-word-anywhere"):
        answer = same(stores, "/v1/trajectories", q=q, limit=1000)
        assert (answer["total"] > 0) == (q != "no-such-word-anywhere"), q


def test_groups_one_trajectory_tokens_export_health_and_viewer_answer_the_same(stores: dict[str, ProcessCollector]) -> None:
    for experiment, step in itertools.product(EXPERIMENTS, STEPS):
        answer = same(stores, "/v1/groups", experiment=experiment, step=step, limit=1000)
        assert answer["groups"], (experiment, step)
        health = [_get(pc.url, "/v1/health", experiment=experiment, step=step)["step"] for pc in stores.values()]
        assert health[0] == health[1] and health[0]["trajectories"] > 0
    same(stores, "/v1/groups", step=1, sort="spread", limit=1000)
    ids = [t["trace_id"] for t in same(stores, "/v1/trajectories", limit=5, sort="reward")["trajectories"]]
    for trace_id in ids:
        same(stores, f"/v1/trajectories/{trace_id}")
        same(stores, f"/v1/trajectories/{trace_id}/tokens")
        same(stores, f"/ui/api/trajectories/{trace_id}")
    for params in ({}, {"experiment": "exp-uniform"}, {"q": "the", "step": 2}):
        body = same(stores, "/v1/export", format="jsonl", **params)
        assert isinstance(body, bytes) and (body or params.get("q"))
        assert all(orjson.loads(line)["trace_id"] for line in body.splitlines())
    same(stores, "/ui/api/facets")
    for experiment in EXPERIMENTS:
        same(stores, "/ui/api/overview", experiment=experiment)
        same(stores, "/ui/api/trajectories", experiment=experiment, sort="reward", limit=50)


def test_the_clickhouse_store_is_chdb_and_resumes_after_a_restart(stores: dict[str, ProcessCollector]) -> None:
    pc = stores["clickhouse"]
    data = Path(pc.env["TRACECAR_DATA_DIR"]) / "clickhouse"
    assert any(p.name.startswith("all_") for p in data.rglob("*") if p.is_dir())  # MergeTree parts on disk
    want = same(stores, "/v1/trajectories", limit=1000, sort="start")
    assert pc.proc is not None
    pc.kill()  # SIGKILL: whatever the cursor had not forgotten is inserted again, and collapses
    pc.start()
    assert _get(pc.url, "/v1/trajectories", limit=1000, sort="start") == want
    # changes after the restart reach ClickHouse through the same cursor, replacing the rows they change
    # (of experiments without a byte or token limit: a late span past its step's limit is not kept)
    listed = [t for t in want["trajectories"] if t["trained"] is None and t["experiment"] in ("exp-uniform", "exp-topk")][:5]
    with httpx.Client() as client:
        for t in listed:
            note = {"span_id": f"{t['trace_id']}-late", "trace_id": t["trace_id"], "parent_id": None, "name": "trainer",
                    "kind": "annotation", "start_time": 1_900_000_000.0, "end_time": 1_900_000_000.0,
                    "attributes": {"trained": True, "advantage": 9.5, "reward_extra_info": {"late": 1}, "fate": "evicted"}}
            for target in stores.values():
                post(client, target.url, t["worker"], [note])
    after = same(stores, "/v1/trajectories", limit=1000, sort="advantage", order="desc")
    assert after["total"] == want["total"]  # replaced, not added
    assert {t["trace_id"] for t in after["trajectories"][:5]} == {t["trace_id"] for t in listed}
    # the truth columns of rows ClickHouse already held are replaced too (a reward component, a fate, both late)
    for flt in ({"where": "late=1"}, {"fate": "evicted", "where": "late>0"}):
        late = same(stores, "/v1/trajectories", limit=1000, **flt)
        assert {t["trace_id"] for t in late["trajectories"]} == {t["trace_id"] for t in listed}, flt
    assert all(t["trained"] is True and t["advantage"] == 9.5 for t in after["trajectories"][:5])


def test_a_failing_clickhouse_store_is_a_503_naming_it_without_paths_and_counted(tmp_path: Path) -> None:
    """chDB refusing statements (here: its table's directory replaced by a file) is not a full disk beside the
    spool: readers get a 503 + Retry-After naming the ClickHouse store and the engine's error, never its
    message's file paths; each refused statement counts in tracecar_store_errors_total{store="clickhouse"}."""
    import shutil

    from tests.support.collector import metric_value

    pc = process_collector(tmp_path / "ch", store="clickhouse", log_level="warning").start()
    try:
        plan = list(batches(workload()))
        with httpx.Client() as client:
            for worker, spans in plan[:4]:
                post(client, pc.url, worker, spans)
        assert httpx.get(pc.url + "/v1/trajectories", timeout=30).status_code == 200
        tables = [p for p in (tmp_path / "ch" / "clickhouse" / "store").glob("*/*") if p.is_dir()]
        assert tables
        for table in tables:  # the engine can no longer write its parts
            shutil.rmtree(table)
            table.write_text("not a directory")
        with httpx.Client() as client:
            for worker, spans in plan[4:8]:
                post(client, pc.url, worker, spans)
        r = httpx.get(pc.url + "/v1/trajectories", timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"], r.text
        detail = r.text
        assert "ClickHouse store" in detail and "retry later" in detail, detail
        assert "disk" not in detail and "/" not in detail, detail
        assert metric_value(httpx.get(pc.url + "/metrics", timeout=10).text, "tracecar_store_errors_total",
                            store="clickhouse") >= 1
        assert str(tmp_path) in pc.log_text()  # the operator's log has the engine's full message
    finally:
        if pc.proc is not None and pc.proc.poll() is None:
            stop_process(pc.proc, grace_s=20)


def test_killed_mid_insert_the_clickhouse_store_shows_each_trajectory_once(tmp_path: Path) -> None:
    """SIGKILL while the store drains a backlog one trajectory per insert (some inserted, some not, one maybe
    inserted and not yet forgotten): after the restart every trajectory is listed and exported exactly once."""
    pc = process_collector(tmp_path / "ch", store="clickhouse", store_batch_rows=1, list_catch_up_s=0.05,
                           log_level="warning").start()
    try:
        trajectories = workload()
        with httpx.Client() as client:
            for worker, spans in batches(trajectories):
                post(client, pc.url, worker, spans)
        want = {t.trace_id for t in trajectories}

        def state() -> dict[str, Any]:
            return httpx.get(pc.url + "/v1/trajectories", params={"limit": 1}, timeout=30).json()["index"]

        pending: list[int] = []
        wait_until(lambda: pending.append(state()["store_pending"]) or 0 < pending[-1] < len(want) - 20, 60,
                   "the store part-way through its backlog", poll_s=0.02)
        pc.kill()
        pc.start()
        wait_until(lambda: state()["caught_up"], 60, "caught up after the restart")
        page = httpx.get(pc.url + "/v1/trajectories", params={"limit": 1000}, timeout=30).json()
        ids = [t["trace_id"] for t in page["trajectories"]]
        assert page["total"] == len(ids) == len(set(ids)) and set(ids) == want, (page["total"], len(ids), len(set(ids)))
        exported = [orjson.loads(line)["trace_id"] for line in
                    httpx.get(pc.url + "/v1/export", timeout=60).content.splitlines()]
        assert sorted(exported) == sorted(want)
        for experiment in EXPERIMENTS:
            for step in STEPS:
                health = _get(pc.url, "/v1/health", experiment=experiment, step=step)["step"]
                assert health["trajectories"] == PER_STEP, (experiment, step, health)
        print(f"\nkilled with store_pending={pending[-1]} of {len(want)}")
    finally:
        if pc.proc is not None and pc.proc.poll() is None:
            stop_process(pc.proc, grace_s=20)
