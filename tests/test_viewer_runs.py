"""Run against run (issue 31, item 11): two experiments, or two checkpoints (steps) of one, joined on the
sample index, with each side's group mean and best reward, the change, and a link comparing the best
rollouts. The numbers are checked against /v1/groups; the page runs in Debian's Chromium."""

from __future__ import annotations

import asyncio

import pytest

from tests.test_viewer import Page, _browser, expect, get, js_fixed
from tracecar.client.demo import run_demo

pytestmark = pytest.mark.timeout(240)


def test_runs_page_joins_two_experiments_on_the_sample_index(start_collector, tracer_to, deepseek_tokenizer_path, tmp_path) -> None:
    col = start_collector(token2text=True, tokenizer=deepseek_tokenizer_path)
    for experiment, seed in (("run-a", 0), ("run-b", 1)):  # two runs of the same prompts, different sampling
        tracer = tracer_to(col.url, experiment=experiment, project="p")
        assert asyncio.run(run_demo(2, 8, 4, seed)) == 64
        assert tracer.flush(30)
    a = {g["sample_index"]: g for g in get(col, "/v1/groups", experiment="run-a", step=2, diff="false", limit=100)["groups"]}
    b = {g["sample_index"]: g for g in get(col, "/v1/groups", experiment="run-b", step=2, diff="false", limit=100)["groups"]}
    assert set(a) == set(b) and len(a) == 8
    deltas = {k: b[k]["mean"] - a[k]["mean"] for k in a}

    with _browser() as pw:
        view = Page(pw, tmp_path, col.url)
        page = view.page
        try:
            page.goto(col.url + "/ui/#/runs")
            page.locator("[data-testid=runs-a]").select_option("run-a")
            page.locator("[data-testid=runs-step-a]").fill("2")
            page.locator("[data-testid=runs-b]").select_option("run-b")
            page.locator("[data-testid=runs-step-b]").fill("2")
            page.get_by_role("button", name="Compare runs").click()
            expect(page.locator("[data-testid=runs-row]")).to_have_count(8)
            assert "a=run-a" in page.url and "step_b=2" in page.url
            for row in page.locator("[data-testid=runs-row]").all():
                k = int(row.get_attribute("data-sample-index") or "-1")
                assert row.locator("[data-testid=runs-mean-a]").inner_text() == js_fixed(a[k]['mean'], 3)
                assert row.locator("[data-testid=runs-mean-b]").inner_text() == js_fixed(b[k]['mean'], 3)
                shown = row.locator("[data-testid=runs-delta]").inner_text()
                assert float(shown) == pytest.approx(deltas[k], abs=6e-4), (k, shown)
            summary = page.locator("[data-testid=runs-summary]").inner_text()
            better = sum(d > 0 for d in deltas.values())
            assert "8 sample indices in both" in summary and f"B better on {better}," in summary, summary
            view.shot("39-runs-run-a-vs-run-b")
            first = page.locator("[data-testid=runs-row]").first
            k = int(first.get_attribute("data-sample-index") or "-1")
            first.locator("[data-testid=runs-compare]").click()
            cols = page.locator("[data-testid=compare-col]")
            expect(cols).to_have_count(2)
            assert [cols.nth(i).get_attribute("data-trace-id") for i in range(2)] == [a[k]["best"], b[k]["best"]]
            expect(page.locator("[data-testid=compare-summary]")).to_have_text("All 2 answer the same prompt.")  # the same sample
            view.shot("40-runs-best-vs-best")
            view.check_clean()
        finally:
            view.close()
