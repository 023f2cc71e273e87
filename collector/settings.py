"""Collector configuration in one place: TRACECAR_* env vars, an optional YAML file, CLI flags.

Precedence, highest first: CLI flags (passed as init kwargs), environment, the YAML file named
by ``TRACECAR_CONFIG`` (or ``--config``), defaults. ``WANDB_API_KEY``, ``WANDB_BASE_URL`` and
``WF_TRACE_SERVER_URL`` are read under their usual unprefixed names.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict, YamlConfigSettingsSource

from tracecar.client.redact import parse_keys

MiB = 2**20


MIN_STORE_RESERVE_BYTES = 8 * MiB  # the WAL (~4 MiB between checkpoints) plus room for the checkpoint's and evictions' writes


class BudgetSettings(BaseModel):
    """The budget settings, declared once: CollectorSettings has them, BudgetOverride overrides them."""

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
    keep_groups_whole: bool = Field(True, description="Tail-based budgets keep or drop each GRPO group (the rollouts of one sample index) whole, so no group is judged on a survivor; false decides trajectory by trajectory.")


class BudgetOverride(BudgetSettings):
    """Budget settings for one experiment (``budgets:``) or for validation steps.

    Same names, meanings and bounds as the CollectorSettings fields (both are BudgetSettings); a
    field left out inherits, a field given as ``null`` removes that limit. ``validation`` overrides
    further for validate=True steps.
    """

    model_config = ConfigDict(extra="forbid")

    validation: BudgetOverride | None = None


class CollectorSettings(BudgetSettings, BaseSettings):
    """Every knob of the collector. Each bound is enforced and counted when hit (the budgets: BudgetSettings)."""

    model_config = SettingsConfigDict(env_prefix="TRACECAR_", extra="ignore", populate_by_name=True)

    host: str = Field("127.0.0.1", description="Bind address. A sidecar shares the pod's network, so loopback is enough.")
    port: int = Field(9470, ge=0, le=65535, description="HTTP port (0 picks a free one).")
    data_dir: Path = Field(Path("./tracecar-data"), description="Directory of the SQLite spool/store.")
    token: SecretStr | None = Field(None, description="Shared bearer token required on every API and viewer route when set.")
    backend: Literal["auto", "local", "weave", "otlp", "mlflow"] = Field("auto", description="Where traces go: weave if WANDB_API_KEY is set (auto), the embedded local store only, an OTLP/HTTP endpoint (otlp), or an MLflow >= 3.6 server (mlflow).")
    exporters: Annotated[list[str], NoDecode] | None = Field(None, description="Exporters that all get every kept span, each with its own delivery cursor, retries and dead letters: a comma list of weave, otlp, mlflow (empty: local store only); unset: the one TRACECAR_BACKEND names.")
    otlp_endpoint: str | None = Field(None, description="backend=otlp: the full OTLP/HTTP traces URL, e.g. http://127.0.0.1:6006/v1/traces (Phoenix) or .../api/public/otel/v1/traces (Langfuse).")
    otlp_headers: SecretStr | None = Field(None, description="Headers sent with every OTLP (and MLflow) export, k1=v1,k2=v2 (like OTEL_EXPORTER_OTLP_HEADERS); a secret, never logged.")
    otlp_content: bool = Field(True, description="backend=otlp: send message content (gen_ai.input.messages/output.messages, OpenInference input.value/output.value); off sends structure, timings and usage only.")
    otlp_timeout_s: float = Field(10.0, gt=0, description="Timeout of one OTLP or MLflow export request.")
    mlflow_tracking_uri: str | None = Field(None, validation_alias=AliasChoices("TRACECAR_MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_URI"), description="backend=mlflow: the MLflow server (http(s) URL; also read from MLFLOW_TRACKING_URI); spans go to <it>/v1/traces.")
    mlflow_experiment_id: str | None = Field(None, description="backend=mlflow: experiment the traces land in (x-mlflow-experiment-id).")
    mlflow_experiment_name: str | None = Field(None, description="backend=mlflow: experiment name resolved (or created) through MLflow's REST API when no id is given; unset: each trace goes to the experiment named by its project (VERL's trainer.project_name, as VERL's mlflow.set_experiment(project_name)), tracecar when it has none.")
    mlflow_span_types: Literal["verl", "typed"] = Field("verl", description="backend=mlflow: span types as VERL's own mlflow backend shows them (verl: every span UNKNOWN) or typed (AGENT trajectory, LLM, TOOL, CHAIN).")
    wandb_api_key: SecretStr | None = Field(None, validation_alias=AliasChoices("WANDB_API_KEY", "TRACECAR_WANDB_API_KEY"), description="W&B API key (read from WANDB_API_KEY).")
    wandb_entity: str | None = Field(None, validation_alias=AliasChoices("TRACECAR_WANDB_ENTITY", "WANDB_ENTITY"), description="W&B entity (team or user) the Weave project lives in (also read from WANDB_ENTITY).")
    wandb_project: str | None = Field(None, validation_alias=AliasChoices("TRACECAR_WANDB_PROJECT", "WANDB_PROJECT"), description="Default W&B project when a batch names none (also read from WANDB_PROJECT).")
    wandb_run_id: str | None = Field(None, description="The trainer's W&B run (run id or entity/project/run_id): Weave calls link to it (wb_run_id, wb_run_step = the trajectory's step) when the client's batch names none.")
    wandb_base_url: str | None = Field(None, validation_alias=AliasChoices("WANDB_BASE_URL", "TRACECAR_WANDB_BASE_URL"), description="W&B server (WANDB_BASE_URL); a dedicated or self-hosted one also moves the Weave trace server to <it>/traces, as weave does.")
    weave_server_url: str | None = Field(None, validation_alias=AliasChoices("WF_TRACE_SERVER_URL", "TRACECAR_WEAVE_SERVER_URL"), description="Weave trace server base URL (WF_TRACE_SERVER_URL); default https://trace.wandb.ai, or <WANDB_BASE_URL>/traces.")
    token2text: bool = Field(False, description="Decode prompt_ids/response_ids to prompt_text/response_text (VERL's token2text).")
    tokenizer: str | None = Field(None, description="Default tokenizer: a tokenizer.json path, a directory holding one, or a Hugging Face name found offline in the local cache.")
    tokenizer_root: Path | None = Field(None, description="Directory under which a batch may name any tokenizer (a tokenizer.json or a directory holding one); paths elsewhere are refused.")
    tokenizers: list[str] = Field(default_factory=list, description="Further tokenizers a batch may name (paths or Hugging Face names), besides TRACECAR_TOKENIZER, TRACECAR_TOKENIZER_ROOT and models in the local Hugging Face cache.")
    tokenizer_max_bytes: int = Field(64 * MiB, ge=1024, description="Largest tokenizer.json the collector will load; a bigger one is refused unread.")
    decode_table: bool = Field(True, description="Decode byte-level BPE tokenizers (ByteLevel decoder) from a per-id byte table, checked against tokenizers when the tokenizer is loaded (several times less CPU); false: tokenizers' decode_batch for every tokenizer.")
    tokenizer_retry_s: float = Field(60.0, ge=0, description="A tokenizer that failed to load (or was refused) is tried again after this long, not cached as failed for good.")
    reward_wait_s: float = Field(30.0, ge=0, description="After a trajectory's root arrives, how long to wait for its reward annotation before deciding without it.")
    step_idle_s: float = Field(120.0, ge=0, description="A held step whose trajectories are complete is decided after this long without new spans (when no later step or count closes it first).")
    decision_wait_s: float = Field(600.0, gt=0, description="A held step is decided after this long without new spans even if trajectories are incomplete (those are dropped).")
    live_window_s: float = Field(3600.0, gt=0, description="Live view (/v1/live): trajectories with a span received this recently and no root yet are listed as running; one silent for longer drops out of the list.")
    live_max_open_calls: int = Field(100_000, ge=0, description="Live view: calls reported running (clients' open markers, in memory, never stored) remembered at most; past it the oldest are forgotten.")
    live_max_scan_spans: int = Field(50_000, ge=1, description="Live view: most recent spans scanned per request (bounds its cost on a busy store; the answer says scan_capped when hit). Trajectories with open markers are found without the scan.")
    max_held_trajectories: int = Field(200_000, ge=1, description="Bound on trajectories awaiting a decision (their summaries are in memory); above it the oldest step is decided early.")
    validation_budget: BudgetOverride | None = Field(None, description="Budget overrides for validate=True steps (JSON/YAML mapping of the budget settings); they are always counted apart from training steps.")
    budgets: dict[str, BudgetOverride] = Field(default_factory=dict, description="Per-experiment budget overrides: experiment name -> mapping of budget settings (with an optional `validation` mapping).")
    otlp_join_traces: int = Field(16384, ge=0, description="Trajectories remembered so that OTLP engine spans (vLLM's llm_request) joining them take their worker, project and budget attributes, and are kept or dropped with them; past it (or after a restart) the store is asked, where dropped trajectories are not.")
    otlp_hold_max_spans: int = Field(10000, ge=0, description="OTLP engine spans that arrive before any span of their trajectory are stored but sent to no exporter until its project is known (else they would go to the default experiment, and MLflow would file the whole trace there); at most this many wait (0: none wait, the old behaviour); past it the oldest are sent as they are.")
    otlp_hold_max_age_s: float = Field(120.0, gt=0, description="How long an OTLP engine span waits for its trajectory (TRACECAR_OTLP_HOLD_MAX_SPANS) before it is sent as it is, to the default destination; each such release is logged and counted.")
    max_body_bytes: int = Field(20 * MiB, ge=1024, description="Largest request body accepted on the wire (413 above).")
    max_decompressed_bytes: int = Field(100 * MiB, ge=1024, description="Largest body after gzip/zstd decompression (413 above; stops zip bombs).")
    max_batch_spans: int = Field(8192, ge=1, description="Most spans in one request (413 above).")
    max_span_bytes: int = Field(8 * MiB, ge=1024, description="Largest single span after decoding; bigger spans are rejected by name.")
    prompt_refs_max_bytes: int = Field(128 * MiB, ge=0, description="Memory for the prompt contexts that wire-version-2 clients refer to (a growing prompt sent as earlier span + new ids); least recently used first out, counted; a reference to one gone is refused by name and the client resends the full list. 0: every reference is refused (clients send full lists).")
    store_prompt_refs: bool = Field(True, description="Store a growing prompt as the wire sends it: a reference to the earlier turn's context + the new ids (and its decoded text as a reference to the earlier texts), rebuilt whole for every reader; stored bytes grow linearly with turns instead of quadratically. Only with keep_forwarded=true (or no exporter) and no tail budget; false stores every full list (a spool that holds references is rewritten whole at a start where they are off).")
    store_prompt_refs_cache_ids: int = Field(1_000_000, ge=0, description="Ids of rebuilt prompt contexts kept between reads of stored prompt references (the forwarder and the viewer's index read a turn or two of a trajectory at a time; without it each read rebuilds every earlier turn again); about 36 bytes an id, least recently used first out. 0: none kept.")
    max_tree_depth: int = Field(64, ge=1, le=10_000, description="Deepest level a trajectory tree is served with (root = 0); deeper spans are attached at this level, flagged depth_capped with their true depth.")
    spool_max_bytes: int = Field(2048 * MiB, ge=MiB, description="Bound on span bytes waiting to be forwarded (in local mode: on all stored span bytes); at the bound ingest answers 503 with Retry-After.")
    spool_sync: Literal["normal", "full"] = Field("normal", description="SQLite synchronous mode: normal survives a killed process, full also survives power loss (slower).")
    max_inflight_requests: int = Field(16, ge=1, description="Ingest requests processed at once; more answer 503 (bounds memory to this many bodies).")
    retry_after_s: int = Field(2, ge=1, description="Retry-After seconds sent with 503 backpressure answers.")
    forward_batch_spans: int = Field(1000, ge=1, description="Spans per forward request to the backend.")
    forward_retry_initial_s: float = Field(1.0, gt=0, description="First backoff after a failed forward.")
    forward_retry_max_s: float = Field(30.0, gt=0, description="Backoff cap for forwarding retries.")
    forward_probe_s: float = Field(1.0, gt=0, description="While the spool is at its bound and the backend fails, probe it with a one-span batch this often instead of waiting out the backoff.")
    store_max_bytes: int | None = Field(4096 * MiB, ge=MiB, description="Bound on the store file (used SQLite pages): above it the oldest forwarded trajectories are evicted whole; unset: no bound (a full disk still evicts forwarded ones when forwarding to a backend).")
    store_reserve_bytes: int = Field(64 * MiB, ge=0, description="When forwarding (any backend but local): disk space held back in a preallocated file (data_dir/reserve), released on a full disk so forwarded trajectories can be evicted, then taken again; 0: none; else at least 8 MiB (less cannot let SQLite checkpoint its WAL on a full disk: refused at start).")
    store: Literal["sqlite", "clickhouse"] = Field("sqlite", description="The read store every read API answers from (lists, groups, search, export, health): sqlite, the trajectory index beside the spool; clickhouse, embedded chDB under data_dir/clickhouse (pip install 'tracecar[clickhouse]'), fed from the index's change cursor in batches. The spool stays SQLite either way.")
    store_url: SecretStr | None = Field(None, description="store=clickhouse: a ClickHouse server's HTTP interface instead of embedded chDB, clickhouse://USER:PASSWORD@HOST:8123/DATABASE (https:// or port 8443: TLS; ?compress=true: compressed responses; DATABASE default tracecar, one collector per database); through clickhouse-connect. Unset: embedded chDB.")
    store_database: str | None = Field(None, description="store_url: the ClickHouse database, instead of the URL's (default tracecar); characters other than letters, digits and _ become _ (TRACECAR_STORE_DATABASE=tracecar_$(POD_NAME): one database per gateway replica on one server, each collector's own).")
    store_timeout_s: float = Field(30.0, gt=0, le=3600, description="store_url: seconds to connect to the ClickHouse server, and per query or insert; a read past it answers 503, an insert is retried by the next catch-up.")
    store_batch_rows: int = Field(5000, ge=1, le=1_000_000, description="clickhouse store: trajectories per insert (ClickHouse wants few large inserts).")
    store_archive_max_bytes: int | None = Field(None, ge=MiB, description="clickhouse store with store_archive: bound on the span archive's bytes on disk (ClickHouse's, compressed); above it the oldest hour of archived spans is dropped, whole (checked every minute, counted in tracecar_store_archive_dropped_bytes_total); the trajectories stay listed, their spans gone as after an eviction without the archive. Unset: no bound (an embedded chDB shares TRACECAR_DATA_DIR's disk with the spool).")
    store_archive: bool = Field(True, description="clickhouse store: trajectories that retention evicts from the spool (store_max_bytes, store_max_age_s, a full disk) move to the store's span table instead of being deleted; every reader (tree, tokens, truth, group diffs, export) finds them there. false: deleted, as with the sqlite store.")
    store_max_age_s: float | None = Field(None, gt=0, description="Forwarded trajectories older than this (by arrival of their last span) are evicted whole; unset keeps them.")
    decisions_max_rows: int = Field(1_000_000, ge=1000, description="Bound on each table of sampling decisions (head budgets' per-sample rows, tail budgets' per-trajectory rows): above it the oldest rows are deleted.")
    forgotten_ids_max: int = Field(200_000, ge=0, description="Ids of deleted spans (forwarded with keep_forwarded=false, evicted, sampled out) kept so a client's resend stays a duplicate and is never forwarded twice; above it the oldest go (about 90 bytes each, counted in the store's size).")
    http_header_timeout_s: float = Field(60.0, gt=0, description="Time a client has to send a request's headers (from connect, or from its first byte on a kept-alive connection); then the connection is closed.")
    http_body_timeout_s: float = Field(60.0, gt=0, description="Time a client has to send a request's whole body once its headers are in; then the connection is closed.")
    http_idle_timeout_s: float = Field(60.0, gt=0, description="An idle kept-alive connection is closed after this long.")
    http_max_header_bytes: int = Field(64 * 1024, ge=1024, description="Largest request head (request line and headers); larger ones get 431 and the connection is closed.")
    decode_threads: int = Field(2, ge=1, description="Threads decoding tokens (tokenizers releases the GIL).")
    workers: int | None = Field(None, ge=1, le=256, description="Worker processes that decode token ids and serialise spool payloads beside the ingest process (which keeps the HTTP server, sampling, the spool writer and the metrics); unset: the cores this container may use (CPU affinity, capped by a cgroup CPU quota), or 1 below 3 cores; 1: all in the ingest process (threads).")
    keep_forwarded: bool = Field(True, description="Keep forwarded spans in the local store (queryable); false deletes them once the backend has them.")
    shutdown_unready_s: float = Field(0.0, ge=0, description="On SIGTERM, stay up this long answering /readyz and ingest with 503 before closing the listener (lets endpoints and load balancers stop sending first); a second signal skips it.")
    shutdown_drain_s: float = Field(10.0, ge=0, description="On SIGTERM, how long to keep forwarding before exit; the rest stays in the spool.")
    redact_keys: Annotated[list[str], NoDecode] = Field(default_factory=list, description="Keys whose values are replaced by REDACTED at ingest, on top of weave's api_key, auth_headers, authorization (case-insensitive, any depth; comma-separated in the environment).")
    log_level: str = Field("info", description="Log level (JSON lines on stderr).")

    # --- the cluster tier (issue 26): node collectors feed a gateway (collector/service/roles.py) ---
    role: Literal["node", "gateway"] = Field("node", description="node: the collector beside the workers (today's collector; with TRACECAR_GATEWAY_URL it forwards its decoded trajectories to that gateway); gateway: takes node collectors' trajectories, decides the global (tail) budgets, stores, serves the viewer and read APIs for the whole job and fans out to the exporters.")
    gateway_url: str | None = Field(None, description="role=node: the gateway's base URL (http(s)://HOST:PORT), or several, comma-separated (every node lists the same ones: each step goes to one gateway by rendezvous hashing of (experiment, step), docs/cluster.md); the node then forwards everything its head budget keeps to it (exporter gateway, or gateway@HOST:PORT each; candidates only where the gateway's tail budget decomposes, node_candidates) and the gateway decides the tail budgets.")
    gateway_peers: str | None = Field(None, description="role=gateway with several gateways: every gateway of the job (the nodes' gateway_url list, this one included), comma-separated; this gateway then answers the lists, one trajectory, one step, the JSONL export and the viewer's facets for all of them, merged (viewer/federation.py); each asked with the caller's own credentials. Unset: its own store only.")
    gateway_peers_timeout_s: float = Field(30.0, gt=0, le=600, description="gateway_peers: seconds per request to one gateway; one that does not answer makes a merged list partial (said in the answer), one trajectory or step 503 naming it.")
    gateway_token: SecretStr | None = Field(None, description="role=node: the bearer token the gateway requires (its TRACECAR_TOKEN); unset: this node's own TRACECAR_TOKEN.")
    node_name: str | None = Field(None, max_length=256, description="role=node: this node's name at the gateway (its metrics' node label, the forwarded batches' envelope); unset: <hostname>:<port>.")
    gateway_timeout_s: float = Field(30.0, gt=0, description="role=node: timeout of one forward request to the gateway.")
    gateway_batch_bytes: int = Field(8 * MiB, ge=64 * 1024, description="role=node: most JSON bytes of spans in one forward request to the gateway (sent zstd-compressed; keep it under the gateway's TRACECAR_MAX_DECOMPRESSED_BYTES); a larger single span goes alone.")
    gateway_heartbeat_s: float = Field(1.0, gt=0, description="role=node: how often the node tells the gateway how far it has acknowledged and delivered (also between batches), so the gateway's steps wait for a node that is behind.")
    node_candidates: bool = Field(True, description="role=node with a gateway: for experiments whose gateway tail budget decomposes (docs/cluster.md: max_trajectories_per_step alone, trajectory by trajectory, no spread quota), hold each step until this node's view of it closes (next_step, TRACECAR_STEP_IDLE_S, TRACECAR_DECISION_WAIT_S, TRACECAR_MAX_HELD_TRAJECTORIES) and forward only the trajectories that can be kept (each rule's local top-k); the rest stay in this node's store. false: forward everything.")
    node_silent_s: float = Field(3.0, gt=0, description="role=gateway: a node collector not heard from for this long counts as behind: steps it may still hold trajectories of do not close on next_step, idle or shutdown until it has delivered what it had acknowledged (count and TRACECAR_DECISION_WAIT_S still close them).")
    node_lost_s: float = Field(300.0, gt=0, description="role=gateway: a node collector not heard from for this long is no longer waited for (it left the job); its late trajectories open later rounds of their steps.")

    # --- the list API over the viewer's trajectory index (issue 15, helper "lists") ---
    list_catch_up_s: float = Field(5.0, gt=0, description="GET /v1/trajectories: how long a request lets the trajectory index catch up with the store before answering (so a list right after an ingest shows it); past it the answer says index.caught_up=false and the rest is indexed in the background.")

    @field_validator("redact_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: Any) -> Any:
        return parse_keys(value) if isinstance(value, str) else value

    @field_validator("exporters", mode="before")
    @classmethod
    def _split_exporters(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("exporters")
    @classmethod
    def _no_repeated_exporter(cls, value: list[str] | None) -> list[str] | None:
        """A name twice would mean two cursors under one key. (Unknown names: config_check, which knows the registry.)"""
        if value is not None and len(set(value)) != len(value):
            raise ValueError("names an exporter twice")
        return value

    @field_validator("store_database")
    @classmethod
    def _a_database_name(cls, value: str | None) -> str | None:
        """A plain identifier (the store puts it into its SQL unquoted): a pod's name (tracecar-gateway-0) spelled so."""
        if value is None or not value.strip():
            return None
        import re

        from .store_url import DATABASE_NAME

        name = re.sub(r"[^A-Za-z0-9_]", "_", value.strip())
        if not DATABASE_NAME.match(name):
            raise ValueError("must start with a letter or _ and be at most 64 characters (letters, digits, _)")
        return name

    @field_validator("store_url")
    @classmethod
    def _a_server_url(cls, value: SecretStr | None) -> SecretStr | None:
        """A ClickHouse server's URL, checked at start (never echoed: it may hold a password); blank: embedded chDB."""
        if value is None or not value.get_secret_value():
            return None
        from .store_url import url_problem

        problem = url_problem(value.get_secret_value())
        if problem is not None:
            raise ValueError(f"TRACECAR_STORE_URL {problem}")
        return value

    @model_validator(mode="after")
    def _peers_are_a_gateways(self) -> CollectorSettings:
        if self.gateway_peers and self.role != "gateway":
            raise ValueError("TRACECAR_GATEWAY_PEERS lists the job's gateways for a gateway (TRACECAR_ROLE=gateway) to "
                             "answer reads for all of them; a node lists them in TRACECAR_GATEWAY_URL")
        return self

    @model_validator(mode="after")
    def _server_url_needs_the_clickhouse_store(self) -> CollectorSettings:
        if self.store_url is not None and self.store != "clickhouse":
            raise ValueError("TRACECAR_STORE_URL names a ClickHouse server for TRACECAR_STORE=clickhouse: set it, or unset the URL")
        return self

    @field_validator("store_reserve_bytes")
    @classmethod
    def _reserve_that_can_work(cls, value: int) -> int:
        """A reserve too small to let SQLite checkpoint its WAL on a full disk cannot free anything:
        ingest would answer 503 for good (issue 28, item 7). Refused at start instead."""
        if 0 < value < MIN_STORE_RESERVE_BYTES:
            raise ValueError(f"must be 0 (no reserve) or at least {MIN_STORE_RESERVE_BYTES} (8 MiB): on a full "
                             "disk the released reserve must let SQLite checkpoint its write-ahead log (up to about 4 MiB "
                             "between checkpoints) into the main file before forwarded trajectories can be evicted; a "
                             "smaller one leaves ingest answering 503 with nothing evicted")
        return value

    @field_validator("token", mode="before")
    @classmethod
    def _no_empty_token(cls, value: Any) -> Any:
        """An empty token would mean "auth off" while looking set: refuse it."""
        raw = value.get_secret_value() if isinstance(value, SecretStr) else value
        if isinstance(raw, str) and not raw.strip():
            raise ValueError("is set but empty: give a token, or unset TRACECAR_TOKEN to serve without one")
        return value

    @field_validator("data_dir", mode="before")
    @classmethod
    def _expand(cls, value: Any) -> Any:
        return Path(os.path.expanduser(str(value))) if value is not None else value

    @model_validator(mode="after")
    def _weave_server_from_wandb_base(self) -> CollectorSettings:
        """Like weave: WF_TRACE_SERVER_URL, else <WANDB_BASE_URL>/traces off W&B's cloud, else the cloud's."""
        if not self.weave_server_url:
            base = (self.wandb_base_url or "").rstrip("/")
            cloud = base in ("", "https://api.wandb.ai", "https://wandb.ai")
            self.weave_server_url = "https://trace.wandb.ai" if cloud else base + "/traces"
        return self

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
    def effective_workers(self) -> int:
        """TRACECAR_WORKERS, else the cores this process may use, 1 below 3 (see collector/cores.py)."""
        if self.workers is not None:
            return self.workers
        from .cores import default_workers

        return default_workers()

    @property
    def gateway_urls(self) -> list[str]:
        """The gateways of TRACECAR_GATEWAY_URL (comma-separated), in the order given."""
        return [u.strip() for u in (self.gateway_url or "").split(",") if u.strip()]

    @property
    def gateway_peer_urls(self) -> list[str]:
        """The gateways of TRACECAR_GATEWAY_PEERS (comma-separated), in the order given."""
        return [u.strip() for u in (self.gateway_peers or "").split(",") if u.strip()]

    @field_validator("gateway_peers")
    @classmethod
    def _peer_urls(cls, value: str | None) -> str | None:
        """http(s)://HOST[:PORT] each, no user or password (the caller's own credentials are passed on)."""
        from urllib.parse import urlsplit

        from .gateway_names import gateway_identity

        seen: set[str] = set()
        for url in (u.strip() for u in (value or "").split(",") if u.strip()):
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"{url!r:.80} is not an http(s)://HOST:PORT URL")
            if parts.username or parts.password:
                raise ValueError("a gateway URL with a user or password: the caller's own credentials are passed on")
            if gateway_identity(url) in seen:
                raise ValueError(f"lists {url!r:.80} twice (each gateway's rows would count twice)")
            seen.add(gateway_identity(url))
        return value

    @property
    def effective_node_name(self) -> str:
        """This node's name at its gateway: TRACECAR_NODE_NAME, else <hostname>:<port>."""
        import socket

        return self.node_name or f"{socket.gethostname()}:{self.port}"

    @property
    def effective_backend(self) -> Literal["local", "weave", "otlp", "mlflow"]:
        if self.backend == "auto":
            return "weave" if self.wandb_api_key is not None else "local"
        return self.backend

    @property
    def effective_exporters(self) -> list[str]:
        """The exporters forwarded to: TRACECAR_EXPORTERS, else the one the backend setting names."""
        if self.role == "node" and self.gateway_url:  # a node forwards to its gateway(s) only (service/roles.py checks the rest)
            from .gateway_names import exporter_name

            urls = self.gateway_urls
            return ["gateway"] if len(urls) == 1 else [exporter_name(u) for u in urls]
        if self.exporters is not None:
            return list(self.exporters)
        backend = self.effective_backend
        return [] if backend == "local" else [backend]

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
        out["effective_workers"] = self.effective_workers
        out["effective_exporters"] = self.effective_exporters
        return out


def load_settings(config_file: str | None = None, **overrides: Any) -> CollectorSettings:
    """Builds settings with CLI overrides (None means 'not given') and an optional YAML file."""
    if config_file:
        os.environ["TRACECAR_CONFIG"] = config_file
    return CollectorSettings(**{k: v for k, v in overrides.items() if v is not None})
