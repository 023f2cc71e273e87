"""Receivers: the formats spans arrive in, each turned into tracecar spans for the pipeline.

``otlp``: OTLP/HTTP at ``/v1/traces`` (vLLM, SGLang, any OpenTelemetry SDK). tracecar's own
wire format (``/v1/spans``) is still served from ``tracecar.collector.app``/``receive``.
"""
