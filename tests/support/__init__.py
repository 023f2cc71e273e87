"""What tests, fixtures and bench scripts share: ports, processes, collectors, stubs.

``processes``: a free loopback port, waiting for an HTTP service, terminate-wait-kill;
``collector``: the collector started on 127.0.0.1 in a thread of the caller or as
``python -m tracecar.collector``; ``weave_stub``: the loopback Weave stand-ins;
``weave_server``: weave's own trace server, run as a script by the weave 0.52 venv.
Nothing here imports pytest, so bench scripts can use it too.
"""

from tests.support.collector import ProcessCollector, ThreadCollector, collector_env, serve_in_thread, wait_ready
from tests.support.processes import Service, clean_env, free_port, start_service, stop_process, wait_http

__all__ = [
    "ProcessCollector", "Service", "ThreadCollector", "clean_env", "collector_env", "free_port", "serve_in_thread",
    "start_service", "stop_process", "wait_http", "wait_ready",
]
