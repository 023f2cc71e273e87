"""The capture proxy's settings: ``TRACECAR_PROXY_*`` variables, overridden by ``tracecar proxy`` flags.

The collector it records to is the thin client's ``TRACECAR_URL`` (and every other client setting:
token, queue bound, retries), so a proxy is configured like any worker. A setting that cannot work
is one clear line (:class:`ProxyConfigError`); the CLI exits 2 on it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import urlsplit

ENV = {
    "upstream": "TRACECAR_PROXY_UPSTREAM",
    "host": "TRACECAR_PROXY_HOST",
    "port": "TRACECAR_PROXY_PORT",
    "connect_timeout_s": "TRACECAR_PROXY_CONNECT_TIMEOUT_S",
    "read_timeout_s": "TRACECAR_PROXY_READ_TIMEOUT_S",
    "max_connections": "TRACECAR_PROXY_MAX_CONNECTIONS",
    "max_record_bytes": "TRACECAR_PROXY_MAX_RECORD_BYTES",
    "rollout_idle_s": "TRACECAR_PROXY_ROLLOUT_IDLE_S",
    "max_rollouts": "TRACECAR_PROXY_MAX_ROLLOUTS",
}


class ProxyConfigError(ValueError):
    """A setting the proxy cannot start with; the message names it and says what is expected."""


@dataclass(frozen=True)
class ProxyConfig:
    upstream: str = ""
    host: str = "127.0.0.1"
    port: int = 9480
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 600.0  # a long generation: the agent's own timeout (openai's is 600 s) decides first
    max_connections: int = 0  # to the upstream; 0: no bound, as when the agents call it directly
    max_record_bytes: int = 8 * 2**20  # per request and per response; past it the rest is forwarded, not recorded
    rollout_idle_s: float = 600.0
    max_rollouts: int = 100_000

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> ProxyConfig:
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for item in fields(cls):
            raw = overrides.get(item.name)
            if raw is None:
                raw = env.get(ENV[item.name]) or None
            if raw is None:
                continue
            kind = type(getattr(cls, item.name))
            try:
                values[item.name] = kind(raw) if kind is not int else int(float(raw))
            except ValueError:
                raise ProxyConfigError(f"{ENV[item.name]}={raw!r}: not a number") from None
        config = cls(**values)
        config.check()
        return config

    def check(self) -> None:
        if not self.upstream:
            raise ProxyConfigError("no upstream: give --upstream URL or TRACECAR_PROXY_UPSTREAM (the inference server's "
                                   "OpenAI base URL, e.g. http://127.0.0.1:8000/v1)")
        parts = urlsplit(self.upstream)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ProxyConfigError(f"TRACECAR_PROXY_UPSTREAM={self.upstream!r} is not an http(s) URL with a host "
                                   "(expected e.g. http://127.0.0.1:8000/v1)")
        for name in ("connect_timeout_s", "read_timeout_s", "rollout_idle_s"):
            if not getattr(self, name) > 0:
                raise ProxyConfigError(f"{ENV[name]} must be > 0, got {getattr(self, name)}")
        for name in ("max_record_bytes", "max_rollouts"):
            if getattr(self, name) < 1:
                raise ProxyConfigError(f"{ENV[name]} must be >= 1, got {getattr(self, name)}")
        if self.max_connections < 0:
            raise ProxyConfigError(f"{ENV['max_connections']} must be >= 0 (0: no bound), got {self.max_connections}")
        if not 0 <= self.port <= 65535:
            raise ProxyConfigError(f"{ENV['port']} must be a port number, got {self.port}")

    @property
    def upstream_base(self) -> str:
        """The upstream's origin and path prefix without a trailing ``/v1``: the proxy appends the
        request's own ``/v1/...`` path (given with or without ``/v1``, the URL means the same server)."""
        base = self.upstream.rstrip("/")
        return base[:-3] if base.endswith("/v1") else base
