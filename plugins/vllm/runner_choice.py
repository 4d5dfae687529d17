"""Which model runner adaptspec runs on: vLLM's choice, checked and logged in the engine core.

vLLM 0.32 and 0.33 have two model runners. `VllmConfig.use_v2_model_runner` (`vllm/config/
vllm.py`, 0.33.0 line 731) returns `VLLM_USE_V2_MODEL_RUNNER` when it is set, else the V2
runner wherever Triton is present (every GPU), unless `_get_v2_model_runner_unsupported_features`
(line 3053) names a feature of the config: methods `suffix` and `custom_class` are among them
(line 3067), so vLLM itself keeps adaptspec's own proposers (custom_class) on V1 and refuses
them on a forced V2 (`_validate_v2_model_runner`, line 3324).

So adaptspec leaves the choice to vLLM. With vLLM's own methods (ngram, draft_model, eagle,
mtp, ngram_gpu) everything adaptspec does is in the scheduler, on either runner: the batch's
draft depth (`num_spec_tokens_to_schedule`, which V2 drafts to: `v1/worker/gpu/model_runner.py`
line 2133) and each request's verify length (its scheduled draft slots, cut to its K; V2's
rejection sampler is ragged over them). On V2 the drafts reach the scheduler as placeholders
(`[-1] * n`), counted as drafts all the same (account.verified_drafts). What needs V1 is
adaptspec's worker side, the wrapper of `GPUModelRunner.propose_draft_token_ids` through which
its custom_class proposers get each request's K and return confidences and sources: `check`
refuses a config that would put those on V2 (vLLM refuses it first; this says why in
adaptspec's terms) and logs the runner and scheduling mode the engine runs in.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger("vllm.adaptspec")

ENV = "VLLM_USE_V2_MODEL_RUNNER"
# Methods whose proposers are adaptspec's own, drafting through the V1 runner's
# propose_draft_token_ids (adaptspec_vllm.proposer).
OWN_WORKER_SIDE = ("custom_class",)
WHY = ("adaptspec's own proposers (custom_class) get each request's K and return their "
       "confidences and sources through the V1 model runner's propose_draft_token_ids")


class V2RunnerRefused(RuntimeError):
    pass


def mode(vllm_config: Any) -> str:
    """The engine's model runner and scheduling mode, in words, for the start-up log."""
    runner = "V2" if getattr(vllm_config, "use_v2_model_runner", False) else "V1"
    sched = ("asynchronous" if vllm_config.scheduler_config.async_scheduling
             else "synchronous")
    spec = vllm_config.speculative_config
    method = getattr(spec, "method", None)
    return f"vLLM's {runner} model runner, {sched} scheduling, method {method}"


def check(vllm_config: Any) -> None:
    """In the engine core, before serving: refuse adaptspec's own proposers on the V2 runner;
    log the runner and scheduling mode vLLM chose."""
    spec = vllm_config.speculative_config
    method = getattr(spec, "method", None)
    if getattr(vllm_config, "use_v2_model_runner", False) and method in OWN_WORKER_SIDE:
        value = os.environ.get(ENV)
        cause = f"{ENV}={value}" if value is not None else \
            f"vLLM's default on this machine ({ENV} unset)"
        raise V2RunnerRefused(
            f"adaptspec's {method} proposers cannot run on vLLM's V2 model runner ({cause}): "
            f"{WHY}. Unset {ENV} or set it to 0 (vLLM's own methods run on either).")
    log.info("adaptspec: %s (vLLM's choice)", mode(vllm_config))
