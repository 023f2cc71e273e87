"""Client configuration, read from the environment once.

The client is installed in rollout workers next to the training stack, so it uses no settings
library: plain environment variables with the ``TRACECAR_`` prefix and explicit defaults. Every
bound the sender applies is one of these fields.
"""

from __future__ import annotations

import functools
import os
import platform
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from .redact import parse_keys

ENV_PREFIX = "TRACECAR_"


def _env_float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(ENV_PREFIX + name)
    try:
        return float(raw) if raw not in (None, "") else default
    except ValueError:
        return default


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    return int(_env_float(env, name, default))


def default_worker_id() -> str:
    """host:pid — unique per rollout worker process, recomputed after fork."""
    return f"{socket.gethostname()}:{os.getpid()}"


@functools.lru_cache(maxsize=1)
def client_info() -> dict[str, str]:
    """What weave puts under ``attributes.weave`` (``weave.utils.capture_info``), for tracecar:
    the collector forwards it there, with ``source`` "tracecar" and the worker added."""
    try:
        from importlib.metadata import version

        client_version = version("tracecar")
    except Exception:  # noqa: BLE001 - a source checkout without metadata
        client_version = "unknown"
    return {"client_version": client_version, "source": "tracecar", "sys_version": sys.version,
            "os_name": platform.system(), "os_version": platform.version(), "os_release": platform.release()}


@dataclass(frozen=True)
class ClientConfig:
    """What the thin client needs; ``url=None`` means tracing is off and costs one global read."""

    url: str | None = None
    token: str | None = field(default=None, repr=False)
    project: str | None = None
    entity: str | None = None
    experiment: str | None = None
    worker_id: str | None = None
    tokenizer: str | None = None
    # The trainer's W&B run (run id or entity/project/run_id), sent with each batch so the
    # collector links Weave calls to it; the run lives in the driver, so it comes from the
    # environment (WANDB_RUN_ID, which wandb.init also honours) or the VERL adapter.
    wandb_run_id: str | None = None
    # Job-level preferences sent with each batch (the VERL adapter sets them from VERL's trace
    # config); the collector applies them where its own settings leave the choice open.
    token2text: bool | None = None
    max_samples_per_step_per_worker: int | None = None
    queue_max_spans: int = 4096
    batch_max_spans: int = 512
    # 1.75 MiB: a post costs the worker ~0.6 ms of CPU whatever its size (bench/sender_posts.py), so
    # bodies are large (~145 spans of 2,000 ids, ~4 µs of post a span); a body closes with at most one
    # span past this, which leaves 256 KiB for it under the collector's 2 MiB warm-parse window
    # (collector/heap.py WARM_BODY_MAX: a larger body's parse buffer is fresh mmapped memory)
    batch_max_bytes: int = 1792 * 2**10
    max_span_bytes: int = 8 * 2**20
    flush_interval_s: float = 0.2
    http_timeout_s: float = 5.0
    retry_initial_s: float = 0.5
    retry_max_s: float = 30.0
    retry_max_elapsed_s: float = 300.0
    # while the collector cannot be reached, retry at least this often (a refused connect costs
    # nothing), so a worker finds a returning collector within about this long
    retry_probe_s: float = 1.0
    shutdown_timeout_s: float = 5.0
    compression: str = "none"
    compress_min_bytes: int = 8 * 1024
    max_string_chars: int = 1_000_000
    max_depth: int = 32
    # Keys whose values are replaced by "REDACTED" on top of weave's own set (api_key,
    # auth_headers, authorization), matched case-insensitively at any depth.
    redact_keys: tuple[str, ...] = ()
    max_traceback_frames: int = 200
    # live view: a call still running when the sender drains sends a small "open" marker, so
    # the collector can name a call that hangs (calls that end first never send one)
    open_markers: bool = True
    # Prompt deltas (tracecar.client.prompt_delta): a growing prompt_ids goes out as a reference
    # to the request's previous span + the new ids; the memory kept for it is bounded by these.
    prompt_delta: bool = True
    prompt_delta_max_requests: int = 4096
    prompt_delta_max_ids: int = 4_000_000
    # "spliced" (numeric lists packed apart and spliced in, the redaction search over the rest,
    # default-valued fields left out) or "legacy" (the previous packing: one dump searched whole,
    # every field sent), kept so bench/hot_path.py can run both in one run
    packing: str = "spliced"
    # What the caller's path copies of a call's values (tracecar.client.spans): "shallow" (dict
    # arguments one level, lists by length, the output two levels), "deep" (all the way down at
    # call and return, as weave does), "refs" (no argument copied)
    snapshot: str = "shallow"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> ClientConfig:
        env = os.environ if env is None else env
        base = cls(
            url=(env.get("TRACECAR_URL") or "").strip().rstrip("/") or None,
            token=env.get("TRACECAR_TOKEN") or None,
            project=env.get("TRACECAR_PROJECT") or env.get("WANDB_PROJECT") or None,
            entity=env.get("TRACECAR_ENTITY") or env.get("WANDB_ENTITY") or None,
            experiment=env.get("TRACECAR_EXPERIMENT") or None,
            worker_id=env.get("TRACECAR_WORKER_ID") or None,
            tokenizer=env.get("TRACECAR_CLIENT_TOKENIZER") or None,
            wandb_run_id=env.get("TRACECAR_WANDB_RUN_ID") or env.get("WANDB_RUN_ID") or None,
            queue_max_spans=_env_int(env, "QUEUE_MAX_SPANS", cls.queue_max_spans),
            batch_max_spans=_env_int(env, "BATCH_MAX_SPANS", cls.batch_max_spans),
            batch_max_bytes=_env_int(env, "BATCH_MAX_BYTES", cls.batch_max_bytes),
            max_span_bytes=_env_int(env, "MAX_SPAN_BYTES", cls.max_span_bytes),
            flush_interval_s=_env_float(env, "FLUSH_INTERVAL_S", cls.flush_interval_s),
            http_timeout_s=_env_float(env, "HTTP_TIMEOUT_S", cls.http_timeout_s),
            retry_initial_s=_env_float(env, "RETRY_INITIAL_S", cls.retry_initial_s),
            retry_max_s=_env_float(env, "RETRY_MAX_S", cls.retry_max_s),
            retry_max_elapsed_s=_env_float(env, "RETRY_MAX_ELAPSED_S", cls.retry_max_elapsed_s),
            retry_probe_s=_env_float(env, "RETRY_PROBE_S", cls.retry_probe_s),
            shutdown_timeout_s=_env_float(env, "SHUTDOWN_TIMEOUT_S", cls.shutdown_timeout_s),
            compression=(env.get("TRACECAR_COMPRESSION") or cls.compression).strip().lower(),
            compress_min_bytes=_env_int(env, "COMPRESS_MIN_BYTES", cls.compress_min_bytes),
            max_string_chars=_env_int(env, "MAX_STRING_CHARS", cls.max_string_chars),
            max_depth=_env_int(env, "MAX_DEPTH", cls.max_depth),
            redact_keys=parse_keys(env.get("TRACECAR_REDACT_KEYS")),
            max_traceback_frames=_env_int(env, "MAX_TRACEBACK_FRAMES", cls.max_traceback_frames),
            open_markers=(env.get("TRACECAR_OPEN_MARKERS") or "true").strip().lower() not in ("0", "false", "no", "off"),
            prompt_delta=(env.get("TRACECAR_PROMPT_DELTA") or "1").strip().lower() not in ("0", "false", "no", "off"),
            prompt_delta_max_requests=_env_int(env, "PROMPT_DELTA_MAX_REQUESTS", cls.prompt_delta_max_requests),
            prompt_delta_max_ids=_env_int(env, "PROMPT_DELTA_MAX_IDS", cls.prompt_delta_max_ids),
            packing=(env.get("TRACECAR_PACKING") or cls.packing).strip().lower(),
            snapshot=(env.get("TRACECAR_SNAPSHOT") or cls.snapshot).strip().lower(),
        )
        known = {f.name for f in fields(cls)}
        return replace(base, **{k: v for k, v in overrides.items() if k in known and v is not None})
