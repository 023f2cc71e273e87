"""VERL's ``enable_otel`` as a real job shapes it, one rollout replica per process.

``python -m tests.verl_otel_workload URL K MODEL_DIR MANIFEST`` (in a venv with the real ``verl``
and ``rl-insight``) is one worker process of a job whose RL-Insight URL is the collector's:

* the agent-loop side is VERL's own: ``AgentLoopWorker.generate_sequences`` on a real
  ``DataProto`` (two prompts, two rollouts each: ``ToolAgentLoop`` with a tool call, two turns, and
  ``SingleTurnAgentLoop``), through VERL's unmodified ``LLMServerClient.generate``, which mints
  the request id each turn sends to the server (``_vllm_request_id``); traced by tracecar's VERL
  adapter (``trace.backend=tracecar``, ``TRACECAR_URL``), which notes that id on the call;
* the replica side is what verl #8158 adds (its source is newer than the VERL we can install, so
  its calls are replicated here): the replica asks the RL-Insight server for its services with
  RL-Insight's own code (``rl_insight.server.http_api.get_server_services`` and
  ``rl_insight.server.network.service_url_from_server_url``: ``GET /api/v1/services`` →
  ``otlp_port`` → ``<host>:<otlp_port>/v1/traces``), sets ``OTEL_RESOURCE_ATTRIBUTES``
  (``project``, ``experiment_name``, ``replica``) and ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``
  and starts vLLM's request tracing (``vllm.tracing.otel.init_tracer``: ``Resource.create`` with
  vLLM's own resource attributes, which merges the environment's; a ``BatchSpanProcessor`` over
  the OTLP/HTTP exporter);
* the server is VERL's ``vLLMHttpServer.generate`` stand-in (vLLM needs CUDA): it answers with
  scripted tokens and records one ``llm_request`` span per request the way
  ``OutputProcessor.do_tracing`` does, with ``gen_ai.request.id`` = the request id it was given
  and **no parent context** (VERL passes no ``trace_headers``). On every first turn of an even
  rollout the engine span is exported and answered before ``generate`` returns, so it reaches
  the collector before anything of its trajectory.

Writes the manifest: every request the server saw (id, prompt length, whether its span went first).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

PROJECT = "proj-verl"  # tests.test_verl_adapter's VERL config: trainer.project_name / experiment_name
EXPERIMENT = "exp-verl"


def replica_endpoint(replica: int) -> str:
    """What an ``enable_otel`` replica does before starting its engine (verl #8158, replicated)."""
    from rl_insight.server.http_api import get_server_services
    from rl_insight.server.network import service_url_from_server_url

    services = get_server_services()  # GET $RL_INSIGHT_SERVER_URL/api/v1/services, RL-Insight's retries
    endpoint = service_url_from_server_url(os.environ["RL_INSIGHT_SERVER_URL"], services.get("otlp_port"), "/v1/traces")
    assert endpoint, f"no OTLP endpoint from {services}"
    os.environ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"
    os.environ["OTEL_RESOURCE_ATTRIBUTES"] = f"project={PROJECT},experiment_name={EXPERIMENT},replica={replica}"
    return endpoint


async def run(url: str, k: int, model_dir: Path) -> list[dict[str, Any]]:
    import tracecar.client.verl as adapter
    from tests import test_verl_adapter as kit
    from tests.test_otlp_receiver import VllmEngine  # vLLM's request tracing, vLLM's names

    assert adapter.install() is True
    engine = VllmEngine(replica_endpoint(k))  # Resource.create merges OTEL_RESOURCE_ATTRIBUTES
    assert (kit.PROJECT, kit.EXPERIMENT) == (PROJECT, EXPERIMENT)
    config = kit.verl_config(model_dir)
    from transformers import AutoTokenizer

    worker, server = kit.make_worker(config, AutoTokenizer.from_pretrained(str(model_dir)))
    scripted = server.generate.remote
    seen: list[dict[str, Any]] = []

    async def vllm_http_server_generate(*, request_id: str, prompt_ids: list[int], sampling_params: dict,
                                        **kwargs: Any) -> Any:
        arrival = time.time()
        output = await scripted(request_id=request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs)
        first = len(seen) % 4 == 0  # every other tool rollout's first turn, and some single turns
        engine.request(None, request_id, len(prompt_ids), len(output.token_ids), arrival)  # no trace_headers
        if first:
            engine.flush()  # answered by the collector while generate still runs
        seen.append({"request_id": request_id, "prompt_tokens": len(prompt_ids), "first": first, "replica": k})
        return output

    server.generate.remote = vllm_http_server_generate
    out = await worker.generate_sequences(kit.make_batch())
    assert len(out) == 4
    from tracecar.client import get_tracer

    tracer = get_tracer()
    assert tracer and tracer.flush(30)
    engine.flush()
    engine.close()
    return seen


def main() -> None:
    url, k, model_dir, manifest = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
    os.environ.update({"TRACECAR_URL": url, "RL_INSIGHT_SERVER_URL": url, "TRACECAR_WORKER_ID": f"replica-{k}",
                       "TRACECAR_OPEN_MARKERS": "false", "TRACECAR_FLUSH_INTERVAL_S": "0.2"})
    seen = asyncio.run(run(url, k, model_dir))
    manifest.write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
