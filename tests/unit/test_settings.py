"""Collector settings: precedence (flags > environment > YAML > defaults), names and bounds, and
the one-line errors `tracecar serve` / `tracecar config` print for every mistake."""

from __future__ import annotations

from pathlib import Path

import pytest

from tracecar.collector.service.config_check import ConfigError, load_checked_settings
from tracecar.collector.settings import CollectorSettings, load_settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No TRACECAR_* / W&B variable of the machine running the tests leaks in."""
    import os

    for name in list(os.environ):
        if name.startswith(("TRACECAR_", "WANDB_", "WF_TRACE", "MLFLOW_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("TRACECAR_CONFIG", "")  # load_settings may set it: monkeypatch restores it
    return monkeypatch


def test_flags_beat_the_environment_which_beats_the_yaml_file(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    config = tmp_path / "tracecar.yaml"
    config.write_text("port: 9001\nretry_after_s: 7\nforward_batch_spans: 50\n")
    clean_env.setenv("TRACECAR_PORT", "9002")
    clean_env.setenv("TRACECAR_RETRY_AFTER_S", "3")
    settings = load_settings(str(config), port=9003, retry_after_s=None)  # None = the flag was not given
    assert settings.port == 9003
    assert settings.retry_after_s == 3
    assert settings.forward_batch_spans == 50
    assert load_settings().max_body_bytes == 20 * 2**20  # and the default when nothing sets it


def test_exporters_are_a_comma_list_and_the_backend_follows_the_api_key(clean_env: pytest.MonkeyPatch) -> None:
    assert CollectorSettings().effective_exporters == []  # no key: the local store only
    clean_env.setenv("WANDB_API_KEY", "k" * 40)
    assert CollectorSettings().effective_backend == "weave"
    clean_env.setenv("TRACECAR_EXPORTERS", " weave , otlp,")
    assert CollectorSettings().effective_exporters == ["weave", "otlp"]
    clean_env.setenv("TRACECAR_EXPORTERS", "")
    assert CollectorSettings().effective_exporters == []  # set but empty: no exporter, not "the backend's"


def test_unprefixed_names_are_read_as_weave_and_wandb_read_them(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("WANDB_ENTITY", "team")
    clean_env.setenv("WANDB_BASE_URL", "https://wandb.example.com/")
    settings = CollectorSettings()
    assert settings.wandb_entity == "team"
    assert settings.weave_server_url == "https://wandb.example.com/traces"  # as weave derives it
    clean_env.setenv("WF_TRACE_SERVER_URL", "http://127.0.0.1:1/")
    assert CollectorSettings().weave_server_url == "http://127.0.0.1:1/"


@pytest.mark.parametrize(("env", "value", "expected"), [
    ("TRACECAR_PORT", "70000", "port: Input should be less than or equal to 65535 (got '70000')"),
    ("TRACECAR_EXPORTERS", "otlp,otlp", "exporters: Value error, names an exporter twice"),
    ("TRACECAR_EXPORTERS", "weave,kafka", "kafka"),
    ("TRACECAR_BACKEND", "otlp", "TRACECAR_BACKEND=otlp but TRACECAR_OTLP_ENDPOINT is not set"),
    ("TRACECAR_MAX_TRAJECTORY_BYTES", "10", "max_trajectory_bytes: Input should be greater than or equal to 4096"),
])
def test_a_mistake_is_one_line_naming_the_setting(clean_env: pytest.MonkeyPatch, env: str, value: str, expected: str) -> None:
    clean_env.setenv(env, value)
    with pytest.raises(ConfigError) as caught:
        load_checked_settings()
    message = str(caught.value)
    assert expected in message and "\n" not in message, message


def test_a_secret_is_never_echoed_in_an_error_nor_in_the_masked_view(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("TRACECAR_TOKEN", "   ")
    with pytest.raises(ConfigError) as caught:
        load_checked_settings()
    assert "token: Value error, is set but empty" in str(caught.value)
    clean_env.setenv("TRACECAR_TOKEN", "s3cret-token-value")
    clean_env.setenv("WANDB_API_KEY", "w" * 40)
    clean_env.setenv("WANDB_ENTITY", "team")
    settings, _ = load_checked_settings()
    shown = repr(settings.masked())
    assert "s3cret-token-value" not in shown and "w" * 40 not in shown and shown.count("***set***") >= 2


def test_yaml_mistakes_name_the_file_and_the_key(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("max_trajectory_per_step: 4\n")
    with pytest.raises(ConfigError, match=r"unknown setting 'max_trajectory_per_step' \(did you mean 'max_trajectories_per_step'\?\)"):
        load_checked_settings(str(config))
    config.write_text("budgets:\n  exp-a:\n    max_trajectory_per_step: 4\n")
    with pytest.raises(ConfigError, match=r"budgets\.exp-a\.max_trajectory_per_step: unknown setting"):
        load_checked_settings(str(config))
    config.write_text("port: [1\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line \d+, column \d+"):
        load_checked_settings(str(config))
    with pytest.raises(ConfigError, match="no such file"):
        load_checked_settings(str(tmp_path / "missing.yaml"))


def test_a_per_experiment_override_inherits_and_null_removes_a_limit(tmp_path: Path) -> None:
    config = tmp_path / "budgets.yaml"
    config.write_text("max_trajectories_per_step: 16\nbudgets:\n  exp-a:\n    max_trajectories_per_step: null\n"
                      "    validation:\n      max_trajectories_per_step: 2\n")
    settings, _ = load_checked_settings(str(config))
    override = settings.budgets["exp-a"]
    assert settings.max_trajectories_per_step == 16
    assert "max_trajectories_per_step" in override.model_fields_set and override.max_trajectories_per_step is None
    assert override.validation is not None and override.validation.max_trajectories_per_step == 2
    assert "keep_errors_share" not in override.model_fields_set  # left out: inherits the collector's
