"""docker-compose.yml, profile ``cluster``: a gateway fed by a node collector fed by the demo worker.

Validated statically (no Docker engine here): each collector's environment, resolved as compose
would resolve it, built into the collector's settings and checked as ``tracecar serve`` checks
them; the wiring (the node's gateway URL is the gateway service's, the worker's the node's, each
waits for the one it feeds to be healthy); only the profile starts them.
"""

from __future__ import annotations

from typing import Any

import pytest

from .manifests import DATA_DIR, build_settings, compose_published_ports, interpolate, parse_duration_s, resolve_compose_env

CLUSTER = ("gateway", "node", "cluster-worker")
HOST_ENV = {"TRACECAR_TOKEN": "t" * 32, "WANDB_API_KEY": "k" * 40, "TRACECAR_WANDB_ENTITY": "team"}


def _checked(settings: Any) -> None:
    from tracecar.collector.service.config_check import check_backend
    from tracecar.collector.service.roles import check_role

    check_role(settings)
    check_backend(settings)


def test_the_cluster_services_start_only_with_their_profile(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name in CLUSTER:
        assert services[name]["profiles"] == ["cluster"], name
    for name in ("collector", "demo-worker"):  # `docker compose up` alone is the single collector, as before
        assert "profiles" not in services[name]
    assert services["gateway"]["image"] == services["node"]["image"] == services["collector"]["image"]


def test_the_gateway_is_a_valid_gateway_holding_the_credentials(compose: dict[str, Any], settings_cls: type,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    gateway = compose["services"]["gateway"]
    settings = build_settings(settings_cls, resolve_compose_env(gateway, HOST_ENV), monkeypatch)
    assert settings.role == "gateway" and settings.host == "0.0.0.0" and settings.token is not None
    assert str(settings.data_dir) == DATA_DIR and settings.effective_exporters == ["weave"]
    assert settings.max_trajectories_per_step == 16  # the tail budget, over the whole job
    _checked(settings)
    assert [(ip, target) for ip, _, target in compose_published_ports(gateway)] == [("127.0.0.1", settings.port)]
    assert parse_duration_s(gateway["stop_grace_period"]) > settings.shutdown_drain_s + 5
    assert any(str(v).endswith(":" + DATA_DIR) for v in gateway["volumes"])


def test_the_node_forwards_to_the_gateway_service_without_credentials(compose: dict[str, Any], settings_cls: type,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    services = compose["services"]
    node = services["node"]
    settings = build_settings(settings_cls, resolve_compose_env(node, HOST_ENV), monkeypatch)
    gateway_port = build_settings(settings_cls, resolve_compose_env(services["gateway"], HOST_ENV), monkeypatch).port
    assert settings.role == "node" and settings.gateway_url == f"http://gateway:{gateway_port}"
    assert settings.wandb_api_key is None and settings.effective_exporters == ["gateway"]  # the host's key stays off it
    _checked(settings)
    assert node["depends_on"]["gateway"]["condition"] == "service_healthy"
    assert not compose_published_ports(node)  # the worker reaches it inside the compose network
    worker = services["cluster-worker"]
    assert worker["depends_on"]["node"]["condition"] == "service_healthy"
    env = resolve_compose_env(worker, HOST_ENV)
    command = [interpolate(str(part), env) for part in worker["command"]]
    assert env["TRACECAR_URL"] == command[command.index("--url") + 1] == f"http://node:{settings.port}"
