"""`tracecar doctor` from a worker's environment (issue 12, item 10): one PASS/FAIL line per check,
an actionable FAIL, exit 1 on any FAIL; its test trajectory goes to experiment tracecar-doctor."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.conftest import FaultKit
from tests.support import clean_env, free_port
from tests.support.weave_stub import WeaveStub

pytestmark = pytest.mark.timeout(180)


def doctor(*args: str, **env: str) -> tuple[int, dict[str, str], str]:
    full = clean_env()
    full.update(env)
    done = subprocess.run([sys.executable, "-m", "tracecar.client.cli", "doctor", "--timeout", "8", *args], env=full,
                          capture_output=True, text=True, timeout=120)
    checks = {}
    for line in done.stdout.splitlines():
        verdict, _, rest = line.partition("  ")
        assert verdict in ("PASS", "FAIL"), line  # every line is a verdict
        checks[rest.split(":", 1)[0]] = verdict + ":" + rest.split(":", 1)[1]
    return done.returncode, checks, done.stdout + done.stderr


def test_all_pass_on_a_healthy_collector_and_the_probe_is_readable(start_collector, deepseek_tokenizer_path: str) -> None:
    col = start_collector(token="tok", token2text=True, tokenizer=deepseek_tokenizer_path)
    rc, checks, out = doctor(TRACECAR_URL=col.url, TRACECAR_TOKEN="tok")
    assert rc == 0, out
    assert list(checks) == ["TRACECAR_URL", "collector", "ready", "token", "tokenizer", "spans", "backend"], out
    assert all(v.startswith("PASS") for v in checks.values()), out
    assert "sent and read back" in checks["spans"] and "local store" in checks["backend"]
    listed = httpx.get(col.url + "/v1/trajectories", params={"experiment": "tracecar-doctor"},
                       headers={"Authorization": "Bearer tok"}).json()
    assert listed["total"] == 1  # its own experiment, never a real one's budget
    assert httpx.get(col.url + "/v1/trajectories", params={"experiment": "demo"},
                     headers={"Authorization": "Bearer tok"}).json()["total"] == 0


def test_wrong_token_fails_with_the_fix(start_collector) -> None:
    col = start_collector(token="right")
    rc, checks, out = doctor(TRACECAR_URL=col.url, TRACECAR_TOKEN="wrong")
    assert rc == 1
    assert checks["token"].startswith("FAIL") and "set it to the collector's TRACECAR_TOKEN" in checks["token"], out
    assert "wrong" not in checks["token"].replace("refused", "")


def test_collector_down_and_url_without_scheme(start_collector) -> None:
    rc, checks, out = doctor(TRACECAR_URL=f"http://127.0.0.1:{free_port()}")
    assert rc == 1 and checks["collector"].startswith("FAIL: cannot reach the collector"), out
    col = start_collector()
    rc, checks, out = doctor(TRACECAR_URL=col.url.removeprefix("http://"))
    assert rc == 1 and checks["TRACECAR_URL"].startswith("FAIL") and "has no scheme" in checks["TRACECAR_URL"], out
    assert checks["spans"].startswith("PASS"), out  # the rest still runs against the fixed URL


def test_tokenizer_the_collector_cannot_load(start_collector, tmp_path) -> None:
    # the operator allows the models directory, but this model is not in it
    col = start_collector(token2text=True, tokenizer_root=str(tmp_path / "models"))
    missing = str(tmp_path / "models" / "qwen")
    rc, checks, out = doctor("--tokenizer", missing, TRACECAR_URL=col.url)
    assert rc == 1
    line = checks["tokenizer"]
    assert line.startswith("FAIL") and f"cannot load {missing!r}" in line and "tried: no file or directory" in line, out
    assert "set TRACECAR_TOKENIZER" in line
    assert checks["spans"].startswith("PASS")  # spans still arrive, only without text
    # a path outside what the operator allows: refused unread, and the line says how to allow it
    rc, checks, out = doctor("--tokenizer", "/etc/passwd", TRACECAR_URL=col.url)
    line = checks["tokenizer"]
    assert rc == 1 and line.startswith("FAIL") and "refused" in line and "TRACECAR_TOKENIZER_ROOT" in line, out
    assert "None" not in line and "tried:" not in line


def test_weave_unreachable_fails_and_reachable_passes(start_collector, weave_stub: WeaveStub) -> None:
    key = FaultKit.WANDB_KEY
    down = start_collector(backend="weave", wandb_api_key=key, wandb_entity="team", wandb_project="rl",
                           weave_server_url=f"http://127.0.0.1:{free_port()}", forward_retry_initial_s=0.05,
                           forward_retry_max_s=0.1)
    rc, checks, out = doctor(TRACECAR_URL=down.url)
    assert rc == 1 and checks["backend"].startswith("FAIL: the collector cannot forward to weave"), out
    assert "ConnectError" in checks["backend"] and "check WANDB_API_KEY" in checks["backend"] and key not in out
    up = start_collector(backend="weave", wandb_api_key=key, wandb_entity="team", wandb_project="rl",
                         weave_server_url=weave_stub.url)
    rc, checks, out = doctor(TRACECAR_URL=up.url)
    assert rc == 0 and checks["backend"].startswith("PASS: the collector forwards to weave"), out
    assert weave_stub.completed_calls()


def test_tokenizer_root_without_a_model_in_it_fails_and_with_one_passes(start_collector, tmp_path, deepseek_tokenizer_path: str) -> None:
    # the README's VERL set-up: token2text with TRACECAR_TOKENIZER_ROOT, the workers name the model (tokenizer_path)
    import shutil

    models = tmp_path / "models"
    models.mkdir()
    col = start_collector(token2text=True, tokenizer_root=str(models))
    rc, checks, out = doctor(TRACECAR_URL=col.url)
    assert rc == 1 and checks["tokenizer"].startswith("FAIL"), out
    assert f"no tokenizer.json under TRACECAR_TOKENIZER_ROOT={models} on the collector: mount the model" in checks["tokenizer"]
    (models / "org" / "qwen").mkdir(parents=True)
    shutil.copy(deepseek_tokenizer_path, models / "org" / "qwen" / "tokenizer.json")
    rc, checks, out = doctor(TRACECAR_URL=col.url)
    assert rc == 0 and checks["tokenizer"].startswith("PASS"), out
    assert f"found under {models}: {models / 'org' / 'qwen'} (vocabulary" in checks["tokenizer"]
    assert "tracecar doctor --tokenizer PATH" in checks["tokenizer"]
