"""How a node names each of its gateways: the hash's input and the delivery cursor's key.

Shared by the settings (a node's exporters) and the router (exporters/gateway_route.py).
"""

from __future__ import annotations

import urllib.parse


def gateway_identity(url: str) -> str:
    """A gateway as the hash sees it: its URL without a trailing slash, scheme and host in lower case
    (every node must list the same gateways; spelling the same one two ways would route apart)."""
    parts = urllib.parse.urlsplit(url.strip().rstrip("/"))
    port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    return urllib.parse.urlunsplit((parts.scheme.lower(), f"{(parts.hostname or '').lower()}:{port}", parts.path, "", ""))


def exporter_name(url: str) -> str:
    """The delivery cursor's name of one of several gateways: ``gateway@HOST:PORT`` (stable across reorderings;
    the scheme's default port when none is given)."""
    parts = urllib.parse.urlsplit(gateway_identity(url))
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"gateway@{parts.hostname}:{port}"
