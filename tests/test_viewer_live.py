"""Live rollouts in the viewer (issue 31, item 9): each running trajectory links to its page (its spans so
far), shows its experiment, and each step says how many of its trajectories are done (n of m). The API,
the CLI and the page in Debian's Chromium (screenshots in artifacts/viewer/)."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

from tests.test_live import Agent
from tests.test_viewer import Page, _browser, expect
from tracecar.client import annotate, rollout_trace_attr
from tracecar.client.cli import main as cli_main

pytestmark = pytest.mark.timeout(240)


def test_live_rows_link_to_their_trajectory_with_experiment_and_step_progress(start_collector, tracer_to, kit, tmp_path, capsys) -> None:
    col = start_collector()
    tracer = tracer_to(col.url, experiment="exp-live")
    release = threading.Event()
    release.set()
    for i in range(3):  # three of step 3 done
        with rollout_trace_attr(sample_index=i, step=3, rollout_n=0, name="agent_loop") as traj:
            Agent(release).generate("q")
        annotate(traj, reward=1.0)
    hang = threading.Event()

    def body() -> None:
        with rollout_trace_attr(sample_index=7, step=3, rollout_n=1, name="agent_loop"):
            Agent(hang).run("2+2?")

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    try:
        assert tracer.flush(20)
        page: dict[str, Any] = kit.wait_for(lambda: (p := httpx.get(col.url + "/v1/live", timeout=10).json())["total"] == 1
                                            and p["trajectories"][0]["spans"] == 2 and p)
        assert page["steps"] == [{"experiment": "exp-live", "step": 3, "done": 3, "running": 1, "total": 4}]
        running = page["trajectories"][0]["trace_id"]
        cli_main(["live", "--url", col.url])
        assert "step 3 of 'exp-live': 3 of 4 trajectories done, 1 running" in capsys.readouterr().out

        with _browser() as pw:
            b = Page(pw, tmp_path, col.url)
            view = b.page
            try:
                view.goto(col.url + "/ui/#/live")
                row = view.locator(f"[data-testid=live-row][data-trace-id='{running}']")
                expect(row).to_have_count(1)
                expect(row.locator("[data-testid=live-experiment]")).to_have_text("exp-live")
                expect(view.locator("[data-testid=live-step-progress][data-step='3'] [data-testid=live-step-done]")).to_have_text(
                    " 3 of 4 trajectories done")
                assert view.locator("[data-testid=live-step-progress] progress").get_attribute("value") == "3"
                b.shot("33-live-rows-link-step-progress")
                row.locator("[data-testid=live-link]").click()
                view.wait_for_selector(f"[data-testid=trajectory][data-trace-id='{running}']")
                assert view.url.endswith("#/t/" + running)
                expect(view.locator("[data-testid=trajectory]")).to_contain_text("Agent.search")  # its spans so far
                expect(view.locator("[data-testid=trajectory]")).to_contain_text("exp-live")  # filed as its spans say
                b.shot("34-live-row-opened")
                b.check_clean()
            finally:
                b.close()
    finally:
        hang.set()
        thread.join(10)
