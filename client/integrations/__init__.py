"""Capture paths for frameworks that are not VERL's decorators.

* :mod:`.proxy_app` (``tracecar proxy``): an OpenAI-compatible capture proxy in front of an
  inference server (vLLM, SGLang, any OpenAI-compatible one): each request of a rollout becomes a
  ``generate`` span, ``POST /rollout/{id}/reward`` its reward.
* :mod:`.trl`: TRL's ``GRPOTrainer``: every scored completion becomes a trajectory.

Each sends through the thin client's sender (bounded queue, background thread), so none needs the
collector's dependencies. See docs/integrations.md.
"""
