"""Separate queues in the API server: latency-critical requests to engines of their own.

With the policy's `latency_critical_engines` set and vLLM's data parallelism (internal load
balancing, `--data-parallel-size N`), each API-server process classifies a request by the
policy's rules (adaptspec.routing.Router) and hands it to the least loaded of the engines its
class may use. The engines named there never draft (AdaptiveScheduler gives them a K cap of 0).

Two of vLLM's methods are wrapped, both in the API-server process:

* ``EngineArgs.create_engine_config``: once the config is built, the split is checked against
  the data-parallel size, so that a bad one stops start-up with the reason (an engine index out
  of range, every engine latency-critical, no data parallelism); with a valid split the
  router is made and the client's hook installed.
* ``DPLBAsyncMPClient.get_core_engine_for_request``: vLLM's own choice, among the engines the
  request may use. A request that names its engine (the ``X-data-parallel-rank`` header) keeps
  it. A fault here is logged once and vLLM's own choice stands: routing never fails a request.
"""

from __future__ import annotations

import os
from typing import Any

from adaptspec_vllm import touchpoints

from adaptspec.policy import PolicyError, load_policy
from adaptspec.routing import Router, least_loaded
from adaptspec.serve import POLICY_ENV
from vllm.logger import init_logger

log = init_logger("vllm.adaptspec")

# This process's router (API server), None without a split.
_router: Router | None = None
_warned = False


def install() -> None:
    """Wrap EngineArgs.create_engine_config (cheap, idempotent; every process)."""
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config
    if getattr(original, "_adaptspec", False):
        return

    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        config = original(self, *args, **kwargs)
        configure(config)
        return config

    create_engine_config._adaptspec = True  # type: ignore[attr-defined]
    create_engine_config.__wrapped__ = original  # type: ignore[attr-defined]
    EngineArgs.create_engine_config = create_engine_config  # type: ignore[method-assign]


def configure(vllm_config: Any) -> Router | None:
    """Check the policy's split against this config and, with a split, route by it. A policy
    that does not load is left to the engine, which refuses it with its message."""
    global _router
    source = os.environ.get(POLICY_ENV)
    if not source:
        return None
    try:
        policy = load_policy(source)
    except PolicyError:
        return None
    if not policy.latency_critical_engines:
        return None
    engines = int(vllm_config.parallel_config.data_parallel_size)
    names = vllm_config.model_config.served_model_name
    try:
        router = Router(policy, engines, names[0] if isinstance(names, list) else names)
    except PolicyError as e:
        raise ValueError(f"adaptspec: {e}") from None
    touchpoints.check("router")
    _install_client_hook()
    _router = router
    log.info("adaptspec: separate queues: latency-critical requests to engines %s, the others "
             "to %s", list(router.split.critical), list(router.split.others))  # type: ignore
    return router


def _install_client_hook() -> None:
    from vllm.v1.engine.core_client import DPLBAsyncMPClient

    original = DPLBAsyncMPClient.get_core_engine_for_request
    if getattr(original, "_adaptspec", False):
        return

    def get_core_engine_for_request(self: Any, request: Any) -> Any:
        if (_router is not None and request.data_parallel_rank is None
                and request.request_id not in self.reqs_in_flight):
            try:
                route(self, request, _router)
            except Exception:
                _warn_once()
        return original(self, request)

    get_core_engine_for_request._adaptspec = True  # type: ignore[attr-defined]
    get_core_engine_for_request.__wrapped__ = original  # type: ignore[attr-defined]
    DPLBAsyncMPClient.get_core_engine_for_request = get_core_engine_for_request  # type: ignore


def route(client: Any, request: Any, router: Router) -> int | None:
    """Name the request's engine (request.data_parallel_rank, which vLLM's choice then keeps):
    the least loaded of those its class may use, by vLLM's own load estimate (the coordinator's
    waiting + running, or this client's in-flight count, whichever is larger)."""
    sp = request.sampling_params
    allowed = router.candidates(getattr(sp, "extra_args", None) if sp is not None else None,
                                int(request.priority or 0))
    if allowed is None:
        return None
    counts = client.lb_engines
    load = [max(client.client_count * client.engine_inflight[client.core_engines[i]],
                counts[i][0] + counts[i][1]) for i in range(len(client.core_engines))]
    start = getattr(client, "_adaptspec_turn", 0)
    client._adaptspec_turn = start + 1
    engine = least_loaded(allowed, load, start)
    # as vLLM counts its own choice until the coordinator's next figures
    counts[engine][0] += client.client_count
    request.data_parallel_rank = engine
    return engine


def _warn_once() -> None:
    global _warned
    if not _warned:
        _warned = True
        log.exception("adaptspec: routing a request failed; vLLM's load balancing chose its "
                      "engine (logged once)")
