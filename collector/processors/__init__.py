"""Processors: what the ingest pipeline does to a received batch before it is spooled.

``validate`` checks each span (naming the field and the reason) and redacts secrets under the
configured keys; ``sampling`` keeps whole trajectories within per-step budgets (``head`` first-N,
the tail-based rules in the rest of the package); ``decoding`` turns token ids into text.
"""
