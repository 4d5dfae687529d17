"""custom_class proposers: adaptspec's model-free drafters inside vLLM's model runner.

Use with ``--speculative-config '{"method": "custom_class",
"model": "adaptspec_vllm.proposer.NgramProposer", "num_speculative_tokens": 8}'``
(or ``...proposer.SuffixProposer``, or ``...proposer.HybridProposer``: both, the controller
choosing per request and step which one drafts).

vLLM calls ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)`` with rows of the
input batch but no request ids and no per-request K. One wrapper around the model runner's
``propose_draft_token_ids`` (installed by the first proposer built) records the batch's request
ids and the plan the AdaptiveScheduler attached to the step's SchedulerOutput (StepPlan, the
one thing it carries to the worker); the proposer drafts exactly the plan's K tokens per
request, with the plan's proposer, and nothing at all for K = 0.

What the proposers say of their drafts rides back to the scheduler as one DraftReport on the
DraftTokenIds that ``take_draft_token_ids`` returns (the same object in one process, pickled
with its attributes across a multiprocess executor): each draft's confidence (the scheduler
lets the controller cut a weak draft shorter), which proposer drafted it (the controller
credits what is verified to the proposer that proposed it) and what a draft model ran.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from adaptspec_vllm import touchpoints
from adaptspec_vllm.version import check_version

from adaptspec import proposers as core
from adaptspec.plan import DRAFT_REPORT_ATTR, DraftReport, StepPlan

# The batch's request ids, the plan and the report of the step being drafted, per worker
# thread (vLLM's propose() is given neither ids nor a plan).
_step = threading.local()
# The draft model of the hybrid (a Hugging Face folder sharing the target's tokenizer); set by
# `adaptspec serve --draft`. Read by the scheduler and by the worker, which inherit it.
DRAFT_ENV = "ADAPTSPEC_DRAFT_MODEL"


def _install_runner_hook() -> None:
    # No public hook gives a proposer the batch's request ids or a per-request K: vLLM's
    # custom_class interface passes token rows only. So the model runner's two methods are
    # wrapped (probed at start-up, touchpoints.py).
    touchpoints.check("runner")
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.propose_draft_token_ids
    if getattr(original, "_adaptspec", False):
        return

    def propose_draft_token_ids(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any):
        _step.req_ids = self.input_batch.req_ids
        _step.plan = getattr(scheduler_output, "adaptspec_plan", None)
        _step.report = DraftReport()
        try:
            return original(self, scheduler_output, *args, **kwargs)
        finally:
            # Kept on the runner until take_draft_token_ids hands the drafts to the scheduler.
            self._adaptspec_report = _step.report
            _step.req_ids = _step.plan = _step.report = None

    take = GPUModelRunner.take_draft_token_ids

    def take_draft_token_ids(self: Any, *args: Any, **kwargs: Any):
        out = take(self, *args, **kwargs)
        report = getattr(self, "_adaptspec_report", None)
        self._adaptspec_report = None
        if out is not None and report is not None:
            setattr(out, DRAFT_REPORT_ATTR, report)
        return out

    propose_draft_token_ids._adaptspec = True  # type: ignore[attr-defined]
    propose_draft_token_ids.__wrapped__ = original  # type: ignore[attr-defined]
    take_draft_token_ids.__wrapped__ = take  # type: ignore[attr-defined]
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids  # type: ignore[method-assign]
    GPUModelRunner.take_draft_token_ids = take_draft_token_ids  # type: ignore[method-assign]


class _AdaptiveProposer:
    """Base: maps vLLM's batch rows to request ids and K, and keeps request lifetimes.

    `drafts_to_bound`: a model-free proposer drafts up to the plan's bound (StepPlan.bound_of),
    not its K, since a lookup costs next to nothing and the scheduler cuts what came to what
    pays; one whose drafts cost passes (the hybrid's draft model) drafts its K."""

    drafts_to_bound = False

    def __init__(self, vllm_config: Any) -> None:
        check_version()
        self.k_max = int(vllm_config.speculative_config.num_speculative_tokens)
        self.core = self.make_core()
        self._live: set[str] = set()
        _install_runner_hook()

    def make_core(self) -> core.Proposer:
        raise NotImplementedError

    def draft(self, req_id: str, token_ids: Any, k: int) -> tuple[core.Draft, int]:
        """One request's draft of up to k tokens, and the index of the proposer that made it."""
        return self.core.propose(req_id, token_ids, k), 0

    def draft_many(self, asks: list[tuple[str, Any, int]]) -> list[tuple[core.Draft, int]]:
        """The step's drafts, (req_id, token_ids, k) each: `draft` for each by default."""
        return [self.draft(req_id, token_ids, k) for req_id, token_ids, k in asks]

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Model-free: nothing to load."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: Any,
                token_ids_cpu: Any, *args: Any, **kwargs: Any) -> list[list[int]]:
        req_ids = getattr(_step, "req_ids", None)
        plan: StepPlan | None = getattr(_step, "plan", None)
        if req_ids is None:
            # The runner hook did not run (another vLLM code path): without ids there is no
            # per-request state to keep, so draft nothing rather than guess.
            return [[] for _ in sampled_token_ids]
        report: DraftReport | None = getattr(_step, "report", None)
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        rows, asks = [], []
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled:  # a prefill chunk that produced no token yet
                continue
            req_id = req_ids[i]
            if plan is None:
                k = self.k_max
            elif self.drafts_to_bound:
                k = min(plan.bound_of(req_id, self.k_max), self.k_max)
            else:
                k = min(plan.k_of(req_id, self.k_max), self.k_max)
            if k > 0:
                rows.append(i)
                asks.append((req_id, token_ids_cpu[i, :int(num_tokens_no_spec[i])], k))
        for i, (req_id, _, _), (draft, source) in zip(rows, asks, self.draft_many(asks),
                                                      strict=True):
            drafts[i] = draft.tokens
            if report is not None:
                if draft.tokens:
                    report.confidence[req_id] = draft.confidence
                # (also for an empty draft: the proposer was asked and found nothing)
                report.source[req_id] = source
        self._forget_finished(req_ids)
        return drafts

    def _forget_finished(self, req_ids: list[str]) -> None:
        current = set(req_ids)
        for gone in self._live - current:
            self.core.remove_request(gone)
        self._live = current


class NgramProposer(_AdaptiveProposer):
    """Prompt-lookup drafts from each request's own tokens."""

    drafts_to_bound = True

    def make_core(self) -> core.Proposer:
        return core.NgramProposer()


class SuffixProposer(_AdaptiveProposer):
    """Drafts from the request's own text and from recent outputs of other requests."""

    drafts_to_bound = True

    def make_core(self) -> core.Proposer:
        return core.SuffixProposer()


class HybridProposer(_AdaptiveProposer):
    """The n-gram and suffix proposers in one server, and a draft model when ADAPTSPEC_DRAFT_MODEL
    names one; per request and step the controller says which drafts (the scheduler's
    plan's proposer, an index into ``names``). The others keep their copy of the
    request's tokens (``observe``: the model-free ones append, the draft model does nothing and
    catches up when next asked), so the suffix proposer's corpus gets every output. The draft
    model's time, passes and catch-up tokens ride back with the drafts (DRAFT_COST_ATTR)."""

    NAMES = ("ngram", "suffix")
    DRAFT = "draft"

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return cls.NAMES + ((cls.DRAFT,) if os.environ.get(DRAFT_ENV) else ())

    def make_core(self) -> core.Proposer:
        cores: list[core.Proposer] = [core.NgramProposer(), core.SuffixProposer()]
        path = os.environ.get(DRAFT_ENV)
        if path:
            from adaptspec.proposers.draft_model import DraftModelProposer

            cores.append(DraftModelProposer(path))
        self.cores = tuple(cores)
        return self.cores[0]

    def draft(self, req_id: str, token_ids: Any, k: int) -> tuple[core.Draft, int]:
        return self.draft_many([(req_id, token_ids, k)])[0]

    def draft_many(self, asks: list[tuple[str, Any, int]]) -> list[tuple[core.Draft, int]]:
        """The model-free proposers draft request by request; the draft model drafts all of
        its requests together (DraftModelProposer.propose_batch)."""
        plan: StepPlan | None = getattr(_step, "plan", None)
        out: list[tuple[core.Draft, int]] = [(core.Draft(), 0)] * len(asks)
        model_rows = []
        for i, (req_id, token_ids, k) in enumerate(asks):
            p = min(max(plan.proposer_of(req_id) if plan else 0, 0), len(self.cores) - 1)
            for q, c in enumerate(self.cores):
                if q != p:
                    c.observe(req_id, token_ids)
            if p < len(self.NAMES):
                out[i] = (self.cores[p].propose(req_id, token_ids, k), p)
            else:
                model_rows.append(i)
        if model_rows:
            p, c = len(self.cores) - 1, self.cores[-1]
            before, t0 = (c.passes, c.draft_tokens, c.catchup_tokens), time.perf_counter()
            drafts = c.propose_batch([asks[i] for i in model_rows])
            for i, d in zip(model_rows, drafts, strict=True):
                out[i] = (d, p)
            # (time, draft tokens: what the controller prices, catch-up tokens, forward passes)
            report: DraftReport | None = getattr(_step, "report", None)
            if report is not None:
                report.draft_cost = ((time.perf_counter() - t0) * 1e3, c.draft_tokens - before[1],
                                     c.catchup_tokens - before[2], c.passes - before[0])
        return out

    def _forget_finished(self, req_ids: list[str]) -> None:
        current = set(req_ids)
        for gone in self._live - current:
            for c in self.cores:
                c.remove_request(gone)
        self._live = current


def proposer_names(speculative_config: Any) -> tuple[str, ...]:
    """The proposers a server drafts with, in the order the controller indexes them."""
    method = getattr(speculative_config, "method", None) or "none"
    if method == "custom_class":
        model = str(getattr(speculative_config, "model", "") or "")
        if model.endswith(".HybridProposer"):
            return HybridProposer.names()
        if model.endswith(".SuffixProposer"):
            return ("suffix",)
        return ("ngram",) if model.endswith(".NgramProposer") else ("custom",)
    return (method,)
