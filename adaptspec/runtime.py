"""What an engine integration drives once per step: classes, the controller, snapshots, faults.

The engine plugin stays thin: it tells the runtime when a request arrives (`admit`), what each
step's verification did (`step`) and when a request leaves (`finish`); it reads back the plan
(`plan_for`: K, proposer and reason per request, all decided by `Controller.plan`).
Everything here is engine-agnostic and never raises into the engine: a fault gives every
request the policy's fallback K, is logged and counted (the controller's one error count).
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
from adaptspec.plan import StepFeedback, StepPlan
from adaptspec.policy import Policy

log = logging.getLogger(__name__)


class AdaptiveRuntime:
    """Per-engine state around one Controller.

    Attributes: policy, k_cap (the engine's num_speculative_tokens), proposers (names of the
    engine's proposers, in the order the engine indexes them), controller, classifier, metrics,
    classes (request id -> class name), last_plan (the plan of the last step).
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
        # The controller records each step's metrics through a guard, so a failing registry is
        # counted in adaptspec_controller_errors_total like any other fault.
        guarded = None if metrics is None else _MetricsGuard(metrics, self._count_error)
        self.controller = Controller(policy, metrics=guarded, seed=seed, proposers=proposers,
                                     k_cap=self.k_cap, payoff_guard=True)
        self.proposers = self.controller.proposers
        self.guard = self.controller.guard
        self.classes: dict[str, str] = {}
        self.last_plan: StepPlan | None = None
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

    @property
    def errors(self) -> int:
        """Faults absorbed on this engine (the controller's count: one for the engine)."""
        return self.controller.errors

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
        self.controller.admit(req_id, cls)
        return cls

    def finish(self, req_id: str) -> None:
        self.classes.pop(req_id, None)
        try:
            self.controller.remove_request(req_id)
        except Exception:
            self._count_error()
            log.exception("adaptspec: removing request failed")

    # ---------------------------------------------------------------- the step

    def step(self, req_ids: Sequence[str], drafted: Sequence[int], accepted: Sequence[int],
             step_time_s: float | None, sources: Sequence[int] | None = None,
             missed: Sequence[bool] | None = None) -> dict[str, int]:
        """Feed back one engine step (see plan.StepFeedback); returns the K each of these
        requests gets next (the whole plan: `last_plan`, `plan_for`)."""
        if not req_ids:
            return {}
        self.last_plan = self.controller.plan(
            StepFeedback(req_ids, drafted, accepted, step_time_s, sources, missed))
        return self.last_plan.k_map()

    def plan_for(self, req_ids: Sequence[str]) -> StepPlan:
        """The plan in force for these requests (Controller.plan_for)."""
        return self.controller.plan_for(req_ids)

    def k_for(self, req_id: str) -> int:
        """A request's K in the plan in force."""
        return int(self.plan_for([req_id]).k[0])

    def proposer_for(self, req_id: str) -> int:
        """Index of the proposer to draft a request's next step, in the plan in force."""
        return int(self.plan_for([req_id]).proposer[0])

    def draft_bounds(self, plan: StepPlan) -> list[int]:
        """Per request of `plan`, the longest draft `cut` may keep (Controller.draft_bounds);
        a fault gives the plan's K."""
        try:
            return [int(k) for k in self.controller.draft_bounds(plan).tolist()]
        except Exception:
            self._count_error()
            log.exception("adaptspec: draft bounds failed; the plan's K bounds the drafts")
            return [int(k) for k in plan.k.tolist()]

    def keep_drafts(self, req_ids: Sequence[str], lengths: Sequence[int],
                    confidence: Sequence[float]) -> list[int]:
        """How many tokens of each draft as proposed the next step verifies: `lengths` (0:
        none came) cut to each request's bound in the plan in force (`draft_bounds`: a learned
        K was chosen as if every request drafted, and the drafts now show which came), then
        the drafts that remain trimmed to the step shape that pays (`cut`, with each
        request's planned K). `confidence`: each draft's own (NaN: none given)."""
        plan = self.plan_for(req_ids)
        keep = [min(int(n), b) for n, b in zip(lengths, self.draft_bounds(plan), strict=True)]
        came = [i for i, k in enumerate(keep) if k]
        if came:
            cut = self.cut([req_ids[i] for i in came], [keep[i] for i in came],
                           [confidence[i] for i in came], [int(plan.k[i]) for i in came])
            for i, k in zip(came, cut, strict=True):
                keep[i] = min(keep[i], k)
        return keep

    def cut(self, req_ids: Sequence[str], lengths: Sequence[int],
            confidence: Sequence[float], planned: Sequence[int] | None = None) -> list[int]:
        """Draft lengths after weighing each draft's own confidence (NaN: none given) and
        trimming the step to the shape that pays (see Controller.cut). `planned`: each
        request's K in the plan, where `lengths` may run past it (`draft_bounds`).

        Only ever shortens; a fault keeps the drafts as they are, cut to the K planned."""
        out = [int(x) for x in lengths]
        if planned is not None:
            planned = [int(k) for k in planned]
        if not req_ids:
            return out
        try:
            slots = [self.controller.slot(r) for r in req_ids]
            known = [i for i, s in enumerate(slots) if s is not None]
            if known:
                ks = self.controller.cut(
                    np.array([slots[i] for i in known], dtype=np.int64),
                    np.array([out[i] for i in known], dtype=np.int64),
                    np.array([confidence[i] for i in known], dtype=np.float64),
                    None if planned is None else np.array([planned[i] for i in known],
                                                          dtype=np.int64))
                for i, k in zip(known, ks.tolist(), strict=True):
                    out[i] = max(0, min(out[i], int(k)))
        except Exception:
            self._count_error()
            log.exception("adaptspec: confidence cut failed; drafts kept as planned")
            if planned is None:
                return [int(x) for x in lengths]
            return [min(int(x), k) for x, k in zip(lengths, planned, strict=True)]
        if self.metrics is not None:
            arrived: dict[str, int] = {}
            removed: dict[str, int] = {}
            trimmed: dict[str, int] = {}
            # (NaN or confidence_weight 0: no confidence, as Controller.cut reads it; trimmed
            # all the same)
            given = ~np.isnan(np.asarray(confidence, dtype=np.float64)) & (
                self.policy.confidence_weight > 0)
            for i in known:
                c = self.classes.get(req_ids[i], self.policy.default_class)
                # (what the trim took off the plan's K: tokens past it were never granted)
                granted = int(lengths[i]) if planned is None else min(int(lengths[i]),
                                                                      planned[i])
                dropped = granted - out[i]
                if dropped > 0:
                    trimmed[c] = trimmed.get(c, 0) + dropped
                if given[i]:
                    arrived[c] = arrived.get(c, 0) + 1
                    if dropped > 0:
                        removed[c] = removed.get(c, 0) + dropped
            if arrived or trimmed:
                try:
                    self.metrics.record_confidence_cut(arrived, removed, trimmed)
                except Exception:
                    self._count_error()
                    log.exception("adaptspec: metrics failed")
        return out

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

    def _count_error(self) -> None:
        self.controller.count_error()

    def summary(self) -> dict[str, Any]:
        s = self.controller.summary()
        s["runtime_errors"] = self.errors
        return s

    def state_sizes(self) -> dict[str, int]:
        """How much per-request and per-class state is held (bounded by the policy's caps)."""
        return {"requests": len(self.classes),
                "controller_requests": self.controller.num_requests,
                "controller_new_requests": self.controller.num_new_requests,
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
