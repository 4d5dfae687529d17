"""Every vLLM name the plugin hooks or reads, in one place, probed at start-up.

vLLM has no public API for what adaptspec does (a K per request per step, feedback from each
step), so the plugin relies on internals that move between releases. `probe()` checks that each
exists, with the parameters the override passes on; `check()` refuses with the missing names
and the supported versions. Each group is probed where its hooks are installed: `config` in
every process (adaptspec_vllm.register), `scheduler` in the engine core (AdaptiveScheduler),
`runner` in the worker (the first custom_class proposer), `sampler` on the CPU platform
(cpu_fixes). ADAPTSPEC_ALLOW_ANY_VLLM=1 skips the version check (version.py), never this probe.

docs/vllm-touchpoints.md's table says what each is used for, where, and why no public
hook serves; the public ones are `--scheduler-cls`, `--speculative-config` with method
`custom_class` (vLLM builds the proposer from a class path) and the `vllm.general_plugins`
entry point.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from dataclasses import dataclass

from adaptspec_vllm.version import SUPPORTED, UnsupportedVLLMVersion


@dataclass(frozen=True)
class TouchPoint:
    """`module:qualname` must exist; `params`: parameter names its signature must have;
    `fields`: attributes instances have (dataclass fields, class attributes or `self.X =` in
    `__init__`); `source`: code its source must contain (whitespace ignored)."""

    target: str
    params: tuple[str, ...] = ()
    fields: tuple[str, ...] = ()
    # Code its source must contain, whitespace ignored: how vLLM calls into the plugin (the
    # arguments a custom_class proposer's `propose` receives), which no signature shows.
    source: tuple[str, ...] = ()


SCHED = "vllm.v1.core.sched.scheduler:Scheduler"
RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
# By where they are used, each group probed where its hooks are installed (the engine core,
# the worker, every process), so no process imports more of vLLM than it already does.
TOUCH_POINTS: dict[str, tuple[TouchPoint, ...]] = {
    "config": (
        TouchPoint("vllm.config.scheduler:SchedulerConfig",
                   fields=("scheduler_cls", "async_scheduling")),
        TouchPoint("vllm.config.scheduler:SchedulerConfig.get_scheduler_cls"),
        # runner_choice.py: the runner vLLM chose (this variable decides when set)
        TouchPoint("vllm.config:VllmConfig.use_v2_model_runner",
                   source=("envs.VLLM_USE_V2_MODEL_RUNNER",)),
    ),
    "scheduler": (
        TouchPoint(SCHED, fields=("requests", "running")),
        TouchPoint(SCHED + ".add_request", ("request",)),
        TouchPoint(SCHED + "._free_request", ("request",)),
        TouchPoint(SCHED + ".schedule", source=("self._update_after_schedule(scheduler_output)",)),
        # the plan goes on the step's output here, before AsyncScheduler makes the next step's
        # draft placeholders from its depth
        TouchPoint(SCHED + "._update_after_schedule", ("scheduler_output",)),
        TouchPoint("vllm.v1.core.sched.async_scheduler:AsyncScheduler._update_after_schedule",
                   ("scheduler_output",), source=(
                       "request.spec_token_ids=self._spec_token_placeholders",)),
        TouchPoint(SCHED + ".update_from_output", ("scheduler_output", "model_runner_output")),
        TouchPoint(SCHED + ".update_draft_token_ids", ("draft_token_ids",)),
        TouchPoint(SCHED + ".shutdown"),
        # the engine time account (adaptspec/account.py): is the gap after a step idle?
        TouchPoint(SCHED + ".has_unfinished_requests"),
        TouchPoint("vllm.v1.request:Request",
                   fields=("request_id", "sampling_params", "spec_token_ids", "priority",
                           "all_token_ids")),
        TouchPoint("vllm.v1.request:Request.is_finished"),
        TouchPoint("vllm.sampling_params:SamplingParams", fields=("extra_args",)),
        TouchPoint("vllm.v1.core.sched.output:SchedulerOutput",
                   fields=("num_scheduled_tokens", "scheduled_spec_decode_tokens",
                           "num_spec_tokens_to_schedule", "total_num_scheduled_tokens",
                           "num_invalid_spec_tokens")),
        TouchPoint("vllm.v1.outputs:ModelRunnerOutput",
                   fields=("sampled_token_ids", "req_id_to_index")),
        TouchPoint("vllm.v1.outputs:DraftTokenIds", fields=("req_ids", "draft_token_ids")),
        TouchPoint("vllm.config:VllmConfig",
                   fields=("speculative_config", "scheduler_config", "model_config",
                           "parallel_config", "use_v2_model_runner")),
        TouchPoint("vllm.config:ParallelConfig",
                   fields=("data_parallel_index",)),
        TouchPoint("vllm.config:SpeculativeConfig",
                   fields=("method", "num_speculative_tokens", "model", "prompt_lookup_max")),
        TouchPoint("vllm.config:ModelConfig", fields=("served_model_name",)),
    ),
    "runner": (
        TouchPoint(RUNNER, fields=("input_batch",)),
        TouchPoint(RUNNER + ".propose_draft_token_ids", ("scheduler_output",), source=(
            # the custom_class branch: what _AdaptiveProposer.propose is given
            "self.drafter).propose(sampled_token_ids,self.input_batch.num_tokens_no_spec,"
            "self.input_batch.token_ids_cpu,",)),
        TouchPoint(RUNNER + ".take_draft_token_ids"),
        TouchPoint("vllm.v1.worker.gpu_input_batch:InputBatch",
                   fields=("req_ids", "num_tokens_no_spec", "token_ids_cpu")),
        TouchPoint("vllm.v1.spec_decode.custom_class_proposer:create_custom_proposer",
                   ("vllm_config",), source=("user_class(vllm_config)",)),
    ),
    # router.py, in the API server, only with the policy's latency_critical_engines
    "router": (
        TouchPoint("vllm.engine.arg_utils:EngineArgs.create_engine_config"),
        TouchPoint("vllm.v1.engine.core_client:DPLBAsyncMPClient",
                   fields=("lb_engines", "engine_inflight", "core_engines", "client_count",
                           "reqs_in_flight")),
        TouchPoint("vllm.v1.engine.core_client:DPLBAsyncMPClient.get_core_engine_for_request",
                   ("request",), source=("eng_index:=request.data_parallel_rank",)),
        TouchPoint("vllm.v1.engine:EngineCoreRequest",
                   fields=("request_id", "sampling_params", "priority", "data_parallel_rank")),
        TouchPoint("vllm.config:ParallelConfig", fields=("data_parallel_size",)),
    ),
    "sampler": (
        TouchPoint("vllm.v1.sample.rejection_sampler:expand_batch_to_tokens",
                   ("x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to")),
        TouchPoint("vllm.v1.sample.rejection_sampler:rejection_sample"),
    ),
}


def _resolve(target: str) -> object:
    module, _, qualname = target.partition(":")
    obj: object = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _has_field(cls: type, name: str) -> bool:
    if dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}:
        return True
    if hasattr(cls, name) or any(name in getattr(c, "__annotations__", {}) for c in cls.__mro__):
        return True
    # set in __init__ (vLLM's Request, Scheduler and model runner are plain classes)
    for c in cls.__mro__:
        init = c.__dict__.get("__init__")
        if init is not None:
            try:
                source = inspect.getsource(init)
            except (OSError, TypeError):
                continue
            if f"self.{name} =" in source or f"self.{name}:" in source:
                return True
    return False


def probe(*groups: str) -> list[str]:
    """What is missing in these groups (all when none named), one line each; empty: all there."""
    missing = []
    for p in (p for g in (groups or tuple(TOUCH_POINTS)) for p in TOUCH_POINTS[g]):
        try:
            obj = _resolve(p.target)
        except (ImportError, AttributeError) as e:
            missing.append(f"{p.target} ({type(e).__name__}: {e})")
            continue
        if p.params:
            try:
                have = set(inspect.signature(obj).parameters)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                have = set()
            lost = [x for x in p.params if x not in have]
            if lost:
                missing.append(f"{p.target}: no parameter {', '.join(lost)}")
        if p.fields:
            lost = [f for f in p.fields if not (isinstance(obj, type) and _has_field(obj, f))]
            if lost:
                missing.append(f"{p.target}: no attribute {', '.join(lost)}")
        if p.source:
            try:
                # vLLM's own code, under the plugin's wrappers once they are installed
                text = inspect.getsource(inspect.unwrap(  # type: ignore[arg-type]
                    obj.fget if isinstance(obj, property) else obj))
            except (OSError, TypeError):
                text = ""
            missing += source_lost(p, text)
    return missing


def squeeze(text: str) -> str:
    """Code with all whitespace removed: how `source` patterns are compared."""
    return "".join(text.split())


def source_lost(point: TouchPoint, text: str) -> list[str]:
    """One line per `source` pattern of `point` that `text` (its code) does not contain."""
    code = squeeze(text)
    return [f"{point.target}: its code no longer contains `{pattern}`"
            for pattern in point.source if squeeze(pattern) not in code]


def check(*groups: str) -> None:
    """Refuse to start, naming what is missing, when vLLM lacks a name adaptspec touches."""
    missing = probe(*groups)
    if missing:
        raise UnsupportedVLLMVersion(
            "adaptspec cannot run on this vLLM: it hooks or reads names this version does not "
            "have:\n  " + "\n  ".join(missing) + f"\nSupported vLLM versions: "
            f"{', '.join(SUPPORTED)} (ADAPTSPEC_ALLOW_ANY_VLLM=1 skips the version check, "
            "never this one).")
