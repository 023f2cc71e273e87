"""One list (issue 15): /v1/trajectories, /ui/api/trajectories, q= search, /v1/export and /v1/live
take one filter (collector/trajectory_filter.py) over one index, so they agree row for row, and
``experiment=""`` means "sent without an experiment name" on every path."""

from __future__ import annotations

import time
from typing import Any

import httpx
import orjson
import pytest

from tests.test_groups_export import EXPERIMENT, LOSE, WIN, export_bytes, post, trainer_note, trajectory
from tracecar.client import cli

pytestmark = pytest.mark.timeout(240)


def anonymous(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for span in spans:
        span["attributes"] = {k: v for k, v in span["attributes"].items() if k != "experiment_name"}
    return spans


@pytest.fixture
def fed(start_collector: Any) -> Any:
    col = start_collector()
    spans: list[dict[str, Any]] = []
    for n, (turns, reward) in enumerate([(LOSE, 0.0), (WIN, 1.0), (WIN, 0.5), (LOSE, 0.25)]):
        spans += trajectory(f"e-n{n}", 3 + n % 2, n % 2, n, turns, reward=reward, t0=1000.0 + n,
                            kept_because="fill" if n % 2 else None)
    spans += anonymous(trajectory("anon-0", 3, 0, 0, WIN, reward=0.75, t0=2000.0))
    spans += anonymous([s for s in trajectory("anon-run", 3, 5, 0, WIN, t0=time.time()) if s["parent_id"] is not None])
    post(col.url, spans)
    post(col.url, [trainer_note("e-n1", trained=False, filtered_by="zero_variance"), trainer_note("e-n0", trained=True)])
    return col


def ids(answer: dict[str, Any]) -> list[str]:
    return [t["trace_id"] for t in answer["trajectories"]]


def test_the_api_and_the_viewer_list_the_same_rows_for_every_filter_and_sort(fed):
    cases: list[dict[str, Any]] = [
        {}, {"experiment": EXPERIMENT}, {"experiment": ""}, {"step": 3}, {"step_min": 4}, {"sample_index": "1"},
        {"rollout_n": 2}, {"validate": "false"}, {"kept_because": "fill"}, {"reward_min": 0.5}, {"reward_max": 0.3},
        {"has_error": "true"}, {"worker": "w0"}, {"trained": "false"}, {"filtered_by": "zero_variance"},
        {"q": "giving up"}, {"q": "answer", "experiment": ""}, {"worker": "", "filtered_by": ""},
    ]
    for params in cases:
        for sort in ("start", "reward", "turns", "advantage"):
            for order in ("asc", "desc"):
                query = {**params, "sort": sort, "order": order, "limit": 3, "offset": 1}
                api = httpx.get(fed.url + "/v1/trajectories", params=query, timeout=30)
                viewer = httpx.get(fed.url + "/ui/api/trajectories", params=query, timeout=30)
                assert api.status_code == viewer.status_code == 200, (query, api.text, viewer.text)
                a, v = api.json(), viewer.json()
                assert (a["total"], a["trajectories"]) == (v["total"], v["trajectories"]), query
                assert a["index"]["caught_up"] and (a["limit"], a["offset"]) == (3, 1)
    page = httpx.get(fed.url + "/v1/trajectories", params={"experiment": EXPERIMENT, "sort": "reward"}, timeout=30).json()
    assert ids(page) == ["e-n1", "e-n2", "e-n3", "e-n0"] and page["total"] == 4
    row = page["trajectories"][0]
    assert (row["trained"], row["filtered_by"], row["span_count"], row["has_error"], row["reward"]) == (False, "zero_variance", 4, False, 1.0)
    assert row["response_preview"] == "The answer is 42." and row["turns"] == 2  # the index's columns too


def test_an_empty_experiment_means_no_experiment_name_on_every_path(fed, tmp_path, capsys):
    assert ids(httpx.get(fed.url + "/v1/trajectories", params={"experiment": ""}, timeout=30).json()) == ["anon-0"]
    assert ids(httpx.get(fed.url + "/ui/api/trajectories", params={"experiment": ""}, timeout=30).json()) == ["anon-0"]
    assert ids(httpx.get(fed.url + "/v1/trajectories", params={"experiment": "", "q": "answer"}, timeout=30).json()) == ["anon-0"]
    exported = [orjson.loads(line)["trace_id"] for line in export_bytes(fed.url, experiment="").splitlines()]
    assert exported == ["anon-0"]
    live = httpx.get(fed.url + "/v1/live", params={"experiment": ""}, timeout=30).json()
    assert [t["trace_id"] for t in live["trajectories"]] == ["anon-run"]
    assert httpx.get(fed.url + "/v1/live", params={"experiment": EXPERIMENT}, timeout=30).json()["total"] == 0
    groups = httpx.get(fed.url + "/v1/groups", params={"experiment": "", "step": 3}, timeout=30).json()
    assert [r["trace_id"] for g in groups["groups"] for r in g["rollouts"]] == ["anon-0"]
    cli.main(["trajectories", "--url", fed.url, "--experiment", "", "--json"])
    assert ids(__import__("json").loads(capsys.readouterr().out)) == ["anon-0"]


def test_the_cli_list_takes_every_filter_the_api_has(fed, capsys):
    cli.main(["trajectories", "--url", fed.url, "--experiment", EXPERIMENT, "--kept-because", "fill", "--has-error", "false",
              "--reward-min", "0.5", "--step-min", "3", "--step-max", "4", "--worker", "w0", "--sort", "turns"])
    out = capsys.readouterr().out
    assert out.startswith("1 trajectories") and "e-n1" in out and "dropped (zero_variance)" in out


def test_a_list_right_after_an_ingest_shows_it(fed):
    for i in range(5):
        post(fed.url, trajectory(f"late-{i}", 9, i, 0, WIN, reward=0.1 * i, t0=5000.0 + i))
        got = httpx.get(fed.url + "/v1/trajectories", params={"step": 9}, timeout=30).json()
        assert got["total"] == i + 1 and got["index"]["caught_up"], got["index"]


def test_page_shows_tracing_health_per_step_and_exports_the_lists_selection(fed, tmp_path):
    """The overview's *Tracing health* card (GET /ui/api/health?step=: the totals and the chosen
    step's numbers) and the list's export links (GET /ui/api/export: the list's filters), in Chromium."""
    from tests.test_groups_export import load
    from tests.test_viewer import Page, _browser, expect
    from tests.test_viewer_lookfeel import doc_shot

    with _browser() as pw:
        b = Page(pw, tmp_path, fed.url)
        page = b.page
        try:
            page.goto(fed.url + f"/ui/#/?experiment={EXPERIMENT}")
            step = page.locator("[data-testid=health-step]")
            expect(step).to_contain_text("step 4: 2 stored")  # the latest step is chosen first
            expect(page.locator("[data-testid=health-client_dropped]")).to_have_text("0 dropped by the workers")
            page.locator("[data-testid=step-row][data-step='3'] td").nth(1).click()
            expect(step).to_contain_text("step 3: 2 stored")
            expect(page.locator("[data-testid=health-step-errors]")).to_have_text("1 with an error")
            expect(page.locator("[data-testid=health-step-trainer]")).to_have_text("trainer: 1 trained, 0 dropped")
            expect(page.locator("[data-testid=health-step-sampling]")).to_contain_text("kept 0, dropped 0")
            page.locator("[data-testid=health]").scroll_into_view_if_needed()
            b.shot("40-overview-health")
            doc_shot(page, "health")

            page.goto(fed.url + f"/ui/#/list?experiment={EXPERIMENT}&trained=false")
            expect(page.locator("[data-testid=page-info]")).to_have_text("1–1 of 1")
            link = page.locator("[data-testid=export-jsonl]")
            assert "trained=false" in link.get_attribute("href") and "sort=" not in link.get_attribute("href")
            with page.expect_download() as download:
                link.click()
            path = tmp_path / "from-the-list.jsonl"
            download.value.save_as(path)
            assert load(path, "jsonl")["trace_id"] == ["e-n1"]  # the list's one row, as a dataset
            b.shot("41-list-export-links")
            doc_shot(page, "export")
            b.check_clean()
        finally:
            b.close()
