"""Fixtures of the deployment checks: the files, and what the code says."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

from .manifests import (
    COMPOSE,
    DOCKERFILE,
    POD_YAML,
    PYPROJECT,
    SIDECAR_NAME,
    TRAINER_NAME,
    Stage,
    parse_dockerfile,
    parse_env_instruction,
    split_stages,
)


@pytest.fixture(scope="session")
def pyproject() -> dict[str, Any]:
    return tomllib.loads(PYPROJECT.read_text())


@pytest.fixture(scope="session")
def stages() -> list[Stage]:
    _, parsed = split_stages(parse_dockerfile(DOCKERFILE.read_text()))
    assert parsed, "deploy/Dockerfile has no FROM"
    return parsed


@pytest.fixture(scope="session")
def runtime(stages: list[Stage]) -> Stage:
    return stages[-1]


@pytest.fixture(scope="session")
def image_env(runtime: Stage) -> dict[str, str]:
    env: dict[str, str] = {}
    for ins in runtime.all("ENV"):
        env.update(parse_env_instruction(ins))
    return env


@pytest.fixture(scope="session")
def image_uid_gid(runtime: Stage) -> tuple[int, int | None]:
    user = runtime.last("USER")
    assert user is not None, "the runtime stage never sets USER"
    uid, _, gid = user.args.partition(":")
    assert uid.isdigit(), (
        f"USER {user.args!r}: use a numeric uid; Kubernetes runAsNonRoot cannot verify a user name"
    )
    return int(uid), (int(gid) if gid.isdigit() else None)


@pytest.fixture(scope="session")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="session")
def k8s_docs() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(POD_YAML.read_text()) if d]


@pytest.fixture(scope="session")
def pod_spec(k8s_docs: list[dict[str, Any]]) -> dict[str, Any]:
    for doc in k8s_docs:
        if doc.get("kind") == "Pod":
            return doc["spec"]
        template = (doc.get("spec") or {}).get("template") or (((doc.get("spec") or {}).get("jobTemplate") or {}).get("spec") or {}).get("template")
        if template:
            return template["spec"]
    raise AssertionError(f"{POD_YAML} holds no Pod nor pod template")


@pytest.fixture(scope="session")
def pod_metadata(k8s_docs: list[dict[str, Any]]) -> dict[str, Any]:
    for doc in k8s_docs:
        if doc.get("kind") == "Pod":
            return doc["metadata"]
        template = (doc.get("spec") or {}).get("template")
        if template:
            return template["metadata"]
    raise AssertionError("no pod metadata")


@pytest.fixture(scope="session")
def sidecar(pod_spec: dict[str, Any]) -> dict[str, Any]:
    for c in pod_spec.get("initContainers") or []:
        if c["name"] == SIDECAR_NAME:
            return c
    raise AssertionError(f"no initContainer named {SIDECAR_NAME!r} (tracecar must be a native sidecar)")


@pytest.fixture(scope="session")
def trainer(pod_spec: dict[str, Any]) -> dict[str, Any]:
    for c in pod_spec.get("containers") or []:
        if c["name"] == TRAINER_NAME:
            return c
    raise AssertionError(f"no container named {TRAINER_NAME!r}")


@pytest.fixture(scope="session")
def settings_cls() -> type:
    # The collector's settings class is the source of truth for names and defaults.
    from tracecar.collector.settings import CollectorSettings

    return CollectorSettings


@pytest.fixture(scope="session")
def client_config_cls() -> type:
    from tracecar.client.config import ClientConfig

    return ClientConfig


@pytest.fixture(scope="session")
def collector_env_names(settings_cls: type) -> set[str]:
    prefix = str(settings_cls.model_config.get("env_prefix", ""))
    assert prefix.upper() == "TRACECAR_"
    names = {"TRACECAR_CONFIG"}  # read directly by settings_customise_sources
    for name, info in settings_cls.model_fields.items():
        alias = info.validation_alias
        choices = getattr(alias, "choices", None)
        if choices:
            names.update(str(c).upper() for c in choices if isinstance(c, str))
        elif isinstance(alias, str):
            names.add(alias.upper())
        else:
            names.add((prefix + name).upper())
    return names


@pytest.fixture(scope="session")
def secret_env_names(settings_cls: type) -> set[str]:
    """Env names of the settings typed SecretStr, plus the client's token."""
    from pydantic import SecretStr

    prefix = str(settings_cls.model_config.get("env_prefix", "")).upper()
    names = {"TRACECAR_TOKEN", "WANDB_API_KEY"}
    for name, info in settings_cls.model_fields.items():
        if "SecretStr" in repr(info.annotation) or info.annotation is SecretStr:
            choices = getattr(info.validation_alias, "choices", None)
            if choices:
                names.update(str(c).upper() for c in choices if isinstance(c, str))
            else:
                names.add(prefix + name.upper())
    return names

