"""The ids the viewer shows work in the CLI (issue 31, item 7): `tracecar show` / `tracecar tokens` take
the viewer's short form (…000000e7), a unique prefix or the full id; a prefix that matches several
names them; a sampled-out id answers with its sampling decision, not a bare 404."""

from __future__ import annotations

import secrets
import subprocess
import sys
from typing import Any

import httpx
import pytest

from tests.conftest import FaultKit
from tests.test_viewer import demo_collector, get
from tracecar.client.cli.quickstart import wait_for_decisions

pytestmark = pytest.mark.timeout(240)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tracecar.client.cli", *args], capture_output=True, text=True, timeout=60)


def viewer_form(trace_id: str) -> str:
    """As the viewer's fmt.id shows an id (app.js): an ellipsis and the last 8 characters."""
    return "…" + trace_id[-8:]


def test_viewer_forms_prefixes_and_sampled_out_ids_in_show_and_tokens(start_collector, tracer_to, deepseek_tokenizer_path) -> None:
    col = demo_collector(start_collector, tracer_to, deepseek_tokenizer_path, max_trajectories_per_step=16, step_idle_s=1)
    assert wait_for_decisions(col.url, "demo", 3).get("decisions")
    kept = get(col, "/v1/trajectories", experiment="demo", step=2, limit=100)["trajectories"]
    one = kept[0]["trace_id"]
    for form in (viewer_form(one), "..." + one[-8:]):
        shown = cli("show", "--url", col.url, form)
        assert shown.returncode == 0 and shown.stdout.startswith(f"trajectory {one} ("), (form, shown.stdout, shown.stderr)
        tokens = cli("tokens", "--url", col.url, form)
        assert tokens.returncode == 0 and tokens.stdout.startswith(f"trajectory {one}:"), (form, tokens.stdout, tokens.stderr)
        truth = cli("truth", "--url", col.url, form)  # every command that takes an id reads it the same way
        assert truth.returncode == 0 and one in truth.stdout, (form, truth.stdout, truth.stderr)
        truth_api = httpx.get(col.url + "/v1/trajectories/" + form + "/truth")
        assert truth_api.status_code == 200 and truth_api.json()["trace_id"] == one, truth_api.text
    api = httpx.get(col.url + "/v1/trajectories/" + viewer_form(one))
    assert api.status_code == 200 and api.json()["trace_id"] == one

    # random ids (OpenTelemetry's, other clients'): a prefix is unique
    kit = FaultKit()
    spans = kit.trajectory(2, experiment="exp-ids")
    random_id = secrets.token_hex(16)
    for span in spans:
        span["trace_id"] = random_id
        span["parent_id"] = random_id if span["parent_id"] is not None else None
        if span["name"] == "agent_loop":
            span["span_id"] = random_id
    assert kit.post(col.url, spans).status_code == 200
    assert FaultKit.wait_for(lambda: httpx.get(col.url + "/v1/trajectories/" + random_id).status_code == 200)
    shown = cli("show", "--url", col.url, random_id[:10])
    assert shown.returncode == 0 and shown.stdout.startswith(f"trajectory {random_id} ("), shown.stderr

    ambiguous = cli("show", "--url", col.url, one[:6])  # the client's ids share their first characters within a process
    assert ambiguous.returncode == 1
    line = ambiguous.stderr.strip()
    assert line.startswith(f"tracecar: the collector answered HTTP 404 Not Found: trace_id: '{one[:6]}' matches more than 5 "
                           "trajectories (") and line.endswith("): give more characters"), line

    decisions = get(col, "/v1/decisions", experiment="demo", step=2)["decisions"]
    dropped: dict[str, Any] = next(d for d in decisions if not d["keep"])
    expected = (f"trajectory {dropped['trace_id']} was sampled out ({dropped['reason']}) at experiment 'demo', step 2, "
                f"sample_index {dropped['sample_index']}, rollout_n {dropped['rollout_n']}: see tracecar decisions --step 2 "
                "--experiment demo")
    for form in (dropped["trace_id"], viewer_form(dropped["trace_id"])):
        out = cli("show", "--url", col.url, form)
        assert out.returncode == 1 and out.stderr.strip() == f"tracecar: the collector answered HTTP 404 Not Found: trace_id: {expected}", out.stderr
    answer = httpx.get(col.url + "/v1/trajectories/" + dropped["trace_id"]).json()["error"]
    assert answer["sampling_decision"]["reason"] == dropped["reason"] and answer["sampling_decision"]["keep"] is False

    missing = cli("show", "--url", col.url, "…zzzzzzzz")
    assert missing.returncode == 1 and "no trajectory '…zzzzzzzz' in the store (nor in the sampling decisions)" in missing.stderr
    short = cli("show", "--url", col.url, "…e7")
    assert short.returncode == 1 and "of 4 characters at least" in short.stderr
