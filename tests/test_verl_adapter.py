"""VERL adapter: VERL's own agent-loop code, traced by VERL's own decorators, lands in tracecar.

Runs only where the real ``verl`` package is importable (CPU torch is enough): it builds an
unmodified ``verl.experimental.agent_loop.AgentLoopWorker`` from VERL's own ``ppo_trainer``
config and calls ``generate_sequences`` on a real ``DataProto``.  VERL's ``ToolAgentLoop`` and
``SingleTurnAgentLoop`` run unmodified against an unmodified ``LLMServerClient`` whose Ray
load-balancer handle is a stub (it returns a fake server whose ``generate`` returns scripted
token ids), with the Hermes tool parser and a ``BaseTool`` subclass.  The only tracing switch
is VERL's config ``actor_rollout_ref.rollout.trace.backend=tracecar`` plus ``TRACECAR_URL``;
spans go over HTTP to a real collector on 127.0.0.1 and are read back from its store.

Set up (see the adapter's docstring):  python3 -m venv V && V/bin/pip install torch==2.13.0
&& V/bin/pip install verl cachetools uvicorn fastapi && V/bin/pip install -e '.[dev]'.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("verl")
pytest.importorskip("verl.experimental.agent_loop.tool_agent_loop")
pytest.importorskip("hydra")

import numpy as np  # noqa: E402
from verl.tools.base_tool import BaseTool  # noqa: E402
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse  # noqa: E402
from verl.utils import rollout_trace as verl_rt  # noqa: E402
from verl.utils.rollout_trace import rollout_trace_op  # noqa: E402  (VERL's, as a user tool would)

VERL_ROLLOUT_TRACE_OP = rollout_trace_op  # the adapter repoints names called rollout_trace_op, not this one

pytestmark = [pytest.mark.timeout(240)]

EXPERIMENT = "exp-verl"
PROJECT = "proj-verl"
STEP = 7
PROMPT_LEN = RESPONSE_LEN = 512

TOOL_CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>'
ANSWER = "The answer is 5.<|im_end|>"

CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- if m.tool_calls %}{%- for tc in m.tool_calls %}<tool_call>{{ tc.function | tojson }}</tool_call>"
    "{%- endfor %}{%- endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# ---------------------------------------------------------------------------------------------
# a tiny model directory VERL can load: byte-level tokenizer (no merges) + a Llama config
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-verl-model")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    fast.add_tokens(["<tool_call>", "</tool_call>"])
    fast.save_pretrained(path)
    LlamaConfig(
        vocab_size=len(fast), hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=1, num_key_value_heads=1, architectures=["LlamaForCausalLM"],
    ).save_pretrained(path)
    assert (path / "tokenizer.json").is_file()
    return path


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def verl_config(
    model_dir: Path, *, backend: str | None = "tracecar", max_samples: int | None = None, extra: tuple[str, ...] = ()
) -> Any:
    """VERL's own ppo_trainer config, as ``python -m verl.trainer.main_ppo ...overrides`` builds it."""
    import verl
    from hydra import compose, initialize_config_dir

    overrides = [
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.rollout.prompt_length={PROMPT_LEN}",
        f"actor_rollout_ref.rollout.response_length={RESPONSE_LEN}",
        "actor_rollout_ref.rollout.multi_turn.format=hermes",
        f"actor_rollout_ref.rollout.trace.backend={'null' if backend is None else backend}",
        "actor_rollout_ref.rollout.trace.token2text=True",
        f"actor_rollout_ref.rollout.trace.max_samples_per_step_per_worker={'null' if max_samples is None else max_samples}",
        f"trainer.project_name={PROJECT}",
        f"trainer.experiment_name={EXPERIMENT}",
        *extra,
    ]
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


# ---------------------------------------------------------------------------------------------
# the LLM side: VERL's LLMServerClient, unmodified, with a stub Ray load-balancer handle
# ---------------------------------------------------------------------------------------------


class _Remote:
    """Stands in for a Ray actor method: ``handle.method.remote(...)``."""

    def __init__(self, fn: Any) -> None:
        self.remote = fn


class FakeServer:
    """A rollout server: answers a tool call first (when tools are offered), then the answer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.calls = 0

        async def generate(*, request_id: str, prompt_ids: list[int], sampling_params: dict, **kwargs: Any) -> Any:
            from verl.workers.rollout.replica import TokenOutput

            self.calls += 1
            text = self.tokenizer.decode(prompt_ids)
            out = TOOL_CALL if ("Tools:" in text and "<|im_start|>tool" not in text) else ANSWER
            return TokenOutput(token_ids=self.tokenizer.encode(out, add_special_tokens=False), extra_fields={})

        self.generate = _Remote(generate)


class FakeLoadBalancer:
    def __init__(self, server: FakeServer) -> None:
        async def no_fields() -> list[str]:
            return []

        async def acquire_server(request_id: str, **kwargs: Any) -> tuple[str, Any]:
            return "fake-server-0", server

        self.require_acquire_fields = _Remote(no_fields)
        self.require_release_fields = _Remote(no_fields)
        self.acquire_server = _Remote(acquire_server)
        self.release_server = _Remote(lambda **kwargs: None)  # fire-and-forget in VERL


class AddTool(BaseTool):
    """A user tool, decorated with VERL's rollout_trace_op at import time (before any install)."""

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> Any:
        return ToolResponse(text=str(parameters["a"] + parameters["b"])), 1.0, {}


ADD_SCHEMA = {
    "type": "function",
    "function": {
        "name": "add", "description": "add two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]},
    },
}


def make_worker(config: Any, tokenizer: Any) -> tuple[Any, FakeServer]:
    from verl.experimental.agent_loop import AgentLoopWorker
    from verl.workers.rollout.llm_server import LLMServerClient

    server = FakeServer(tokenizer)
    client = LLMServerClient(config, load_balancer_handle=FakeLoadBalancer(server))
    worker = AgentLoopWorker(config, client)  # calls RolloutTraceConfig.init(...) itself
    worker.tools = [AddTool(config={}, tool_schema=OpenAIFunctionToolSchema.model_validate(ADD_SCHEMA))]
    return worker, server


def make_batch(validate: bool = False, index: Any = None) -> Any:
    """Two prompts, n=2 rollouts each, interleaved like ``DataProto.repeat(n, interleave=True)``."""
    from verl.protocol import DataProto

    tool_prompt = [{"role": "user", "content": "What is 2+3? 数字 🙂"}]
    plain_prompt = [{"role": "user", "content": "Say hi"}]
    return DataProto(
        non_tensor_batch={
            "raw_prompt": np.array([tool_prompt, tool_prompt, plain_prompt, plain_prompt], dtype=object),
            "agent_name": np.array(["tool_agent"] * 2 + ["single_turn_agent"] * 2, dtype=object),
            "index": np.array([0, 0, 1, 1]) if index is None else index,
        },
        meta_info={"global_steps": STEP, "validate": validate},
    )


# ---------------------------------------------------------------------------------------------
# fixtures: clean VERL / adapter / client state around every test
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def adapter(monkeypatch: pytest.MonkeyPatch) -> Any:
    import tracecar.client.verl as tv
    from tracecar.client import tracer

    for name in ("TRACECAR_VERL_WORKER_SAMPLING", "TRACECAR_PROJECT", "TRACECAR_EXPERIMENT",
                 "TRACECAR_CLIENT_TOKENIZER", "TRACECAR_WORKER_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TRACECAR_FLUSH_INTERVAL_S", "0.02")
    verl_rt.RolloutTraceConfig.reset()
    tv.uninstall()
    yield tv
    tv.uninstall()
    verl_rt.RolloutTraceConfig.reset()
    tracer.shutdown(5)


def trajectories(url: str, **params: Any) -> list[dict[str, Any]]:
    listing = httpx.get(url + "/v1/trajectories", params={"experiment": EXPERIMENT, "limit": 100, **params}).json()
    return listing["trajectories"]


def flush() -> dict[str, Any]:
    from tracecar.client import get_tracer

    tracer = get_tracer()
    assert tracer, "the adapter should have configured the client from TRACECAR_URL"
    assert tracer.flush(30)
    return tracer.stats()


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------


def test_verl_agent_loop_worker_traces_land_in_collector(adapter, start_collector, monkeypatch, model_dir, hf_tokenizer):
    col = start_collector(token2text=True, tokenizer=str(model_dir))
    monkeypatch.setenv("TRACECAR_URL", col.url)
    assert adapter.install() is True

    worker, server = make_worker(verl_config(model_dir), hf_tokenizer)
    assert adapter.is_active()
    assert verl_rt.RolloutTraceConfig.get_backend() == "tracecar"
    assert adapter.settings()["tokenizer"] == str(model_dir)  # read off the AgentLoopWorker

    out = asyncio.run(worker.generate_sequences(make_batch()))
    assert len(out) == 4 and server.calls == 2 * 2 + 2 * 1  # tool loops: 2 turns, single turn: 1
    stats = flush()
    assert stats["dropped_total"] == 0

    trajs = trajectories(col.url, step=STEP)
    assert sorted((t["sample_index"], t["rollout_n"]) for t in trajs) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for summary in trajs:
        tree = httpx.get(f"{col.url}/v1/trajectories/{summary['trace_id']}").json()
        root = tree["root"]
        assert root["kind"] == "trajectory" and root["name"] == "agent_loop" and root["parent_id"] is None
        assert root["attributes"] == {"sample_index": summary["sample_index"], "step": STEP,
                                      "rollout_n": summary["rollout_n"], "validate": False,
                                      "experiment_name": EXPERIMENT}
        [run] = root["children"]
        assert run["parent_id"] == root["span_id"]
        assert run["attributes"] == root["attributes"]
        assert "self" not in run["inputs"] and run["inputs"]["kwargs"]["raw_prompt"]
        children = sorted(run["children"], key=lambda s: s["start_time"])
        output = run["output"]
        # token2text in the collector: VERL's fields, decoded with the job's tokenizer
        assert output["prompt_text"] == hf_tokenizer.decode(output["prompt_ids"])
        assert output["response_text"] == hf_tokenizer.decode(output["response_ids"])
        if summary["sample_index"] == 0:
            assert run["name"] == "ToolAgentLoop.run"
            assert [c["name"] for c in children] == [
                "LLMServerClient.generate", "HermesToolParser.extract_tool_calls", "AddTool.execute",
                "LLMServerClient.generate", "HermesToolParser.extract_tool_calls",
            ]
            assert "数字 🙂" in output["prompt_text"] and output["response_text"].endswith(ANSWER)
            first_gen, _, tool, second_gen, _ = children
            assert first_gen["output"]["response_text"] == TOOL_CALL
            assert first_gen["output"]["prompt_text"] == hf_tokenizer.decode(first_gen["inputs"]["prompt_ids"])
            assert len(second_gen["inputs"]["prompt_ids"]) > len(first_gen["inputs"]["prompt_ids"])
            assert tool["inputs"]["parameters"] == {"a": 2, "b": 3} and tool["exception"] is None
        else:
            assert run["name"] == "SingleTurnAgentLoop.run"
            assert [c["name"] for c in children] == ["LLMServerClient.generate"]
            assert children[0]["output"]["response_text"] == ANSWER


def test_budget_from_collector_settings_keeps_whole_samples(adapter, start_collector, monkeypatch, model_dir, hf_tokenizer):
    """VERL's per-worker pre-selection is off: all 4 rollouts are sent, the collector keeps 1 sample."""
    col = start_collector(max_samples_per_step_per_worker=1)
    monkeypatch.setenv("TRACECAR_URL", col.url)
    adapter.install()
    worker, _ = make_worker(verl_config(model_dir, max_samples=1), hf_tokenizer)
    # VERL was told "no budget", so it ran every sample with trace=True ...
    assert verl_rt.RolloutTraceConfig.get_instance().max_samples_per_step_per_worker is None
    assert adapter.settings()["max_samples_per_step_per_worker"] == 1
    asyncio.run(worker.generate_sequences(make_batch()))
    stats = flush()
    # ... and every span of every rollout went out, after the step's membership announcement
    assert stats["sent"] == 1 + 2 * 7 + 2 * 3
    trajs = trajectories(col.url, step=STEP)
    assert len({t["sample_index"] for t in trajs}) == 1
    assert sorted(t["rollout_n"] for t in trajs) == [0, 1]  # all rollouts of the kept sample
    # the adapter announced the call's indices: the kept one is the seeded hash choice, not the first back
    from tracecar.collector.processors.sampling import sample_hash

    assert {t["sample_index"] for t in trajs} == {min((0, 1), key=lambda i: sample_hash(0, EXPERIMENT, STEP, i))}


def test_string_dataset_indices_are_traced_and_budgeted(adapter, start_collector, monkeypatch, model_dir, hf_tokenizer):
    """VERL passes extra_info.index through unchanged; uuid strings (a numpy object column) are kept as such."""
    col = start_collector(max_samples_per_step_per_worker=1)
    monkeypatch.setenv("TRACECAR_URL", col.url)
    adapter.install()
    worker, _ = make_worker(verl_config(model_dir), hf_tokenizer)
    uuids = ["9b1d-uuid-a", "9b1d-uuid-a", "3c2e-uuid-b", "3c2e-uuid-b"]
    asyncio.run(worker.generate_sequences(make_batch(index=np.array(uuids, dtype=object))))
    flush()
    trajs = trajectories(col.url, step=STEP)
    assert len(trajs) == 2 and len({t["sample_index"] for t in trajs}) == 1
    assert trajs[0]["sample_index"] in uuids and sorted(t["rollout_n"] for t in trajs) == [0, 1]
    assert "tracecar_spans_rejected_total{" not in httpx.get(col.url + "/metrics").text  # no span refused


def test_budget_from_verl_config_is_honoured_by_collector(adapter, start_collector, monkeypatch, model_dir, hf_tokenizer):
    col = start_collector()  # no budget of its own: VERL's config must reach it
    monkeypatch.setenv("TRACECAR_URL", col.url)
    adapter.install()
    worker, _ = make_worker(verl_config(model_dir, max_samples=1), hf_tokenizer)
    asyncio.run(worker.generate_sequences(make_batch()))
    flush()
    trajs = trajectories(col.url, step=STEP)
    assert len({t["sample_index"] for t in trajs}) == 1 and len(trajs) == 2


class FakeRewardLoop:
    """Stands in for VERL's reward-loop worker handle: ``await handle.compute_score.remote(data)``."""

    def __init__(self) -> None:
        self.calls = 0
        self.compute_score = self

    def remote(self, data: Any) -> Any:
        self.calls += 1
        score = 0.25 * self.calls

        async def answer() -> dict[str, Any]:
            return {"reward_score": score, "reward_extra_info": {}}

        return answer()


def test_rewards_scored_in_the_agent_loop_reach_the_trajectory(adapter, start_collector, monkeypatch, model_dir, hf_tokenizer):
    col = start_collector()
    monkeypatch.setenv("TRACECAR_URL", col.url)
    adapter.install()
    worker, _ = make_worker(verl_config(model_dir), hf_tokenizer)
    reward_loop = FakeRewardLoop()
    worker.reward_loop_worker_handles = [reward_loop]  # VERL's async reward path, inside the trajectory
    out = asyncio.run(worker.generate_sequences(make_batch()))
    flush()
    trajs = trajectories(col.url, step=STEP)
    assert reward_loop.calls == 4 and len(trajs) == 4
    assert sorted(t["reward"] for t in trajs) == [0.25, 0.5, 0.75, 1.0]
    assert out is not None  # VERL's own result is untouched


def test_worker_sampling_opt_in_skips_unchosen_samples_in_the_worker(
    adapter, start_collector, monkeypatch, model_dir, hf_tokenizer
):
    col = start_collector()
    monkeypatch.setenv("TRACECAR_URL", col.url)
    monkeypatch.setenv("TRACECAR_VERL_WORKER_SAMPLING", "1")
    adapter.install()
    worker, _ = make_worker(verl_config(model_dir, max_samples=1), hf_tokenizer)
    assert verl_rt.RolloutTraceConfig.get_instance().max_samples_per_step_per_worker == 1
    asyncio.run(worker.generate_sequences(make_batch()))
    stats = flush()
    trajs = trajectories(col.url, step=STEP)
    [index] = {t["sample_index"] for t in trajs}
    assert sorted(t["rollout_n"] for t in trajs) == [0, 1]
    assert stats["sent"] == (2 * 7 if index == 0 else 2 * 3)  # trace=False rollouts cost nothing


def test_without_install_backend_tracecar_is_silently_untraced(adapter, start_collector, monkeypatch, model_dir, hf_tokenizer):
    """What VERL does by itself with an unknown backend: init accepts it, every op falls through."""
    from tracecar.client import configure

    col = start_collector()
    configure(url=col.url, experiment=EXPERIMENT, flush_interval_s=0.02)
    worker, _ = make_worker(verl_config(model_dir), hf_tokenizer)
    assert verl_rt.RolloutTraceConfig.get_backend() == "tracecar"
    assert verl_rt.RolloutTraceConfig.get_client() is None
    out = asyncio.run(worker.generate_sequences(make_batch()))
    assert len(out) == 4
    assert flush()["sent"] == 0 and trajectories(col.url) == []


def test_late_install_after_verl_init_still_traces(adapter, start_collector, monkeypatch, model_dir, hf_tokenizer):
    col = start_collector()
    monkeypatch.setenv("TRACECAR_URL", col.url)
    worker, _ = make_worker(verl_config(model_dir, max_samples=1), hf_tokenizer)  # VERL init first
    assert not adapter.is_installed()
    adapter.install()  # e.g. from a custom agent loop module hydra imports lazily
    assert adapter.is_active()
    assert verl_rt.RolloutTraceConfig.get_instance().max_samples_per_step_per_worker is None
    asyncio.run(worker.generate_sequences(make_batch()))
    flush()
    trajs = trajectories(col.url, step=STEP)  # every sample was sent; the collector kept VERL's budget of 1
    assert len(trajs) == 2 and len({t["sample_index"] for t in trajs}) == 1
    assert sorted(t["rollout_n"] for t in trajs) == [0, 1]


def test_validation_batches_are_marked(adapter, start_collector, monkeypatch, model_dir, hf_tokenizer):
    col = start_collector()
    monkeypatch.setenv("TRACECAR_URL", col.url)
    adapter.install()
    worker, _ = make_worker(verl_config(model_dir), hf_tokenizer)
    asyncio.run(worker.generate_sequences(make_batch(validate=True)))
    flush()
    trajs = trajectories(col.url, validate=True)
    assert len(trajs) == 4 and all(t["validate"] in (True, 1) for t in trajs)


def test_ops_decorated_after_activation_are_traced(adapter, start_collector, monkeypatch, model_dir, hf_tokenizer):
    col = start_collector()
    monkeypatch.setenv("TRACECAR_URL", col.url)
    adapter.install()
    make_worker(verl_config(model_dir), hf_tokenizer)
    assert verl_rt.rollout_trace_op is not VERL_ROLLOUT_TRACE_OP  # the module name now points at the adapter
    assert rollout_trace_op is verl_rt.rollout_trace_op  # ... and so does every module that imported it

    class LateLoop:  # like a custom agent loop that hydra imports after RolloutTraceConfig.init
        @verl_rt.rollout_trace_op
        async def run(self, x: int) -> dict[str, int]:
            return {"y": x + 1}

        @verl_rt.rollout_trace_op
        def score(self, x: int) -> int:
            return x * 2

    async def main() -> None:
        with verl_rt.rollout_trace_attr(sample_index=3, step=STEP, rollout_n=0, name="agent_loop"):
            assert await LateLoop().run(1) == {"y": 2}
            assert LateLoop().score(2) == 4

    asyncio.run(main())
    flush()
    [summary] = trajectories(col.url, step=STEP)
    tree = httpx.get(f"{col.url}/v1/trajectories/{summary['trace_id']}").json()
    names = sorted(c["name"] for c in tree["root"]["children"])
    assert names == [LateLoop.run.__qualname__, LateLoop.score.__qualname__]


def test_other_backends_are_left_alone_and_uninstall_restores(adapter, model_dir, hf_tokenizer):
    import sys

    agent_loop_module = sys.modules["verl.experimental.agent_loop.agent_loop"]
    original_attr = verl_rt.rollout_trace_attr
    from verl.workers.rollout.llm_server import LLMServerClient

    generate = LLMServerClient.generate
    func_cell = generate.__closure__[generate.__code__.co_freevars.index("func")]
    original_func = func_cell.cell_contents

    adapter.install()
    make_worker(verl_config(model_dir, backend=None), hf_tokenizer)
    assert not adapter.is_active()
    assert func_cell.cell_contents is original_func
    assert agent_loop_module.rollout_trace_attr is original_attr

    verl_rt.RolloutTraceConfig.reset()
    make_worker(verl_config(model_dir), hf_tokenizer)  # tracecar backend: swapped
    assert adapter.is_active()
    assert func_cell.cell_contents is not original_func
    assert agent_loop_module.rollout_trace_attr is not original_attr

    from verl.experimental.agent_loop import AgentLoopWorker

    assert getattr(AgentLoopWorker._compute_score, "__tracecar_shim__", False)
    adapter.uninstall()
    assert not getattr(AgentLoopWorker._compute_score, "__tracecar_shim__", False)
    assert func_cell.cell_contents is original_func
    assert agent_loop_module.rollout_trace_attr is original_attr
    assert verl_rt.rollout_trace_op is VERL_ROLLOUT_TRACE_OP and rollout_trace_op is VERL_ROLLOUT_TRACE_OP


EXTERNAL_LIB_SCRIPT = """
import asyncio, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import test_verl_adapter as t
from transformers import AutoTokenizer
model_dir = Path(sys.argv[2])
config = t.verl_config(model_dir, extra=("actor_rollout_ref.model.external_lib=tracecar.client.verl",))
assert "tracecar.client.verl" not in sys.modules
worker, _ = t.make_worker(config, AutoTokenizer.from_pretrained(str(model_dir)))
import tracecar.client.verl as tv
assert tv.is_active(), "model.external_lib should have imported and installed the adapter"
asyncio.run(worker.generate_sequences(t.make_batch()))
from tracecar.client import get_tracer
assert get_tracer().flush(30)
print("SENT", get_tracer().stats()["sent"])
"""


def test_config_only_switch_via_model_external_lib(start_collector, model_dir):
    """The user-facing switch, in a fresh process: two VERL config keys and TRACECAR_URL, no code."""
    col = start_collector()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACECAR_")}
    env.update(TRACECAR_URL=col.url, TRACECAR_FLUSH_INTERVAL_S="0.02")
    proc = subprocess.run(
        [sys.executable, "-c", EXTERNAL_LIB_SCRIPT, str(Path(__file__).parent), str(model_dir)],
        env=env, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "SENT 21" in proc.stdout  # 20 spans + the step's membership announcement
    assert len(trajectories(col.url, step=STEP)) == 4


def test_ray_setup_hook_string_resolves_to_install():
    """``runtime_env={"worker_process_setup_hook": "tracecar.client.verl.install"}`` names install()."""
    pytest.importorskip("ray")
    try:
        from ray._common.utils import load_class
    except ImportError:  # older Ray
        from ray._private.utils import load_class

    import tracecar.client.verl as tv

    assert load_class("tracecar.client.verl.install") is tv.install


@pytest.mark.ray
def test_ray_worker_process_setup_hook_traces_from_an_actor(start_collector, model_dir):
    """The other config-only switch: Ray runs install() in each worker before any actor code."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("a Ray session is already running in this process")
    col = start_collector()
    tests_dir = str(Path(__file__).parent)
    ray.init(
        num_cpus=1, include_dashboard=False, log_to_driver=False,
        runtime_env={
            "worker_process_setup_hook": "tracecar.client.verl.install",
            "env_vars": {"TRACECAR_URL": col.url, "TRACECAR_FLUSH_INTERVAL_S": "0.02", "PYTHONPATH": tests_dir},
        },
    )
    try:

        @ray.remote
        class Rollout:
            def run(self, model_dir: str) -> tuple[bool, bool, int]:
                import tracecar.client.verl as tv

                installed_by_hook = tv.is_installed()
                from transformers import AutoTokenizer

                from tracecar.client import get_tracer

                import test_verl_adapter as t

                worker, _ = t.make_worker(t.verl_config(Path(model_dir)), AutoTokenizer.from_pretrained(model_dir))
                asyncio.run(worker.generate_sequences(t.make_batch()))
                assert get_tracer().flush(30)
                return installed_by_hook, tv.is_active(), get_tracer().stats()["sent"]

        installed_by_hook, active, sent = ray.get(Rollout.remote().run.remote(str(model_dir)), timeout=180)
    finally:
        ray.shutdown()
    assert installed_by_hook and active and sent == 21  # 20 spans and the step's membership announcement
    assert len(trajectories(col.url, step=STEP)) == 4


# the lines docs/opentelemetry.md asks VERL to add to LLMServerClient.generate, verbatim
README_VERL_LINES = '''\
from tracecar.client import trace_headers
if (headers := trace_headers()) is not None:
    kwargs["trace_headers"] = headers
'''
_REMOTE_CALL = "output: TokenOutput = await server.generate.remote("


def _generate_with_readme_lines() -> Any:
    """VERL's own ``LLMServerClient.generate`` source with the README's lines put before the server call."""
    import inspect
    import textwrap

    from verl.workers.rollout import llm_server

    assert README_VERL_LINES in (Path(__file__).resolve().parents[1] / "docs" / "opentelemetry.md").read_text()
    source = textwrap.dedent(inspect.getsource(llm_server.LLMServerClient.generate.__wrapped__))
    head, found, tail = source.partition(_REMOTE_CALL)
    assert found, "VERL's LLMServerClient.generate changed: update README's lines and this test"
    indent = head[head.rindex("\n") + 1:]
    source = head.rstrip(" ") + textwrap.indent(README_VERL_LINES, indent) + indent + found + tail
    source = "class LLMServerClient:\n" + textwrap.indent(source, "    ")  # so its qualname is VERL's
    namespace = dict(vars(llm_server))
    exec(compile(source, llm_server.__file__, "exec"), namespace)  # decorated by VERL's rollout_trace_op, as in VERL
    return vars(namespace["LLMServerClient"])["generate"]


def test_vllm_engine_spans_join_verl_generate_calls_with_the_readme_lines(adapter, start_collector, monkeypatch, model_dir,
                                                                          hf_tokenizer):
    import contextvars
    import time

    from verl.workers.rollout.llm_server import LLMServerClient

    from tests.test_otlp_receiver import VllmEngine  # vLLM's request tracing, with vLLM's names

    col = start_collector()
    monkeypatch.setenv("TRACECAR_URL", col.url)
    monkeypatch.setattr(LLMServerClient, "generate", _generate_with_readme_lines())
    assert adapter.install() is True
    engine = VllmEngine(col.url + "/v1/traces")
    worker, server = make_worker(verl_config(model_dir), hf_tokenizer)
    scripted = server.generate.remote
    seen: list[dict[str, str] | None] = []

    async def vllm_http_server_generate(*, request_id: str, prompt_ids: list[int], sampling_params: dict,
                                        trace_headers: dict[str, str] | None = None, **kwargs: Any) -> Any:
        """vLLMHttpServer.generate with README's parameter, in a context of its own (another Ray actor)."""
        async def engine_side() -> Any:
            seen.append(trace_headers)
            arrival = time.time()
            output = await scripted(request_id=request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs)
            engine.request(trace_headers, request_id, len(prompt_ids), len(output.token_ids), arrival)  # AsyncLLM.generate's span
            return output

        return await asyncio.get_running_loop().create_task(engine_side(), context=contextvars.Context())

    server.generate.remote = vllm_http_server_generate
    out = asyncio.run(worker.generate_sequences(make_batch()))
    assert len(out) == 4 and len(seen) == 6 and all(h is not None for h in seen)
    flush()
    engine.flush()
    engine.close()
    for summary in trajectories(col.url, step=STEP):
        tree = httpx.get(f"{col.url}/v1/trajectories/{summary['trace_id']}").json()
        [run] = tree["root"]["children"]
        generates = [c for c in run["children"] if c["name"] == "LLMServerClient.generate"]
        assert generates and len(generates) == (2 if summary["sample_index"] == 0 else 1)
        for generate in generates:
            [llm] = generate["children"]
            assert llm["name"] == "llm_request" and llm["parent_id"] == generate["span_id"]
            assert llm["attributes"]["gen_ai.usage.prompt_tokens"] == len(generate["inputs"]["prompt_ids"])
            assert llm["attributes"]["step"] == STEP and llm["attributes"]["experiment_name"] == EXPERIMENT
            # generate sits under the agent loop's run (VERL's Weave root): the tracestate says so
            assert {"traceparent": f"00-{summary['trace_id']}-{generate['span_id'][16:]}-01",
                    "tracestate": f"tracecar={run['span_id']}.{generate['span_id']}"} in seen


def test_trainer_learns_what_it_did_through_extra_fields_and_the_real_compute_advantage(
        adapter, start_collector, monkeypatch, model_dir, hf_tokenizer):
    """Issue 15 §3/§2 against real VERL: the worker puts each trajectory id in extra_fields, VERL carries it
    into the batch, and hook_trainer() annotates after VERL's own ray_trainer.compute_advantage (GRPO)."""
    ray_trainer = pytest.importorskip("verl.trainer.ppo.ray_trainer")
    import torch

    from tracecar.client import verl_trainer

    col = start_collector(token2text=True, tokenizer=str(model_dir))
    monkeypatch.setenv("TRACECAR_URL", col.url)
    assert adapter.install() is True
    worker, _ = make_worker(verl_config(model_dir), hf_tokenizer)
    out = asyncio.run(worker.generate_sequences(make_batch()))
    flush()
    ids = list(out.non_tensor_batch[verl_trainer.TRACE_KEY])
    stored = {t["trace_id"]: t for t in trajectories(col.url, step=STEP)}
    assert sorted(ids) == sorted(stored) and len(ids) == 4
    for trace_id in ids:  # the traced output stays what the agent loop returned
        run = httpx.get(f"{col.url}/v1/trajectories/{trace_id}").json()["root"]["children"][0]
        assert verl_trainer.TRACE_KEY not in str(run["output"])
    tool_traj = next(t for t in ids if stored[t]["sample_index"] == 0)
    view = httpx.get(f"{col.url}/v1/trajectories/{tool_traj}/tokens").json()
    whole = next(s for s in view["spans"] if s["aggregate"])
    assert whole["outside_mask"] > 0 and "".join(t["text"] for t in whole["tokens"]) == whole["text"]
    assert "5" in "".join(t["text"] for t in whole["tokens"] if t["mask"] == 0)  # the tool's answer, not trained on

    assert verl_trainer.hook_trainer()
    try:
        scores = torch.zeros_like(out.batch["response_mask"], dtype=torch.float32)
        scores[[0, 2], 0] = 1.0
        out.batch["token_level_rewards"] = scores
        out.non_tensor_batch["uid"] = np.array(["a", "a", "b", "b"], dtype=object)

        class Trainer:
            global_steps = STEP

            def fit(self) -> Any:
                return ray_trainer.compute_advantage(out, adv_estimator=ray_trainer.AdvantageEstimator.GRPO, num_repeat=2)

        Trainer().fit()
        flush()
        rows = {t["trace_id"]: t for t in trajectories(col.url, step=STEP)}
        advantages = [rows[t]["advantage"] for t in ids]
        assert advantages[0] > 0 > advantages[1] and advantages[2] > 0 > advantages[3]
        assert all(rows[t]["trained"] is True and rows[t]["trained_on_version"] == STEP for t in ids)
    finally:
        verl_trainer.unhook_trainer()


# ---------------------------------------------------------------------------------------------
# dataset export of VERL's real agent loops (issue 27 §5)
# ---------------------------------------------------------------------------------------------

SYSTEM = "You are a careful calculator. Answer in one sentence."


def dataset_batch(tmp_path: Path, tokenizer: Any, rows: list[dict[str, Any]], n: int = 2) -> Any:
    """A batch as VERL's trainer makes it: its own RLHFDataset reading a data file, its own
    collate_fn, DataProto.from_single_dict and repeat(n, interleave=True)."""
    import json

    from omegaconf import OmegaConf
    from verl.protocol import DataProto
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    config = OmegaConf.create({"prompt_key": "prompt", "max_prompt_length": PROMPT_LEN, "filter_overlong_prompts": False,
                               "cache_dir": str(tmp_path / "cache"), "return_raw_chat": True})
    dataset = RLHFDataset(data_files=str(path), tokenizer=tokenizer, config=config)
    batch = DataProto.from_single_dict(collate_fn([dataset[i] for i in range(len(dataset))]))
    batch = batch.repeat(repeat_times=n, interleave=True)
    batch.meta_info = {"global_steps": STEP, "validate": False}
    return batch


def test_export_of_verl_agent_loops_carries_the_chat_they_were_given(adapter, start_collector, monkeypatch, model_dir,
                                                                     hf_tokenizer, tmp_path):
    """VERL's ToolAgentLoop / SingleTurnAgentLoop record their chat as inputs.kwargs.raw_prompt (``**kwargs``,
    bound as VERL's own weave backend binds it): every exported row starts with that chat, not with the
    decoded, templated prompt, and assistant turns carry no end-of-turn token."""
    import json

    from tracecar.collector.chat import parse_template

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    col = start_collector(token2text=True, tokenizer=str(model_dir))
    monkeypatch.setenv("TRACECAR_URL", col.url)
    assert adapter.install() is True
    worker, _ = make_worker(verl_config(model_dir), hf_tokenizer)
    tool_chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 2+3? 数字 🙂"}]
    plain_chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say hi"}]
    rows = [{"data_source": "t", "prompt": tool_chat, "agent_name": "tool_agent", "extra_info": {"index": 0}},
            {"data_source": "t", "prompt": plain_chat, "agent_name": "single_turn_agent", "extra_info": {"index": 1}}]
    batch = dataset_batch(tmp_path, hf_tokenizer, rows)
    assert type(batch.non_tensor_batch["raw_prompt"][0]) is list  # VERL's collate_fn: an object array of lists
    out = asyncio.run(worker.generate_sequences(batch))
    assert len(out) == 4
    flush()
    # the shape VERL records (and tracecar with it): the chat under the **kwargs parameter's name
    for summary in trajectories(col.url, step=STEP):
        run = httpx.get(f"{col.url}/v1/trajectories/{summary['trace_id']}").json()["root"]["children"][0]
        assert "raw_prompt" not in run["inputs"] and run["inputs"]["kwargs"]["raw_prompt"] in (tool_chat, plain_chat)
        assert run["output"]["prompt_text"].startswith("<|im_start|>")  # only the decoded text is templated
        if run["name"] == "SingleTurnAgentLoop.run":  # where only that text exists, the template is undone
            first = next(c for c in run["children"] if c["name"] == "LLMServerClient.generate")
            assert parse_template(first["output"]["prompt_text"]) == plain_chat

    response = httpx.get(f"{col.url}/v1/export", params={"experiment": EXPERIMENT, "format": "jsonl"}, timeout=60)
    assert response.status_code == 200, response.text
    exported = [json.loads(line) for line in response.text.splitlines()]
    assert len(exported) == 4
    for row in exported:
        roles = [m["role"] for m in row["messages"]]
        system, user, *turns = row["messages"]
        assert (system["content"], user["content"]) == (SYSTEM, (tool_chat if row["sample_index"] == 0 else plain_chat)[1]["content"])
        assert not any("<|im_" in (m["content"] or "") for m in row["messages"]), row["messages"]
        if row["sample_index"] == 0:
            assert roles == ["system", "user", "assistant", "tool", "assistant"]
            call, result, answer = turns
            [tool_call] = call["tool_calls"]
            assert tool_call["function"]["name"] == "AddTool" and json.loads(tool_call["function"]["arguments"])["a"] == 2
            assert result["tool_call_id"] == tool_call["id"] and "5" in result["content"]
            assert answer["content"] == ANSWER.removesuffix("<|im_end|>")
        else:
            assert roles == ["system", "user", "assistant"] and turns[0]["content"] == ANSWER.removesuffix("<|im_end|>")
    # the viewer's list and group previews show the question, not the template's markup
    listed = httpx.get(f"{col.url}/ui/api/trajectories", params={"experiment": EXPERIMENT}).json()["trajectories"]
    assert sorted(t["prompt_preview"] for t in listed) == sorted([tool_chat[1]["content"]] * 2 + [plain_chat[1]["content"]] * 2)
    groups = httpx.get(f"{col.url}/v1/groups", params={"experiment": EXPERIMENT, "step": STEP}).json()["groups"]
    # a group shows the question its rollouts answer (the whole templated prompt is one click away)
    assert [g["prompt_question"] for g in groups] == [tool_chat[1]["content"], plain_chat[1]["content"]]
