"""What an engine integration drives once per step: classes, the controller, snapshots, faults.

The engine plugin stays thin: it tells the runtime when a request arrives (`admit`), what each
step's verification did (`step`) and when a request leaves (`finish`); it reads back K per
request (`k_for`, `k_to_propose`). Everything here is engine-agnostic and never raises into the
engine: a fault gives every request the policy's fallback K, is logged and counted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from adaptspec import snapshot
from adaptspec.classify import Classifier, RequestInfo
from adaptspec.controller import Controller
from adaptspec.metrics import Metrics
from adaptspec.payoff import PayoffGuard
from adaptspec.policy import Policy

log = logging.getLogger(__name__)


class AdaptiveRuntime:
    """Per-engine state around one Controller.

    Attributes: policy, k_cap (the engine's num_speculative_tokens), proposers (names of the
    engine's proposers, in the order the engine indexes them), controller, classifier, metrics,
    classes (request id -> class name), errors (faults absorbed here).
    """

    def __init__(self, policy: Policy, *, k_cap: int, metrics: Metrics | None = None,
                 model: str | None = None, seed: int | None = 0,
                 proposers: Sequence[str] = ("ngram",), engine: int = 0) -> None:
        self.policy = policy
        # One engine of a data-parallel server (`engine`: its index): its own state file.
        self.state_file = snapshot.engine_path(policy.state_file, engine)
        self.k_cap = max(0, int(k_cap))
        self.model = model
        self.metrics = metrics
        self.classifier = Classifier(policy)
        self.errors = 0
        # The controller records each step's metrics through a guard, so a failing registry is
        # counted in adaptspec_controller_errors_total like any other fault.
        guarded = None if metrics is None else _MetricsGuard(metrics, self._count_error)
        self.controller = Controller(policy, metrics=guarded, seed=seed, proposers=proposers)
        self.proposers = self.controller.proposers
        self.fallback_k = min(policy.fallback_k, self.k_cap)
        pay = policy.payoff
        # The guard's account of what speculating steps lost or saved against plain decoding is
        # kept (and exported) whether or not it gates: an operator sees what speculation does on
        # this engine before turning the gate on. Off, it never holds a step.
        self.guard = PayoffGuard(pay.budget, pay.cap_steps, pay.refresh_steps)
        self.guard_gates = pay.enabled
        self.classes: dict[str, str] = {}
        self._k: dict[str, int] = {}
        self._p: dict[str, int] = {}  # proposer per request, with more than one proposer
        self._last_snapshot = time.monotonic()
        # What start-up restored (classes, and from which file): the engine logs it.
        self.restored, self.restored_from = 0, None
        for path in (self.state_file, policy.warm_start):
            if not path or self.restored:
                continue
            try:
                self.restored = snapshot.load(self.controller, path)
                if self.restored:
                    self.restored_from = str(path)
            except (snapshot.SnapshotError, OSError) as e:
                self._count_error()
                log.warning("adaptspec: ignoring state snapshot (%s); starting from priors", e)

    # ---------------------------------------------------------------- requests

    def admit(self, req_id: str, info: RequestInfo) -> str:
        """Classify a new request; returns its class name."""
        try:
            cls = self.classifier.classify(info)
        except Exception:
            self._count_error()
            log.exception("adaptspec: classifying request failed; using the default class")
            cls = self.policy.default_class
        self.classes[req_id] = cls
        if len(self.proposers) > 1:
            self._p[req_id] = self.controller.first_proposer(cls)
        return cls

    def finish(self, req_id: str) -> None:
        self.classes.pop(req_id, None)
        self._k.pop(req_id, None)
        self._p.pop(req_id, None)
        try:
            self.controller.remove_request(req_id)
        except Exception:
            self._count_error()
            log.exception("adaptspec: removing request failed")

    # ---------------------------------------------------------------- the step

    def step(self, req_ids: Sequence[str], drafted: Sequence[int], accepted: Sequence[int],
             step_time_s: float | None, sources: Sequence[int] | None = None,
             missed: Sequence[bool] | None = None) -> dict[str, int]:
        """Feed back one engine step; returns the K each of these requests gets next (and
        `proposer_for` who drafts it). `sources`: the proposer (index into `proposers`) whose
        drafts each request verified; None: the first. `missed`: whose proposer was asked for
        drafts and found none."""
        if not req_ids:
            return {}
        props = None
        try:
            classes = [self.classes.get(r, self.policy.default_class) for r in req_ids]
            allow = self._payoff(req_ids, classes, drafted, accepted, step_time_s)
            ks, props = self.controller.step_by_id(
                list(req_ids), classes, np.asarray(drafted, dtype=np.int64),
                np.asarray(accepted, dtype=np.int64), step_time_s, allow_speculation=allow,
                sources=None if sources is None else np.asarray(sources, dtype=np.int64),
                missed=None if missed is None else np.asarray(missed, dtype=bool),
            )
            ks = np.minimum(ks, self.k_cap).tolist()
            props = props.tolist()
        except Exception:
            self._count_error()
            log.exception("adaptspec: controller step failed; using fallback K=%d", self.fallback_k)
            ks = [self._fallback_for(r) for r in req_ids]
            props = None
            self._record_fallback(req_ids, drafted, accepted, sources)
        decided = {r: int(k) for r, k in zip(req_ids, ks, strict=True)}
        self._k.update(decided)
        if len(self.proposers) > 1:
            self._p.update(zip(req_ids, props or [0] * len(req_ids), strict=True))
        return decided

    def _payoff(self, req_ids: Sequence[str], classes: Sequence[str], drafted: Sequence[int],
                accepted: Sequence[int], step_time_s: float | None) -> bool:
        """Feed the payoff guard this step; may the next one speculate?"""
        guard = self.guard
        # Gating, a step speculated if it verified drafts or its proposer ran with K > 0 (the
        # K decided last step): either costs time whatever was accepted. Not gating, the guard
        # forces no plain steps to measure, so steps that only proposed are its plain samples
        # (a model-free proposer's run costs well under 1% of a step; a draft model's passes in
        # such steps are then not charged).
        speculated = any(drafted) or (self.guard_gates
                                      and any(self._k.get(r, 0) for r in req_ids))
        lc = any(self._latency_critical(c) for c in set(classes))
        loss = guard.observe(len(req_ids), speculated, int(sum(accepted)),
                             None if step_time_s is None else step_time_s * 1e3,
                             latency_critical=lc, slack=self.policy.latency_critical_slack)
        allow = guard.allow(len(req_ids)) if self.guard_gates else True
        hold = guard.last_hold if self.guard_gates else None
        if allow and lc and guard.drafts_slow_steps(self.policy.latency_critical_slack):
            # The controller's cost model may price a step with drafts within the slack of
            # plain decoding while the engine measures it slower: with a latency-critical
            # request in the batch, measurements decide, whether or not the guard gates.
            allow, hold = False, "latency"
        if self.metrics is not None:
            try:
                self.metrics.record_payoff(hold, loss,
                                           guard.account_ms if self.guard_gates else None)
            except Exception:
                self._count_error()
                log.exception("adaptspec: metrics failed; serving continues")
        return allow

    def cut(self, req_ids: Sequence[str], lengths: Sequence[int],
            confidence: Sequence[float]) -> list[int]:
        """Draft lengths after weighing each draft's own confidence (see Controller.cut).

        Only ever shortens; a fault keeps the drafts as they are (the K already granted)."""
        out = [int(x) for x in lengths]
        if not req_ids:
            return out
        try:
            slots = [self.controller.slot(r) for r in req_ids]
            known = [i for i, s in enumerate(slots) if s is not None]
            if known:
                ks = self.controller.cut(
                    np.array([slots[i] for i in known], dtype=np.int64),
                    np.array([out[i] for i in known], dtype=np.int64),
                    np.array([confidence[i] for i in known], dtype=np.float64))
                for i, k in zip(known, ks.tolist(), strict=True):
                    out[i] = max(0, min(out[i], int(k)))
        except Exception:
            self._count_error()
            log.exception("adaptspec: confidence cut failed; drafts kept as planned")
            return [int(x) for x in lengths]
        if self.metrics is not None:
            removed: dict[str, int] = {}
            for r, before, after in zip(req_ids, lengths, out, strict=True):
                if after < before:
                    c = self.classes.get(r, self.policy.default_class)
                    removed[c] = removed.get(c, 0) + int(before) - after
            if removed:
                try:
                    self.metrics.record_confidence_cut(removed)
                except Exception:
                    self._count_error()
                    log.exception("adaptspec: metrics failed")
        return out

    def k_for(self, req_id: str) -> int:
        """K for a request's next step; one the controller has not seen gets the fallback."""
        k = self._k.get(req_id)
        return self._fallback_for(req_id) if k is None else k

    def k_to_propose(self, req_id: str) -> int:
        """How many tokens a request's proposer may draft this step: its K once decided; before
        that (the step that prefills it proposes its first drafts, which the decision made in
        the same step then cuts) its class's k_max, and 0 for a latency-critical class, whose
        proposer then never runs."""
        k = self._k.get(req_id)
        if k is None:
            k = min(self.k_cap, self.policy.class_k_max(self._settings(req_id)))
        return k

    def record_draft_cost(self, ms: float, passes: int, catchup_tokens: int = 0,
                          forward_passes: int | None = None) -> None:
        """What the draft model ran for the drafts just proposed (a hybrid with a draft model):
        its time, its passes per request (a draft token each: what the controller prices),
        the tokens it caught up on, and its forward passes (batched: fewer; None: `passes`)."""
        try:
            cost = None
            if "draft" in self.proposers:
                p = self.proposers.index("draft")
                self.controller.record_pass_cost(p, ms, passes, catchup_tokens)
                cost = (float(self.controller.pass_ms[p]), float(self.controller.catchup_ms[p]))
            if self.metrics is not None:
                self.metrics.record_draft_model(
                    passes if forward_passes is None else forward_passes, catchup_tokens, cost)
        except Exception:
            self._count_error()
            log.exception("adaptspec: recording the draft model's cost failed")

    def proposer_for(self, req_id: str) -> int:
        """Index of the proposer to draft a request's next step (0 until decided)."""
        return self._p.get(req_id, 0)

    def proposer_map(self) -> dict[str, int]:
        return dict(self._p)

    def _settings(self, req_id: str) -> str:
        """The policy class whose settings a request has: dynamic classes (names the policy
        does not list) and unknown requests have the default class's."""
        cls = self.classes.get(req_id, self.policy.default_class)
        return cls if cls in self.policy.classes else self.policy.default_class

    def _latency_critical(self, cls: str) -> bool:
        p = self.policy
        return p.classes[cls if cls in p.classes else p.default_class].latency_critical

    def _fallback_for(self, req_id: str) -> int:
        # Latency-critical stays at 0 even in a fault (class_k_max is 0 there): that promise
        # does not depend on the model; nor does a class's k_max.
        return min(self.fallback_k, self.policy.class_k_max(self._settings(req_id)))

    # ---------------------------------------------------------------- snapshots and faults

    def maybe_snapshot(self, force: bool = False) -> bool:
        """Write the state file if the policy names one and the interval has passed."""
        path = self.state_file
        if not path:
            return False
        now = time.monotonic()
        if not force and now - self._last_snapshot < self.policy.snapshot_interval_s:
            return False
        self._last_snapshot = now
        try:
            snapshot.save(self.controller, path)
            return True
        except Exception as e:
            self._count_error()
            log.warning("adaptspec: could not write state snapshot %s: %s", path, e)
            return False

    def _record_fallback(self, req_ids: Sequence[str], drafted: Sequence[int],
                         accepted: Sequence[int], sources: Sequence[int] | None = None) -> None:
        if self.metrics is None:
            return
        try:
            self.metrics.record_fallback(
                [self.classes.get(r, self.policy.default_class) for r in req_ids],
                drafted, accepted, self._source_names(sources, len(req_ids)))
        except Exception:
            log.exception("adaptspec: metrics failed")

    def _source_names(self, sources: Sequence[int] | None, n: int) -> list[str]:
        names = self.proposers
        if sources is None:
            return [names[0]] * n
        return [names[min(max(int(s), 0), len(names) - 1)] for s in sources]

    def _count_error(self) -> None:
        self.errors += 1
        if self.metrics is not None:
            try:
                self.metrics.record_error()
            except Exception:
                log.exception("adaptspec: metrics failed")

    def summary(self) -> dict[str, Any]:
        s = self.controller.summary()
        s["runtime_errors"] = self.errors
        return s

    def state_sizes(self) -> dict[str, int]:
        """How much per-request and per-class state is held (bounded by the policy's caps)."""
        return {"requests": len(self.classes), "k_entries": len(self._k),
                "proposer_entries": len(self._p),
                "controller_requests": self.controller.num_requests,
                "controller_classes": len(self.controller.class_names), "errors": self.errors}


class _MetricsGuard:
    """The controller's view of Metrics: a failure while recording a step is logged and counted
    (through the errors counter, which may still work) instead of reaching the controller."""

    def __init__(self, metrics: Metrics, count_error: Any) -> None:
        self._metrics = metrics
        self._count_error = count_error

    def record_step(self, *args: Any, **kwargs: Any) -> None:
        try:
            self._metrics.record_step(*args, **kwargs)
        except Exception:
            self._count_error()
            log.exception("adaptspec: recording metrics failed; serving continues")

    def record_error(self) -> None:
        self._metrics.record_error()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._metrics, name)
