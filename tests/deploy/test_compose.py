"""docker-compose.yml: services, loopback ports, settings the collector and the client really read."""

from __future__ import annotations

import re
from typing import Any

import pytest

from .manifests import (
    COMPOSE,
    DATA_DIR,
    DOCKERFILE,
    LOOPBACK,
    REPO,
    WORKER_ENV_REQUIRED,
    MissingRequired,
    Stage,
    _assert_client_reads,
    build_settings,
    compose_environment,
    compose_published_ports,
    healthcheck_exec,
    interpolate,
    iter_strings,
    looks_secret,
    parse_duration_s,
    resolve_compose_env,
)


def _services(compose: dict[str, Any]) -> dict[str, Any]:
    return compose["services"]


def test_compose_services_build_the_deploy_dockerfile(compose: dict[str, Any]) -> None:
    services = _services(compose)
    assert {"collector", "demo-worker"} <= set(services)
    images = set()
    for name in ("collector", "demo-worker"):
        build = services[name].get("build")
        assert isinstance(build, dict), f"{name}: build must be a mapping with context and dockerfile"
        context = (COMPOSE.parent / build["context"]).resolve()
        assert context == REPO, f"{name}: build context {context} is not the repo root"
        assert (context / build["dockerfile"]).resolve() == DOCKERFILE
        images.add(services[name].get("image"))
    assert len(images) == 1, "both services should run the same image"


def test_compose_publishes_only_on_loopback(compose: dict[str, Any], settings_cls: type) -> None:
    port = settings_cls.model_fields["port"].default
    for name, service in _services(compose).items():
        for host_ip, published, target in compose_published_ports(service):
            assert host_ip in LOOPBACK, f"{name}: port {published}:{target} is published on all interfaces"
    assert [t for _, _, t in compose_published_ports(_services(compose)["collector"])] == [port]


def test_compose_collector_env_is_valid_settings(compose: dict[str, Any], settings_cls: type, collector_env_names: set[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    service = _services(compose)["collector"]
    declared = compose_environment(service)
    for name in declared:
        if name.startswith("TRACECAR_"):
            assert name in collector_env_names, f"collector env {name} is not a CollectorSettings setting"
    env = resolve_compose_env(service, {"TRACECAR_TOKEN": "t" * 32})
    settings = build_settings(settings_cls, env, monkeypatch)
    # The worker is another container: the collector must listen beyond loopback ...
    assert settings.host == "0.0.0.0"
    assert str(settings.data_dir) == DATA_DIR
    assert settings.port == settings_cls.model_fields["port"].default
    # ... and so the token is mandatory: compose refuses to start without it.
    assert settings.token is not None
    with pytest.raises(MissingRequired):
        resolve_compose_env(service, {})
    # Without a W&B key on the host the demo runs on the local store.
    assert settings.effective_backend == "local"
    with_key = build_settings(settings_cls, resolve_compose_env(service, {"TRACECAR_TOKEN": "t", "WANDB_API_KEY": "k"}), monkeypatch)
    assert with_key.effective_backend == "weave"


def test_compose_has_no_literal_secrets(compose: dict[str, Any], secret_env_names: set[str]) -> None:
    for name, service in _services(compose).items():
        for key, value in compose_environment(service).items():
            if not looks_secret(key, secret_env_names):
                continue
            if value is None:
                continue  # passed through from the host environment
            m = re.fullmatch(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}", value)
            assert m and m.group(1) == key, f"{name}: {key} must come from the host env, not {value!r}"
            op, arg = m.group(2), m.group(3)
            assert not (op in (":-", "-") and arg), f"{name}: {key} has a literal default"
    for text in iter_strings(compose):
        assert not re.search(r"\b[0-9a-f]{40}\b", text), "something that looks like a W&B API key"


def test_compose_healthcheck_mirrors_the_dockerfile(compose: dict[str, Any], runtime: Stage) -> None:
    collector = _services(compose)["collector"]
    expected = ["CMD", *healthcheck_exec(runtime.all("HEALTHCHECK")[0])]
    assert collector["healthcheck"]["test"] == expected
    # The worker inherits the image's HEALTHCHECK, which probes a collector it does not run.
    worker = _services(compose)["demo-worker"]
    assert worker.get("healthcheck", {}).get("disable") is True or worker["healthcheck"].get("test") in (["NONE"], "NONE")


def test_compose_worker_waits_for_a_healthy_collector(compose: dict[str, Any], client_config_cls: type, monkeypatch: pytest.MonkeyPatch) -> None:
    worker = _services(compose)["demo-worker"]
    assert worker["depends_on"]["collector"]["condition"] == "service_healthy"
    env = resolve_compose_env(worker, {"TRACECAR_TOKEN": "t"})
    command = worker.get("command")
    assert isinstance(command, list) and command[0] == "demo"
    command = [interpolate(str(part), {}) for part in command]
    urls = [command[command.index("--url") + 1]] if "--url" in command else []
    for flag, name in (("--project", "TRACECAR_PROJECT"), ("--experiment", "TRACECAR_EXPERIMENT")):
        if flag in command:
            assert command[command.index(flag) + 1] == env[name], f"demo {flag} disagrees with {name}"
    urls.append(env["TRACECAR_URL"])
    for url in urls:
        assert url == "http://collector:9470", url
    assert WORKER_ENV_REQUIRED <= set(env)
    config = client_config_cls.from_env(env)
    assert config.url == "http://collector:9470" and config.token == "t"
    with pytest.raises(MissingRequired):
        resolve_compose_env(worker, {})


def test_compose_worker_env_names_are_read_by_the_client(compose: dict[str, Any], client_config_cls: type) -> None:
    worker = _services(compose)["demo-worker"]
    _assert_client_reads(client_config_cls, resolve_compose_env(worker, {"TRACECAR_TOKEN": "t"}), "demo-worker")


def test_compose_spool_volume_and_graceful_stop(compose: dict[str, Any], settings_cls: type, monkeypatch: pytest.MonkeyPatch) -> None:
    collector = _services(compose)["collector"]
    mounts = [str(v).split(":") for v in collector.get("volumes") or []]
    named = [m[0] for m in mounts if len(m) >= 2 and m[1] == DATA_DIR]
    assert named and named[0] in (compose.get("volumes") or {}), f"{DATA_DIR} should be a declared named volume"
    settings = build_settings(settings_cls, resolve_compose_env(collector, {"TRACECAR_TOKEN": "t"}), monkeypatch)
    grace = parse_duration_s(collector.get("stop_grace_period", "10s"))
    assert grace > settings.shutdown_drain_s + 5, f"stop_grace_period {grace}s leaves no room for a {settings.shutdown_drain_s}s drain"
    assert collector.get("stop_signal", "SIGTERM") == "SIGTERM"
    if collector.get("read_only"):
        tmpfs = collector.get("tmpfs") or []
        assert "/tmp" in tmpfs and "/home/tracecar" in tmpfs, "read_only needs writable /tmp and HOME"


