"""Exporters: each destination's translation of stored spans (its transport lives apart).

``otlp_translate``: tracecar spans → OTLP spans with the OpenTelemetry GenAI conventions.
The Weave exporter is still ``tracecar.collector.weave_sink``.
"""
