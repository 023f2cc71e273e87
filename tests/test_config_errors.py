"""Config mistakes are one clear line and a non-zero exit, and `config` validates as `serve` does
(issue 12, items 7 and 8). Each test makes the mistake through the real command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import clean_env, free_port

pytestmark = pytest.mark.timeout(120)


def env_for(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = clean_env()
    env.update({"TRACECAR_DATA_DIR": str(tmp_path / "data"), "TRACECAR_HOST": "127.0.0.1",
                "TRACECAR_PORT": str(free_port())})
    env.update(extra)
    return env


def tracecar(args: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tracecar.client.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tracecar: "), done.stderr  # no traceback
    assert "Traceback" not in done.stderr
    return lines[0]


@pytest.mark.parametrize("command", ["config", "serve"])
def test_missing_config_file(command: str, tmp_path: Path) -> None:
    line = one_line_error(tracecar([command, "--config", str(tmp_path / "nope.yaml")], env_for(tmp_path)))
    assert f"config file {tmp_path / 'nope.yaml'}: no such file" in line


@pytest.mark.parametrize("command", ["config", "serve"])
def test_unknown_yaml_key_names_it_with_did_you_mean(command: str, tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max_trajectory_per_step: 8\n")
    line = one_line_error(tracecar([command, "--config", str(cfg)], env_for(tmp_path)))
    assert "unknown setting 'max_trajectory_per_step'" in line and "did you mean 'max_trajectories_per_step'" in line


def test_unknown_budget_key_inside_budgets(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("budgets:\n  grpo:\n    max_group_per_step: 2\n")
    line = one_line_error(tracecar(["serve", "--config", str(cfg)], env_for(tmp_path)))
    assert "budgets.grpo.max_group_per_step: unknown setting" in line and "did you mean 'max_groups_per_step'" in line


@pytest.mark.parametrize("command", ["config", "serve"])
def test_bad_yaml_is_one_line_with_position(command: str, tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("port: [1\n  a: b\n")
    line = one_line_error(tracecar([command, "--config", str(cfg)], env_for(tmp_path)))
    assert "not valid YAML at line 2" in line


def test_bad_value_names_the_field(tmp_path: Path) -> None:
    line = one_line_error(tracecar(["config"], env_for(tmp_path, TRACECAR_PORT="99999")))
    assert "port:" in line and "65535" in line


def test_wandb_key_without_entity_fails_config_and_serve_alike(tmp_path: Path) -> None:
    env = env_for(tmp_path, WANDB_API_KEY="k" * 40)
    from_config = one_line_error(tracecar(["config"], env))
    from_serve = one_line_error(tracecar(["serve"], env))
    assert from_config == from_serve
    assert "no W&B entity is set: set WANDB_ENTITY" in from_config
    assert "k" * 40 not in from_config


def test_wandb_standard_variables_are_honoured(tmp_path: Path) -> None:
    import json

    env = env_for(tmp_path, WANDB_API_KEY="k" * 40, WANDB_ENTITY="my-team", WANDB_PROJECT="rl-runs",
                  WANDB_BASE_URL="https://wandb.example.com")
    done = tracecar(["config"], env)
    assert done.returncode == 0, done.stderr
    cfg = json.loads(done.stdout)
    assert cfg["wandb_entity"] == "my-team" and cfg["wandb_project"] == "rl-runs"
    assert cfg["weave_server_url"] == "https://wandb.example.com/traces" and cfg["effective_backend"] == "weave"
    # the tracecar-specific names win over W&B's own
    env.update(TRACECAR_WANDB_ENTITY="other", WF_TRACE_SERVER_URL="http://127.0.0.1:1/t")
    cfg = json.loads(tracecar(["config"], env).stdout)
    assert cfg["wandb_entity"] == "other" and cfg["weave_server_url"] == "http://127.0.0.1:1/t"


def test_unknown_tracecar_variable_is_warned_with_did_you_mean(tmp_path: Path) -> None:
    done = tracecar(["config"], env_for(tmp_path, TRACECAR_MAX_TRAJECTORY_PER_STEP="4"))
    assert done.returncode == 0
    assert ("TRACECAR_MAX_TRAJECTORY_PER_STEP is not a tracecar setting and is ignored "
            "(did you mean 'TRACECAR_MAX_TRAJECTORIES_PER_STEP'?)") in done.stderr


@pytest.mark.parametrize("command", ["config", "serve"])
def test_configured_tokenizer_that_cannot_load_stops_startup(command: str, tmp_path: Path) -> None:
    missing = tmp_path / "models" / "qwen" / "tokenizer.json"
    env = env_for(tmp_path, TRACECAR_TOKEN2TEXT="true", TRACECAR_TOKENIZER=str(missing))
    line = one_line_error(tracecar([command], env))
    assert f"TRACECAR_TOKENIZER: tokenizer {str(missing)!r} not found" in line
    assert "mount the model's tokenizer.json" in line


def test_token2text_without_tokenizer_warns_at_start(tmp_path: Path) -> None:
    done = tracecar(["config"], env_for(tmp_path, TRACECAR_TOKEN2TEXT="true"))
    assert done.returncode == 0
    assert "token2text is on but TRACECAR_TOKENIZER is unset" in done.stderr


def test_serve_on_a_busy_port_is_one_line(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = tracecar(["serve"], env_for(tmp_path, TRACECAR_PORT=str(port)))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines == [f"tracecar: port {port} on 127.0.0.1 is already in use (another collector?): stop it, or set "
                     "--port N / TRACECAR_PORT=N (0 picks a free one)"]


@pytest.mark.parametrize("command", ["config", "serve"])
def test_an_empty_token_is_refused_rather_than_turning_auth_off(command: str, tmp_path: Path) -> None:
    line = one_line_error(tracecar([command], env_for(tmp_path, TRACECAR_TOKEN="")))
    assert "token" in line and "is set but empty" in line and "unset TRACECAR_TOKEN" in line


@pytest.mark.parametrize("command", ["config", "serve"])
def test_a_tokenizer_root_that_does_not_exist_stops_startup(command: str, tmp_path: Path) -> None:
    """Issue 31, item 5: every tokenizer the workers name under it would fail, batch after batch."""
    missing = tmp_path / "models"
    line = one_line_error(tracecar([command], env_for(tmp_path, TRACECAR_TOKEN2TEXT="true", TRACECAR_TOKENIZER_ROOT=str(missing))))
    assert line == (f"tracecar: TRACECAR_TOKENIZER_ROOT={missing} does not exist on this collector: mount the model directory "
                    "there (read-only, at the path the workers' tokenizer_path names), or unset it")
    missing.mkdir()
    done = tracecar(["config"], env_for(tmp_path, TRACECAR_TOKEN2TEXT="true", TRACECAR_TOKENIZER_ROOT=str(missing)))
    assert done.returncode == 0 and done.stderr == "", done.stderr  # the README's VERL set-up: no warning either
