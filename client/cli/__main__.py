"""``python -m tracecar.client.cli``."""

from .command import main

main()
