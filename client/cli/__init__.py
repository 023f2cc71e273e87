"""The ``tracecar`` command (``python -m tracecar.client.cli``): serve the collector, feed it a demo
rollout, read what it stored. One module per command group; common.py holds what they share.

Subcommands that need the collector's dependencies import them lazily, so the thin client's
install still gets a working ``tracecar demo`` and query commands.
"""

from .command import build_parser, main
from .lists import LIST_SORTS

__all__ = ["LIST_SORTS", "build_parser", "main"]
