"""``TRACECAR_STORE_URL``: what makes it a ClickHouse server's URL (checked with the settings, at start).

Shared (top level) because the settings check it before any store exists; the store's transport
(viewer/clickhouse_transport.py) reads the database from it.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

#: a database name the store may put into its SQL unquoted
DATABASE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
DEFAULT_DATABASE = "tracecar"
URL_SCHEMES = ("clickhouse", "http", "https")


def url_problem(url: str) -> str | None:
    """Why ``TRACECAR_STORE_URL`` cannot name a ClickHouse server (None when it can); never echoes the URL."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return "is not a URL (give clickhouse://USER:PASSWORD@HOST:PORT/DATABASE)"
    if parts.scheme not in URL_SCHEMES:
        return f"must start with {', '.join(s + '://' for s in URL_SCHEMES)} (its scheme is {parts.scheme or 'missing'!r})"
    if not parts.hostname:
        return "names no host (give clickhouse://USER:PASSWORD@HOST:PORT/DATABASE)"
    if port is None and parts.scheme == "clickhouse":
        return "names no port (ClickHouse's HTTP interface: 8123, or 8443 with TLS)"
    database = parts.path.strip("/")
    if database and not DATABASE_NAME.match(database):
        return "names a database that is not a plain identifier (letters, digits, _; at most 64)"
    return None
