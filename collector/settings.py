"""Collector configuration in one place: TRACECAR_* env vars, an optional YAML file, CLI flags.

Precedence, highest first: CLI flags (passed as init kwargs), environment, the YAML file named
by ``TRACECAR_CONFIG`` (or ``--config``), defaults. ``WANDB_API_KEY``, ``WANDB_BASE_URL`` and
``WF_TRACE_SERVER_URL`` are read under their usual unprefixed names.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, YamlConfigSettingsSource

MiB = 2**20


class CollectorSettings(BaseSettings):
    """Every knob of the collector. Each bound is enforced and counted when hit."""

    model_config = SettingsConfigDict(env_prefix="TRACECAR_", extra="ignore", populate_by_name=True)

    host: str = Field("127.0.0.1", description="Bind address. A sidecar shares the pod's network, so loopback is enough.")
    port: int = Field(9470, ge=0, le=65535, description="HTTP port (0 picks a free one).")
    data_dir: Path = Field(Path("./tracecar-data"), description="Directory of the SQLite spool/store.")
    token: SecretStr | None = Field(None, description="Shared bearer token required on every API and viewer route when set.")
    backend: Literal["auto", "local", "weave"] = Field("auto", description="Where traces go: weave if WANDB_API_KEY is set (auto), or the embedded local store only.")
    wandb_api_key: SecretStr | None = Field(None, validation_alias=AliasChoices("WANDB_API_KEY", "TRACECAR_WANDB_API_KEY"), description="W&B API key (read from WANDB_API_KEY).")
    wandb_entity: str | None = Field(None, description="W&B entity (team or user) the Weave project lives in.")
    wandb_project: str | None = Field(None, description="Default W&B project when a batch names none.")
    weave_server_url: str = Field("https://trace.wandb.ai", validation_alias=AliasChoices("WF_TRACE_SERVER_URL", "TRACECAR_WEAVE_SERVER_URL"), description="Weave trace server base URL (WF_TRACE_SERVER_URL).")
    token2text: bool = Field(False, description="Decode prompt_ids/response_ids to prompt_text/response_text (VERL's token2text).")
    tokenizer: str | None = Field(None, description="Default tokenizer: a tokenizer.json path, a directory holding one, or a Hugging Face name found offline in the local cache.")
    max_samples_per_step_per_worker: int | None = Field(None, ge=0, description="VERL-compatible budget: distinct sample indices kept per (experiment, step, worker); unset keeps all, 0 keeps none.")
    max_body_bytes: int = Field(20 * MiB, ge=1024, description="Largest request body accepted on the wire (413 above).")
    max_decompressed_bytes: int = Field(100 * MiB, ge=1024, description="Largest body after gzip/zstd decompression (413 above; stops zip bombs).")
    max_batch_spans: int = Field(8192, ge=1, description="Most spans in one request (413 above).")
    max_span_bytes: int = Field(8 * MiB, ge=1024, description="Largest single span after decoding; bigger spans are rejected by name.")
    spool_max_bytes: int = Field(2048 * MiB, ge=MiB, description="Bound on span bytes waiting to be forwarded (in local mode: on all stored span bytes); at the bound ingest answers 503 with Retry-After.")
    spool_sync: Literal["normal", "full"] = Field("normal", description="SQLite synchronous mode: normal survives a killed process, full also survives power loss (slower).")
    max_inflight_requests: int = Field(16, ge=1, description="Ingest requests processed at once; more answer 503 (bounds memory to this many bodies).")
    retry_after_s: int = Field(2, ge=1, description="Retry-After seconds sent with 503 backpressure answers.")
    forward_batch_spans: int = Field(1000, ge=1, description="Spans per forward request to the backend.")
    forward_retry_initial_s: float = Field(1.0, gt=0, description="First backoff after a failed forward.")
    forward_retry_max_s: float = Field(30.0, gt=0, description="Backoff cap for forwarding retries.")
    decode_threads: int = Field(2, ge=1, description="Threads decoding tokens (tokenizers releases the GIL).")
    keep_forwarded: bool = Field(True, description="Keep forwarded spans in the local store (queryable); false deletes them once Weave has them.")
    shutdown_drain_s: float = Field(10.0, ge=0, description="On SIGTERM, how long to keep forwarding before exit; the rest stays in the spool.")
    log_level: str = Field("info", description="Log level (JSON lines on stderr).")

    @field_validator("data_dir", mode="before")
    @classmethod
    def _expand(cls, value: Any) -> Any:
        return Path(os.path.expanduser(str(value))) if value is not None else value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        yaml_file = os.environ.get("TRACECAR_CONFIG")
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if yaml_file:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=yaml_file))
        return tuple(sources)

    @property
    def spool_path(self) -> Path:
        return self.data_dir / "spool.sqlite3"

    @property
    def effective_backend(self) -> Literal["local", "weave"]:
        if self.backend == "auto":
            return "weave" if self.wandb_api_key is not None else "local"
        return self.backend

    def masked(self) -> dict[str, Any]:
        """Effective configuration for printing and the startup log: secrets shown as set/unset."""
        out: dict[str, Any] = {}
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, SecretStr):
                value = "***set***"
            elif isinstance(value, Path):
                value = str(value)
            out[name] = value
        out["effective_backend"] = self.effective_backend
        return out


def load_settings(config_file: str | None = None, **overrides: Any) -> CollectorSettings:
    """Builds settings with CLI overrides (None means 'not given') and an optional YAML file."""
    if config_file:
        os.environ["TRACECAR_CONFIG"] = config_file
    return CollectorSettings(**{k: v for k, v in overrides.items() if v is not None})
