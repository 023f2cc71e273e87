"""The collector's HTTP surface: ingest, health, readiness, metrics and store queries."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from fastapi import Depends, FastAPI, HTTPException, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import ClientDisconnect

from tracecar.client import __version__

from ..exporters.forward import Forwarder, NullSink, Sink, SpoolTrajectories
from ..exporters.registry import make_sinks
from ..heap import WARM_BODY_MAX
from ..json_out import dumps_deep
from ..loudness import AuthFailures, WatchedSink
from ..metrics import Metrics
from ..processors.sampling.candidates import describe as describe_budgets
from ..processors.validate import EnvelopeError
from ..query_params import (
    ATTR_QUERY,
    INT64_MAX,
    Int64,
    OptionalInt64,
    SampleIndexError,
    attribute_filters,
    check_bounded_ints,
    sample_index_filter,
    validation_error_body,
)
from ..read_store import StoreUnavailable
from ..receivers.otlp import build_router as build_otlp_router
from ..receivers.pipeline import Backpressure, IngestPipeline
from ..receivers.receive import BodyError
from ..receivers.rl_insight import build_router as build_rl_insight_router
from ..settings import CollectorSettings
from ..spool.full_payloads import CONTEXTS as STORED_CONTEXTS
from ..spool.query import get_trajectory
from ..spool.retention import Retention
from ..spool.store import Spool
from ..trajectory_filter import TrajectoryFilter
from ..viewer.group_export_api import build_router as build_group_export_router
from ..viewer.index import SORTS
from ..viewer.list_api import caught_up as viewer_list_caught_up
from ..viewer.list_api import index_unavailable, list_page, read_index
from ..viewer.live_api import build_router as build_live_router
from ..viewer.routes import build_router as build_viewer_router
from ..viewer.search import QUERY_MAX_CHARS
from ..viewer.tokens import trajectory_tokens
from ..viewer.trajectory_ids import read_by_id as read_trajectory_by_id
from ..viewer.truth_api import TruthFilters, add_trainer_logprobs
from ..viewer.truth_api import build_router as build_truth_router
from .auth import BearerAuth
from .health import health_snapshot
from .health_step import latest_experiment, step_health
from .roles import (
    NODE_HEADER,
    PROGRESS_HEADER,
    BudgetsAgreement,
    GatewayIntake,
    gateway_routing,
    gateway_sinks,
    heartbeat_loop,
    wire_gateway_sinks,
)

log = logging.getLogger("tracecar.collector")
LIST_SORT_PATTERN = "^(" + "|".join(SORTS) + ")$"  # the viewer list's sorts


class Collector:
    """Everything one collector process owns; the app's lifespan opens and closes it."""

    def __init__(self, settings: CollectorSettings, sink: Sink | None = None, sinks: list[Sink] | None = None) -> None:
        self.settings = settings
        self.metrics = Metrics()
        built = list(sinks) if sinks is not None else [sink] if sink is not None else make_sinks(settings)
        local_only = all(isinstance(s, NullSink) for s in built)
        self.sinks: list[Sink] = built if not local_only else [NullSink()]
        names = [s.name for s in self.sinks]
        if len(set(names)) != len(names):
            raise RuntimeError(f"two exporters share a name ({', '.join(names)}): each needs its own delivery cursor")
        self.sink = self.sinks[0]
        STORED_CONTEXTS.max_ids = settings.store_prompt_refs_cache_ids
        self.spool = Spool(settings.spool_path, local_only=local_only, sync=settings.spool_sync,
                           exporters=() if local_only else names, routing=gateway_routing(self.sinks))
        for s in self.sinks:
            if hasattr(s, "trajectories") and s.trajectories is None:
                s.trajectories = SpoolTrajectories(self.spool, s.name)  # kept_because, feedback targets
        self.pipeline = IngestPipeline(settings, self.spool, self.metrics)
        # a node's gateway sink reads its token offsets and progress here (and the steps it holds)
        wire_gateway_sinks(self.sinks, self.spool, self.pipeline.selection)
        several = gateway_sinks(self.sinks)
        if len(several) == 1:  # ... and learns the gateway's budgets (candidates only)
            several[0].on_budgets = self.pipeline.learn_budgets
        elif several:  # ... while its gateways agree on them
            agreement = BudgetsAgreement([s.name for s in several], self.pipeline.learn_budgets)
            for gateway_sink in several:
                gateway_sink.on_budgets = functools.partial(agreement.heard, gateway_sink.name)
        # a gateway's budgets, as its heartbeat answers tell its nodes (processors/sampling/candidates.py)
        self.budgets_description = (describe_budgets(self.pipeline.policies, list(settings.budgets))
                                    if settings.role == "gateway" else None)
        self.intake = GatewayIntake(settings, self.pipeline.redact_keys, self.metrics.gateway_spans_received)
        if self.intake.marks is not None and self.pipeline.selection is not None:  # a gateway's steps wait for lagging nodes
            self.pipeline.selection.may_close = self.intake.marks.may_close
        self._heartbeat_tasks: list[asyncio.Task[None]] = []
        self.auth_failures = AuthFailures(self.metrics.auth_failures)
        # one forwarder per exporter (fan-out), each sending through a watcher that logs its
        # outages (rate-limited) and feeds /readyz
        self.watched_sinks: list[WatchedSink] = []
        self.forwarders: list[Forwarder] = []
        for s in self.sinks:
            watched = WatchedSink(s, self.metrics.backend_unreachable.labels(exporter=s.name), redact=self.pipeline.redact_keys)
            forwarder = Forwarder(
                self.spool, watched, self.metrics, batch_spans=settings.forward_batch_spans,
                retry_initial_s=settings.forward_retry_initial_s, retry_max_s=settings.forward_retry_max_s,
                keep_forwarded=settings.keep_forwarded, probe_s=settings.forward_probe_s,
                urgent=self.pipeline.at_capacity,
            )
            self.watched_sinks.append(watched)
            self.forwarders.append(forwarder)
            # a local-only store writes every span done: a commit leaves nothing pending to wake the forwarder for
            # (each wake cost a thread hand-off and a query per request; pending rows an earlier run with an
            # exporter left behind are found by the forwarder's first pass, then its own poll once a second)
            if not local_only:
                self.pipeline.on_committed.append(forwarder.notify)
                self.metrics.bind_exporter(s.name, functools.partial(self.spool.owed_count, s.name),
                                           functools.partial(getattr, forwarder, "backoff_s"))  # this exporter's, read at scrape
        self.watched_sink, self.forwarder = self.watched_sinks[0], self.forwarders[0]  # the first (or only) one
        if self.spool.local_only:  # the store is the destination: count what reaches it as forwarded
            stored = self.metrics.forwarded.labels(backend="local", exporter="local")
            self.spool.on_stored = stored.inc
        self.retention = Retention(self.spool, self.metrics, max_bytes=settings.store_max_bytes,
                                   max_age_s=settings.store_max_age_s, evict_on_disk_full=not self.spool.local_only,
                                   decisions_max_rows=settings.decisions_max_rows,
                                   forgotten_ids_max=settings.forgotten_ids_max,
                                   reserve_bytes=settings.store_reserve_bytes,
                                   archive_max_bytes=settings.store_archive_max_bytes)
        self.pipeline.make_room = self.retention.make_room
        self.pipeline.disk_short = lambda: self.retention.reserve_out
        self.metrics.bind_spool(
            lambda: self.spool.pending_count, lambda: self.spool.pending_bytes,
            self.spool.size_bytes, self.spool.dead_count,
        )
        self.ready = False
        self._forward_tasks: list[asyncio.Task[None]] = []
        self._select_task: asyncio.Task[None] | None = None
        self._retention_task: asyncio.Task[None] | None = None
        self._hold_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.pipeline.pool is not None and self.settings.token2text:  # spawned now, warm in the background
            self.pipeline.pool.start()
        self._forward_tasks = [asyncio.create_task(f.run(), name=f"tracecar-forwarder-{f.name}") for f in self.forwarders]
        await asyncio.to_thread(self.retention.take_reserve)
        self._retention_task = asyncio.create_task(self.retention.run(), name="tracecar-retention")
        self._hold_task = asyncio.create_task(self.pipeline.run_hold(), name="tracecar-engine-hold")
        if self.pipeline.selection is not None:  # tail-based budgets: decide held steps
            self._select_task = asyncio.create_task(self.pipeline.run_selection(), name="tracecar-selection")
        self._heartbeat_tasks = [asyncio.create_task(heartbeat_loop(s, self.settings.gateway_heartbeat_s), name="tracecar-heartbeat")
                                 for s in gateway_sinks(self.sinks)]  # a node: its progress to the gateway
        self.ready = True
        self.metrics.ready.set(1)

    def mark_unready(self) -> None:
        self.ready = False
        self.metrics.ready.set(0)

    async def stop(self) -> None:
        """Drains to the backend up to the deadline; whatever is left stays in the spool."""
        self.mark_unready()
        for task in self._heartbeat_tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._retention_task is not None:
            self._retention_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._retention_task
        if self._hold_task is not None:
            self._hold_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._hold_task
        if self._select_task is not None:
            self._select_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._select_task
            await self.pipeline.finish_selection()
        for forwarder in self.forwarders:
            forwarder.stop()
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + self.settings.shutdown_drain_s
        if self._forward_tasks:
            # A forward in flight counts against the drain budget (a hung backend must not hold
            # SIGTERM for the sink's whole timeout); cut off, its batch simply stays pending.
            await asyncio.wait(set(self._forward_tasks), timeout=self.settings.shutdown_drain_s)
            for task in self._forward_tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        with contextlib.suppress(asyncio.TimeoutError):  # every exporter drains at once, to one deadline
            await asyncio.wait_for(asyncio.gather(*(f.run(deadline=deadline) for f in self.forwarders)),
                                   timeout=max(0.0, deadline - loop.time()))
        log.info("drained", extra={"event": "drained", "left_in_spool": self.spool.pending_count,
                                   "drain_s": round(loop.time() - started, 3)})
        for s in self.sinks:
            with contextlib.suppress(Exception):
                await s.aclose()
        self.pipeline.close()
        self.spool.close()


    def exporter_states(self) -> dict[str, Any]:
        """Per exporter, for /readyz: reachable, backlog, backoff, last error."""
        return {f.name: {**w.details(), "pending": self.spool.owed_count(f.name), "backoff_s": f.backoff_s,
                         "last_forward_error": f.last_error}
                for f, w in zip(self.forwarders, self.watched_sinks) if not self.spool.local_only}


def create_app(settings: CollectorSettings | None = None, sink: Sink | None = None, sinks: list[Sink] | None = None) -> FastAPI:
    settings = settings or CollectorSettings()
    collector = Collector(settings, sink, sinks)
    auth = BearerAuth(settings.token.get_secret_value() if settings.token else None, on_failure=collector.auth_failures)

    federations: list[Any] = []  # viewer/federation.py's middleware (with TRACECAR_GATEWAY_PEERS): its clients closed at stop

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await collector.start()
        yield
        for federation in federations:
            await federation.aclose()
        await collector.stop()

    # With a token, the schema is behind it like the API it describes, and the interactive
    # docs pages (which a browser opens without an Authorization header) are off.
    guarded_schema = settings.token is not None
    app = FastAPI(title="tracecar collector", version=__version__, lifespan=lifespan,
                  openapi_url=None if guarded_schema else "/openapi.json",
                  docs_url=None if guarded_schema else "/docs", redoc_url=None if guarded_schema else "/redoc")
    app.state.collector = collector

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse({"error": exc.detail}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(request: Request, exc: RequestValidationError) -> Response:
        return _json(validation_error_body(exc.errors()), status_code=422)

    @app.exception_handler(StoreUnavailable)
    async def _store_unavailable(request: Request, exc: StoreUnavailable) -> JSONResponse:
        """A read of the ClickHouse store (a trajectory's archived spans, viewer/clickhouse_spans.py) it refused: the
        same 503 naming the store as every list gives (viewer/list_api.py), never a 500."""
        refused = index_unavailable(exc)
        return JSONResponse({"error": refused.detail}, status_code=refused.status_code, headers=refused.headers)

    @app.exception_handler(SampleIndexError)
    async def _bad_sample_index(request: Request, exc: SampleIndexError) -> Response:
        return _json({"error": {"field": "sample_index", "reason": str(exc)}}, status_code=422)

    if guarded_schema:
        @app.get("/openapi.json", dependencies=[Depends(auth)], include_in_schema=False)
        async def openapi() -> Any:
            return app.openapi()

    @app.post("/v1/spans", dependencies=[Depends(auth)])
    async def ingest(request: Request) -> Any:
        """Accepts a span batch (JSON or msgpack, optionally gzip/zstd)."""
        started = time.perf_counter()
        m = collector.metrics
        try:
            status, payload, headers = await _ingest(request, collector)
        except Exception:
            m.requests.labels(status="500").inc()  # a bug answered 500 by the server: counted like any answer
            raise
        m.requests.labels(status=str(status)).inc()
        m.ingest_seconds.observe(time.perf_counter() - started)
        return _json(payload, status_code=status, headers=headers)

    @app.get("/healthz")
    async def healthz() -> Any:
        return {"status": "ok", "version": __version__, "pid": os.getpid()}  # pid: the quickstart knows its own child

    @app.get("/readyz")
    async def readyz() -> Any:
        body = {"ready": collector.ready, "spool_depth": collector.spool.pending_count,
                "forward_backoff_s": collector.forwarder.backoff_s, "last_forward_error": collector.forwarder.last_error,
                "forwarding": collector.watched_sink.details(), "exporters": collector.exporter_states(),
                "auth_failures": collector.auth_failures.details()}
        return _json(body, status_code=200 if collector.ready else 503)

    @app.get("/v1/health", dependencies=[Depends(auth)])
    async def health(step: OptionalInt64 = None, experiment: str | None = None, validate: bool | None = None) -> Any:
        """Tracing health totals (client drops, sampled out, rejected, decode failures, spool depth).

        ``step``: also that step's numbers (``step``: stored, running, held, errors, sampling
        decisions, what the trainer did; service/health_step.py) of ``experiment`` (default: the
        latest; empty: none) and ``validate`` (default: both).
        """
        answer = health_snapshot(collector.metrics.registry, collector.pipeline.client_drops.by_worker())
        if step is not None:
            index = viewer.trajectory_index
            await asyncio.to_thread(viewer_list_caught_up, index, settings.list_catch_up_s, collector.metrics.list_index_behind.inc)
            if experiment is None:
                experiment = await asyncio.to_thread(read_index, latest_experiment, index)
            decided = await collector.pipeline.decisions(experiment or None, step, validate)
            now = time.time()
            answer["step"] = await asyncio.to_thread(
                read_index, step_health, collector.spool, index, experiment, step, validate, window_s=settings.live_window_s,
                max_scan_spans=settings.live_max_scan_spans, decisions=decided,
                open_calls=lambda: collector.pipeline.open_calls.snapshot(now - settings.live_window_s))
        return _json(answer)

    @app.get("/metrics")
    async def metrics() -> Any:
        return PlainTextResponse(generate_latest(collector.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/trajectories", dependencies=[Depends(auth)])
    async def trajectories(
        truth: TruthFilters, experiment: str | None = None, step: OptionalInt64 = None, step_min: OptionalInt64 = None,
        step_max: OptionalInt64 = None, sample_index: str | None = Query(None, max_length=256), rollout_n: OptionalInt64 = None,
        validate: bool | None = None, kept_because: str | None = Query(None, max_length=256),
        worker: str | None = Query(None, max_length=256), has_error: bool | None = None,
        reward_min: float | None = None, reward_max: float | None = None, trained: bool | None = None,
        filtered_by: str | None = Query(None, max_length=256), node: str | None = Query(None, max_length=256),
        sort: str = Query("start", pattern=LIST_SORT_PATTERN), order: str = Query("desc", pattern="^(asc|desc)$"),
        limit: int = Query(50, ge=1, le=1000), offset: int = Query(0, ge=0, le=INT64_MAX),
        q: str | None = Query(None, max_length=QUERY_MAX_CHARS),
        attr: list[str] | None = ATTR_QUERY,
    ) -> Any:
        """Trajectories in the embedded store, filtered, sorted and paginated; ``q`` searches their text.

        Answered from the viewer's trajectory index (viewer/list_api.py), as ``/ui/api/trajectories``;
        ``experiment=`` (empty) is the trajectories sent without an experiment name.
        """
        flt = TrajectoryFilter(experiment=experiment, step=step, step_min=step_min, step_max=step_max,
                               sample_index=sample_index_filter(sample_index), rollout_n=rollout_n, validate=validate,
                               kept_because=kept_because, reward_min=reward_min, reward_max=reward_max, has_error=has_error,
                               worker=worker, trained=trained, filtered_by=filtered_by, node=node, q=q,
                               attributes=attribute_filters(attr), **truth)
        page = await asyncio.to_thread(list_page, viewer.trajectory_index, flt, sort=sort, descending=order == "desc",
                                       limit=limit, offset=offset, budget_s=settings.list_catch_up_s,
                                       on_behind=collector.metrics.list_index_behind.inc)
        return _json(page)

    def read_by_id(trace_id: str, read: Callable[[str], Any]) -> Any:
        return read_trajectory_by_id(collector.spool, trace_id, read)

    @app.get("/v1/trajectories/{trace_id}", dependencies=[Depends(auth)])
    async def trajectory(trace_id: str = Path(max_length=1024)) -> Any:
        """One trajectory with all its spans as a tree (``trace_id``: the id, its viewer form or a unique prefix)."""
        found = await asyncio.to_thread(read_by_id, trace_id, lambda t: get_trajectory(collector.spool, t, settings.max_tree_depth))
        return Response(await asyncio.to_thread(dumps_deep, found), media_type="application/json")

    @app.get("/v1/trajectories/{trace_id}/tokens", dependencies=[Depends(auth)])
    async def tokens(trace_id: str = Path(max_length=1024), lowest: int = Query(10, ge=0, le=1000)) -> Any:
        """The token view: per span with per-token data, each token's text, log-probability, mask, entropy."""
        found = await asyncio.to_thread(read_by_id, trace_id, lambda t: trajectory_tokens(collector.spool, t, lowest))
        await asyncio.to_thread(add_trainer_logprobs, found, viewer.trajectory_index)
        return Response(await asyncio.to_thread(orjson.dumps, found), media_type="application/json")

    @app.get("/v1/decisions", dependencies=[Depends(auth)])
    async def decisions(step: Int64, experiment: str | None = None, validate: bool | None = None) -> Any:
        """Tail-based sampling decisions of one step: kept/dropped per trajectory, with rule or reason."""
        return await collector.pipeline.decisions(experiment, step, validate)

    @app.get("/v1/tokenizers/check", dependencies=[Depends(auth)])
    async def tokenizer_check(name: str | None = Query(None, max_length=1024)) -> Any:
        """Can this collector load ``name`` (default: TRACECAR_TOKENIZER)? For `tracecar doctor`."""
        return await asyncio.to_thread(check_tokenizer_name, collector, name)

    @app.get("/v1/dead-letters", dependencies=[Depends(auth)])
    async def dead_letters(limit: int = Query(100, ge=1, le=10000), exporter: str | None = Query(None, max_length=64)) -> Any:
        """Spans a backend rejected permanently, with its reason and exporter (``exporter``: one only)."""
        known = [s.name for s in collector.sinks]
        if exporter is not None and exporter not in known:
            reason = f"no exporter {exporter!r} here (configured: {', '.join(known)})"
            raise HTTPException(422, detail={"field": "exporter", "reason": reason})
        rows = await asyncio.to_thread(collector.spool.dead_letters, limit, exporter)
        return {"count": await asyncio.to_thread(collector.spool.dead_count, exporter), "dead_letters": rows}

    @app.post("/v1/cluster/heartbeat", dependencies=[Depends(auth)], include_in_schema=False)
    async def heartbeat(request: Request) -> Any:
        """A node collector's progress between its batches (service/roles.py NodeMarks); a gateway's only."""
        node = request.headers.get(NODE_HEADER)
        _, refusal = collector.intake.receiver(node if node is not None else "")
        if refusal is not None or node is None:
            status, body = refusal or (400, {"error": {"field": NODE_HEADER, "reason": "missing"}})
            return _json(body, status_code=status)
        report: Any = None
        try:
            raw = await _read_body(request, 16 * 2**20)
            report = orjson.loads(raw) if raw else None
        except (BodyError, orjson.JSONDecodeError):
            report = None  # an old node's empty heartbeat, or one too large: its progress header still counts
        collector.intake.delivered(node, request.headers.get(PROGRESS_HEADER), report)
        selection = collector.pipeline.selection
        if isinstance(report, dict) and selection is not None:
            await asyncio.to_thread(selection.merge_latest, report.get("latest"))
        return _json({"ok": True, "budgets": collector.budgets_description})

    @app.get("/v1/cluster/nodes", dependencies=[Depends(auth)])
    async def cluster_nodes() -> Any:
        """A gateway's node collectors: how far each has acknowledged and delivered, when last heard."""
        marks = collector.intake.marks
        return _json({"role": settings.role, "nodes": marks.snapshot() if marks is not None else {}})

    # OTLP/HTTP in (vLLM/SGLang engine spans, any OpenTelemetry SDK): same pipeline, same token
    app.include_router(build_otlp_router(collector, auth, _read_body))
    # RL-Insight's service discovery (VERL's enable_otel, RL-Insight's SDK): their spans come to /v1/traces
    app.include_router(build_rl_insight_router())
    # the local trajectory viewer (/ui/): read-only, same token
    viewer = build_viewer_router(collector, settings.token.get_secret_value() if settings.token else None)
    app.include_router(viewer)
    # GRPO groups and dataset export, over the viewer's trajectory index
    app.include_router(build_group_export_router(collector, viewer.trajectory_index, viewer.fresh, auth, viewer.viewer_auth))
    app.include_router(build_truth_router(collector, viewer.trajectory_index, auth, settings.list_catch_up_s))
    # the same health answer for the viewer's overview (its token or cookie)
    app.add_api_route("/ui/api/health", health, methods=["GET"], dependencies=[Depends(viewer.viewer_auth)],
                      include_in_schema=False)
    # running trajectories (root not yet arrived), for /v1/live and the viewer's "Running now"
    app.include_router(build_live_router(collector, auth, viewer.viewer_auth, collector.pipeline.open_calls))
    check_bounded_ints(app.routes)  # every integer query parameter fits SQLite, or the app does not start
    if settings.gateway_peer_urls:  # any gateway answers the read APIs for every gateway of the job (docs/cluster.md)
        from ..viewer.federation import Federation

        app.add_middleware(Federation, peers=settings.gateway_peer_urls, timeout_s=settings.gateway_peers_timeout_s,
                           made=federations, token=settings.token.get_secret_value() if settings.token else None,
                           on_failure=lambda gateway, reason: collector.metrics.gateway_peer_failures.labels(
                               gateway=gateway, reason=reason).inc())
    return app


def check_tokenizer_name(collector: Collector, name: str | None) -> dict[str, Any]:
    """The answer of GET /v1/tokenizers/check: loads through the pipeline's own registry."""
    from ..loudness import REFUSALS, describe_tokenizer_attempts
    from ..processors.decoding import TokenizerNotFound

    settings = collector.settings
    chosen = name or settings.tokenizer
    answer: dict[str, Any] = {"name": chosen, "token2text": settings.token2text, "default_tokenizer": settings.tokenizer}
    if not chosen:
        return {**answer, **_tokenizers_under_root(collector), "ok": False,
                "error": "no tokenizer named and TRACECAR_TOKENIZER is unset"}
    try:
        tokenizer = collector.pipeline.tokenizers.get(chosen)
    except TokenizerNotFound as exc:
        refused = getattr(exc, "reason", "") in REFUSALS  # the policy said no: the path was not looked at
        return {**answer, "ok": False, "error": str(exc), "tried": None if refused else describe_tokenizer_attempts(chosen)}
    return {**answer, "ok": True, "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True)}


def _tokenizers_under_root(collector: Collector) -> dict[str, Any]:
    """With TRACECAR_TOKENIZER_ROOT and no name: whether the root exists, and the tokenizers the
    workers have named (or, before any, the model directories found under it) and whether each loads."""
    from ..processors.decoding import TokenizerNotFound, tokenizers_under

    root = collector.settings.tokenizer_root
    if root is None:
        return {}
    if not root.is_dir():
        return {"root": str(root), "root_exists": False, "found": []}
    named = collector.pipeline.tokenizers.loaded_names()
    candidates = named or [str(path) for path in tokenizers_under(root)]
    found: list[dict[str, Any]] = []
    for candidate in candidates[:4]:
        try:
            tokenizer = collector.pipeline.tokenizers.get(candidate)
        except TokenizerNotFound as exc:
            found.append({"name": candidate, "ok": False, "error": str(exc)})
        else:
            found.append({"name": candidate, "ok": True, "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True)})
    return {"root": str(root), "root_exists": True, "found": found, "named_by_workers": bool(named)}


def _json(payload: Any, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(payload), status_code=status_code, headers=headers, media_type="application/json")


async def _read_body(request: Request, limit: int) -> bytearray:
    """The body in one buffer (no list of chunks joined into a second copy).

    A body of usual size (a Content-Length up to heap.WARM_BODY_MAX, 2 MiB: what tracecar's client
    sends) is read into a buffer made at that size once, each chunk copied into place: grown chunk
    by chunk in the heap, a 1 MiB body was copied again at almost every 64 KiB chunk (~8 MiB of
    memmove a body on the event loop, issue 32). A larger one grows in place (its own mmap, which
    grows without copies), so that memory follows what arrived, as the memory bound assumes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyError(413, "body", f"body of {declared} bytes exceeds TRACECAR_MAX_BODY_BYTES={limit}")
    if declared is not None and declared.isdigit() and int(declared) <= WARM_BODY_MAX:
        return await _read_declared(request, int(declared))
    body = bytearray()
    async for chunk in request.stream():
        if len(body) + len(chunk) > limit:
            raise BodyError(413, "body", f"body exceeds TRACECAR_MAX_BODY_BYTES={limit}")
        body += chunk
    return body


async def _read_declared(request: Request, size: int) -> bytearray:
    """A body of ``size`` declared bytes (at most the body bound, checked by the caller) read into
    one buffer of that size; a body that ends early is cut to what came (the server answers a
    client that disconnects first with ClientDisconnect), one longer than declared is refused."""
    body = bytearray(size)
    view, at = memoryview(body), 0
    try:
        async for chunk in request.stream():
            end = at + len(chunk)
            if end > size:
                raise BodyError(400, "body", f"body longer than its Content-Length of {size} bytes")
            view[at:end] = chunk
            at = end
    finally:
        view.release()
    if at != size:
        del body[at:]
    return body


async def _ingest(request: Request, collector: Collector) -> tuple[int, Any, dict[str, str] | None]:
    settings = collector.settings
    if not collector.ready:
        return (503, {"error": {"field": None, "reason": "collector is not ready (starting or draining)"}},
                {"Retry-After": str(settings.retry_after_s)})
    node = request.headers.get(NODE_HEADER)
    receiver, refusal = collector.intake.receiver(node)  # a node's batch: a gateway's only
    if refusal is not None:
        return refusal[0], refusal[1], None
    try:
        collector.pipeline.check_capacity()
        async with collector.pipeline.permit():  # before the body is read: that is what bounds memory
            body = await _read_body(request, settings.max_body_bytes)
            if not body:
                return 200, {"accepted": 0, "duplicates": 0, "sampled_out": 0, "rejected_count": 0, "rejected": [], "warnings": {}}, None
            result = await collector.pipeline.ingest(body, request.headers.get("content-type"), request.headers.get("content-encoding"),
                                                     receiver)
            if receiver is not None:  # committed: how far that node has delivered now
                collector.intake.delivered(node, request.headers.get(PROGRESS_HEADER))
    except ClientDisconnect:  # the client went away (or a body read timed out): nothing was stored
        collector.metrics.batches_rejected.labels(reason="client_disconnect").inc()
        return 400, {"error": {"field": "body", "reason": "client disconnected before the body was read"}}, None
    except Backpressure as exc:
        collector.metrics.backpressure.labels(bound=exc.bound).inc()
        return 503, {"error": {"field": None, "reason": str(exc)}}, {"Retry-After": str(settings.retry_after_s)}
    except BodyError as exc:
        collector.metrics.batches_rejected.labels(reason=exc.field.lower()).inc()
        return exc.status, {"error": {"field": exc.field, "reason": exc.reason}}, None
    except EnvelopeError as exc:
        collector.metrics.batches_rejected.labels(reason="envelope").inc()
        return 400, {"error": {"field": exc.field, "reason": exc.reason}}, None
    payload = result.as_dict()
    status = 422 if result.rejected and not (result.accepted or result.duplicates or result.sampled_out) else 200
    return status, payload, None
