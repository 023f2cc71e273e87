"""VERL adapter: route VERL's own ``rollout_trace_op`` / ``rollout_trace_attr`` to tracecar.

A VERL user switches to tracecar by configuration only::

    actor_rollout_ref.rollout.trace.backend=tracecar
    # plus ONE way of getting this module imported in the AgentLoopWorker process:
    actor_rollout_ref.model.external_lib=tracecar.client.verl                          # (a)
    +ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=tracecar.client.verl.install  # (b)
    # and the collector's address in the workers' environment:
    +ray_kwargs.ray_init.runtime_env.env_vars.TRACECAR_URL=http://127.0.0.1:9470

How it works
------------
VERL decorates its methods (``ToolAgentLoop.run``, ``SingleTurnAgentLoop.run``,
``LLMServerClient.generate``, ``ToolParser.extract_tool_calls``, ``BaseTool.execute``, user
tools and agent loops) with ``verl.utils.rollout_trace.rollout_trace_op`` at *import time*.
The wrapper it returns dispatches on ``RolloutTraceConfig.get_backend()`` at *call time*; an
unknown backend string such as ``"tracecar"`` is accepted silently by
``RolloutTraceConfig.init`` (client ``None``) and every wrapper falls through to
``await func(...)`` untraced.  That fall-through is the hook used here:

* :func:`install` wraps ``RolloutTraceConfig.init``.  Nothing else changes unless VERL
  initialises tracing with ``backend == "tracecar"``.
* When it does, :func:`_activate` configures the tracecar client and then, for every wrapper
  VERL's ``rollout_trace_op`` ever made (found exactly through ``gc.get_referrers`` on the
  wrapper's code object), replaces the wrapper's closure cell ``func`` with a shim that
  calls ``tracecar.client.rollout_trace_op(func)``.  VERL's wrapper, taking its unknown-backend
  branch, then calls tracecar's op.  Wrappers made later (custom agent loops that hydra
  imports lazily) are covered by replacing ``rollout_trace_op`` in ``verl.utils.rollout_trace``
  and in every loaded module that imported it.
* ``rollout_trace_attr`` is replaced (in ``verl.utils.rollout_trace`` and in every module that
  imported it, e.g. ``verl.experimental.agent_loop.agent_loop``, whose ``_run_agent_loop``
  looks the name up in its module globals at call time) by a context manager that enters
  VERL's original (keeping VERL's own context variables right) *and* tracecar's
  ``rollout_trace_attr``, which opens the trajectory root span.
* Sampling: VERL normally pre-selects ``max_samples_per_step_per_worker`` samples per worker
  and runs the rest with ``trace=False``.  With ``backend=tracecar`` the budget is handed to
  the collector instead (VERL is told ``None``, so every sample is captured and sent), and
  the collector samples per (experiment, step, worker).  ``TRACECAR_VERL_WORKER_SAMPLING=1``
  keeps VERL's cheap worker-side pre-selection (unchosen samples are then never sent).
* ``token2text``: VERL's unknown-backend branch never decodes in the worker; the collector
  decodes the ``prompt_ids`` / ``response_ids`` / ``token_ids`` it finds in span outputs and
  inputs, with the tokenizer named by the job's ``model_config.tokenizer_path`` (read off the
  AgentLoopWorker calling init and sent as the client's ``tokenizer``).  ``token2text`` and
  the budget are offered to ``configure()`` too; the client passes on only the settings its
  ``ClientConfig`` has, so until it carries them the collector's own settings decide.
* The trainer's W&B run: ``wandb.init`` runs in the trainer, not in the agent-loop workers, so
  the client takes the run id from ``WANDB_RUN_ID`` / ``TRACECAR_WANDB_RUN_ID`` (set once in the
  Ray runtime env: the trainer's ``wandb.init`` honours ``WANDB_RUN_ID`` too); where a run is
  active in the worker's own process the adapter reads ``wandb.run``. The collector links the
  Weave calls to it (``wb_run_id``, ``wb_run_step``).
* Environment wins over VERL's config for ``TRACECAR_PROJECT``, ``TRACECAR_EXPERIMENT``,
  ``TRACECAR_CLIENT_TOKENIZER`` and ``TRACECAR_WANDB_RUN_ID``; ``TRACECAR_URL`` (read by the
  client) turns sending on.

This module does not import ``verl`` (nor ``tracecar.client``) at import time, except that
importing it *inside a process where VERL's ``verl.utils.rollout_trace`` is already loaded*
calls :func:`install` (that is what makes ``model.external_lib=tracecar.client.verl`` work;
disable with ``TRACECAR_VERL_AUTOINSTALL=0``).  :func:`install` is idempotent, cheap and
never raises because of tracing problems: tracing must not take a training run down.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import inspect
import logging
import os
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

__all__ = ["BACKEND", "install", "uninstall", "is_installed", "is_active", "settings"]

logger = logging.getLogger("tracecar.verl")

BACKEND = "tracecar"
_VERL_MODULE = "verl.utils.rollout_trace"
_SHIM_FLAG = "__tracecar_shim__"

_lock = threading.RLock()


class _State:
    def __init__(self) -> None:
        self.installed = False
        self.active = False
        self.rt: types.ModuleType | None = None  # verl.utils.rollout_trace
        self.orig_init: Callable | None = None  # bound classmethod RolloutTraceConfig.init
        self.orig_init_raw: Any = None  # the classmethod object as found in the class dict
        self.orig_reset_raw: Any = None
        self.orig_op: Callable[..., Any] | None = None
        self.orig_attr: Callable[..., Any] | None = None
        self.orig_attr_params: frozenset[str] = frozenset()
        self.wrapper_codes: tuple[types.CodeType, ...] = ()
        self.swapped_cells: list[tuple[types.CellType, Any]] = []
        self.patched_names: list[tuple[Any, str, Any]] = []  # (module or class, attribute, original)
        self.settings: dict[str, Any] = {}
        # fully-async VERL (step -1): the newest parameter version this worker's rollouts reported
        self.policy_version: int | None = None


_state = _State()


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


def is_installed() -> bool:
    return _state.installed


def is_active() -> bool:
    return _state.active


def settings() -> dict[str, Any]:
    """What the adapter saw in ``RolloutTraceConfig.init`` and handed to the client."""
    return dict(_state.settings)


# --------------------------------------------------------------------------------------------
# install / uninstall
# --------------------------------------------------------------------------------------------


def install() -> bool:
    """Make VERL's ``trace.backend=tracecar`` route traces to tracecar.

    Safe to call from a Ray ``worker_process_setup_hook`` (any process, before or after the
    agent-loop modules are imported), more than once, and in processes that never trace.
    Returns True when the hook is in place.
    """
    with _lock:
        if _state.installed:
            return True
        try:
            import importlib

            rt = importlib.import_module(_VERL_MODULE)
        except Exception as e:  # verl missing or broken: nothing to adapt
            logger.debug("tracecar.verl: %s not importable (%s); not installed", _VERL_MODULE, e)
            return False

        cfg_cls = getattr(rt, "RolloutTraceConfig", None)
        if cfg_cls is None or not hasattr(cfg_cls, "init"):
            logger.warning("tracecar.verl: unexpected %s layout; not installed", _VERL_MODULE)
            return False

        _state.rt = rt
        _state.orig_op = rt.rollout_trace_op
        _state.orig_attr = rt.rollout_trace_attr
        try:
            _state.orig_attr_params = frozenset(inspect.signature(rt.rollout_trace_attr).parameters)
        except (TypeError, ValueError):
            _state.orig_attr_params = frozenset()
        _state.wrapper_codes = _find_wrapper_codes(rt.rollout_trace_op)
        _state.orig_init_raw = cfg_cls.__dict__.get("init")
        _state.orig_init = cfg_cls.init  # bound to the class
        orig_init = _state.orig_init

        @functools.wraps(orig_init)
        def init(cls, *args, **kwargs):
            return _patched_init(cls, orig_init, *args, **kwargs)

        cfg_cls.init = classmethod(init)

        # RolloutTraceConfig.reset() (tests, re-initialisation) also turns our routing off, so
        # that a later init(backend=...) decides afresh.
        _state.orig_reset_raw = cfg_cls.__dict__.get("reset")
        orig_reset = getattr(cfg_cls, "reset", None)
        if orig_reset is not None:

            @functools.wraps(orig_reset)
            def reset(cls, *args, **kwargs):
                _deactivate()
                return orig_reset(*args, **kwargs)

            cfg_cls.reset = classmethod(reset)
        _state.installed = True

        # Late install: VERL already initialised tracing with our backend.
        try:
            instance = cfg_cls._instance
            if instance is not None and getattr(instance, "_initialized", False) and instance.backend == BACKEND:
                _activate(
                    project=instance.project_name,
                    experiment=instance.experiment_name,
                    token2text=bool(getattr(instance, "token2text", False)),
                    max_samples=getattr(instance, "max_samples_per_step_per_worker", None),
                    caller=None,
                )
                if not _env_flag("TRACECAR_VERL_WORKER_SAMPLING", False):
                    if hasattr(instance, "max_samples_per_step_per_worker"):
                        instance.max_samples_per_step_per_worker = None
        except Exception:  # pragma: no cover - defensive
            logger.exception("tracecar.verl: late activation failed; tracing stays off")
        if _env_flag("TRACECAR_VERL_HOOK_TRAINER", False):  # opt-in: imports VERL's trainer in every process
            from .verl_trainer import hook_trainer

            hook_trainer()
        return True


def uninstall() -> None:
    """Undo :func:`install` (restores VERL's functions, closure cells and module names)."""
    with _lock:
        _deactivate()
        rt = _state.rt
        if _state.installed and rt is not None:
            cfg_cls = rt.RolloutTraceConfig
            for name, raw in (("init", _state.orig_init_raw), ("reset", _state.orig_reset_raw)):
                if raw is not None:
                    setattr(cfg_cls, name, raw)
                else:  # the method was inherited: drop our override
                    with contextlib.suppress(AttributeError):
                        delattr(cfg_cls, name)
        _state.installed = False
        _state.rt = None
        _state.orig_init = _state.orig_init_raw = _state.orig_reset_raw = None
        _state.orig_op = _state.orig_attr = None
        _state.wrapper_codes = ()
        _state.settings = {}


# --------------------------------------------------------------------------------------------
# RolloutTraceConfig.init
# --------------------------------------------------------------------------------------------


def _patched_init(cls, orig_init: Callable, *args, **kwargs):
    try:
        sig = inspect.signature(orig_init)
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        params = bound.arguments
    except TypeError:
        return orig_init(*args, **kwargs)

    if params.get("backend") != BACKEND:
        return orig_init(*args, **kwargs)

    budget = params.get("max_samples_per_step_per_worker")
    worker_sampling = _env_flag("TRACECAR_VERL_WORKER_SAMPLING", False)
    if "max_samples_per_step_per_worker" in params and not worker_sampling:
        # The collector enforces the budget; VERL must not mark samples trace=False.
        params["max_samples_per_step_per_worker"] = None
    instance = cls.get_instance()
    already = bool(getattr(instance, "_initialized", False))
    result = orig_init(**params)  # unknown backend: VERL stores settings, client=None
    if already:
        return result  # VERL's init is first-call-wins; so is ours
    caller = inspect.currentframe()
    caller = caller.f_back.f_back if caller is not None and caller.f_back is not None else None
    try:
        _activate(
            project=params.get("project_name"),
            experiment=params.get("experiment_name"),
            token2text=bool(params.get("token2text", False)),
            max_samples=budget,
            caller=caller,
        )
    except Exception:
        logger.exception("tracecar.verl: activation failed; VERL runs untraced")
    finally:
        del caller
    return result


def _caller_tokenizer(frame) -> str | None:
    """Best effort: the tokenizer of the AgentLoopWorker calling init, named for the collector.

    ``AgentLoopWorker.__init__`` holds ``self.model_config`` (``HFModelConfig``); its
    ``tokenizer_path`` is the HF name or path the job was given (a remote ``hdfs://`` path is
    skipped in favour of the local copy VERL made).
    """
    try:
        owner = frame.f_locals.get("self") if frame is not None else None
        model_config = getattr(owner, "model_config", None)
        for attr in ("tokenizer_path", "path", "local_tokenizer_path", "local_path"):
            value = getattr(model_config, attr, None)
            if isinstance(value, str) and value and "://" not in value:
                return value
        tok = getattr(owner, "tokenizer", None)
        value = getattr(tok, "name_or_path", None)
        return value if isinstance(value, str) and value else None
    except Exception:  # pragma: no cover - defensive
        return None


# Environment variables that, when set, win over what VERL's config says.
_ENV_WINS = {"project": "TRACECAR_PROJECT", "experiment": "TRACECAR_EXPERIMENT", "tokenizer": "TRACECAR_CLIENT_TOKENIZER",
             "wandb_run_id": "TRACECAR_WANDB_RUN_ID"}


def _current_wandb_run_id() -> str | None:
    """``entity/project/run_id`` of a W&B run active in this process, if ``wandb`` is loaded.

    VERL calls ``wandb.init`` in the trainer; where the agent-loop workers share that process
    (a single-process run, tests) this finds it. Rollout workers in their own Ray processes
    get the run from ``WANDB_RUN_ID`` in the Ray runtime env instead (read by the client), the
    same variable that makes the trainer's ``wandb.init`` use that id. Never imports wandb.
    """
    wandb = sys.modules.get("wandb")
    run = getattr(wandb, "run", None) if wandb is not None else None
    try:
        run_id = getattr(run, "id", None)
        if not isinstance(run_id, str) or not run_id:
            return None
        entity, project = getattr(run, "entity", None), getattr(run, "project", None)
        return f"{entity}/{project}/{run_id}" if entity and project else run_id
    except Exception:  # noqa: BLE001 - a half-torn-down run must not break activation
        return None


def _configure_client(tc, **wanted: Any) -> Any:
    """(Re)configure the tracecar client with VERL's settings; returns the tracer (or None).

    Values are dropped when None, when the matching ``TRACECAR_*`` variable is set (the
    operator's explicit choice wins over VERL's config), or when the client's configuration
    has no such field (logged once).  An already configured tracer keeps its settings (URL
    included) and only gains the fields VERL supplies.
    """
    wanted = {k: v for k, v in wanted.items() if v is not None and not os.environ.get(_ENV_WINS.get(k, ""), "")}
    config_cls = getattr(tc, "ClientConfig", None)
    if config_cls is not None and dataclasses.is_dataclass(config_cls):
        known = {f.name for f in dataclasses.fields(config_cls)}
        dropped = sorted(set(wanted) - known)
        if dropped:
            logger.info("tracecar.verl: the client has no setting %s; not passed on", dropped)
        wanted = {k: v for k, v in wanted.items() if k in known}
        current = tc.get_tracer() if hasattr(tc, "get_tracer") else None  # false while tracing is off
        if current and getattr(current, "config", None) is not None:
            if not wanted:
                return current
            return tc.configure(dataclasses.replace(current.config, **wanted))
    return tc.configure(**wanted)


def _activate(*, project, experiment, token2text: bool, max_samples, caller) -> None:
    with _lock:
        if _state.active:
            return
        import tracecar.client as tc  # lazily: the client pulls in httpx

        worker_sampling = _env_flag("TRACECAR_VERL_WORKER_SAMPLING", False)
        _state.settings = {
            "project": project,
            "experiment": experiment,
            "token2text": token2text,
            "max_samples_per_step_per_worker": max_samples,
            "worker_sampling": worker_sampling,
            "tokenizer": _caller_tokenizer(caller),
            "wandb_run_id": os.environ.get("TRACECAR_WANDB_RUN_ID") or os.environ.get("WANDB_RUN_ID") or _current_wandb_run_id(),
        }
        tracer = _configure_client(
            tc,
            project=project,
            experiment=experiment,
            tokenizer=_state.settings["tokenizer"],
            wandb_run_id=None if os.environ.get("WANDB_RUN_ID") else _current_wandb_run_id(),
            # Sent with every batch: the collector decodes when the job asks for it (otherwise
            # its own TRACECAR_TOKEN2TEXT decides) and applies the job's budget where its own
            # settings set none.
            token2text=True if token2text else None,
            max_samples_per_step_per_worker=None if worker_sampling else max_samples,
        )
        if tracer is None:
            logger.warning(
                "tracecar.verl: trace.backend=tracecar but TRACECAR_URL is not set in this "
                "process (pid %s); VERL runs untraced",
                os.getpid(),
            )
        _state.active = True
        n = _swap_existing_wrappers(tc)
        _patch_module_names()
        rewards = _hook_rewards(tc)
        _hook_membership(tc)
        _hook_trace_ids(tc)
        _hook_engine_request_ids(tc)
        logger.info("tracecar.verl: active (project=%s experiment=%s, %d VERL ops, rewards %s)",
                    project, experiment, n, "hooked" if rewards else "not hooked")


def _hook_rewards(tc) -> bool:
    """Attach each trajectory's reward to it, so the collector can sample on rewards.

    VERL scores a trajectory in ``AgentLoopWorker._compute_score``, called from
    ``_agent_loop_postprocess`` while the trajectory's ``rollout_trace_attr`` is still open, and
    puts the score on ``outputs[-1].reward_score`` (only with the async reward loop; otherwise
    the trainer scores whole batches later and no reward reaches the agent loop). No VERL span
    carries it, so this wraps ``_compute_score`` and sends the score as an annotation of the
    current trajectory. Restored by :func:`uninstall`.
    """
    module = sys.modules.get("verl.experimental.agent_loop.agent_loop")
    worker_cls: Any = getattr(module, "AgentLoopWorker", None)
    original = getattr(worker_cls, "_compute_score", None)
    if original is None or getattr(original, _SHIM_FLAG, False) or not inspect.iscoroutinefunction(original):
        return False

    @functools.wraps(original)
    async def compute_score(self, outputs, *args, **kwargs):
        result = await original(self, outputs, *args, **kwargs)
        if _state.active and _verl_trace_enabled():
            try:
                score = getattr(outputs[-1], "reward_score", None) if outputs else None
                if isinstance(score, (int, float)) and not isinstance(score, bool):
                    tc.annotate(reward=float(score))
            except Exception:  # noqa: BLE001 - tracing never fails a rollout
                logger.debug("tracecar.verl: reward not attached", exc_info=True)
        return result

    setattr(compute_score, _SHIM_FLAG, True)
    worker_cls._compute_score = compute_score
    _state.patched_names.append((worker_cls, "_compute_score", original))
    return True


def _hook_membership(tc) -> bool:
    """Announce each ``generate_sequences`` call's sample indices, and learn policy versions.

    VERL picks ``max_samples_per_step_per_worker`` samples uniformly from the call's indices;
    the collector can do the same, independent of which trajectory finishes first, only if it
    knows them all: this sends the list (``tc.announce_step``) before any trajectory runs. Not
    for ``step == -1`` (fully-async: one sample per call, no step to announce). The call's
    output carries ``max_global_steps`` (the parameter version each rollout finished with):
    the newest becomes the ``policy_version`` of the worker's next fully-async trajectories.
    """
    module = sys.modules.get("verl.experimental.agent_loop.agent_loop")
    worker_cls: Any = getattr(module, "AgentLoopWorker", None)
    original = getattr(worker_cls, "generate_sequences", None)
    if original is None or getattr(original, _SHIM_FLAG, False) or not inspect.iscoroutinefunction(original):
        return False
    announce = getattr(tc, "announce_step", None)

    @functools.wraps(original)
    async def generate_sequences(self, batch, *args, **kwargs):
        if _state.active and announce is not None and not _env_flag("TRACECAR_VERL_WORKER_SAMPLING", False):
            try:
                meta = getattr(batch, "meta_info", None) or {}
                step = _plain(meta.get("global_steps", -1))
                index = (getattr(batch, "non_tensor_batch", None) or {}).get("index")
                if type(step) is int and step != -1:
                    indices = [_plain(i) for i in index] if index is not None else list(range(len(batch)))
                    announce(step, indices, validate=bool(_plain(meta.get("validate", False))))
            except Exception:  # noqa: BLE001 - tracing never fails a rollout
                logger.debug("tracecar.verl: step membership not sent", exc_info=True)
        output = await original(self, batch, *args, **kwargs)
        try:
            versions = (getattr(output, "non_tensor_batch", None) or {}).get("max_global_steps")
            seen = [v for v in (_plain(v) for v in versions) if type(v) is int] if versions is not None else []
            if seen and (_state.policy_version is None or max(seen) > _state.policy_version):
                _state.policy_version = max(seen)
        except Exception:  # noqa: BLE001
            logger.debug("tracecar.verl: policy version not read", exc_info=True)
        return output

    setattr(generate_sequences, _SHIM_FLAG, True)
    worker_cls.generate_sequences = generate_sequences
    _state.patched_names.append((worker_cls, "generate_sequences", original))
    return True


def _hook_trace_ids(tc) -> bool:
    """Put each trajectory's id in ``AgentLoopOutput.extra_fields["tracecar_trace_id"]`` (and its route,
    ``"tracecar_route"``: its experiment, validate and step, for nodes with several gateways).

    VERL carries every extra field into the trainer's batch (``non_tensor_batch``), where
    :func:`tracecar.client.verl_trainer.hook_trainer` reads it to annotate the trajectory with
    what the trainer did. ``_agent_loop_postprocess`` runs inside the trajectory's
    ``rollout_trace_attr``; the field dict is replaced, not changed, so the agent loop's traced
    output stays what it returned.
    """
    from ..tracing import current_trajectory_route
    from .verl_trainer import ROUTE_KEY, TRACE_KEY

    module = sys.modules.get("verl.experimental.agent_loop.agent_loop")
    worker_cls: Any = getattr(module, "AgentLoopWorker", None)
    original = getattr(worker_cls, "_agent_loop_postprocess", None)
    if original is None or getattr(original, _SHIM_FLAG, False) or not inspect.iscoroutinefunction(original):
        return False

    @functools.wraps(original)
    async def _agent_loop_postprocess(self, output, *args, **kwargs):
        if _state.active:
            try:
                trace_id = tc.current_trajectory_id()
                if trace_id is not None:
                    fields = {TRACE_KEY: trace_id}
                    route = current_trajectory_route()  # where its annotations go when nodes have several gateways
                    if route is not None:
                        fields[ROUTE_KEY] = route
                    output.extra_fields = {**(getattr(output, "extra_fields", None) or {}), **fields}
            except Exception:  # noqa: BLE001 - tracing never fails a rollout
                logger.debug("tracecar.verl: trajectory id not attached", exc_info=True)
        return await original(self, output, *args, **kwargs)

    setattr(_agent_loop_postprocess, _SHIM_FLAG, True)
    worker_cls._agent_loop_postprocess = _agent_loop_postprocess
    _state.patched_names.append((worker_cls, "_agent_loop_postprocess", original))
    return True


def _hook_engine_request_ids(tc) -> bool:
    """Note, on each traced ``generate``, the request id the engine is given (for ``enable_otel``).

    VERL's ``LLMServerClient.generate`` hands the server a fresh id per turn
    (``_vllm_request_id``: a uuid, or the caller's id under ``full_determinism``), which is what
    vLLM's ``llm_request`` span carries as ``gen_ai.request.id``; ``request_id`` in the call's
    inputs is the agent loop's sticky-session id, which the engine never sees. This wraps
    ``_vllm_request_id`` to note the id it returns on the current call
    (``tracecar.client.engine_request``), so the collector can join the engine span that VERL's
    ``enable_otel`` sends without a parent context. The id returned is VERL's, unchanged.
    """
    module = sys.modules.get("verl.workers.rollout.llm_server")
    client_cls: Any = getattr(module, "LLMServerClient", None)
    original = getattr(client_cls, "_vllm_request_id", None)
    note = getattr(tc, "engine_request", None)
    if original is None or note is None or getattr(original, _SHIM_FLAG, False) or inspect.iscoroutinefunction(original):
        return False

    @functools.wraps(original)
    def _vllm_request_id(self, *args, **kwargs):
        request_id = original(self, *args, **kwargs)
        if _state.active:
            try:
                note(request_id)
            except Exception:  # noqa: BLE001 - tracing never fails a rollout
                logger.debug("tracecar.verl: engine request id not noted", exc_info=True)
        return request_id

    setattr(_vllm_request_id, _SHIM_FLAG, True)
    client_cls._vllm_request_id = _vllm_request_id
    _state.patched_names.append((client_cls, "_vllm_request_id", original))
    return True


def _deactivate() -> None:
    with _lock:
        for cell, original in reversed(_state.swapped_cells):
            cell.cell_contents = original
        _state.swapped_cells.clear()
        for module, name, original in reversed(_state.patched_names):
            setattr(module, name, original)
        _state.patched_names.clear()
        _state.active = False
        _state.policy_version = None


# --------------------------------------------------------------------------------------------
# ops: swap the ``func`` cell of VERL's wrappers
# --------------------------------------------------------------------------------------------


def _find_wrapper_codes(orig_op: Callable) -> tuple[types.CodeType, ...]:
    """The code objects of VERL's ``async_wrapper`` and ``wrapper`` (shared by all closures)."""
    codes = []

    async def _probe_async(self):  # pragma: no cover - never called
        return None

    def _probe_sync(self):  # pragma: no cover - never called
        return None

    for probe in (_probe_async, _probe_sync):
        try:
            w = orig_op(probe)
        except Exception:
            continue
        code = getattr(w, "__code__", None)
        if code is not None and "func" in code.co_freevars and code not in codes:
            codes.append(code)
    return tuple(codes)


def _is_verl_wrapper(obj: Any) -> bool:
    return isinstance(obj, types.FunctionType) and obj.__code__ in _state.wrapper_codes


def _verl_trace_enabled() -> bool:
    rt = _state.rt
    var = getattr(rt, "_trace_enabled", None) if rt is not None else None
    try:
        return True if var is None else bool(var.get())
    except Exception:  # pragma: no cover
        return True


def _make_shim(func: Callable, tc) -> Callable:
    traced = tc.rollout_trace_op(func)
    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def shim(*args, **kwargs):
            if not _state.active or not _verl_trace_enabled():
                return await func(*args, **kwargs)
            return await traced(*args, **kwargs)

    else:

        @functools.wraps(func)
        def shim(*args, **kwargs):
            if not _state.active or not _verl_trace_enabled():
                return func(*args, **kwargs)
            return traced(*args, **kwargs)

    setattr(shim, _SHIM_FLAG, func)
    return shim


def _swap_wrapper(wrapper: types.FunctionType, tc) -> bool:
    try:
        index = wrapper.__code__.co_freevars.index("func")
        cell = wrapper.__closure__[index]  # type: ignore[index]  # None: TypeError, handled below
        func = cell.cell_contents
    except (ValueError, IndexError, TypeError):
        return False
    if getattr(func, _SHIM_FLAG, None) is not None:
        return False  # already ours
    cell.cell_contents = _make_shim(func, tc)
    _state.swapped_cells.append((cell, func))
    return True


def _swap_existing_wrappers(tc) -> int:
    count = 0
    if not _state.wrapper_codes:
        logger.warning("tracecar.verl: VERL's rollout_trace_op has an unknown shape; ops not traced")
        return 0
    for code in _state.wrapper_codes:
        for ref in gc.get_referrers(code):
            if _is_verl_wrapper(ref) and _swap_wrapper(ref, tc):
                count += 1
    return count


def _rollout_trace_op(func):
    """Replacement for ``verl.utils.rollout_trace.rollout_trace_op`` while active."""
    assert _state.orig_op is not None  # patched in only while installed
    wrapper = _state.orig_op(func)
    if _state.active and _is_verl_wrapper(wrapper):
        import tracecar.client as tc

        _swap_wrapper(wrapper, tc)
    return wrapper


# --------------------------------------------------------------------------------------------
# rollout_trace_attr
# --------------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """numpy scalars (``index[i]`` from a DataProto) to Python values."""
    if type(value).__module__ == "numpy" and hasattr(value, "item"):
        try:
            return value.item()
        except Exception:  # pragma: no cover
            return value
    return value


@contextlib.contextmanager
def _rollout_trace_attr(
    sample_index=None, step=None, rollout_n=None, name="rollout_trace", validate=False, trace: bool = True
):
    """Replacement for VERL's ``rollout_trace_attr``: VERL's context plus a tracecar root span."""
    verl_kwargs = dict(
        sample_index=sample_index, step=step, rollout_n=rollout_n, name=name, validate=validate, trace=trace
    )
    if _state.orig_attr_params:
        verl_kwargs = {k: v for k, v in verl_kwargs.items() if k in _state.orig_attr_params}
    assert _state.orig_attr is not None  # patched in only while installed
    with _state.orig_attr(**verl_kwargs):
        if not _state.active:
            yield
            return
        import tracecar.client as tc

        step = _plain(step)
        with tc.rollout_trace_attr(
            sample_index=_plain(sample_index),
            step=step,
            rollout_n=_plain(rollout_n),
            name=name,
            validate=bool(_plain(validate)),
            trace=bool(trace),
            # fully-async (step -1): the collector budgets per policy version instead of per step
            policy_version=_state.policy_version if step == -1 else None,
        ) as record:
            yield record


def _patch_module_names() -> None:
    """Point every loaded module's ``rollout_trace_op`` / ``rollout_trace_attr`` at ours."""
    replacements = {}
    if _state.orig_op is not None:
        replacements[id(_state.orig_op)] = ("rollout_trace_op", _state.orig_op, _rollout_trace_op)
    if _state.orig_attr is not None:
        replacements[id(_state.orig_attr)] = ("rollout_trace_attr", _state.orig_attr, _rollout_trace_attr)
    for module in list(sys.modules.values()):
        if not isinstance(module, types.ModuleType):
            continue
        try:
            namespace = vars(module)
        except TypeError:  # pragma: no cover
            continue
        for attr_name in ("rollout_trace_op", "rollout_trace_attr"):
            value = namespace.get(attr_name)
            hit = replacements.get(id(value)) if value is not None else None
            if hit is None or hit[1] is not value:
                continue
            try:
                setattr(module, attr_name, hit[2])
            except Exception:  # pragma: no cover - read-only module proxies
                continue
            _state.patched_names.append((module, attr_name, value))


# ``actor_rollout_ref.model.external_lib=tracecar.client.verl``: VERL imports this module while
# building HFModelConfig in the AgentLoopWorker, before RolloutTraceConfig.init.
if _VERL_MODULE in sys.modules and _env_flag("TRACECAR_VERL_AUTOINSTALL", True):
    try:
        install()
    except Exception:  # pragma: no cover - never break the importer
        logger.exception("tracecar.verl: auto-install failed")
