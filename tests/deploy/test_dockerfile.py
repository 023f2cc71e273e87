"""deploy/Dockerfile and .dockerignore: static checks, and the HEALTHCHECK command run against a stub."""

from __future__ import annotations

import fnmatch
import http.server
import re
import threading
from typing import Any

from tests.support import free_port

from .manifests import (
    DATA_DIR,
    LOOPBACK,
    REPO,
    Stage,
    arg_names,
    copy_sources_and_dest,
    healthcheck_exec,
    is_ignored,
    load_dockerignore,
    looks_secret,
    parse_dockerfile,
    parse_env_instruction,
    run_healthcheck,
    split_stages,
)


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


def test_dockerfile_healthcheck_command_really_works(runtime: Stage) -> None:
    cmd = healthcheck_exec(runtime.all("HEALTHCHECK")[0])
    for status, healthy in [(200, True), (503, False)]:
        handler = type("Handler", (_StubHandler,), {"status": status})
        server = http.server.HTTPServer(("127.0.0.1", 0), handler)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            rc = run_healthcheck(cmd, server.server_address[1])
        finally:
            server.shutdown()
            server.server_close()
        assert (rc == 0) is healthy, f"healthcheck exit {rc} for HTTP {status}"
    assert run_healthcheck(cmd, free_port()) != 0, "healthcheck passes with nothing listening"

