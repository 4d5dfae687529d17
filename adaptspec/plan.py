"""What one engine step feeds back, and the plan made from it: per request K, who drafts, why.

`Controller.plan(feedback) -> StepPlan` is the one place a request's K is decided and bounded;
the engine plugin carries the plan, and nothing else, from its scheduler to its proposers. Each
request's K comes with the reason that settled it, a bounded label (REASONS) of the
`adaptspec_steps` counter and of the scheduler's DEBUG log line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

# Why a request got its K, in the order of their codes. The bounds apply in this order, each
# overriding what came before where it changes K: learned (or exploring, or cost_probe) ->
# class_cap -> pass_cost -> guard_hold -> engine_cap; latency_critical, fallback and new_request
# are whole decisions of their own.
LEARNED = "learned"              # acceptance and the step-time model chose it (0 included)
EXPLORING = "exploring"          # the same from a Thompson draw of the acceptance
CLASS_CAP = "class_cap"          # the class's k_max kept it from drafting more
LATENCY_CRITICAL = "latency_critical"  # a latency-critical class: never drafts
GUARD_HOLD = "guard_hold"        # the payoff guard (or the latency hold) kept the step plain
PASS_COST = "pass_cost"          # a model proposer's passes cost more than they would give
ENGINE_CAP = "engine_cap"        # the engine's num_speculative_tokens kept it shorter
FALLBACK = "fallback"            # a fault: the policy's fallback_k within the class's k_max
NEW_REQUEST = "new_request"      # not decided yet: its class's k_max (the prefill step drafts)
COST_PROBE = "cost_probe"        # the step-time model said no draft pays; drafted to check it
REASONS = (LEARNED, EXPLORING, CLASS_CAP, LATENCY_CRITICAL, GUARD_HOLD, PASS_COST, ENGINE_CAP,
           FALLBACK, NEW_REQUEST, COST_PROBE)
CODE = {name: i for i, name in enumerate(REASONS)}

# The coarser decision kind of the adaptspec_steps counter's `decision` label.
DECISIONS = ("speculate", "plain", "latency_critical", "fallback")


def decision_kinds(k: np.ndarray, reason: np.ndarray) -> np.ndarray:
    """Decision kind (index into DECISIONS) of each request: speculate where K > 0, except a
    fallback, which is always counted as one."""
    kind = np.where(k > 0, 0, 1)
    kind = np.where(reason == CODE[LATENCY_CRITICAL], 2, kind)
    return np.where(reason == CODE[FALLBACK], 3, kind)


@dataclass
class StepFeedback:
    """What the engine's last step did, per request that produced tokens in it.

    drafted/accepted: draft tokens verified and accepted; step_time_s: the step's wall time
    (None: a step that also prefilled, which says little about the verify cost); sources: the
    proposer (index) whose drafts each request verified (None: the first); missed: requests
    whose proposer was asked for drafts and found none."""

    req_ids: Sequence[str]
    drafted: Sequence[int]
    accepted: Sequence[int]
    step_time_s: float | None = None
    sources: Sequence[int] | None = None
    missed: Sequence[bool] | None = None


@dataclass
class StepPlan:
    """Per request: K (draft tokens to propose and verify), the proposer (index into the
    controller's proposers) and the reason code (index into REASONS). Picklable: the scheduler
    attaches it to vLLM's SchedulerOutput, the worker's proposers read it."""

    req_ids: list[str]
    k: np.ndarray
    proposer: np.ndarray
    reason: np.ndarray
    # The longest draft a model-free proposer may hand in, for the scheduler to cut to what
    # pays once it sees which requests found one (Controller.draft_bounds; synchronous
    # scheduling only); None: K.
    bound: np.ndarray | None = None
    _index: dict[str, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.k = np.asarray(self.k, dtype=np.int64)
        self.proposer = np.asarray(self.proposer, dtype=np.int64)
        self.reason = np.asarray(self.reason, dtype=np.int64)
        if self.bound is not None:
            self.bound = np.maximum(np.asarray(self.bound, dtype=np.int64), self.k)
        self._index = {r: i for i, r in enumerate(self.req_ids)}

    def k_of(self, req_id: str, default: int = 0) -> int:
        i = self._index.get(req_id)
        return default if i is None else int(self.k[i])

    def bound_of(self, req_id: str, default: int = 0) -> int:
        """The longest draft a model-free proposer may hand in for this request (its K where
        no bound is set)."""
        i = self._index.get(req_id)
        if i is None:
            return default
        return int(self.k[i] if self.bound is None else self.bound[i])

    def proposer_of(self, req_id: str) -> int:
        i = self._index.get(req_id)
        return 0 if i is None else int(self.proposer[i])

    def reason_of(self, req_id: str) -> str | None:
        i = self._index.get(req_id)
        return None if i is None else REASONS[int(self.reason[i])]

    def k_map(self) -> dict[str, int]:
        return {r: int(k) for r, k in zip(self.req_ids, self.k.tolist(), strict=True)}

    def depth(self) -> int:
        """Draft tokens per request a batch-wide proposer (vLLM's own) must draft: the
        longest K of the plan, 0 when every request decodes plainly."""
        return int(self.k.max(initial=0))

    def describe(self, proposers: Sequence[str] = ()) -> str:
        """One line per step for the DEBUG log: each request's K, proposer and reason."""
        parts = []
        for r, k, p, why in zip(self.req_ids, self.k.tolist(), self.proposer.tolist(),
                                self.reason.tolist(), strict=True):
            who = f"/{proposers[p]}" if len(proposers) > 1 and 0 <= p < len(proposers) else ""
            parts.append(f"{r}:K={k}{who}({REASONS[why]})")
        return " ".join(parts)


# The attribute of vLLM's DraftTokenIds that carries a DraftReport from the worker back to the
# scheduler (the same object in one process, pickled with its attributes across processes).
DRAFT_REPORT_ATTR = "adaptspec_drafts"


@dataclass
class DraftReport:
    """What the worker's proposers say of the drafts they just made, per request id: each
    draft's confidence (its per-token acceptance as the proposer estimates it), the proposer
    (index) that drafted it, and what a draft model ran for them: (ms, draft-token passes,
    catch-up tokens, forward passes), None without one."""

    confidence: dict[str, float] = field(default_factory=dict)
    source: dict[str, int] = field(default_factory=dict)
    draft_cost: tuple[float, int, int, int] | None = None
