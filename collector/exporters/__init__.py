"""Exporters: stored spans sent on to their destination.

``forward`` is the transport every backend shares (drains the spool, retries with backoff,
probes, marks done/dead); ``weave_sink`` is the W&B Weave backend (calls built from
trajectories and pushed); ``otlp_translate``: tracecar spans → OTLP spans with the
OpenTelemetry GenAI conventions.
"""
