"""Collector configuration in one place: TRACECAR_* env vars, an optional YAML file, CLI flags.

Precedence, highest first: CLI flags (passed as init kwargs), environment, the YAML file named
by ``TRACECAR_CONFIG`` (or ``--config``), defaults. ``WANDB_API_KEY``, ``WANDB_BASE_URL`` and
``WF_TRACE_SERVER_URL`` are read under their usual unprefixed names.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, YamlConfigSettingsSource

MiB = 2**20


class BudgetOverride(BaseModel):
    """Budget settings for one experiment (``budgets:``) or for validation steps.

    Same names and meanings as the CollectorSettings fields; a field left out inherits, a field
    given as ``null`` removes that limit. ``validation`` overrides further for validate=True steps.
    """

    model_config = ConfigDict(extra="forbid")

    tail_sampling: bool | None = None
    max_samples_per_step_per_worker: int | None = Field(None, ge=0)
    max_trajectories_per_step: int | None = Field(None, ge=0)
    max_groups_per_step: int | None = Field(None, ge=0)
    max_bytes_per_step: int | None = Field(None, ge=0)
    max_tokens_per_step: int | None = Field(None, ge=0)
    max_trajectory_bytes: int | None = Field(None, ge=4096)
    trajectories_per_step: int | None = Field(None, ge=1)
    keep_errors_share: float = Field(0.25, ge=0, le=1)
    keep_reward_extremes: int = Field(1, ge=0)
    keep_spread_groups: int = Field(1, ge=0)
    sampling_seed: int = 0
    validation: "BudgetOverride | None" = None


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
    wandb_run_id: str | None = Field(None, description="The trainer's W&B run (run id or entity/project/run_id): Weave calls link to it (wb_run_id, wb_run_step = the trajectory's step) when the client's batch names none.")
    weave_server_url: str = Field("https://trace.wandb.ai", validation_alias=AliasChoices("WF_TRACE_SERVER_URL", "TRACECAR_WEAVE_SERVER_URL"), description="Weave trace server base URL (WF_TRACE_SERVER_URL).")
    token2text: bool = Field(False, description="Decode prompt_ids/response_ids to prompt_text/response_text (VERL's token2text).")
    tokenizer: str | None = Field(None, description="Default tokenizer: a tokenizer.json path, a directory holding one, or a Hugging Face name found offline in the local cache.")
    max_samples_per_step_per_worker: int | None = Field(None, ge=0, description="VERL-compatible budget: distinct sample indices kept per (experiment, step, worker); unset keeps all, 0 keeps none.")
    tail_sampling: bool | None = Field(None, description="Decide budgets on whole steps (hold spans, keep the interesting trajectories); unset: on whenever a budget other than max_samples_per_step_per_worker is set.")
    max_trajectories_per_step: int | None = Field(None, ge=0, description="Global budget: trajectories kept per (experiment, step) across all workers (tail-based).")
    max_groups_per_step: int | None = Field(None, ge=0, description="Global budget: sample groups (all rollouts of one sample index) kept per (experiment, step) (tail-based).")
    max_bytes_per_step: int | None = Field(None, ge=0, description="Volume budget: stored bytes of kept trajectories per (experiment, step) (tail-based).")
    max_tokens_per_step: int | None = Field(None, ge=0, description="Volume budget: token ids in kept trajectories per (experiment, step) (tail-based).")
    max_trajectory_bytes: int | None = Field(None, ge=4096, description="Per-trajectory size cap: larger kept trajectories have inputs/outputs truncated with a marker (tail-based).")
    trajectories_per_step: int | None = Field(None, ge=1, description="Trajectories this collector receives per step, when known: the step is decided as soon as that many are complete.")
    keep_errors_share: float = Field(0.25, ge=0, le=1, description="Rule quota: share of each step budget (rounded up) reserved for trajectories with an exception or a failed tool call.")
    keep_reward_extremes: int = Field(1, ge=0, description="Rule quota: the N highest and N lowest reward trajectories (or groups) of each step are kept first.")
    keep_spread_groups: int = Field(1, ge=0, description="Rule quota: the N sample groups with the widest reward spread (max - min) are kept whole.")
    sampling_seed: int = Field(0, description="Seed of the hash that fills the rest of a budget; equal seeds make reruns and collectors choose alike.")
    reward_wait_s: float = Field(30.0, ge=0, description="After a trajectory's root arrives, how long to wait for its reward annotation before deciding without it.")
    step_idle_s: float = Field(120.0, ge=0, description="A held step whose trajectories are complete is decided after this long without new spans (when no later step or count closes it first).")
    decision_wait_s: float = Field(600.0, gt=0, description="A held step is decided after this long without new spans even if trajectories are incomplete (those are dropped).")
    max_held_trajectories: int = Field(200_000, ge=1, description="Bound on trajectories awaiting a decision (their summaries are in memory); above it the oldest step is decided early.")
    validation_budget: BudgetOverride | None = Field(None, description="Budget overrides for validate=True steps (JSON/YAML mapping of the budget settings); they are always counted apart from training steps.")
    budgets: dict[str, BudgetOverride] = Field(default_factory=dict, description="Per-experiment budget overrides: experiment name -> mapping of budget settings (with an optional `validation` mapping).")
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
    shutdown_unready_s: float = Field(0.0, ge=0, description="On SIGTERM, stay up this long answering /readyz and ingest with 503 before closing the listener (lets endpoints and load balancers stop sending first); a second signal skips it.")
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
            elif isinstance(value, BaseModel):
                value = value.model_dump(exclude_unset=True)
            elif name == "budgets":
                value = {k: v.model_dump(exclude_unset=True) for k, v in value.items()}
            out[name] = value
        out["effective_backend"] = self.effective_backend
        return out


def load_settings(config_file: str | None = None, **overrides: Any) -> CollectorSettings:
    """Builds settings with CLI overrides (None means 'not given') and an optional YAML file."""
    if config_file:
        os.environ["TRACECAR_CONFIG"] = config_file
    return CollectorSettings(**{k: v for k, v in overrides.items() if v is not None})
