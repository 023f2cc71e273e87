"""The sender's HTTP transport for a plain ``http://`` collector: httpx's interface, ``http.client``'s wire.

httpx costs the sender thread most of a millisecond of CPU per post whatever its size, and its
HTTP/1.1 layer (h11) copies the body once more before it reaches the socket: a 1.75 MiB post
took 2.6 ms of CPU with httpx, 1.4 ms with ``http.client``, 0.9 ms with a raw socket, and the
sender's build + post 0.89x with ``http.client`` (``bench/sender_transport.py``). In a rollout
worker that CPU is GIL time taken from the generation loop.

So the sender keeps httpx's client, requests, responses and exceptions (its retry and failure
logic is written against them), and only this transport underneath speaks HTTP/1.1 through the
standard library: one keep-alive connection, the body written as it is, the answer parsed by
``http.client``. It is used only where httpx would connect directly: a plain ``http://`` URL with
no proxy in the environment, or one bypassed by ``NO_PROXY`` (:func:`usable_for`); TLS and
proxies stay httpx's own.
"""

from __future__ import annotations

import http.client
import select
import urllib.request

import httpx


def usable_for(url: str) -> bool:
    """A plain-http URL that httpx would reach directly: no proxy for ``http://`` in the environment,
    or a ``NO_PROXY`` entry that bypasses it for this host (a sidecar's ``127.0.0.1`` / ``localhost``,
    a cluster domain). Entries are read as httpx reads them (``getproxies()``; ``*``; an IP or
    ``localhost`` exactly; ``example.com`` that domain and below it; ``.example.com`` only below);
    an entry httpx reads some other way (a scheme, a port, a network) is not taken as a bypass:
    where this says "direct", httpx went direct too (tests/test_plain_http.py compares them)."""
    parsed = httpx.URL(url)
    if parsed.scheme != "http":
        return False
    proxies = urllib.request.getproxies()
    if not (proxies.get("http") or proxies.get("all")):
        return True
    host = parsed.host.lower()
    for entry in (e.strip().lower() for e in proxies.get("no", "").split(",")):
        if entry == "*":
            return True
        if not entry or "://" in entry or "/" in entry or (":" in entry and host != entry):
            continue
        if entry == host or (not entry.startswith(".") and host.endswith("." + entry)) \
                or (entry.startswith(".") and host.endswith(entry)):
            return True
    return False


class PlainHttpTransport(httpx.BaseTransport):
    """One HTTP/1.1 keep-alive connection to one ``http://`` origin, through ``http.client``.

    Errors are httpx's (``ConnectError``, ``ConnectTimeout``, ``WriteError``, ``ReadTimeout``,
    ``RemoteProtocolError`` ...), so callers tell an unreachable collector from a slow one as
    they do with httpx. A kept-alive connection that the server closed while idle is noticed
    before reuse (the socket reads as at its end) and replaced; one that closes mid-request is
    retried once on a fresh connection, as httpcore does for a stale connection (a resent batch
    is harmless: the collector skips span ids it already has).
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._conn: http.client.HTTPConnection | None = None
        self._origin: tuple[str, int] | None = None

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            raise httpx.UnsupportedProtocol(f"tracecar's plain transport takes http:// only, not {url.scheme}://",
                                            request=request)
        body = request.read()
        target = url.raw_path.decode("ascii")
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in request.headers.raw}
        origin = (url.host, url.port or 80)
        reused = self._reusable(origin)
        try:
            return self._exchange(request, origin, target, body, headers)
        except (httpx.WriteError, httpx.RemoteProtocolError):
            if not reused:
                raise
            self.close()  # a kept-alive connection the server closed under us: once more, fresh
            return self._exchange(request, origin, target, body, headers)

    def _reusable(self, origin: tuple[str, int]) -> bool:
        """Whether a connection to ``origin`` is open and idle; drops one that is not."""
        conn = self._conn
        if conn is None or conn.sock is None or self._origin != origin:
            self.close()
            return False
        try:
            readable, _, _ = select.select([conn.sock], [], [], 0)
        except (OSError, ValueError):
            readable = [conn.sock]
        if readable:  # idle, yet readable: the server closed it (or sent what nobody asked for)
            self.close()
            return False
        return True

    def _exchange(self, request: httpx.Request, origin: tuple[str, int], target: str, body: bytes,
                  headers: dict[str, str]) -> httpx.Response:
        conn = self._conn
        if conn is None:
            conn = self._conn = http.client.HTTPConnection(origin[0], origin[1], timeout=self.timeout_s)
            self._origin = origin
            try:
                conn.connect()
            except TimeoutError as exc:
                self.close()
                raise httpx.ConnectTimeout(str(exc) or "timed out", request=request) from exc
            except OSError as exc:
                self.close()
                raise httpx.ConnectError(str(exc), request=request) from exc
        try:
            conn.request(request.method, target, body=body, headers=headers)
        except TimeoutError as exc:
            self.close()
            raise httpx.WriteTimeout(str(exc) or "timed out", request=request) from exc
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            raise httpx.WriteError(str(exc), request=request) from exc
        try:
            answer = conn.getresponse()
            content = answer.read()
        except TimeoutError as exc:
            self.close()
            raise httpx.ReadTimeout(str(exc) or "timed out", request=request) from exc
        except (http.client.HTTPException, ConnectionError) as exc:  # RemoteDisconnected, BadStatusLine, a reset
            self.close()
            raise httpx.RemoteProtocolError(str(exc) or type(exc).__name__, request=request) from exc
        except OSError as exc:
            self.close()
            raise httpx.ReadError(str(exc), request=request) from exc
        if answer.will_close:
            self.close()
        return httpx.Response(answer.status, headers=answer.getheaders(), content=content, request=request,
                              extensions={"http_version": b"HTTP/1.1", "reason_phrase": answer.reason.encode("latin-1")})

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
