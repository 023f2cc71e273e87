"""Loading the collector's settings so that every mistake is one clear line, not a traceback.

``tracecar config`` and ``tracecar serve`` both call :func:`load_checked_settings`, so what the
first accepts the second starts with. It adds what pydantic-settings alone does not say: a
``--config`` file that is missing or not YAML, keys in it that are not settings (with a "did
you mean"), Weave without an entity, a configured tokenizer that cannot be loaded.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from tracecar.client.env_check import OTHER_ENV

from ..settings import BudgetOverride, CollectorSettings, load_settings


class ConfigError(Exception):
    """A configuration mistake; ``str()`` is the one line the user sees."""


# TRACECAR_* names read outside the package (tests/run.sh, CI switches); the package's own are
# found in its source (the client's, the VERL adapter's, Ray's), so a new one is never "unknown".
_OTHER_ENV = set(OTHER_ENV)


def _names_in_package_source() -> set[str]:
    root = Path(__file__).resolve().parents[2]  # the tracecar package (client/ and collector/)
    names: set[str] = set()
    for file in list(root.glob("client/*.py")) + list(root.glob("collector/**/*.py")):
        try:
            names.update(re.findall(r"TRACECAR_[A-Z0-9_]*[A-Z0-9]", file.read_text(errors="replace")))
        except OSError:
            continue
    return names


def _did_you_mean(name: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def setting_keys() -> set[str]:
    """The names a YAML file may use: field names and their aliases, lower case."""
    keys = set()
    for name, info in CollectorSettings.model_fields.items():
        keys.add(name)
        if info.validation_alias is not None:
            keys.update(str(a).lower() for a in getattr(info.validation_alias, "choices", []))
    return keys


def collector_env_names() -> set[str]:
    names = set()
    for name, info in CollectorSettings.model_fields.items():
        names.add(f"TRACECAR_{name.upper()}")
        if info.validation_alias is not None:
            names.update(str(a) for a in getattr(info.validation_alias, "choices", []))
    return names


def unknown_env_warnings(env: Mapping[str, str] | None = None) -> list[str]:
    """One line per TRACECAR_* variable that nothing reads (a typo costs a setting silently)."""
    env = os.environ if env is None else env
    known = collector_env_names() | _names_in_package_source() | _OTHER_ENV
    return [f"{name} is not a tracecar setting and is ignored{_did_you_mean(name, known)}"
            for name in sorted(env) if name.startswith("TRACECAR_") and name not in known]


def read_yaml_file(path: str) -> dict[str, Any]:
    """The file's mapping, or a ConfigError naming the file and what is wrong with it."""
    import yaml

    file = Path(os.path.expanduser(path))
    if not file.is_file():
        raise ConfigError(f"config file {path}: {'is a directory' if file.is_dir() else 'no such file'}")
    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"config file {path}: not valid YAML{where}: {problem}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path}: cannot be read: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: must be a mapping of setting: value, not a {type(data).__name__}")
    keys = setting_keys()
    for key in data:
        if str(key).lower() not in keys:
            raise ConfigError(f"config file {path}: unknown setting {key!r}{_did_you_mean(str(key).lower(), keys)}")
    return data


def _format_validation_error(exc: ValidationError, source: str) -> str:
    parts = []
    budget_keys = set(BudgetOverride.model_fields)
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()))
        if err.get("type") == "extra_forbidden":
            last = str(err["loc"][-1]) if err.get("loc") else ""
            parts.append(f"{loc}: unknown setting{_did_you_mean(last, budget_keys)}")
            continue
        value = err.get("input")
        secret = any(word in loc.lower() for word in ("key", "token", "secret", "password", "header", "store_url", "gateway"))
        shown = "" if secret or isinstance(value, (dict, list)) or value is None else f" (got {value!r:.60})"
        parts.append(f"{loc or 'settings'}: {err.get('msg')}{shown}")
    return f"{source}: " + "; ".join(parts)


def _gateway_names(settings: CollectorSettings) -> list[str]:
    """The exporter names of a node's several gateways (gateway@HOST:PORT each)."""
    from ..gateway_names import exporter_name

    urls = settings.gateway_urls
    return [exporter_name(u) for u in urls] if len(urls) > 1 else []


def check_backend(settings: CollectorSettings) -> None:
    """Each configured exporter's needs (Weave a key and an entity, OTLP an endpoint, MLflow a
    server): said now, in one line, not as a traceback from ``serve``."""
    from ..exporters.registry import EXPORTERS, unknown_exporter

    exporters = settings.effective_exporters
    for name in exporters:
        if name not in EXPORTERS and not (settings.role == "node" and name in _gateway_names(settings)):  # a node's gateways
            raise ConfigError(unknown_exporter(name))
    chosen = "TRACECAR_EXPORTERS includes {}" if settings.exporters is not None else "TRACECAR_BACKEND={}"
    if "otlp" in exporters and not settings.otlp_endpoint:
        raise ConfigError(f"{chosen.format('otlp')} but TRACECAR_OTLP_ENDPOINT is not set: give the full /v1/traces URL")
    if "mlflow" in exporters and not (settings.mlflow_tracking_uri or "").startswith(("http://", "https://")):
        raise ConfigError(f"{chosen.format('mlflow')} but TRACECAR_MLFLOW_TRACKING_URI is not an http(s) URL of an MLflow >= 3.6 server")
    if {"otlp", "mlflow"} & set(exporters) and settings.otlp_headers is not None:
        from ..exporters.otlp_sink import parse_headers

        try:
            parse_headers(settings.otlp_headers.get_secret_value())
        except ValueError as exc:
            raise ConfigError(f"TRACECAR_OTLP_HEADERS: {exc}") from None
    if "weave" not in exporters:
        return
    if settings.exporters is not None:
        why, instead = chosen.format("weave"), "take weave out of TRACECAR_EXPORTERS"
    else:
        why = "TRACECAR_BACKEND=weave" if settings.backend == "weave" else "WANDB_API_KEY is set, so the backend is weave"
        instead = "TRACECAR_BACKEND=local to keep traces in the local store"
    if settings.wandb_api_key is None:
        raise ConfigError(f"{why} but WANDB_API_KEY is not set: set it, or {instead}")
    if not settings.wandb_entity:
        raise ConfigError(f"{why} but no W&B entity is set: set WANDB_ENTITY (or TRACECAR_WANDB_ENTITY) to your team or "
                          f"user name, or {instead}")


def check_tokenizer(settings: CollectorSettings) -> str | None:
    """Loads the configured tokenizer once; a ConfigError says what was tried.

    A TRACECAR_TOKENIZER_ROOT that is not a directory is an error (every tokenizer the workers name
    under it would fail, batch after batch). Returns a warning line when token2text is on without a
    default tokenizer or a root (no batch would get text unless its tokenizer is in the HF cache), else None.
    """
    root = settings.tokenizer_root
    if root is not None and not root.is_dir():
        what = "is not a directory" if root.exists() else "does not exist"
        raise ConfigError(f"TRACECAR_TOKENIZER_ROOT={root} {what} on this collector: mount the model directory there "
                          "(read-only, at the path the workers' tokenizer_path names), or unset it")
    name = settings.tokenizer
    if not name:
        if settings.token2text and root is None:
            return ("token2text is on but TRACECAR_TOKENIZER is unset: only batches that name a tokenizer the collector "
                    "can load get text")
        return None
    from ..processors.decoding import TokenizerNotFound, TokenizerPolicy, TokenizerRegistry

    try:  # that it loads: its byte table is made by the pipeline's own registry, not twice
        TokenizerRegistry(replace(TokenizerPolicy.from_settings(settings), decode_table=False)).get(name)
    except TokenizerNotFound as exc:
        raise ConfigError(f"TRACECAR_TOKENIZER: {exc} (mount the model's tokenizer.json into the collector, "
                          "or unset TRACECAR_TOKENIZER)") from None
    return None


def load_checked_settings(config_file: str | None = None, **overrides: Any) -> tuple[CollectorSettings, list[str]]:
    """Settings as ``serve`` runs them, plus warning lines; raises ConfigError with one line."""
    path = config_file or os.environ.get("TRACECAR_CONFIG") or None
    source = f"config file {path}" if path else "settings"
    if path:
        read_yaml_file(path)
    try:
        settings = load_settings(path, **overrides)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, source + " and TRACECAR_* variables" if path else "TRACECAR_* variables")) from None
    except ValueError as exc:  # e.g. a TRACECAR_BUDGETS that is not JSON
        raise ConfigError(f"{source}: {str(exc).splitlines()[0]}") from None
    from .roles import RoleError, check_role

    try:
        check_role(settings)  # node / gateway (the cluster tier): contradictions are one line
    except RoleError as exc:
        raise ConfigError(str(exc)) from None
    check_backend(settings)
    warnings = unknown_env_warnings()
    tokenizer_warning = check_tokenizer(settings)
    if tokenizer_warning:
        warnings.append(tokenizer_warning)
    return settings, warnings
