"""Receivers: the formats spans arrive in, and the ingest pipeline they all feed.

``receive`` decodes tracecar's own wire format (``/v1/spans``: JSON/msgpack, gzip/zstd);
``otlp`` serves OTLP/HTTP at ``/v1/traces`` (vLLM, SGLang, any OpenTelemetry SDK) through
``otlp_translate`` and ``joins``; ``pipeline`` runs each batch through the processors into the spool.
"""
