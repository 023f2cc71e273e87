"""Free-form attribute filters (issue 31, item 11): `attr=key=value` on /v1/trajectories (and the viewer's
list, export, `tracecar trajectories --attr`) keeps the trajectories whose root attribute equals the value:
strings, numbers, booleans, dotted keys into a mapping; a malformed one is a 422 naming `attr`. The
viewer's list filters with it in Debian's Chromium (screenshot in artifacts/viewer/)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import pytest

from tests.test_viewer import Page, _browser, expect
from tracecar.client import rollout_trace_attr, rollout_trace_op

pytestmark = pytest.mark.timeout(240)


@rollout_trace_op
async def generate(prompt_ids: list[int]) -> dict[str, object]:
    return {"response_ids": [1, 2]}


def test_attribute_filters_in_the_api_cli_export_and_viewer(start_collector, tracer_to, tmp_path) -> None:
    col = start_collector()
    tracer = tracer_to(col.url, experiment="attrs")
    setups = [("calc", 0.7, True, "a"), ("calc", 1.0, False, "b"), ("search", 0.7, False, "a"), ("search", 1.0, True, "b")]

    async def run() -> list[str]:
        ids = []
        for i, (tool, temperature, sandbox, region) in enumerate(setups):
            with rollout_trace_attr(sample_index=i, step=1, rollout_n=0, name="agent_loop", tool=tool, temperature=temperature,
                                    sandbox=sandbox, env={"region": region}) as traj:
                await generate([1])
            ids.append(traj.span_id)
        return ids

    ids = asyncio.run(run())
    assert tracer.flush(20)

    def listed(*attrs: str) -> set[str]:
        got = httpx.get(col.url + "/v1/trajectories", params={"experiment": "attrs", "attr": list(attrs), "limit": 100}, timeout=30)
        assert got.status_code == 200, got.text
        return {t["trace_id"] for t in got.json()["trajectories"]}

    assert listed() == set(ids)
    assert listed("tool=calc") == {ids[0], ids[1]}
    assert listed("attributes.temperature=0.7") == {ids[0], ids[2]}
    assert listed("tool=calc", "temperature=0.7") == {ids[0]}
    assert listed("tool=calc; temperature=1.0") == {ids[1]}
    assert listed("sandbox=true") == {ids[0], ids[3]} and listed("sandbox=false") == {ids[1], ids[2]}
    assert listed("env.region=b") == {ids[1], ids[3]}
    assert listed("tool=nothing") == set() and listed("no_such_key=1") == set()
    bad = httpx.get(col.url + "/v1/trajectories", params={"attr": "tool"}, timeout=10)
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "attr" and "give key=value" in bad.json()["error"]["reason"]
    bad = httpx.get(col.url + "/v1/trajectories", params={"attr": "x') OR 1=1 --=1"}, timeout=10)
    assert bad.status_code == 422  # the key is checked, never spliced into SQL
    exported = httpx.get(col.url + "/v1/export", params={"experiment": "attrs", "attr": "tool=search"}, timeout=30).text.splitlines()
    assert len(exported) == 2

    cli = subprocess.run([sys.executable, "-m", "tracecar.client.cli", "trajectories", "--url", col.url, "--experiment", "attrs",
                          "--attr", "tool=search", "--attr", "sandbox=true"], capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0 and cli.stdout.startswith("1 trajectories") and ids[3] in cli.stdout, cli.stdout + cli.stderr
    # the same filters on the CLI's export and groups (one argument set: cli/truth.py add_list_arguments)
    out = tmp_path / "search.jsonl"
    cli = subprocess.run([sys.executable, "-m", "tracecar.client.cli", "export", "--url", col.url, "-o", str(out),
                          "--experiment", "attrs", "--attr", "tool=search", "--attr", "sandbox=true"],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0 and "wrote 1 trajectories" in cli.stdout, cli.stdout + cli.stderr
    assert [json.loads(line)["trace_id"] for line in out.read_text().splitlines()] == [ids[3]]
    cli = subprocess.run([sys.executable, "-m", "tracecar.client.cli", "groups", "--url", col.url, "--experiment", "attrs",
                          "--step", "1", "--attr", "tool=calc", "--json"], capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert sorted(g["sample_index"] for g in json.loads(cli.stdout)["groups"]) == [0, 1]
    cli = subprocess.run([sys.executable, "-m", "tracecar.client.cli", "groups", "--url", col.url, "--step", "1", "--attr", "tool"],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode != 0 and "attr" in cli.stderr and "key=value" in cli.stderr, cli.stdout + cli.stderr

    with _browser() as pw:
        b = Page(pw, tmp_path, col.url)
        page = b.page
        try:
            page.goto(col.url + "/ui/#/list?experiment=attrs")
            expect(page.locator("[data-testid=traj-row]")).to_have_count(4)
            page.locator("[data-testid=filter-attr]").fill("tool=calc; env.region=b")
            page.locator("[data-testid=apply-filters]").click()
            expect(page.locator("[data-testid=traj-row]")).to_have_count(1)
            assert page.locator("[data-testid=traj-row]").get_attribute("data-trace-id") == ids[1]
            assert "attr=" in page.url
            b.shot("41-list-attribute-filter")
            b.check_clean()
        finally:
            b.close()
