"""AdaptiveScheduler: vLLM's Scheduler with the adaptspec controller choosing K per request.

One implementation (`_Adaptive`) over either of vLLM's schedulers: `AdaptiveScheduler` over
`Scheduler` (synchronous scheduling) and `AdaptiveAsyncScheduler` over `AsyncScheduler`
(asynchronous scheduling, vLLM's default on GPUs for EAGLE, MTP, draft_model and ngram_gpu,
which a custom scheduler keeps only by deriving from AsyncScheduler). One engine step, in the
order vLLM's EngineCore calls us (sync scheduling):

1. ``schedule()``: vLLM picks the batch and moves each request's drafts into the step. We
   attach the plan in force (adaptspec/plan.py StepPlan: K, proposer and reason per scheduled
   request) to the SchedulerOutput (``adaptspec_plan``, the one thing the plugin carries to the
   worker): our proposers draft exactly K tokens per request, vLLM's own draft the plan's
   longest K (``num_spec_tokens_to_schedule``).
2. the worker verifies, samples and proposes the next drafts.
3. ``update_from_output()``: per request, drafted = drafts scheduled, accepted = tokens sampled
   minus one (the same arithmetic as vLLM's SpecDecodingStats). With the step time (the
   engine's whole cycle since the last update, adaptspec's own work included) these go to
   the controller, whose ``plan`` is each request's K for the next step.
4. ``update_draft_token_ids()``: the new drafts arrive and are cut to the plan's K (K = 0: plain
   decoding), then trimmed to the step shape that pays, shorter still where the proposer says
   it is unsure of a draft (Controller.cut). This works for every proposer method: ngram,
   draft_model, eagle, suffix, custom_class. Ours give a confidence; for vLLM's n-gram the
   scheduler gives one, from each request's record of its drafts as proposed against the
   tokens that followed (adaptspec/proposers/record.py).

Under async scheduling the drafts stay on the worker and each request holds placeholders
(-1, vLLM's one shared list) for them: ``schedule()`` cuts each request's placeholders to its
K before vLLM schedules the step, which sets how many of its drafts the step verifies (0: plain
decoding), and the batch's draft depth is the plan's longest K as in sync mode. There is no
``update_draft_token_ids`` (no trim and no confidence cut), and the feedback a decision rests
on is a step older: the scheduler deciding step N has seen the outputs of step N - 2.

Speculation on or off, each step also goes to the engine's time account (``account``,
adaptspec/account.py): at the very start of ``schedule()`` and the very end of
``update_from_output()``.

Cutting drafts only ever shortens what is verified, and verification keeps the output
distribution the target's, so the tokens a request gets do not depend on anything here.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from adaptspec_vllm import runner_choice, touchpoints
from adaptspec_vllm.version import check_version

from adaptspec.account import (
    AccountMetrics,
    EngineAccount,
    carries_prefill,
    step_shape,
    verified_drafts,
)
from adaptspec.classify import RequestInfo
from adaptspec.metrics import Metrics
from adaptspec.plan import DRAFT_REPORT_ATTR, DraftReport
from adaptspec.policy import PolicyError, load_policy
from adaptspec.proposers.record import DraftRecords, lookup_prior
from adaptspec.runtime import AdaptiveRuntime
from adaptspec.serve import ASYNC_SCHEDULER_CLS, POLICY_ENV
from vllm.logger import init_logger
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

log = init_logger("vllm.adaptspec")

def policy_source() -> str | None:
    return os.environ.get(POLICY_ENV) or None


class _Adaptive:
    """What adaptspec adds to a vLLM scheduler (a mixin before Scheduler or AsyncScheduler in
    the bases); `runtime` is None when speculation is off (then it is vLLM's own).

    `account` (adaptspec/account.py) partitions the engine's time into categories whether or
    not speculation is on, so a plain server started with this scheduler accounts its time too.
    """

    # (vLLM's scheduler attributes this mixin reads, for the type checker)
    requests: dict[str, Any]
    running: list[Any]

    _accounting = False  # (set by __init__; an instance built otherwise accounts nothing)
    _adapts = True  # False: the engine time account only (AccountScheduler)
    _async = False  # over vLLM's AsyncScheduler (set by __init__)
    _last_update: float | None = None  # when the last update_from_output began
    _busy = False  # requests were left unfinished after the last update
    _records: DraftRecords | None = None  # drafting records of vLLM's n-gram's requests

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        check_version()
        touchpoints.check("scheduler")
        super().__init__(vllm_config, *args, **kwargs)  # type: ignore[call-arg]
        self.runtime: AdaptiveRuntime | None = None
        self._step_start: float | None = None
        # Which proposer drafted each request's pending drafts (a hybrid server's sources).
        self._source: dict[str, int] = {}
        # Requests whose proposer was asked for drafts and found none (for the next feedback).
        self._missed: set[str] = set()
        # The engine's data-parallel index: vLLM runs each non-MoE data-parallel engine core
        # as an engine of one (data_parallel_rank 0, size 1), keeping its index here; it is the
        # `engine` label of vLLM's own series.
        engine = int(vllm_config.parallel_config.data_parallel_index)
        account_metrics = _make_account_metrics(engine)
        self.account = (EngineAccount() if account_metrics is None else
                        EngineAccount(account_metrics.add, account_metrics.add_decode))
        self._accounting = True
        if not self._adapts:
            if vllm_config.scheduler_config.async_scheduling:
                raise RuntimeError("adaptspec: AccountScheduler is vLLM's synchronous "
                                   "scheduler; add --no-async-scheduling")
            log.info("adaptspec: the engine time account only; drafts and K are vLLM's as "
                     "configured")
            return
        spec = vllm_config.speculative_config
        if spec is None or not spec.num_speculative_tokens:
            log.warning("adaptspec: no speculative decoding configured; the scheduler is vLLM's")
            return
        runner_choice.check(vllm_config)
        self._async = isinstance(self, AsyncScheduler)
        if vllm_config.scheduler_config.async_scheduling and not self._async:
            raise RuntimeError(
                "adaptspec: async scheduling is on but the scheduler class is the synchronous "
                f"one; use --scheduler-cls {ASYNC_SCHEDULER_CLS} (the plugin's default under "
                "async scheduling) or --no-async-scheduling")
        from adaptspec.policy import Policy

        source = policy_source()
        try:
            policy = load_policy(source) if source else Policy()
        except PolicyError as e:
            # A bad policy must stop start-up with the message, not serve with a surprise.
            raise RuntimeError(f"adaptspec: {e}") from None
        if policy.k_max < spec.num_speculative_tokens:
            log.info("adaptspec: policy k_max %d caps num_speculative_tokens %d",
                     policy.k_max, spec.num_speculative_tokens)
        metrics = _make_metrics(policy, engine)
        names = vllm_config.model_config.served_model_name
        model = names[0] if isinstance(names, list) else names
        from adaptspec_vllm.proposer import proposer_names

        k_cap = spec.num_speculative_tokens
        if engine in policy.latency_critical_engines:
            # separate queues (adaptspec_vllm.router): the API server sends this engine the
            # latency-critical classes, and it drafts nothing for anyone
            k_cap = 0
            log.info("adaptspec: engine %d is one of latency_critical_engines: it never drafts",
                     engine)
        self.runtime = AdaptiveRuntime(
            policy, k_cap=k_cap, metrics=metrics, model=model,
            proposers=proposer_names(spec), engine=engine,
        )
        if spec.method == "ngram" and not self._async:
            # vLLM's n-gram gives its drafts no confidence; the scheduler sees each draft as
            # proposed and the tokens after it, and keeps the record our n-gram keeps
            # (adaptspec/proposers/record.py), its prior that of vLLM's longest match, the one
            # it tries first. (Under async scheduling the drafts stay on the worker.)
            # (vLLM fills prompt_lookup_max for every n-gram config; touchpoints.py probes it)
            self._records = DraftRecords(lookup_prior(int(spec.prompt_lookup_max)))
        log.info("adaptspec: adaptive K on (policy %s, proposers %s, K <= %d, classes %s)",
                 source or "<built-in default>", "/".join(self.runtime.proposers),
                 self.runtime.k_cap, sorted(policy.classes))
        if self.runtime.restored:
            log.info("adaptspec: restored %d classes from %s", self.runtime.restored,
                     self.runtime.restored_from)

    # ---------------------------------------------------------------- requests

    def add_request(self, request: Any) -> None:
        super().add_request(request)
        rt = self.runtime
        if rt is not None and request.request_id not in rt.classes:
            sp = request.sampling_params
            rt.admit(request.request_id, RequestInfo(
                extra_args=getattr(sp, "extra_args", None) if sp is not None else None,
                priority=int(getattr(request, "priority", 0) or 0),
                model=rt.model,
            ))

    def _free_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        # Private, and no public hook serves: it is the one place every request leaves
        # (finished, aborted, stopped); finish_requests misses requests that end by length or
        # stop string. Probed at start-up (touchpoints.py).
        if self.runtime is not None:
            self.runtime.finish(request.request_id)
            self._source.pop(request.request_id, None)
            if self._records is not None:
                self._records.remove(request.request_id)
        return super()._free_request(request, *args, **kwargs)

    # ---------------------------------------------------------------- the step

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self._account()
        rt = self.runtime
        if rt is not None and self._async:
            self._cut_placeholders(rt)
        out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        if rt is not None:
            self._step_start = time.perf_counter()
        return out

    def _update_after_schedule(self, scheduler_output: Any) -> None:
        # The last thing vLLM's schedule() does, in both its schedulers; under async
        # scheduling AsyncScheduler's makes the next step's draft placeholders from the depth
        # set here, so the plan goes in first.
        rt = self.runtime
        if rt is not None:
            # Every scheduled request's K, a new one's too (its prefill step drafts), from the
            # one owner of K; read by the proposer wrapper on the worker (same process, or
            # pickled with the SchedulerOutput).
            plan = rt.plan_for(list(scheduler_output.num_scheduled_tokens))
            if not self._async:
                # (model-free proposers of ours draft up to the bound; update_draft_token_ids
                # cuts what came to what pays. Under async scheduling nothing is cut.)
                plan.bound = np.asarray(rt.draft_bounds(plan), dtype=np.int64)
            scheduler_output.adaptspec_plan = plan
            # vLLM's own proposers (ngram, draft_model, eagle) draft num_spec_tokens_to_schedule
            # tokens for the whole batch (the field vLLM's batch-size schedule sets): the plan's
            # longest K, so a batch the controller keeps plain pays for no draft passes (a draft
            # model still runs its first pass, which keeps its KV cache in step; vLLM's Dynamic
            # SD relies on the same), never more than vLLM was configured for.
            scheduler_output.num_spec_tokens_to_schedule = min(
                plan.depth(), scheduler_output.num_spec_tokens_to_schedule)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("adaptspec plan: %s", plan.describe(rt.proposers))
        super()._update_after_schedule(scheduler_output)  # type: ignore[misc]

    def _cut_placeholders(self, rt: AdaptiveRuntime) -> None:
        """Async scheduling: each running request's draft placeholders cut to its K in the plan
        in force, so the step verifies that many of the drafts the worker holds. A new list per
        request (vLLM shares one placeholder list among all requests)."""
        waiting = [r for r in self.running if r.spec_token_ids]
        if not waiting:
            return
        plan = rt.plan_for([r.request_id for r in waiting])
        for request, k in zip(waiting, plan.k.tolist(), strict=True):
            if len(request.spec_token_ids) > k:
                request.spec_token_ids = request.spec_token_ids[:k]

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        if self.runtime is None:
            outputs = super().update_from_output(scheduler_output, model_runner_output)
        else:
            outputs = self._update_adaptive(scheduler_output, model_runner_output)
        self._account(scheduler_output)
        return outputs

    def _account(self, scheduler_output: Any = None) -> None:
        """The account's events: a step starts (no output yet) or ends. Whatever goes wrong in
        it is logged once and turns the account off; serving never depends on it."""
        if not self._accounting:
            return
        try:
            if scheduler_output is None:
                self.account.step_started(time.perf_counter())
            else:
                shape = step_shape(scheduler_output)
                self.account.step_ended(time.perf_counter(),
                                        unfinished=self.has_unfinished_requests(), **shape)
        except Exception:
            self._accounting = False
            log.exception("adaptspec: the engine time account failed; it is off from now on")

    def _step_seconds(self) -> float | None:
        """The step's time as the engine spent it: from the previous update to this one (the
        controller's decision, vLLM's bookkeeping, the cut of this step's drafts, the schedule
        and the model: the account's decode step and the time between steps), so that what
        adaptspec itself costs per step is priced and charged like the verify pass. After an
        idle engine, from the end of this step's schedule() only."""
        now = time.perf_counter()
        since_update, self._last_update = self._last_update, now
        if since_update is not None and self._busy:
            return now - since_update
        return None if self._step_start is None else now - self._step_start

    def _update_adaptive(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        rt = self.runtime
        assert rt is not None
        elapsed = self._step_seconds()
        try:
            feedback = _feedback(scheduler_output, model_runner_output, self.requests)
        except Exception:
            log.exception("adaptspec: reading step feedback failed")
            feedback = None
        if feedback is not None:
            req_ids, drafted, accepted, pure_decode = feedback
            sources = missed = None
            if len(rt.proposers) > 1:
                sources = [self._source.get(r, 0) for r in req_ids]
                missed = [r in self._missed for r in req_ids]
            # Before vLLM's own update: that frees the requests this step finished (finish()),
            # and feeding them back afterwards would re-register them with the controller and
            # leave a K entry behind for every request ever served.
            # Steps that also prefilled say little about the verify cost of the decodes.
            rt.step(req_ids, drafted, accepted, elapsed if pure_decode else None, sources,
                    missed)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        rt.maybe_snapshot()
        # (an engine with nothing left idles until the next request: no cycle to time)
        self._busy = self.has_unfinished_requests()
        return outputs

    def update_draft_token_ids(self, draft_token_ids: Any) -> None:
        super().update_draft_token_ids(draft_token_ids)
        rt = self.runtime
        if rt is None:
            return
        report = getattr(draft_token_ids, DRAFT_REPORT_ATTR, None) or DraftReport()
        # (over vLLM's n-gram no report comes with the drafts: this one is made here, and the
        # records below fill it)
        confidence = report.confidence
        # What the next step verifies was drafted by these (a hybrid; else the one proposer).
        sources = report.source
        self._source.update(sources)
        # A proposer that was asked and found nothing failed as surely as a rejected draft:
        # the hybrid learns that too when it chooses who drafts.
        self._missed = {r for r in sources
                        if (req := self.requests.get(r)) is not None and not req.spec_token_ids}
        if report.draft_cost:
            rt.record_draft_cost(*report.draft_cost)
        records = self._records
        req_ids = list(draft_token_ids.req_ids)
        requests = [self.requests.get(r) for r in req_ids]
        lengths = [len(q.spec_token_ids) if q is not None else 0 for q in requests]
        if records is not None:
            for req_id, request, n in zip(req_ids, requests, lengths, strict=True):
                if n:
                    confidence[req_id] = records.confidence(req_id, request.all_token_ids,
                                                            request.spec_token_ids)
        # Each draft as proposed is cut to its bound, then the step to the shape that pays;
        # the proposer's confidence in this very draft (where it gives one) may cut it shorter
        # than the K the controller planned from class and request history
        # (AdaptiveRuntime.keep_drafts).
        keep = rt.keep_drafts(req_ids, lengths,
                              [confidence.get(r, math.nan) for r in req_ids])
        for request, n, k in zip(requests, lengths, keep, strict=True):
            if k < n:
                request.spec_token_ids = request.spec_token_ids[:k]

    def shutdown(self) -> None:
        if self.runtime is not None:
            self.runtime.maybe_snapshot(force=True)
            # What it held at the end (tests/reliability checks these stay within the caps).
            log.info("adaptspec: state at shutdown %s", self.runtime.state_sizes())
        super().shutdown()


class AdaptiveScheduler(_Adaptive, Scheduler):
    """adaptspec over vLLM's synchronous Scheduler."""


class AdaptiveAsyncScheduler(_Adaptive, AsyncScheduler):
    """adaptspec over vLLM's AsyncScheduler (async scheduling)."""


class AccountScheduler(_Adaptive, Scheduler):
    """vLLM's synchronous Scheduler unchanged (its speculative config, static K included, as
    configured), with adaptspec's engine time account: the static arm of an A/B measured by the
    same account and series as the adaptive one."""

    _adapts = False


def _feedback(scheduler_output: Any, model_runner_output: Any, live: Any = None
              ) -> tuple[list[str], list[int], list[int], bool]:
    """Per request that produced tokens this step: drafted and accepted counts.

    `live` (the scheduler's requests): requests no longer in it, or finished, are skipped. vLLM
    processes aborts that arrive while the model runs before this update, so a step's output can
    name requests that are already gone; feeding them back would register them again.
    """
    spec = scheduler_output.scheduled_spec_decode_tokens
    invalid = getattr(scheduler_output, "num_invalid_spec_tokens", None) or {}
    sampled = model_runner_output.sampled_token_ids
    index = model_runner_output.req_id_to_index
    req_ids: list[str] = []
    drafted: list[int] = []
    accepted: list[int] = []
    pure_decode = True
    for req_id, n_tokens in scheduler_output.num_scheduled_tokens.items():
        drafts = spec.get(req_id) or ()
        d = verified_drafts(drafts, invalid.get(req_id, 0))
        if carries_prefill(n_tokens, drafts):
            pure_decode = False
        i = index.get(req_id)
        toks = sampled[i] if sampled and i is not None else None
        if not toks:
            continue  # a prefill chunk that emitted nothing
        if live is not None:
            req = live.get(req_id)
            if req is None or req.is_finished():
                continue  # aborted while the step ran
        req_ids.append(req_id)
        drafted.append(d)
        accepted.append(min(max(len(toks) - 1, 0), d))
    return req_ids, drafted, accepted, pure_decode


# The series of the engine this process built last: a process that builds a second engine (a
# notebook re-creating `LLM`, the tests) gets fresh series for it, as vLLM does for its own:
# the previous engine's are unregistered first.
_process_series: dict[str, Any] = {}


def _fresh_series(kind: str, build: Callable[[], Any]) -> Any:
    """`build()`'s series in place of this process's previous ones of `kind`; a registry failure
    leaves serving on, without them (None)."""
    old = _process_series.pop(kind, None)
    try:
        if old is not None:
            old.unregister()
        _process_series[kind] = series = build()
        return series
    except Exception:
        log.exception("adaptspec: %s series unavailable; serving continues without them", kind)
        return None


def _make_metrics(policy: Any, engine: int = 0) -> Metrics | None:
    """The adaptspec_* series of engine `engine` (its data-parallel index, vLLM's `engine`
    label)."""
    return _fresh_series("controller", lambda: Metrics(policy.max_classes, policy.k_max,
                                                       engine=engine))


def _make_account_metrics(engine: int = 0) -> AccountMetrics | None:
    """The adaptspec_engine_* series of engine `engine`."""
    return _fresh_series("engine account", lambda: AccountMetrics(engine))
