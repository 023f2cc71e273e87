"""Static checks of the deployment files, kept in step with the code.

Covers deploy/Dockerfile (with .dockerignore), docker-compose.yml, deploy/k8s/*.yaml. Needs no
Docker engine, no cluster and no network: the files are parsed here (a small Dockerfile parser,
PyYAML for the rest) and checked against the collector's settings class, the client's config
reader and pyproject.toml, so that renaming a setting, changing a default port or moving a
package folder fails here instead of in a training job.

Two groups run code rather than only reading it, both on loopback only: the image's HEALTHCHECK
command is executed against a stub HTTP server, and ``tracecar serve`` is started with the
Kubernetes sidecar's settings to check that probes and the Prometheus scrape work without the
token while /v1/spans refuses requests without it, and that SIGTERM ends the process in time.
"""

from __future__ import annotations

import fnmatch
import http.server
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import tomllib
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "deploy" / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
COMPOSE = REPO / "docker-compose.yml"
K8S_DIR = REPO / "deploy" / "k8s"
POD_YAML = K8S_DIR / "training-pod.yaml"
KUSTOMIZATION = K8S_DIR / "kustomization.yaml"
PYPROJECT = REPO / "pyproject.toml"

DATA_DIR = "/var/lib/tracecar"
SIDECAR_NAME = "tracecar"
TRAINER_NAME = "trainer"
WORKER_ENV_REQUIRED = {"TRACECAR_URL", "TRACECAR_TOKEN", "TRACECAR_PROJECT", "TRACECAR_EXPERIMENT"}
LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}
SECRET_WORDS = {"KEY", "TOKEN", "SECRET", "SECRETS", "PASSWORD", "PASSWD", "CREDENTIAL", "CREDENTIALS", "APIKEY"}


# ----------------------------------------------------------------------------------------------
# Small parsers
# ----------------------------------------------------------------------------------------------


@dataclass
class Instruction:
    keyword: str
    args: str  # everything after the keyword and its --flags
    flags: dict[str, str]
    exec_form: list[str] | None  # JSON (exec) form, when the args are a JSON array of strings
    lineno: int


@dataclass
class Stage:
    base: str
    name: str | None
    index: int
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction | None:
        found = self.all(keyword)
        return found[-1] if found else None


_FLAG_KEYWORDS = {"FROM", "COPY", "ADD", "RUN", "HEALTHCHECK"}
_DIRECTIVE = re.compile(r"^#\s*([a-zA-Z][a-zA-Z0-9_-]*)\s*=\s*(.+?)\s*$")


def parse_dockerfile(text: str) -> list[Instruction]:
    """Docker's logical-line rules, enough for linting: parser directives (only ``escape``
    matters), comment lines dropped even inside continuations, escape-char line continuations,
    flags (``--from=x``), JSON exec form."""
    lines = text.splitlines()
    escape = "\\"
    # Parser directives: only at the very top, before any comment/blank/instruction.
    for line in lines:
        m = _DIRECTIVE.match(line)
        if not m:
            break
        if m.group(1).lower() == "escape":
            escape = m.group(2)
    out: list[Instruction] = []
    buf: list[str] = []
    start = 0
    for lineno, raw in enumerate(lines, start=1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not buf):
            continue  # comment (also inside a continuation) or blank line between instructions
        if not stripped:
            continue  # blank line inside a continuation: Docker tolerates it
        if not buf:
            start = lineno
        body = raw.rstrip()
        if body.endswith(escape):
            buf.append(body[: -len(escape)])
            continue
        buf.append(body)
        out.append(_instruction(" ".join(part.strip() for part in buf), start))
        buf = []
    if buf:
        out.append(_instruction(" ".join(part.strip() for part in buf), start))
    return out


def _instruction(logical: str, lineno: int) -> Instruction:
    keyword, _, rest = logical.partition(" ")
    keyword = keyword.upper()
    rest = rest.strip()
    flags: dict[str, str] = {}
    if keyword in _FLAG_KEYWORDS:
        while rest.startswith("--"):
            token, _, remainder = rest.partition(" ")
            name, _, value = token[2:].partition("=")
            flags[name] = value
            rest = remainder.strip()
    exec_form = _json_array(rest)
    return Instruction(keyword, rest, flags, exec_form, lineno)


def _json_array(text: str) -> list[str] | None:
    if not text.startswith("["):
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    return None


def split_stages(instructions: list[Instruction]) -> tuple[dict[str, str], list[Stage]]:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for ins in instructions:
        if ins.keyword == "FROM":
            words = ins.args.split()
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base=_substitute(words[0], global_args), name=name, index=len(stages)))
        elif not stages:
            if ins.keyword == "ARG":
                key, _, default = ins.args.partition("=")
                global_args[key.strip()] = default.strip().strip('"')
        else:
            stages[-1].instructions.append(ins)
    return global_args, stages


def _substitute(value: str, env: Mapping[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m.group(1) or m.group(2), ""), value)


def parse_env_instruction(ins: Instruction) -> dict[str, str]:
    """``ENV A=1 B="two words"`` and the legacy ``ENV A value with spaces``."""
    tokens = shlex.split(ins.args, posix=True)
    if tokens and "=" not in tokens[0]:
        return {tokens[0]: " ".join(tokens[1:])}
    return dict(token.split("=", 1) for token in tokens)


def arg_names(ins: Instruction) -> list[str]:
    return [token.split("=", 1)[0] for token in ins.args.split()]


def copy_sources_and_dest(ins: Instruction) -> tuple[list[str], str]:
    parts = ins.exec_form if ins.exec_form is not None else shlex.split(ins.args)
    return parts[:-1], parts[-1]


def healthcheck_exec(ins: Instruction) -> list[str]:
    """The exec-form command of ``HEALTHCHECK [flags] CMD [...]``."""
    word, _, rest = ins.args.partition(" ")
    assert word.upper() == "CMD", f"HEALTHCHECK must run a command, not {word!r}"
    exec_form = _json_array(rest.strip())
    assert exec_form, "HEALTHCHECK CMD should use the JSON exec form (no shell needed in the image)"
    return exec_form


# .dockerignore: Docker's rules, simplified (clean the pattern, '**' spans directories, a match
# on a parent directory excludes everything below it, '!' re-includes, last match wins).


def _ignore_regex(pattern: str) -> re.Pattern[str]:
    pattern = str(PurePosixPath(pattern.strip("/"))) if pattern.strip("/") else ""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        elif pattern[i] == "[":
            end = pattern.find("]", i)
            out += pattern[i : end + 1] if end > i else re.escape(pattern[i])
            i = end + 1 if end > i else i + 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out)


def load_dockerignore() -> list[tuple[bool, re.Pattern[str]]]:
    rules: list[tuple[bool, re.Pattern[str]]] = []
    if not DOCKERIGNORE.exists():
        return rules
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        rules.append((negate, _ignore_regex(line[1:] if negate else line)))
    return rules


def is_ignored(rel_path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    parts = PurePosixPath(rel_path).parts
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    ignored = False
    for negate, regex in rules:
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            ignored = not negate
    return ignored


# Compose interpolation: ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}, ${VAR?err}, $VAR, $$.

_INTERP = re.compile(r"\$\$|\$\{(\w+)(?:(:?[-?])([^}]*))?\}|\$(\w+)")


class MissingRequired(Exception):
    pass


def interpolate(value: str, host_env: Mapping[str, str]) -> str:
    def repl(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, arg = m.group(2), m.group(3)
        current = host_env.get(name)
        empty = current is None or (op is not None and op.startswith(":") and current == "")
        if op in (":-", "-"):
            return arg if empty else current  # type: ignore[return-value]
        if op in (":?", "?"):
            if empty:
                raise MissingRequired(f"{name}: {arg}")
            return current  # type: ignore[return-value]
        return current or ""

    return _INTERP.sub(repl, value)


def compose_environment(service: Mapping[str, Any]) -> dict[str, str | None]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        out: dict[str, str | None] = {}
        for item in env:
            key, sep, value = str(item).partition("=")
            out[key] = value if sep else None
        return out
    return {str(k): (None if v is None else str(v)) for k, v in env.items()}


def resolve_compose_env(service: Mapping[str, Any], host_env: Mapping[str, str]) -> dict[str, str]:
    """What the container would see: null entries pass the host value through or stay unset."""
    out: dict[str, str] = {}
    for key, value in compose_environment(service).items():
        if value is None:
            if key in host_env:
                out[key] = host_env[key]
        else:
            out[key] = interpolate(value, host_env)
    return out


def compose_published_ports(service: Mapping[str, Any]) -> list[tuple[str | None, str | None, int]]:
    """(host_ip, published, target) for each entry of ``ports``."""
    out = []
    for entry in service.get("ports") or []:
        if isinstance(entry, dict):
            out.append((entry.get("host_ip"), str(entry.get("published")) if entry.get("published") else None, int(entry["target"])))
            continue
        text = str(entry).split("/")[0]
        parts = text.rsplit(":", 2)
        if len(parts) == 3:
            out.append((parts[0].strip("[]"), parts[1], int(parts[2])))
        elif len(parts) == 2:
            out.append((None, parts[0], int(parts[1])))
        else:
            out.append((None, None, int(parts[0])))
    return out


def parse_duration_s(value: Any) -> float:
    if isinstance(value, (int, float)):
        return float(value)
    units = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    total, matched = 0.0, ""
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)", str(value)):
        total += float(number) * units[unit]
        matched += number + unit
    assert matched == str(value), f"unparseable compose duration {value!r}"
    return total


def parse_quantity(value: Any) -> float:
    """Kubernetes resource quantity to a number (bytes for memory/storage)."""
    text = str(value)
    binary = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
    decimal = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
    m = re.fullmatch(r"([+-]?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?", text)
    assert m, f"not a Kubernetes quantity: {value!r}"
    number, suffix = float(m.group(1)), m.group(2)
    if suffix is None:
        return number
    return number * (binary.get(suffix) or decimal[suffix])


def looks_secret(name: str, secret_names: set[str]) -> bool:
    return name.upper() in secret_names or any(part in SECRET_WORDS for part in name.upper().split("_"))


def iter_strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from iter_strings(k)
            yield from iter_strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from iter_strings(v)


# ----------------------------------------------------------------------------------------------
# Fixtures: the files, and what the code says
# ----------------------------------------------------------------------------------------------


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


def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith(("TRACECAR_", "WANDB_", "WF_")):
            monkeypatch.delenv(key, raising=False)


def build_settings(settings_cls: type, env: Mapping[str, str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """CollectorSettings as the container would build them from exactly this environment."""
    _clean_env(monkeypatch)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return settings_cls()


def k8s_env(container: Mapping[str, Any]) -> dict[str, str]:
    """Container env as plain strings; secretKeyRef values become a dummy."""
    out = {}
    for item in container.get("env") or []:
        out[item["name"]] = item["value"] if "value" in item else "dummy-from-secret"
    return out


def k8s_env_item(container: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    return next((item for item in container.get("env") or [] if item["name"] == name), None)


def container_port(container: Mapping[str, Any], port: Any) -> int:
    if isinstance(port, int):
        return port
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise AssertionError(f"container {container['name']} has no port named {port!r}")


# ----------------------------------------------------------------------------------------------
# Dockerfile
# ----------------------------------------------------------------------------------------------


def test_dockerfile_parser_handles_continuations_comments_and_json() -> None:
    text = (
        "# syntax=docker/dockerfile:1\n"
        "ARG BASE=python:3.11-slim\n"
        "FROM ${BASE} AS build\n"
        "RUN a \\\n"
        "    # a comment inside the continuation\n"
        "    && b\n"
        "COPY --from=build --chown=1:1 /x /y\n"
        'HEALTHCHECK --interval=5s CMD ["python", "-c", "print(1)"]\n'
        'ENV A=1 B="two words"\n'
        "ENV LEGACY some value\n"
        'CMD ["serve"]\n'
    )
    ins = parse_dockerfile(text)
    assert [i.keyword for i in ins] == ["ARG", "FROM", "RUN", "COPY", "HEALTHCHECK", "ENV", "ENV", "CMD"]
    assert ins[2].args == "a && b"
    assert ins[3].flags == {"from": "build", "chown": "1:1"}
    assert healthcheck_exec(ins[4]) == ["python", "-c", "print(1)"] and ins[4].flags == {"interval": "5s"}
    assert parse_env_instruction(ins[5]) == {"A": "1", "B": "two words"}
    assert parse_env_instruction(ins[6]) == {"LEGACY": "some value"}
    assert ins[7].exec_form == ["serve"]
    _, st = split_stages(ins)
    assert st[0].base == "python:3.11-slim" and st[0].name == "build"


def test_dockerfile_bases_are_python_slim_matching_requires_python(stages: list[Stage], pyproject: dict[str, Any]) -> None:
    names = set()
    for stage in stages:
        if stage.base in names:
            continue  # FROM an earlier stage
        assert re.fullmatch(r"python:3\.\d+-slim(-[a-z]+)?(@sha256:[0-9a-f]{64})?", stage.base), (
            f"stage {stage.name or stage.index} is FROM {stage.base!r}; expected a python:3.X-slim base"
        )
        minor = int(stage.base.split(":")[1].split(".")[1].split("-")[0])
        m = re.search(r">=\s*3\.(\d+)", pyproject["project"]["requires-python"])
        assert m and minor >= int(m.group(1)), "base image Python older than requires-python"
        if stage.name:
            names.add(stage.name)
    assert len(stages) >= 2, "expected a multi-stage build (builder + runtime)"


def test_dockerfile_builder_installs_collector_extra_into_copied_venv(stages: list[Stage], runtime: Stage, pyproject: dict[str, Any]) -> None:
    assert "collector" in pyproject["project"]["optional-dependencies"]
    builders = {s.name: s for s in stages[:-1] if s.name}
    installs = [i for s in builders.values() for i in s.all("RUN") if "pip install" in i.args and ".[collector]" in i.args]
    assert installs, 'no builder stage runs pip install ".[collector]"'
    copies = [i for i in runtime.all("COPY") if "from" in i.flags]
    assert copies, "runtime stage copies nothing from the builder"
    for ins in copies:
        assert ins.flags["from"] in builders, f"COPY --from={ins.flags['from']} names no earlier stage"
    venvs = {m.group(1) for s in builders.values() for i in s.all("RUN") for m in [re.search(r"python -m venv (\S+)", i.args)] if m}
    copied = {copy_sources_and_dest(i)[0][0].rstrip("/") for i in copies}
    assert venvs and venvs <= copied, f"the builder's venv {venvs} is not what the runtime copies {copied}"
    path = " ".join(parse_env_instruction(i).get("PATH", "") for i in runtime.all("ENV"))
    assert all(f"{v}/bin" in path for v in venvs), "the venv's bin/ is not on the runtime PATH"


def test_dockerfile_copy_sources_exist_are_not_dockerignored_and_cover_the_package(stages: list[Stage], pyproject: dict[str, Any]) -> None:
    rules = load_dockerignore()
    copied: dict[str, str] = {}
    for stage in stages:
        for ins in stage.all("COPY") + stage.all("ADD"):
            if "from" in ins.flags:
                continue
            sources, dest = copy_sources_and_dest(ins)
            plain = [s for s in sources if not any(ch in s for ch in "*?[")]
            assert plain, f"line {ins.lineno}: a COPY of wildcards only fails when none matches"
            for src in sources:
                assert not re.match(r"https?://", src), f"line {ins.lineno}: no remote sources at build time"
                rel = src.rstrip("/")
                if src in plain:
                    # A plain source must exist; a wildcard may match nothing (BuildKit accepts
                    # that when another source of the same COPY exists).
                    assert (REPO / rel).exists(), f"line {ins.lineno}: COPY source {src!r} missing from the repo"
                    assert not is_ignored(rel, rules), f"line {ins.lineno}: COPY source {src!r} is excluded by .dockerignore"
                for match in REPO.glob(rel) if src not in plain else []:
                    assert not is_ignored(match.relative_to(REPO).as_posix(), rules), f"line {ins.lineno}: {match} is excluded by .dockerignore"
                copied[rel] = dest
    # What `pip install .` reads: pyproject, its readme and every package folder, at the same
    # relative place (package-dir maps folders by relative path).
    needed = ["pyproject.toml", *pyproject["tool"]["setuptools"]["package-dir"].values()]
    readme = pyproject["project"].get("readme")
    if isinstance(readme, str):
        needed.append(readme)
    for rel in needed:
        rel = rel.rstrip("/")
        # a folder's COPY also covers the package folders nested in it (collector/ → collector/processors/sampling)
        covering = [src for src in copied if src == rel or rel.startswith(src + "/") or fnmatch.fnmatchcase(rel, src)]
        assert covering, f"{rel} is needed by the package build but not copied into the image"
        dest = copied[covering[0]].rstrip("/")
        assert dest in (".", "", covering[0]), f"{rel} is copied to {dest!r}, not its own relative path"
    # No package file (sources, package data) may be dropped by .dockerignore.
    for folder in pyproject["tool"]["setuptools"]["package-dir"].values():
        for path in (REPO / folder).rglob("*"):
            rel = path.relative_to(REPO).as_posix()
            if path.is_file() and "__pycache__" not in rel and not rel.endswith((".pyc", ".pyo")):
                assert not is_ignored(rel, rules), f"{rel} would be missing from the image (.dockerignore)"


def test_dockerignore_keeps_secrets_and_vcs_out_of_the_context() -> None:
    rules = load_dockerignore()
    assert rules, ".dockerignore (at the build context root, the repo root) is missing or empty"
    for rel in [".git/config", ".env", "deploy/.env", "tracecar-data/spool.sqlite3", "client/__pycache__/x.pyc", "tracecar.egg-info/PKG-INFO"]:
        assert is_ignored(rel, rules), f"{rel} would be sent in the build context"
    for rel in ["pyproject.toml", "README.md", "client/config.py", "collector/settings.py", "deploy/Dockerfile"]:
        assert not is_ignored(rel, rules), f"{rel} is needed in the build context"


def test_dockerfile_runs_non_root_before_entrypoint(runtime: Stage, image_uid_gid: tuple[int, int | None]) -> None:
    positions = {i.keyword: n for n, i in enumerate(runtime.instructions)}
    user_pos = max(n for n, i in enumerate(runtime.instructions) if i.keyword == "USER")
    assert user_pos < positions["ENTRYPOINT"]
    uid, gid = image_uid_gid
    assert uid != 0 and gid != 0
    runs = " ".join(i.args for i in runtime.all("RUN"))
    assert re.search(rf"--uid {uid}\b", runs), f"uid {uid} is never created"


def test_dockerfile_entrypoint_is_the_console_script(runtime: Stage, pyproject: dict[str, Any]) -> None:
    entry = runtime.last("ENTRYPOINT")
    cmd = runtime.last("CMD")
    assert entry is not None and entry.exec_form == ["tracecar"], "ENTRYPOINT must be exec form ['tracecar'] (PID 1 gets SIGTERM)"
    assert "tracecar" in pyproject["project"]["scripts"]
    assert cmd is not None and cmd.exec_form == ["serve"]
    stop = runtime.last("STOPSIGNAL")
    assert stop is not None and stop.args.upper() in ("SIGTERM", "15")


def test_dockerfile_expose_matches_the_default_port(runtime: Stage, settings_cls: type, image_env: dict[str, str]) -> None:
    exposed = [int(p.split("/")[0]) for i in runtime.all("EXPOSE") for p in i.args.split()]
    default_port = settings_cls.model_fields["port"].default
    port = int(image_env.get("TRACECAR_PORT", default_port))
    assert exposed == [port] and port == default_port, f"EXPOSE {exposed} vs CollectorSettings port {default_port}"


def test_dockerfile_healthcheck_hits_healthz_on_the_exposed_port(runtime: Stage, settings_cls: type) -> None:
    checks = runtime.all("HEALTHCHECK")
    assert len(checks) == 1, "exactly one HEALTHCHECK in the runtime stage"
    cmd = healthcheck_exec(checks[0])
    assert cmd[0] == "python", "slim images have no curl/wget: use python"
    script = " ".join(cmd)
    assert "/healthz" in script and "127.0.0.1" in script
    m = re.search(r"TRACECAR_PORT['\"],\s*['\"](\d+)['\"]", script) or re.search(r":(\d+)/healthz", script)
    assert m and int(m.group(1)) == settings_cls.model_fields["port"].default
    assert "timeout" in script, "the probe needs its own timeout"
    assert {"interval", "timeout", "retries"} <= set(checks[0].flags)


def test_dockerfile_declares_an_owned_data_volume(runtime: Stage, image_env: dict[str, str], image_uid_gid: tuple[int, int | None]) -> None:
    assert image_env.get("TRACECAR_DATA_DIR") == DATA_DIR
    volumes: list[str] = []
    for ins in runtime.all("VOLUME"):
        volumes += ins.exec_form if ins.exec_form is not None else ins.args.split()
    assert DATA_DIR in volumes
    uid, _ = image_uid_gid
    runs = " ".join(i.args for i in runtime.all("RUN"))
    assert re.search(rf"-o {uid}\b[^&]*{re.escape(DATA_DIR)}|chown[^&]*{uid}[^&]*{re.escape(DATA_DIR)}", runs), (
        f"{DATA_DIR} must be created owned by uid {uid} (a fresh named volume copies that ownership)"
    )
    assert image_env.get("HOME"), "set HOME so it can be mounted writable under a read-only root"


def test_dockerfile_bakes_in_no_secret_and_no_public_bind(stages: list[Stage], secret_env_names: set[str], collector_env_names: set[str],
                                                          image_env: dict[str, str]) -> None:
    for stage in stages:
        for ins in stage.all("ENV"):
            for name in parse_env_instruction(ins):
                assert not looks_secret(name, secret_env_names), f"line {ins.lineno}: ENV {name} looks like a secret"
        for ins in stage.all("ARG"):
            for name in arg_names(ins):
                assert not looks_secret(name, secret_env_names), f"line {ins.lineno}: ARG {name} looks like a secret"
    # The image keeps the collector's loopback default; whoever binds wider sets a token too.
    assert image_env.get("TRACECAR_HOST", "127.0.0.1") in LOOPBACK
    for name in image_env:
        if name.startswith("TRACECAR_"):
            assert name in collector_env_names, f"ENV {name} is not a CollectorSettings field"


class _StubHandler(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(self.status if self.path == "/healthz" else 404)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def _run_healthcheck(cmd: list[str], port: int) -> int:
    env = {**os.environ, "TRACECAR_PORT": str(port)}
    return subprocess.run([sys.executable, *cmd[1:]], env=env, timeout=15, capture_output=True).returncode


def test_dockerfile_healthcheck_command_really_works(runtime: Stage) -> None:
    cmd = healthcheck_exec(runtime.all("HEALTHCHECK")[0])
    for status, healthy in [(200, True), (503, False)]:
        handler = type("Handler", (_StubHandler,), {"status": status})
        server = http.server.HTTPServer(("127.0.0.1", 0), handler)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            rc = _run_healthcheck(cmd, server.server_address[1])
        finally:
            server.shutdown()
            server.server_close()
        assert (rc == 0) is healthy, f"healthcheck exit {rc} for HTTP {status}"
    assert _run_healthcheck(cmd, _free_port()) != 0, "healthcheck passes with nothing listening"


# ----------------------------------------------------------------------------------------------
# docker-compose.yml
# ----------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------
# Kubernetes
# ----------------------------------------------------------------------------------------------

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_PROBE_HANDLERS = {"httpGet", "tcpSocket", "exec", "grpc"}


def test_k8s_objects_have_the_required_fields(k8s_docs: list[dict[str, Any]], pod_spec: dict[str, Any], pod_metadata: dict[str, Any]) -> None:
    assert k8s_docs
    for doc in k8s_docs:
        assert doc.get("apiVersion") and doc.get("kind"), doc
        assert _DNS_LABEL.fullmatch(doc["metadata"]["name"]) or re.fullmatch(r"[a-z0-9.-]+", doc["metadata"]["name"])
        assert doc["kind"] != "Secret" or not (doc.get("data") or doc.get("stringData")), "no Secret with values in the manifests"
    for key in ("labels", "annotations"):
        for k, v in (pod_metadata.get(key) or {}).items():
            assert isinstance(v, str), f"{key}.{k} must be a string, got {v!r}"
    containers = (pod_spec.get("initContainers") or []) + pod_spec["containers"]
    names = [c["name"] for c in containers]
    assert len(names) == len(set(names))
    volumes = {v["name"]: v for v in pod_spec.get("volumes") or []}
    used: set[str] = set()
    for c in containers:
        assert _DNS_LABEL.fullmatch(c["name"]) and c.get("image"), c["name"]
        for item in c.get("env") or []:
            assert ("value" in item) != ("valueFrom" in item), f"{c['name']}: env {item['name']} needs exactly one of value/valueFrom"
            assert "value" not in item or isinstance(item["value"], str), f"{c['name']}: env {item['name']} value must be a string (quote it)"
        for p in c.get("ports") or []:
            assert isinstance(p["containerPort"], int) and 0 < p["containerPort"] < 65536
        for mount in c.get("volumeMounts") or []:
            assert mount["name"] in volumes, f"{c['name']} mounts undefined volume {mount['name']}"
            used.add(mount["name"])
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            if probe in c:
                assert len(_PROBE_HANDLERS & set(c[probe])) == 1, f"{c['name']}.{probe} needs one handler"
    assert set(volumes) == used, f"volumes defined but not mounted: {set(volumes) - used}"
    for c in pod_spec["containers"]:
        assert "restartPolicy" not in c, "restartPolicy is only valid on init containers"


def test_k8s_tracecar_is_a_native_sidecar(sidecar: dict[str, Any], runtime: Stage, image_uid_gid: tuple[int, int | None], pod_spec: dict[str, Any]) -> None:
    assert sidecar.get("restartPolicy") == "Always", "native sidecar: initContainer with restartPolicy: Always"
    assert sidecar["image"].split(":")[0].rsplit("/", 1)[-1] == "tracecar"
    assert sidecar.get("command") in (None, ["tracecar"]), "the image's ENTRYPOINT is tracecar"
    assert (sidecar.get("args") or runtime.last("CMD").exec_form) == ["serve"]
    sc = sidecar["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert "ALL" in sc.get("capabilities", {}).get("drop", [])
    uid, gid = image_uid_gid
    assert sc.get("runAsUser", uid) == uid
    assert pod_spec.get("securityContext", {}).get("fsGroup") in (None, gid, sc.get("runAsGroup"))
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(sidecar["resources"][kind]), f"sidecar resources.{kind}"
    assert parse_quantity(sidecar["resources"]["requests"]["memory"]) <= parse_quantity(sidecar["resources"]["limits"]["memory"])


def test_k8s_sidecar_settings_are_valid(sidecar: dict[str, Any], settings_cls: type, collector_env_names: set[str], monkeypatch: pytest.MonkeyPatch) -> None:
    env = k8s_env(sidecar)
    for name in env:
        if name.startswith("TRACECAR_"):
            assert name in collector_env_names, f"sidecar env {name} is not a CollectorSettings setting"
    settings = build_settings(settings_cls, env, monkeypatch)  # raises on an invalid value
    assert settings.port == settings_cls.model_fields["port"].default
    assert [container_port(sidecar, p["name"]) for p in sidecar["ports"]] == [settings.port]
    assert settings.effective_backend == "weave"


def test_k8s_probes_point_at_health_endpoints(sidecar: dict[str, Any], settings_cls: type, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = build_settings(settings_cls, k8s_env(sidecar), monkeypatch)
    expected = {"livenessProbe": "/healthz", "readinessProbe": "/readyz"}
    if "startupProbe" in sidecar:
        expected["startupProbe"] = sidecar["startupProbe"]["httpGet"]["path"]
        assert expected["startupProbe"] in ("/healthz", "/readyz")
    uses_http = False
    for probe, path in expected.items():
        get = sidecar[probe]["httpGet"]
        assert get["path"] == path, f"{probe} should call {path}"
        assert container_port(sidecar, get["port"]) == settings.port
        assert "host" not in get, "kubelet probes must target the pod IP"
        uses_http = True
    # The kubelet (and Prometheus) connect to the pod IP, not the pod's loopback: a collector
    # bound to 127.0.0.1 would fail every httpGet probe. Binding wider makes the token mandatory.
    if uses_http:
        assert settings.host not in LOOPBACK, "httpGet probes cannot reach a collector bound to loopback"
    if settings.host not in LOOPBACK:
        item = k8s_env_item(sidecar, "TRACECAR_TOKEN")
        assert item and "secretKeyRef" in item.get("valueFrom", {}), "a non-loopback collector needs TRACECAR_TOKEN from a Secret"


def test_k8s_prometheus_annotations(pod_metadata: dict[str, Any], sidecar: dict[str, Any]) -> None:
    ann = pod_metadata["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert ann["prometheus.io/path"] == "/metrics"
    assert int(ann["prometheus.io/port"]) == sidecar["ports"][0]["containerPort"]


def test_k8s_spool_volume_is_bounded_and_mounted_at_the_data_dir(
    sidecar: dict[str, Any], pod_spec: dict[str, Any], settings_cls: type, image_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The image's ENV applies unless the pod overrides it.
    settings = build_settings(settings_cls, {"TRACECAR_DATA_DIR": image_env["TRACECAR_DATA_DIR"], **k8s_env(sidecar)}, monkeypatch)
    assert str(settings.data_dir) == DATA_DIR
    mounts = {m["mountPath"]: m for m in sidecar["volumeMounts"]}
    assert DATA_DIR in mounts and not mounts[DATA_DIR].get("readOnly")
    volume = next(v for v in pod_spec["volumes"] if v["name"] == mounts[DATA_DIR]["name"])
    if "emptyDir" in volume:
        size_limit = parse_quantity(volume["emptyDir"]["sizeLimit"])
        # Going over sizeLimit evicts the whole pod, trainer included: the store must stay a
        # bounded spool (forwarded spans deleted) well under the limit (SQLite overhead, WAL).
        assert settings.keep_forwarded is False, "with an emptyDir spool set TRACECAR_KEEP_FORWARDED=false"
        assert settings.spool_max_bytes * 2 <= size_limit, f"spool_max_bytes {settings.spool_max_bytes} too close to sizeLimit {size_limit}"
    else:
        assert "persistentVolumeClaim" in volume, "the spool lives on an emptyDir or a PVC"
    # A read-only root still needs writable /tmp and HOME.
    for path in ("/tmp", image_env["HOME"]):
        assert path in mounts and not mounts[path].get("readOnly"), f"{path} must be a writable mount"


def test_k8s_secrets_come_from_secret_refs(pod_spec: dict[str, Any], sidecar: dict[str, Any], trainer: dict[str, Any],
                                          k8s_docs: list[dict[str, Any]], secret_env_names: set[str]) -> None:
    wandb = k8s_env_item(sidecar, "WANDB_API_KEY")
    assert wandb and "secretKeyRef" in wandb["valueFrom"], "WANDB_API_KEY must come from a Secret"
    refs = []
    for c in (pod_spec.get("initContainers") or []) + pod_spec["containers"]:
        for item in c.get("env") or []:
            if looks_secret(item["name"], secret_env_names):
                assert "value" not in item, f"{c['name']}: literal {item['name']}"
                assert "secretKeyRef" in item["valueFrom"], f"{c['name']}: {item['name']} must use secretKeyRef"
    for c in (sidecar, trainer):
        item = k8s_env_item(c, "TRACECAR_TOKEN")
        assert item, f"{c['name']} lacks TRACECAR_TOKEN"
        refs.append((item["valueFrom"]["secretKeyRef"]["name"], item["valueFrom"]["secretKeyRef"]["key"]))
    assert refs[0] == refs[1], "sidecar and trainer must share one token"
    for text in iter_strings(k8s_docs):
        assert not re.search(r"\b[0-9a-f]{40}\b", text), "something that looks like a W&B API key"


def test_k8s_trainer_reaches_the_sidecar_on_loopback(trainer: dict[str, Any], sidecar: dict[str, Any], client_config_cls: type) -> None:
    env = k8s_env(trainer)
    assert WORKER_ENV_REQUIRED <= set(env)
    port = sidecar["ports"][0]["containerPort"]
    config = client_config_cls.from_env(env)
    assert config.url == f"http://127.0.0.1:{port}", config.url
    _assert_client_reads(client_config_cls, env, "trainer")
    command = " ".join((trainer.get("command") or []) + (trainer.get("args") or []))
    assert "actor_rollout_ref.rollout.trace.backend=tracecar" in command


def test_k8s_grace_period_outlasts_the_drain(pod_spec: dict[str, Any], sidecar: dict[str, Any], settings_cls: type, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = build_settings(settings_cls, k8s_env(sidecar), monkeypatch)
    grace = pod_spec.get("terminationGracePeriodSeconds", 30)
    # The trainer is stopped first and the sidecar after it, both inside this one budget.
    assert grace >= settings.shutdown_drain_s + 10, f"terminationGracePeriodSeconds {grace} vs drain {settings.shutdown_drain_s}s"


def test_kustomization_lists_the_manifests(sidecar: dict[str, Any], pyproject: dict[str, Any]) -> None:
    kust = yaml.safe_load(KUSTOMIZATION.read_text())
    assert kust["kind"] == "Kustomization"
    resources = kust["resources"]
    for res in resources:
        assert (K8S_DIR / res).is_file(), f"kustomization lists missing {res}"
    on_disk = {p.name for p in K8S_DIR.glob("*.y*ml")} - {KUSTOMIZATION.name}
    assert on_disk <= set(resources), f"manifests not in the kustomization: {on_disk - set(resources)}"
    image = sidecar["image"]
    name, _, tag = image.rpartition(":")
    version = pyproject["project"]["version"]
    assert tag == version, f"sidecar image tag {tag} vs project version {version}"
    entry = next(i for i in kust.get("images", []) if i["name"] == name)
    assert str(entry.get("newTag", version)) == version


@pytest.mark.skipif(shutil.which("kubectl") is None and shutil.which("kustomize") is None, reason="no kubectl/kustomize")
def test_kustomize_build_renders(sidecar: dict[str, Any]) -> None:
    tool = ["kubectl", "kustomize"] if shutil.which("kubectl") else ["kustomize", "build"]
    out = subprocess.run([*tool, str(K8S_DIR)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    pod = next(d for d in docs if d["kind"] == "Pod")
    init = pod["spec"]["initContainers"][0]
    assert init["restartPolicy"] == "Always" and init["image"].split(":")[0].endswith("tracecar")


def _assert_client_reads(client_config_cls: type, env: Mapping[str, str], where: str) -> None:
    """Every TRACECAR_* a worker is given must change what ClientConfig.from_env reads."""
    baseline = client_config_cls.from_env({})
    for name, value in env.items():
        if name.startswith("TRACECAR_"):
            probe_value = value if value else "x"
            assert client_config_cls.from_env({name: probe_value}) != baseline, f"{where}: the client ignores {name}"


# ----------------------------------------------------------------------------------------------
# Live: the real collector with the sidecar's settings (loopback only)
# ----------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tracecar_cmd() -> list[str]:
    script = Path(sys.executable).with_name("tracecar")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from tracecar.client.cli import main; sys.exit(main())"]


def _get(url: str, token: str | None = None, method: str = "GET", data: bytes | None = None) -> tuple[int, str, str]:
    req = urllib.request.Request(url, method=method, data=data)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=3) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("Content-Type", ""), err.read().decode("utf-8", "replace")


def _wait_status(url: str, want: int, deadline_s: float, proc: subprocess.Popen[bytes]) -> int:
    end = time.monotonic() + deadline_s
    status = -1
    while time.monotonic() < end:
        assert proc.poll() is None, f"tracecar serve exited early with {proc.returncode}"
        try:
            status = _get(url)[0]
            if status == want:
                return status
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.2)
    return status


def _require_cli() -> None:
    import tracecar.client.cli  # noqa: F401  (fails loudly if the console script's module is gone)


@pytest.fixture
def live_collector(sidecar: dict[str, Any], tmp_path: Path) -> Iterator[tuple[str, str, subprocess.Popen[bytes]]]:
    _require_cli()
    port = _free_port()
    token = "live-test-" + os.urandom(8).hex()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRACECAR_", "WANDB_", "WF_"))}
    env.update({k: v for k, v in k8s_env(sidecar).items() if k.startswith("TRACECAR_")})
    env.update(
        {
            # Loopback here (this is a test host, not a pod); the local store (no W&B key).
            "TRACECAR_HOST": "127.0.0.1",
            "TRACECAR_PORT": str(port),
            "TRACECAR_DATA_DIR": str(tmp_path / "data"),
            "TRACECAR_TOKEN": token,
            "TRACECAR_BACKEND": "local",
            "TRACECAR_TOKEN2TEXT": "false",
            "TRACECAR_SHUTDOWN_DRAIN_S": "2",
        }
    )
    env.pop("WANDB_API_KEY", None)
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen([*_tracecar_cmd(), "serve"], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        yield f"http://127.0.0.1:{port}", token, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


def test_live_probes_and_scrape_work_without_the_token(live_collector: tuple[str, str, subprocess.Popen[bytes]], runtime: Stage, tmp_path: Path) -> None:
    base, token, proc = live_collector
    try:
        assert _wait_status(base + "/healthz", 200, 90, proc) == 200, "GET /healthz never answered 200"
        port = int(base.rsplit(":", 1)[1])
        assert _run_healthcheck(healthcheck_exec(runtime.all("HEALTHCHECK")[0]), port) == 0
        # kubelet probes and the Prometheus scrape (annotations) carry no bearer token.
        assert _wait_status(base + "/readyz", 200, 60, proc) == 200, "GET /readyz never became ready"
        status, ctype, body = _get(base + "/metrics")
        assert status == 200, f"GET /metrics without token -> {status}: annotation-based scraping would fail"
        assert ctype.startswith("text/plain") and "# TYPE" in body
        # Everything else needs the token (the collector listens beyond loopback in a pod).
        status, _, _ = _get(base + "/v1/spans", method="POST", data=b"{}")
        assert status in (401, 403), f"POST /v1/spans without token -> {status}"
        # What the compose demo-worker runs, with the token from its environment.
        demo_env = {**{k: v for k, v in os.environ.items() if not k.startswith("TRACECAR_")}, "TRACECAR_TOKEN": token}
        out = subprocess.run([*_tracecar_cmd(), "demo", "--url", base, "--steps", "1", "--samples", "2", "--rollout-n", "1"],
                             env=demo_env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert out.returncode == 0, f"tracecar demo failed: {out.stdout[-1000:]} {out.stderr[-2000:]}"
        total, end = 0, time.monotonic() + 15  # accepted spans reach the store asynchronously
        while total < 2 and time.monotonic() < end:
            listed = subprocess.run([*_tracecar_cmd(), "trajectories", "--url", base, "--json"],
                                    env=demo_env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
            assert listed.returncode == 0, listed.stderr[-2000:]
            total = json.loads(listed.stdout)["total"]
            time.sleep(0.3 if total < 2 else 0)
        assert total >= 2, f"the demo's spans did not land: {out.stdout} {out.stderr[-1000:]}"
        # SIGTERM: drain (2 s here) and exit cleanly well inside a pod's grace period.
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=2 + 20)
        # 0, or -SIGTERM: uvicorn re-raises the signal after its graceful shutdown (exit 143
        # to Docker/Kubernetes), which is still a clean, drained stop.
        assert rc in (0, -signal.SIGTERM), f"tracecar serve exited {rc} on SIGTERM"
    except BaseException:
        log = tmp_path / "serve.log"
        print(log.read_text(errors="replace")[-4000:] if log.exists() else "(no log)")
        raise


def test_live_cli_knows_the_commands_the_manifests_run() -> None:
    _require_cli()
    for sub, needle in (("serve", "serve"), ("demo", "--url")):
        out = subprocess.run([*_tracecar_cmd(), sub, "--help"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and needle in out.stdout + out.stderr, f"tracecar {sub} --help: {out.stderr[-500:]}"
