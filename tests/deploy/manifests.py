"""The deployment files, parsed: a small Dockerfile parser, compose interpolation, k8s helpers.

A library for the tests beside it (no test here): it reads deploy/Dockerfile, .dockerignore,
docker-compose.yml and deploy/k8s/*.yaml without a Docker engine, a cluster or the network.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
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



def _assert_client_reads(client_config_cls: type, env: Mapping[str, str], where: str) -> None:
    """Every TRACECAR_* a worker is given must change what ClientConfig.from_env reads."""
    baseline = client_config_cls.from_env({})
    for name, value in env.items():
        if name.startswith("TRACECAR_"):
            probe_value = value if value else "x"
            assert client_config_cls.from_env({name: probe_value}) != baseline, f"{where}: the client ignores {name}"



def run_healthcheck(cmd: list[str], port: int) -> int:
    """Runs the image's HEALTHCHECK command with this interpreter against ``port``; its exit code."""
    env = {**os.environ, "TRACECAR_PORT": str(port)}
    return subprocess.run([sys.executable, *cmd[1:]], env=env, timeout=15, capture_output=True).returncode
