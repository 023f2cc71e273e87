"""``python -m tracecar.collector``: serve the collector, exactly as ``tracecar serve`` does."""

from __future__ import annotations

import sys

from tracecar.client.cli import main

if __name__ == "__main__":
    main(["serve", *sys.argv[1:]])
