"""The online controller: each engine step, the plan for the next one.

`Controller.plan(feedback) -> StepPlan` is the one place a request's K is decided and bounded
(adaptspec/plan.py: the plan and its reasons). It learns from the step and decides
(learner.py), then applies the bounds in order: the class's k_max, a model proposer's pass
cost, the payoff guard's hold, the engine's cap; a fault anywhere gives the policy's fallback
K, counted once. Requests not fed back yet are planned by the new-request rule.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from adaptspec import plan as why
from adaptspec.learner import Learner
from adaptspec.payoff import PayoffGuard
from adaptspec.plan import StepFeedback, StepPlan
from adaptspec.policy import Policy

log = logging.getLogger(__name__)


class Controller(Learner):
    """Chooses K per request per step. Never raises from `plan` or `step`: faults give the
    fallback K.

    Public attributes, beside the Learner's: k_cap (the engine's num_speculative_tokens), guard
    (the payoff guard, None unless asked for), guard_gates, held (the guard held the last step).
    """

    def __init__(self, policy: Policy, *, metrics: Any = None, seed: int | None = 0,
                 proposers: Sequence[str] = ("ngram",), k_cap: int | None = None,
                 payoff_guard: bool = False) -> None:
        super().__init__(policy, metrics=metrics, seed=seed, proposers=proposers)
        self.k_cap = policy.k_max if k_cap is None else max(0, int(k_cap))
        pay = policy.payoff
        # The guard's account of what speculating steps lost or saved against plain decoding is
        # kept (and exported) whether or not it gates: an operator sees what speculation does
        # on this engine before turning the gate on. Off, it never holds a step.
        self.guard = (PayoffGuard(pay.budget, pay.cap_steps, pay.refresh_steps)
                      if payoff_guard else None)
        self.guard_gates = payoff_guard and pay.enabled
        self.held = False  # the guard held the last step plain: so are new requests
        # Admitted, not yet fed back: request -> (class name, first proposer)
        self._new: dict[str, tuple[str, int]] = {}
        # Per class name: the longest K its requests got at the class's last decision, what a
        # new request of the class is planned with until its own first feedback (see plan_for).
        self.class_k: dict[str, int] = {}

    def admit(self, req_id: str, class_name: str) -> None:
        """A new request of a class: until its first feedback it is planned by the new-request
        rule (`plan_for`), drafted by the proposer chosen for it here."""
        if req_id not in self._slot_of:
            self._new[req_id] = (class_name, self.first_proposer(class_name))

    @property
    def num_new_requests(self) -> int:
        """Admitted requests not fed back yet (bounded by the engine's waiting queue)."""
        return len(self._new)

    def remove_request(self, req_id: str) -> None:
        self._new.pop(req_id, None)
        super().remove_request(req_id)

    # ------------------------------------------------------------------ the plan

    def plan_for(self, req_ids: Sequence[str]) -> StepPlan:
        """The plan in force for these requests: the one made at each request's last step, or
        for a request not fed back yet the new-request rule (its class's k_max: the step that
        prefills it proposes its first drafts; 0 for a latency-critical class, and while the
        payoff guard holds)."""
        n = len(req_ids)
        k = np.zeros(n, dtype=np.int64)
        prop = np.zeros(n, dtype=np.int64)
        reason = np.zeros(n, dtype=np.int64)
        for i, r in enumerate(req_ids):
            slot = self._slot_of.get(r)
            if slot is not None:
                k[i], prop[i], reason[i] = self.req_k[slot], self.req_proposer[slot], \
                    self.req_reason[slot]
            else:
                name, prop[i] = self._new.get(r, (self.policy.default_class, 0))
                k[i], reason[i] = self._new_plan(name)
        return StepPlan(list(req_ids), k, prop, reason)

    def draft_bounds(self, plan: StepPlan) -> np.ndarray:
        """Per request of `plan`, the longest draft its step may verify once the drafts are
        seen (synchronous scheduling, before `cut`). A K the decision learned (exploring
        included) was chosen as if every request drafted its K; the drafts as proposed show
        which have nothing (no match), so such a request's bound is its class's, and `cut`
        spends on the drafts that came what the step's shape says pays. A K that a bound or a
        hold set (class cap, latency-critical, guard, engine cap, pass cost, fallback, a new
        request, a cost probe) stays the bound."""
        out = plan.k.copy()
        free = np.flatnonzero((plan.reason == why.CODE[why.LEARNED])
                              | (plan.reason == why.CODE[why.EXPLORING]))
        if free.size:
            # (a learned K was decided at a feedback, so its request has a slot; the class's
            # k_max as `_class_bound` reads it, vectorised: this runs twice an engine step)
            slots = np.fromiter((self._slot_of[plan.req_ids[i]] for i in free.tolist()),
                                dtype=np.int64, count=free.size)
            bound = np.minimum(self.cls_k_max[self.req_class[slots]], self.k_cap)
            out[free] = np.maximum(out[free], bound)
        return out

    def plan(self, fb: StepFeedback) -> StepPlan:
        """Feed back one engine step; the plan for these requests' next step. Every bound on K
        applies here, in order: the decision (learned or exploring; latency-critical classes
        never draft), the class's k_max, a model proposer's pass cost, the payoff guard's hold,
        the engine's cap; a fault gives the fallback."""
        ids = list(fb.req_ids)
        try:
            slots = np.fromiter((self._enter(r) for r in ids), dtype=np.int64, count=len(ids))
        except Exception:
            self._fault("registering the step's requests failed")
            names = [self._class_name_of(r) for r in ids]
            k = np.array([self.fallback_k(c) for c in names], dtype=np.int64)
            plan = StepPlan(ids, k, np.zeros(len(ids)), np.full(len(ids), why.CODE[why.FALLBACK]))
            self._metrics("record_fallback", names, fb.drafted, fb.accepted)
            return plan
        allow = self._guard(slots, fb.drafted, fb.accepted, fb.step_time_s)
        self.held = not allow
        ks, props, reasons = self._decide(slots, fb.drafted, fb.accepted, fb.step_time_s,
                                          allow, fb.sources, fb.missed)
        return StepPlan(ids, ks, props, reasons)

    def step(self, slots: np.ndarray, drafted: np.ndarray, accepted: np.ndarray,
             step_time_s: float | None, allow_speculation: bool = True,
             sources: np.ndarray | None = None, missed: np.ndarray | None = None
             ) -> np.ndarray:
        """`plan` for callers that hold slots (`add_request`): K per request for the next step;
        the proposer to draft it is in req_proposer[slots], the reason in req_reason[slots].
        `allow_speculation` False holds every K at 0 (the guard's hold)."""
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        return self._decide(slots, drafted, accepted, step_time_s, allow_speculation, sources,
                            missed)[0]

    def _enter(self, req_id: str) -> int:
        """A request's slot; its first feedback registers it with what `admit` chose."""
        slot = self._slot_of.get(req_id)
        if slot is not None:
            return slot
        name, prop = self._new.pop(req_id, (self.policy.default_class, 0))
        slot = self.add_request(req_id, name)
        # What its prefill step proposed (the step-time model subtracts a model's passes).
        self.req_proposer[slot] = prop
        self.req_k[slot], self.req_reason[slot] = self._new_plan(name)
        return slot

    def _new_plan(self, class_name: str) -> tuple[int, int]:
        """K and reason of a request not fed back yet (see plan_for)."""
        k, reason = self._new_request_k(class_name)
        if self.held and reason == why.CODE[why.NEW_REQUEST]:
            return 0, why.CODE[why.GUARD_HOLD]
        return k, reason

    def _decide(self, slots: np.ndarray, drafted: Any, accepted: Any, step_time_s: float | None,
                allow: bool, sources: Any, missed: Any
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Learn from the step, then K, proposer and reason per request (see `plan`)."""
        drafted = np.ascontiguousarray(drafted, dtype=np.int64)
        accepted = np.ascontiguousarray(accepted, dtype=np.int64)
        src = None
        try:
            src = (np.zeros(slots.shape, dtype=np.int64) if sources is None
                   else np.clip(np.ascontiguousarray(sources, dtype=np.int64), 0,
                                self.n_prop - 1))
            learned = drafted
            if missed is not None and self.n_prop > 1:
                # Asked and found nothing: for learning, a draft rejected at its first position
                # (the metrics and the step-time model see what was verified).
                learned = np.where(np.asarray(missed, dtype=bool) & (drafted == 0), 1, drafted)
            ks, reasons = self._step(slots, learned, accepted, step_time_s, src, drafted)
            self._note_class_k(slots, ks)  # (what was decided, before a guard's hold)
            if allow and self._latency_hold(slots, ks):
                allow, self.held = False, True  # (new requests plain too, as on a guard hold)
            if not allow:
                reasons = np.where(ks > 0, why.CODE[why.GUARD_HOLD], reasons)
                ks = np.zeros_like(ks)
            over = ks > self.k_cap
            if over.any():
                reasons = np.where(over, why.CODE[why.ENGINE_CAP], reasons)
                ks = np.minimum(ks, self.k_cap)
            self.req_k[slots], self.req_reason[slots] = ks, reasons
        except Exception:  # never let a controller fault reach the engine
            self._fault("controller step failed")
            ks, reasons = self._fallback(slots)
        self._metrics("record_step", self, slots, drafted, accepted, ks, reasons, src)
        return ks, self.req_proposer[slots].copy(), reasons

    def _guard(self, slots: np.ndarray, drafted: Any, accepted: Any,
               step_time_s: float | None) -> bool:
        """Feed the payoff guard this step; may the next one speculate?"""
        guard = self.guard
        if guard is None:
            return True
        try:
            # Gating, a step speculated if it verified drafts or its proposer ran with K > 0
            # (the plan of last step; a new request's first drafts are not counted, as before
            # the plan): either costs time whatever was accepted. Not gating, the
            # guard forces no plain steps to measure, so steps that only proposed are its
            # plain samples (a model-free proposer's run costs well under 1% of a step).
            ran = self.req_k[slots] * (self.req_reason[slots] != why.CODE[why.NEW_REQUEST])
            speculated = bool(np.any(drafted)) or (self.guard_gates and bool(ran.any()))
            allow, hold, loss = guard.step(
                len(slots), speculated, int(np.sum(accepted)),
                None if step_time_s is None else step_time_s * 1e3,
                bool((self.cls_kind[self.req_class[slots]] > 1).any()),
                self.step_slack, self.guard_gates, int(np.sum(drafted)))
        except Exception:
            self._fault("payoff guard failed")
            return True
        self._metrics("record_payoff", hold, loss, guard.account_ms if self.guard_gates else None)
        return allow

    def _latency_hold(self, slots: np.ndarray, ks: np.ndarray) -> bool:
        """Beside a latency-critical request, do steps like the plan (about this batch, at
        most its draft tokens) measure slower than that request allows (latency_burst, the
        most one step may take over plain)? Then the plan is held plain, whatever the cost
        model priced it at: measurements decide where the model may be wrong."""
        guard = self.guard
        if guard is None or not ks.any() or not (self.cls_kind[self.req_class[slots]] > 1).any():
            return False
        try:
            slow = guard.drafts_slow_steps(self.latency_burst, len(slots), int(ks.sum()))
        except Exception:
            self._fault("payoff guard failed")
            return False
        if slow:
            self._metrics("record_payoff", "latency", None, None)
        return slow

    def plain_reference_ms(self, n: int) -> float:
        """The plain steps of about `n` requests this engine measured (the guard's estimate),
        else the step-time model's: a latency budget is spent in measured time, so that a cost
        model that prices drafts too low (or one fixed by the policy) cannot overspend it."""
        measured = self.guard.plain_estimate(n) if self.guard is not None else None
        return measured if measured else super().plain_reference_ms(n)

    def fallback_k(self, class_name: str) -> int:
        """The policy's fallback K for a class: within its k_max (0 for a latency-critical
        class: that promise does not depend on the model) and the engine's cap."""
        bound = self._class_bound(class_name)
        return 0 if bound is None else min(self.policy.fallback_k, bound)

    def _class_bound(self, class_name: str) -> int | None:
        """The longest K a class may draft on this engine (its k_max within the engine's cap);
        None for a latency-critical class, which never drafts."""
        p = self.policy
        settings = class_name if class_name in p.classes else p.default_class
        if p.classes[settings].latency_critical:
            return None
        return min(p.class_k_max(settings), self.k_cap)

    def _note_class_k(self, slots: np.ndarray, ks: np.ndarray) -> None:
        cls = self.req_class[slots]
        longest = np.full(len(self.class_names), -1, dtype=np.int64)
        np.maximum.at(longest, cls, ks)
        for c in np.flatnonzero(longest >= 0).tolist():
            self.class_k[self.class_names[c]] = int(longest[c])

    def _new_request_k(self, class_name: str) -> tuple[int, int]:
        """K and reason code of a request not decided yet: what its class's requests got at the
        class's last decision, or before any its k_max, within the cap. A request is planned so
        for the step that prefills it (which proposes its first drafts), and under async
        scheduling also for its first decode, scheduled before the prefill's feedback: drafting
        the class's k_max there would cost what the class's decisions had stopped paying."""
        k = self._class_bound(class_name)
        if k is None:
            return 0, why.CODE[why.LATENCY_CRITICAL]
        return min(k, self.class_k.get(class_name, k)), why.CODE[why.NEW_REQUEST]

    def _class_name_of(self, req_id: str) -> str:
        slot = self._slot_of.get(req_id)
        if slot is not None:
            return self.class_names[self.req_class[slot]]
        return self._new.get(req_id, (self.policy.default_class, 0))[0]

    def _fallback(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        try:
            ks = np.array([self.fallback_k(self._class_name_of(self.req_id_of[s]))
                           for s in slots.tolist()], dtype=np.int64)
            self.req_proposer[slots] = 0
            self.req_k[slots], self.req_reason[slots] = ks, why.CODE[why.FALLBACK]
        except Exception:
            ks = np.zeros(np.size(slots), dtype=np.int64)
        return ks, np.full(ks.shape, why.CODE[why.FALLBACK], dtype=np.int64)

    def count_error(self) -> None:
        """One fault absorbed: the engine's one error count, and its metric."""
        self.errors += 1
        if self.metrics is not None:
            try:
                self.metrics.record_error()
            except Exception:
                log.exception("adaptspec: metrics failed")

    def _fault(self, what: str) -> None:
        self.count_error()
        log.exception("adaptspec: %s; using the fallback K", what)

    def _metrics(self, method: str, *args: Any) -> None:
        if self.metrics is None:
            return
        try:
            getattr(self.metrics, method)(*args)
        except Exception:
            self.count_error()
            log.exception("adaptspec: metrics failed; serving continues")
