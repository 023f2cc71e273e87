"""One read side over several gateways: any gateway answers for the whole job (``TRACECAR_GATEWAY_PEERS``).

With several gateways each one stores the steps it owns (docs/cluster.md, *Several gateways*), so a
user would otherwise have to know which gateway holds what. A gateway given the job's gateway list
answers the read APIs a user browses with over all of them: it asks every listed gateway (itself
included, over HTTP, so it needs no special case) for its own answer (``scope=local``, which a
gateway answers from its own store alone) with the caller's own credentials (each gateway checks
them: no one reads through a gateway what that gateway would refuse), and merges:

* **lists** (``/v1/trajectories``, ``/ui/api/trajectories``): every gateway's rows down to
  ``offset + limit``, merged by the sort key in the same order as one store (rows without the key
  last either way; ties in gateway order, then each gateway's own), ``total`` summed. Pages deeper
  than ``MAX_DEPTH`` merged rows are refused by name (narrow the list: experiment, step, ``q=``).
* **one trajectory** (its tree, tokens, truth, the viewer's trajectory): the first gateway that
  has it; 404 when none has, 503 naming the gateway when one that could have it did not answer.
* **one step** (``/v1/groups``, ``/v1/decisions``, ``/v1/health?step=``): a step lives on one
  gateway: the answer of the gateway that has it.
* **one step** of the viewer too (``/ui/api/groups``, ``/ui/api/health?step=``); a missing ``experiment``
  is the job's latest (its newest trajectory's, over every gateway), except on ``/v1/decisions``
  (the trajectories sent without one, as on one gateway).
* **the export** (``/v1/export``, ``/ui/api/export``): each gateway's JSONL in turn, streamed,
  ``limit`` counted over all of them; Parquet written here from those records (spooled to a
  temporary file first); **the viewer's facets**: counts summed per experiment, rule, trainer verdict, node;
  **its overview** of an experiment: each gateway's steps, histograms binned over the job's reward
  range (asked twice: each gateway's range, then each overview over the whole one).

A gateway that does not answer makes a list ``partial: true`` with its error under ``gateways``;
everything else on a gateway (its health totals, metrics, live view, dead letters) stays its own.
Bounded: ``TRACECAR_GATEWAY_PEERS_TIMEOUT_S`` per request to a gateway.
"""

from __future__ import annotations

import asyncio
import logging
import re
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any
from urllib.parse import urlencode

import httpx
import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..bearer import bearer_matches
from ..loudness import RateLimited
from .export import MEDIA_TYPES, parquet_available, parquet_chunks
from .index import SORTS
from .routes import ViewerAuth

log = logging.getLogger("tracecar.collector.federation")

MAX_DEPTH = 10_000  # merged rows a list pages through at most (each gateway is asked for offset + limit rows)
PEER_PAGE = {"/v1/trajectories": 1000, "/ui/api/trajectories": 500}  # each list's own limit bound
ROW_KEYS = {"tools": "tool_calls", "tokens": "response_tokens", "spans": "span_count", "start": "start_time"}
FORWARDED_HEADERS = ("authorization", "cookie", "accept")
IDENTITY_HEADER = b"x-tracecar-gateway"  # on a scope=local answer: the answering gateway process
PASSED_HEADERS = ("content-type", "retry-after", "cache-control", "www-authenticate", "content-disposition")
_ONE = re.compile(r"^(/v1/trajectories/[^/]+(/tokens|/truth)?|/ui/api/trajectories/[^/]+(/tokens)?)$")
_LISTS = ("/v1/trajectories", "/ui/api/trajectories")
_STEPPED = {"/v1/groups": "groups", "/ui/api/groups": "groups", "/v1/decisions": "decisions", "/v1/health": "step",
            "/ui/api/health": "step"}
_LATEST_BY_DEFAULT = ("/v1/groups", "/ui/api/groups", "/v1/health", "/ui/api/health")  # a missing experiment: the latest
# (on /v1/decisions a missing experiment means the trajectories sent without one, as on one gateway)
_EXPORTS = ("/v1/export", "/ui/api/export")


class Federation:
    """ASGI middleware: the merged answers of the listed gateways for the routes above, the app's own for the rest."""

    def __init__(self, app: ASGIApp, peers: list[str], timeout_s: float, made: list[Federation] | None = None,
                 token: str | None = None, on_failure: Callable[[str, str], None] = lambda gateway, reason: None) -> None:
        self.app = app
        self.peers = [p.rstrip("/") for p in peers]
        self.timeout = httpx.Timeout(timeout_s)
        self._held: tuple[asyncio.AbstractEventLoop, httpx.AsyncClient] | None = None
        self._auth = ViewerAuth(token)  # checked before asking any gateway: a refused caller costs no request
        self._token = token.encode() if token else None
        self._on_failure = on_failure  # tracecar_gateway_peer_failures_total{gateway, reason}
        self._failures = RateLimited()
        self.instance = uuid.uuid4().hex.encode()  # this process, as its scope=local answers name it
        self._list_checked = RateLimited()
        if made is not None:  # the app closes its clients when it stops (aclose)
            made.append(self)

    async def aclose(self) -> None:
        if self._held is not None:
            await self._held[1].aclose()
            self._held = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "GET":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        if request.query_params.get("scope") == "local":  # one gateway's own answer, signed with who gave it
            async def signed(message: Message) -> None:
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", []), (IDENTITY_HEADER, self.instance)]}
                await send(message)

            await self.app(scope, receive, signed)
            return
        handler = self._handler(request)
        if handler is None or not self._allowed(request):  # a refused caller: the app itself says 401 (and counts it)
            await self.app(scope, receive, send)
            return
        response = await handler(request)
        await response(scope, receive, send)

    def _allowed(self, request: Request) -> bool:
        """The check the route itself makes (the viewer's routes take the cookie too), made before any fan-out."""
        if self._token is None:
            return True
        if request.url.path.startswith("/ui/"):
            return self._auth.allowed(request)
        return bearer_matches(request.headers.get("authorization", ""), self._token)

    def _failed(self, peer: str, answer: httpx.Response | Exception) -> None:
        reason = "unreachable" if isinstance(answer, Exception) else str(answer.status_code)
        self._on_failure(peer, reason)
        count = self._failures.hit()
        if count is not None:
            log.warning("gateway %s did not answer a merged read: %s (%d failure(s) since last said)", peer,
                        self._why(answer), count, extra={"event": "gateway_peer_failed", "gateway": peer})

    def _handler(self, request: Request) -> Callable[[Request], Awaitable[Response]] | None:
        path = request.url.path
        if path in _LISTS:
            return self._list
        if _ONE.match(path):
            return self._one
        if path in _STEPPED and (not path.endswith("/health") or "step" in request.query_params):
            return self._step
        if path in _EXPORTS:
            return self._export
        if path == "/ui/api/facets":
            return self._facets
        if path == "/ui/api/overview":
            return self._overview
        return None

    # ---- asking the gateways ---------------------------------------------------------------------
    def _url(self, peer: str, request: Request, path: str | None = None, **override: Any) -> str:
        """The request as one gateway's own (``scope=local``); ``path``: another route, without the request's query."""
        params = [] if path else [(k, v) for k, v in request.query_params.multi_items() if k not in override and k != "scope"]
        params += [(k, str(v)) for k, v in override.items()] + [("scope", "local")]
        return f"{peer}{path or request.url.path}?{urlencode(params)}"

    def _headers(self, request: Request) -> dict[bytes, bytes]:
        """The caller's credentials, byte for byte (a cookie may hold any byte: as it came, latin-1)."""
        return {k.encode(): v.encode("latin-1") for k, v in request.headers.items() if k in FORWARDED_HEADERS}

    def _client(self) -> httpx.AsyncClient:
        """One client (its kept-alive connections to the gateways) per event loop: the server's."""
        loop = asyncio.get_running_loop()
        if self._held is None or self._held[0] is not loop or self._held[1].is_closed:
            self._held = (loop, httpx.AsyncClient(timeout=self.timeout, limits=httpx.Limits(max_connections=64)))
        return self._held[1]

    async def _ask_all(self, request: Request, path: str | None = None, **override: Any) -> list[httpx.Response | Exception]:
        client = self._client()

        async def ask(peer: str) -> httpx.Response | Exception:
            try:
                answer: httpx.Response | Exception = await client.get(self._url(peer, request, path, **override),
                                                                      headers=self._headers(request))
            except httpx.HTTPError as exc:
                answer = exc
            if isinstance(answer, Exception) or answer.status_code >= 500:
                self._failed(peer, answer)
            return answer

        answers = list(await asyncio.gather(*(ask(p) for p in self.peers)))
        self._check_list(answers)
        return answers

    def _check_list(self, answers: list[httpx.Response | Exception]) -> None:
        """Says (once a minute) when the list leaves this gateway out, or names one gateway twice (an address and a
        name of it): its answers, signed by each gateway's process, show it."""
        if any(isinstance(a, Exception) or a.status_code != 200 for a in answers):
            return  # only a full set of answers tells
        signed = [a.headers.get(IDENTITY_HEADER.decode(), "") for a in answers if isinstance(a, httpx.Response)]
        problem = None
        if self.instance.decode() not in signed:
            problem = "does not list this gateway: its own store is left out of every merged answer"
        elif len(set(signed)) < len(signed):
            problem = "names one gateway twice (two spellings of one address): its rows count twice"
        if problem is not None:
            self._on_failure("self", "list")
            count = self._list_checked.hit()
            if count is not None:
                log.error("TRACECAR_GATEWAY_PEERS %s (%s; %d time(s) since last said)", problem, ", ".join(self.peers), count,
                          extra={"event": "gateway_peers_wrong"})

    async def _default_experiment(self, request: Request) -> dict[str, Any]:
        """``experiment=`` the job's latest when the request names none (each gateway would take its own latest)."""
        if "experiment" in request.query_params:
            return {}
        latest = await self._latest_experiment(request)
        return {} if latest is None else {"experiment": latest}

    async def _latest_experiment(self, request: Request) -> str | None:
        """The job's latest experiment, as one store names it: the experiment of the newest trajectory (by start),
        over every gateway ("" for the trajectories without one; None when nothing is listed)."""
        answers = await self._ask_all(request, "/ui/api/trajectories", limit=1, sort="start", order="desc")
        newest = [r for a in answers if isinstance(a, httpx.Response) and a.status_code == 200
                  for r in orjson.loads(a.content)["trajectories"] if r.get("start_time") is not None]
        if not newest:
            return None
        experiment = max(newest, key=lambda r: r["start_time"])["experiment"]
        return "" if experiment is None else str(experiment)

    @staticmethod
    def _why(answer: httpx.Response | Exception) -> str:
        if isinstance(answer, Exception):
            return f"unreachable ({type(answer).__name__})"
        return f"answered {answer.status_code}"

    def _refused(self, answers: list[httpx.Response | Exception]) -> Response | None:
        """A caller every gateway refuses (401/403) or asked wrongly (422) gets that answer, as one gateway gives it."""
        for answer in answers:
            if isinstance(answer, httpx.Response) and answer.status_code in (401, 403, 422):
                return _passed(answer)
        return None

    def _unavailable(self, answers: list[httpx.Response | Exception]) -> Response:
        down = [f"{peer} {self._why(a)}" for peer, a in zip(self.peers, answers)
                if isinstance(a, Exception) or a.status_code >= 500]
        return _json({"error": f"gateway(s) not answering: {'; '.join(down)}; retry later"}, 503, {"Retry-After": "2"})

    # ---- merged answers --------------------------------------------------------------------------
    async def _list(self, request: Request) -> Response:
        page_max = PEER_PAGE[request.url.path]
        values: dict[str, int] = {}
        for field, default in (("offset", 0), ("limit", 50)):
            try:
                values[field] = int(request.query_params.get(field, default))
            except ValueError:
                return _json({"error": {"field": field, "reason": "an integer"}}, 422)
        offset, limit = values["offset"], values["limit"]
        if offset < 0:
            return _json({"error": {"field": "offset", "reason": "at least 0"}}, 422)
        if not 1 <= limit <= page_max:
            return _json({"error": {"field": "limit", "reason": f"from 1 to {page_max}"}}, 422)
        depth = offset + limit
        if depth > MAX_DEPTH:
            return _json({"error": {"field": "offset", "reason": f"a list merged over {len(self.peers)} gateways pages at "
                                    f"most {MAX_DEPTH} rows deep (offset + limit): narrow it (experiment, step, q), or "
                                    "ask one gateway with scope=local"}}, 422)
        first = await self._ask_all(request, offset=0, limit=min(depth, page_max))
        refused = self._refused(first)
        if refused is not None:
            return refused
        rows: list[list[dict[str, Any]]] = [[] for _ in self.peers]
        bodies: list[dict[str, Any] | None] = [None] * len(self.peers)
        errors: dict[int, str] = {}
        for i, answer in enumerate(first):
            if isinstance(answer, Exception) or answer.status_code != 200:
                errors[i] = self._why(answer)
                continue
            bodies[i] = orjson.loads(answer.content)
            rows[i] = bodies[i]["trajectories"]  # type: ignore[index]
        for start in range(page_max, depth, page_max):  # deeper than one page of a gateway's own list
            more = await self._ask_all(request, offset=start, limit=min(depth - start, page_max))
            for i, answer in enumerate(more):
                if i in errors or len(rows[i]) < start:
                    continue
                if isinstance(answer, Exception) or answer.status_code != 200:
                    errors[i] = self._why(answer)
                    continue
                rows[i] += orjson.loads(answer.content)["trajectories"]
        answered = [b for b in bodies if b is not None]
        if not answered:
            return self._unavailable(first)
        sort = request.query_params.get("sort", "start")
        merged = merge_rows(rows, ROW_KEYS.get(sort, sort), request.query_params.get("order", "desc") == "desc")
        out = dict(answered[0])
        out.update(trajectories=merged[offset:offset + limit], offset=offset, limit=limit,
                   total=sum(b["total"] for b in answered),
                   index={"caught_up": all(b.get("index", {}).get("caught_up", True) for b in answered) and not errors,
                          "behind_spans": sum(b.get("index", {}).get("behind_spans") or 0 for b in answered),
                          "gateways": [b.get("index") if b is not None else None for b in bodies]},
                   gateways=[{"url": p, "total": b["total"]} if b is not None else {"url": p, "error": errors.get(i)}
                             for i, (p, b) in enumerate(zip(self.peers, bodies))],
                   partial=bool(errors))
        return _json(out)

    async def _one(self, request: Request) -> Response:
        answers = await self._ask_all(request)
        for answer in answers:
            if isinstance(answer, httpx.Response) and answer.status_code == 200:
                return _passed(answer)
        refused = self._refused(answers)
        if refused is not None:
            return refused
        if any(isinstance(a, Exception) or a.status_code >= 500 for a in answers):
            return self._unavailable(answers)  # the one that did not answer may hold it
        return _passed(next(a for a in answers if isinstance(a, httpx.Response)))  # every gateway's 404

    async def _step(self, request: Request) -> Response:
        override = await self._default_experiment(request) if request.url.path in _LATEST_BY_DEFAULT else {}
        answers = await self._ask_all(request, **override)
        refused = self._refused(answers)
        if refused is not None:
            return refused
        key = _STEPPED[request.url.path]
        ok = [a for a in answers if isinstance(a, httpx.Response) and a.status_code == 200]
        for answer in ok:
            body = orjson.loads(answer.content)
            found = body.get(key)
            if found and (key != "step" or found.get("trajectories") or found.get("held_spans")
                          or (found.get("sampling") or {}).get("kept")):
                return _passed(answer)
        if len(ok) < len(answers):
            return self._unavailable(answers)
        return _passed(ok[0])  # no gateway has the step: the first one's (empty) answer

    async def _export(self, request: Request) -> Response:
        parquet = request.query_params.get("format", "jsonl") == "parquet"
        if parquet and not parquet_available():
            return _json({"error": {"field": "format", "reason": "parquet needs pyarrow: pip install 'tracecar[export]'"}}, 501)
        try:  # at most this many records in all (each gateway is asked for as many; the stream stops there)
            limit = int(request.query_params["limit"]) if "limit" in request.query_params else None
        except ValueError:
            return _json({"error": {"field": "limit", "reason": "an integer"}}, 422)
        if limit is not None and limit < 1:
            return _json({"error": {"field": "limit", "reason": "at least 1"}}, 422)
        client = httpx.AsyncClient(timeout=self.timeout)
        heads: list[httpx.Response] = []
        for peer in self.peers:  # every gateway must answer before the first byte goes out: a 200 cannot be taken back
            try:  # JSONL from each (a Parquet file is written here from their records: files cannot be concatenated)
                r = await client.send(client.build_request("GET", self._url(peer, request, format="jsonl"),
                                                           headers=self._headers(request)), stream=True)
            except httpx.HTTPError as exc:
                self._failed(peer, exc)
                await _close(client, heads)
                return _json({"error": f"gateway {peer} {self._why(exc)}; retry later"}, 503, {"Retry-After": "2"})
            heads.append(r)
            if r.status_code != 200:
                await r.aread()
                await _close(client, heads)
                if r.status_code >= 500:
                    self._failed(peer, r)
                return self._refused([r]) or _json({"error": f"gateway {peer} {self._why(r)}; retry later"}, 503,
                                                   {"Retry-After": "2"})

        async def body() -> AsyncIterator[bytes]:
            left = limit
            try:
                for peer, r in zip(self.peers, heads):
                    try:
                        async for chunk in r.aiter_bytes():
                            if left is not None:
                                ends = chunk.count(b"\n")
                                if ends >= left:  # the last record wanted ends in this chunk
                                    cut = -1
                                    for _ in range(left):
                                        cut = chunk.index(b"\n", cut + 1)
                                    yield chunk[:cut + 1]
                                    return
                                left -= ends
                            yield chunk
                    except httpx.HTTPError as exc:  # after the 200: the stream is cut (the client sees it end early)
                        self._failed(peer, exc)
                        raise
            finally:
                await _close(client, heads)

        headers = {"Cache-Control": "no-store"}
        if not parquet:
            disposition = heads[0].headers.get("content-disposition") if heads else None
            return StreamingResponse(body(), media_type="application/x-ndjson",
                                     headers={**headers, **({"Content-Disposition": disposition} if disposition else {})})
        # Parquet: the merged records to a spooled file first (bounded memory), then one file written from them in a
        # worker thread, a row group at a time (export.parquet_chunks, the same writer as one gateway's)
        records = tempfile.SpooledTemporaryFile(max_size=32 << 20)
        try:
            async for chunk in body():
                await asyncio.to_thread(records.write, chunk)
        except httpx.HTTPError:
            records.close()
            return _json({"error": "a gateway stopped answering during the export; retry later"}, 503, {"Retry-After": "2"})
        records.seek(0)
        token_ids = request.query_params.get("token_ids", "").lower() in ("1", "true", "yes", "on")

        def parquet_file() -> Iterator[bytes]:
            try:
                yield from parquet_chunks((orjson.loads(line) for line in records if line.strip()), token_ids=token_ids)
            finally:
                records.close()

        return StreamingResponse(parquet_file(), media_type=MEDIA_TYPES["parquet"],
                                 headers={**headers, "Content-Disposition": 'attachment; filename="tracecar-export.parquet"'})

    async def _bodies(self, request: Request, **override: Any) -> tuple[list[dict[str, Any]], int] | Response:
        """Every gateway's answer that came (parsed) and how many were asked, or the refusal or 503 to give."""
        answers = await self._ask_all(request, **override)
        refused = self._refused(answers)
        if refused is not None:
            return refused
        ok = [orjson.loads(a.content) for a in answers if isinstance(a, httpx.Response) and a.status_code == 200]
        return (ok, len(answers)) if ok else self._unavailable(answers)

    async def _facets(self, request: Request) -> Response:
        got = await self._bodies(request)
        if isinstance(got, Response):
            return got
        ok, asked = got
        merged = merge_facets(ok)
        latest = await self._latest_experiment(request)  # first, then by name: as one store orders them
        merged["experiments"].sort(key=lambda e: (latest is None or ("" if e["experiment"] is None else str(e["experiment"]))
                                                  != latest, str(e["experiment"])))
        return _json({**merged, "partial": len(ok) < asked})

    async def _overview(self, request: Request) -> Response:
        """Each gateway's steps of the experiment, binned over the job's reward range: the range first (each
        gateway's own overview), then each overview again over it, merged by step."""
        override = await self._default_experiment(request)
        got = await self._bodies(request, **override)
        if isinstance(got, Response):
            return got
        ok, asked = got
        lows = [st["min"] for o in ok for st in o["steps"] if "min" in st]
        if lows and "reward_low" not in request.query_params:
            highs = [st["max"] for o in ok for st in o["steps"] if "max" in st]
            got = await self._bodies(request, **override, reward_low=min(lows), reward_high=max(highs))
            if isinstance(got, Response):
                return got
            ok, asked = got
        return _json({**merge_overviews(ok), "partial": len(ok) < asked})


async def _close(client: httpx.AsyncClient, heads: list[httpx.Response]) -> None:
    for r in heads:
        await r.aclose()
    await client.aclose()


def _passed(answer: httpx.Response) -> Response:
    headers = {k: v for k, v in answer.headers.items() if k in PASSED_HEADERS}
    return Response(answer.content, status_code=answer.status_code, headers=headers)


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS), status_code=status, media_type="application/json",
                    headers={"Cache-Control": "no-store", **(headers or {})})


def _rank(value: Any) -> tuple[int, Any]:
    """SQLite's order across types: numbers before text."""
    return (0, value) if isinstance(value, (int, float)) and not isinstance(value, bool) else (1, str(value))


def merge_rows(per_gateway: list[list[dict[str, Any]]], key: str, descending: bool) -> list[dict[str, Any]]:
    """Each gateway's rows (each already in the list's order) merged into one list in that order: rows with the key
    by it (ties: gateway order, then each gateway's own), then the rows without it, in gateway order."""
    if key not in {*SORTS.values(), "start_time"}:
        key = "start_time"
    keyed = [r for rows in per_gateway for r in rows if r.get(key) is not None]
    keyed.sort(key=lambda r: _rank(r[key]), reverse=descending)  # stable: ties keep gateway, then own, order
    return keyed + [r for rows in per_gateway for r in rows if r.get(key) is None]


def merge_facets(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """The viewer's facets of several gateways: counts summed by experiment, rule, trainer verdict and node; step
    ranges widened; experiments in the order the gateways list them (the latest first in each)."""
    experiments: dict[Any, dict[str, Any]] = {}
    counts: dict[str, dict[Any, dict[str, Any]]] = {"kept_because": {}, "trainer": {}, "nodes": {}}
    keys = {"kept_because": ("rule",), "trainer": ("trained", "filtered_by"), "nodes": ("node",)}
    components: list[Any] = []
    for answer in answers:
        for e in answer.get("experiments", []):
            have = experiments.setdefault(e["experiment"], {**e, "trajectories": 0, "train": 0, "validation": 0,
                                                            "step_min": None, "step_max": None})
            for k in ("trajectories", "train", "validation"):
                have[k] += e.get(k) or 0
            for k, pick in (("step_min", min), ("step_max", max)):
                if e.get(k) is not None:
                    have[k] = e[k] if have[k] is None else pick(have[k], e[k])
        for facet, names in keys.items():
            for row in answer.get(facet, []):
                have = counts[facet].setdefault(tuple(row.get(n) for n in names), {**row, "trajectories": 0})
                have["trajectories"] += row.get("trajectories") or 0
        components += [c for c in answer.get("reward_components", []) if c not in components]
    out = dict(answers[0])
    out.update(experiments=list(experiments.values()), reward_components=components,
               **{facet: list(rows.values()) for facet, rows in counts.items()})
    out["nodes"].sort(key=lambda r: str(r["node"]))
    return out


def merge_overviews(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """Several gateways' overviews of one experiment, binned alike, as one: each step from the gateway that holds it
    (a step split between two, by a list change mid-step, gets its counts and histogram summed, its extremes widened,
    the rest from the larger part)."""
    steps: dict[Any, dict[str, Any]] = {}
    for answer in answers:
        for entry in answer["steps"]:
            have = steps.get(entry["step"])
            if have is None:
                steps[entry["step"]] = dict(entry)
                continue
            larger = entry if entry["scored"] > have["scored"] else have
            merged = {**larger, "trajectories": have["trajectories"] + entry["trajectories"],
                      "scored": have["scored"] + entry["scored"], "hist": [a + b for a, b in zip(have["hist"], entry["hist"])],
                      "kept": {k: have["kept"].get(k, 0) + entry["kept"].get(k, 0) for k in {*have["kept"], *entry["kept"]}}}
            scored = [e for e in (have, entry) if "min" in e]
            if scored:
                merged["mean"] = sum(e["mean"] * e["scored"] for e in scored) / sum(e["scored"] for e in scored)
                merged["worst"] = min((e["worst"] for e in scored), key=lambda w: w["reward"])
                merged["best"] = max((e["best"] for e in scored), key=lambda b: b["reward"])
                merged["min"], merged["max"] = min(e["min"] for e in scored), max(e["max"] for e in scored)
            steps[entry["step"]] = merged
    out = dict(answers[0])
    out.update(trajectories=sum(a["trajectories"] for a in answers),
               rules=sorted({rule for a in answers for rule in a["rules"]}),
               steps=sorted(steps.values(), key=lambda e: (e["step"] is not None, _rank(e["step"]) if e["step"] is not None else 0)))
    return out
