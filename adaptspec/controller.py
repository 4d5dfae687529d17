"""The online controller: each engine step, K per request for the next step.

Data flows one way: the engine reports what the last verification did (drafted k, accepted a,
per request) and how long the step took; the controller updates its acceptance posteriors and
its step-time model, then chooses every request's K jointly, because one request's extra draft
tokens slow the whole batch's step.

The choice: request i with K_i drafts emits E_i(K_i) = 1 + sum_{j<K_i} prod_{l<=j} alpha_il
tokens in expectation. Each extra draft token is an increment prod_{l<=j} alpha_il, and these
shrink along j, so for any total S of draft tokens the best plan takes the S largest increments
across the batch. The controller sorts the increments once, scores every S by
(B + top-S increments) / predicted step time, and keeps the best S that the latency limits allow.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from adaptspec.acceptance import AcceptanceEstimator, RequestAcceptance
from adaptspec.cost import StepCostModel
from adaptspec.policy import OTHER_CLASS, ClassPolicy, Policy

log = logging.getLogger(__name__)

# Decision kinds, in the order of the metric label values.
SPECULATE, PLAIN, LATENCY_CRITICAL, FALLBACK = "speculate", "plain", "latency_critical", "fallback"
# Resolution of the increment values when choosing how many draft tokens the batch gets.
_BINS = 128


class Controller:
    """Chooses K per request per step. Never raises from `step`: faults give the fallback K.

    Public attributes: policy, class_names (index -> name), estimator, requests, cost,
    errors (faults absorbed), last_predicted_ms, last_step_ms.
    """

    def __init__(self, policy: Policy, *, metrics: Any = None, seed: int | None = 0) -> None:
        self.policy = policy
        self.metrics = metrics
        self.rng = np.random.default_rng(seed)
        self.k_max = policy.k_max
        n_cls = policy.max_classes + 1  # +1 for "other"
        self.class_names: list[str] = []
        self._class_index: dict[str, int] = {}
        self._class_last_used = np.zeros(n_cls)
        self._dynamic: set[str] = set()
        self.cls_k_min = np.zeros(n_cls, dtype=np.int64)
        self.cls_k_max = np.zeros(n_cls, dtype=np.int64)
        self.cls_latency_critical = np.zeros(n_cls, dtype=bool)
        self.cls_slo_ms = np.full(n_cls, np.inf)
        # Per class and draft position: may the controller choose it (open) or must it (forced)?
        self.cls_open = np.zeros((n_cls, max(self.k_max, 1)), dtype=np.int64)
        self.cls_forced = np.zeros((n_cls, max(self.k_max, 1)), dtype=bool)
        self.estimator = AcceptanceEstimator(n_cls, self.k_max, policy.forgetting)
        for name in policy.classes:
            self._register_class(name, policy.classes[name])
        self._other = self._register_class(OTHER_CLASS, policy.classes[policy.default_class])

        cap = policy.max_requests
        self.requests = RequestAcceptance(cap, policy.request_forgetting, policy.request_shrinkage)
        self._slot_of: dict[str, int] = {}
        self._free = list(range(cap - 1, -1, -1))
        self.req_class = np.zeros(cap, dtype=np.int64)
        self.req_prev_k = np.zeros(cap, dtype=np.int64)
        self.req_votes = np.zeros(cap, dtype=np.int64)
        self.req_last_step = np.zeros(cap)
        self.req_id_of = [""] * cap

        self.cost = StepCostModel(policy.cost_model)
        self.errors = 0
        self.steps = 0
        self.last_predicted_ms = float("nan")
        self.last_step_ms = float("nan")
        self._cols = np.arange(max(self.k_max, 1))[None, :]

    # ------------------------------------------------------------------ classes and requests

    def _register_class(self, name: str, cfg: ClassPolicy) -> int:
        idx = len(self.class_names)
        self.class_names.append(name)
        self._class_index[name] = idx
        self._configure_class(idx, cfg)
        return idx

    def _configure_class(self, idx: int, cfg: ClassPolicy) -> None:
        p = self.policy
        k_max = 0 if cfg.latency_critical else (p.k_max if cfg.k_max is None else cfg.k_max)
        self.cls_k_max[idx] = k_max
        self.cls_k_min[idx] = min(cfg.k_min, k_max)
        self.cls_latency_critical[idx] = cfg.latency_critical
        self.cls_slo_ms[idx] = cfg.itl_slo_ms if cfg.itl_slo_ms else np.inf
        cols = np.arange(self.cls_open.shape[1])
        self.cls_open[idx] = (cols >= self.cls_k_min[idx]) & (cols < k_max)
        self.cls_forced[idx] = cols < self.cls_k_min[idx]
        p_acc = cfg.prior_acceptance
        vec = p_acc if isinstance(p_acc, list) else [p_acc]
        prior = [vec[min(i, len(vec) - 1)] for i in range(self.estimator.k_max)]
        self.estimator.set_prior(idx, prior, cfg.prior_strength)

    def class_index(self, name: str) -> int:
        """Index of a class; unknown names become dynamic classes (if the policy allows) up to
        max_classes, evicting the least recently used dynamic class, else fold into `other`."""
        idx = self._class_index.get(name)
        if idx is not None:
            return idx
        p = self.policy
        if not p.dynamic_classes:
            return self._class_index[p.default_class]
        cfg = p.classes[p.default_class]
        if len(self.class_names) < len(self.cls_k_max):
            idx = self._register_class(name, cfg)
        elif victims := self._idle_dynamic_classes():
            victim = min(victims, key=lambda n: self._class_last_used[self._class_index[n]])
            idx = self._class_index.pop(victim)
            self._dynamic.discard(victim)
            self.class_names[idx] = name
            self._class_index[name] = idx
            self._configure_class(idx, cfg)
        else:
            return self._other
        self._dynamic.add(name)
        return idx

    def _idle_dynamic_classes(self) -> list[str]:
        """Dynamic classes no live request belongs to: only those may give up their slot, or a
        running request would silently start feeding another tenant's estimates."""
        live = set(self.req_class[list(self._slot_of.values())].tolist())
        return [n for n in self._dynamic if self._class_index[n] not in live]

    def add_request(self, req_id: str, class_name: str) -> int:
        """Register a request; returns its slot. Re-adding a known id returns its slot."""
        slot = self._slot_of.get(req_id)
        if slot is not None:
            return slot
        if not self._free:
            # Cap reached (an engine that never reports finished requests): evict the request
            # seen least recently rather than grow.
            victim = int(np.argmin(self.req_last_step))
            self.remove_request(self.req_id_of[victim])
        slot = self._free.pop()
        self._slot_of[req_id] = slot
        self.req_id_of[slot] = req_id
        self.req_class[slot] = self.class_index(class_name)
        self.req_prev_k[slot] = 0
        self.req_votes[slot] = 0
        self.req_last_step[slot] = self.steps + 1
        self.requests.reset(slot)
        return slot

    def remove_request(self, req_id: str) -> None:
        slot = self._slot_of.pop(req_id, None)
        if slot is not None:
            self.req_last_step[slot] = np.inf  # never chosen as an LRU victim while free
            self.req_id_of[slot] = ""
            self._free.append(slot)

    def slot(self, req_id: str) -> int | None:
        return self._slot_of.get(req_id)

    @property
    def num_requests(self) -> int:
        return len(self._slot_of)

    # ------------------------------------------------------------------ the step

    def step(self, slots: np.ndarray, drafted: np.ndarray, accepted: np.ndarray,
             step_time_s: float | None) -> np.ndarray:
        """Feed back the last step, return K per request for the next one."""
        slots = np.asarray(slots, dtype=np.int64)
        try:
            drafted = np.asarray(drafted, dtype=np.int64)
            accepted = np.asarray(accepted, dtype=np.int64)
            self.observe(slots, drafted, accepted, step_time_s)
            ks, kinds = self.decide(slots)
        except Exception:  # never let a controller fault reach the engine
            self.errors += 1
            log.exception("adaptspec controller failed; using fallback K")
            ks, kinds = self._fallback(slots)
            if self.metrics is not None:
                self.metrics.record_error()
        if self.metrics is not None:
            try:
                self.metrics.record_step(self, slots, drafted, accepted, ks, kinds)
            except Exception:
                self.errors += 1
                log.exception("adaptspec metrics failed; serving continues")
        return ks

    def step_by_id(self, req_ids: list[str], classes: list[str], drafted: np.ndarray,
                   accepted: np.ndarray, step_time_s: float | None) -> np.ndarray:
        """`step` for callers that track requests by id; unknown ids are added."""
        slots = np.fromiter(
            (self.add_request(r, c) for r, c in zip(req_ids, classes, strict=True)),
            dtype=np.int64, count=len(req_ids),
        )
        return self.step(slots, drafted, accepted, step_time_s)

    def observe(self, slots: np.ndarray, drafted: np.ndarray, accepted: np.ndarray,
                step_time_s: float | None) -> None:
        self.steps += 1
        if slots.size == 0:
            return
        self.req_last_step[slots] = self.steps
        cls = self.req_class[slots]
        self._class_last_used[cls] = self.steps
        self.estimator.partial_fit(cls, drafted, accepted)
        self.requests.partial_fit(slots, drafted, accepted)
        if step_time_s is not None and step_time_s > 0:
            self.last_step_ms = step_time_s * 1e3
            self.cost.partial_fit(
                int(slots.size), int(drafted.sum()), int(drafted.max(initial=0)), self.last_step_ms
            )

    def decide(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """K per request and the kind of each decision (index into DECISIONS)."""
        n = slots.size
        cls = self.req_class[slots]
        latency_critical = self.cls_latency_critical[cls]
        kinds = np.where(latency_critical, 2, 1)
        k_cap = self.cls_k_max[cls]
        if n == 0 or self.k_max == 0 or not k_cap.any():
            return np.zeros(n, dtype=np.int64), kinds

        p, est = self.policy, self.estimator
        class_mean = est.mean()
        alpha = class_mean[cls] * self.requests.factor(slots, est.pooled()[cls])[:, None]
        if p.exploration > 0:
            explore = np.flatnonzero(self.rng.random(n) < p.exploration)
            if explore.size:
                alpha[explore] = est.sample(cls[explore], self.rng)
        np.minimum(alpha, 0.995, out=alpha)
        inc = np.cumprod(alpha, axis=1)  # inc[i, j]: expected value of request i's (j+1)-th draft

        k_min = self.cls_k_min[cls]
        n_forced = int(k_min.sum())
        forced_gain = float(inc[self.cls_forced[cls]].sum()) if n_forced else 0.0

        # Taking the S best increments is taking every increment above a threshold. Binning the
        # scores (bin 0 = not allowed) gives, per threshold bin b, the number of tokens S(b) and
        # their value by two bincounts, instead of sorting n * k_max values. Bins are even in
        # sqrt(score): fine near 0, where a memory-bound GPU still finds tokens worth drafting.
        nb = _BINS
        q = (np.sqrt(inc) * (nb - 1)).astype(np.int64)
        q += 1
        q *= self.cls_open[cls]
        qf = q.ravel()
        count = np.bincount(qf, minlength=nb + 1)[:0:-1]  # bins nb..1, best first
        value = np.bincount(qf, weights=inc.ravel(), minlength=nb + 1)[:0:-1]
        spec = np.concatenate(([0], np.cumsum(count))) + n_forced
        gains = n + forced_gain + np.concatenate(([0.0], np.cumsum(value)))
        # Column maxima fall with j (rows do), so the longest draft above a threshold is the
        # number of columns whose best bin reaches it.
        col_best = q.max(axis=0)
        thresholds = np.arange(nb + 1, 0, -1)  # select q >= t; the first (nb + 1) selects none
        max_k = np.maximum(
            np.searchsorted(-col_best, -thresholds, side="right"), int(k_min.max())
        )
        t_ms = self.cost.predict(n, spec, max_k)

        goodput = gains / np.maximum(t_ms, 1e-9)
        best_free = int(np.argmax(goodput))
        limit = np.inf
        if latency_critical.any():
            limit = t_ms[0] * (1.0 + p.latency_critical_slack)
        limit = min(limit, self.cls_slo_ms[cls].min())
        if limit < np.inf:
            allowed = t_ms <= limit
            allowed[0] = True  # the forced minimum is always allowed, at its own goodput
            goodput = np.where(allowed, goodput, -np.inf)
        best = int(np.argmax(goodput))
        ks = k_min + (q >= thresholds[best]).sum(axis=1)
        self.last_predicted_ms = float(t_ms[best])
        if p.hysteresis_steps > 1:
            # Hysteresis runs on the plan the controller would want without this step's limit:
            # a latency-critical request passing through forces K down for a step, which is no
            # change of mind, and must not make every request wait again to get its K back.
            wanted = self._hold_increases(
                slots, k_min + (q >= thresholds[best_free]).sum(axis=1), p.hysteresis_steps)
            self.req_prev_k[slots] = wanted
            ks = np.minimum(ks, wanted)  # fewer drafts than the limited plan: within the limit
        else:
            self.req_prev_k[slots] = ks
        kinds[ks > 0] = 0
        return ks, kinds

    def _hold_increases(self, slots: np.ndarray, ks: np.ndarray, steps: int) -> np.ndarray:
        """Hysteresis: K rises by one only after `steps` consecutive steps asked for more.

        Decreases apply at once: over-speculating is the costly mistake, and the latency limits
        computed for this step must hold. A jump of 2 or more is a real change, not noise.
        """
        prev = self.req_prev_k[slots]
        up = ks > prev
        votes = np.where(up, self.req_votes[slots] + 1, 0)
        hold = up & (ks - prev < 2) & (votes < steps)
        self.req_votes[slots] = np.where(hold, votes, 0)
        return np.where(hold, prev, ks)

    def _fallback(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        try:
            cap = self.cls_k_max[self.req_class[slots]]
            ks = np.minimum(self.policy.fallback_k, cap)
        except Exception:
            ks = np.zeros(np.size(slots), dtype=np.int64)
        return ks.astype(np.int64), np.full(ks.shape, 3, dtype=np.int64)

    # ------------------------------------------------------------------ introspection

    def acceptance_estimate(self, name: str) -> np.ndarray:
        """Posterior mean per-position acceptance of a class."""
        return self.estimator.mean()[self._class_index[name]].copy()

    def summary(self) -> dict[str, Any]:
        means = self.estimator.mean()
        return {
            "steps": self.steps,
            "errors": self.errors,
            "requests": self.num_requests,
            "cost_coef_ms": self.cost.coef.round(4).tolist(),
            "classes": {
                name: {"acceptance": means[i].round(3).tolist(),
                       "observations": float(self.estimator.observations()[i])}
                for i, name in enumerate(self.class_names)
            },
        }


DECISIONS = (SPECULATE, PLAIN, LATENCY_CRITICAL, FALLBACK)


def time_decisions(policy: Policy, batch: int, repeats: int = 2000, seed: int = 0) -> dict:
    """Median and p99 wall time of one controller step for a batch (used by the bench CLI)."""
    rng = np.random.default_rng(seed)
    ctl = Controller(policy, seed=seed)
    names = list(policy.classes)
    slots = np.array([ctl.add_request(f"r{i}", names[i % len(names)]) for i in range(batch)])
    times = np.empty(repeats)
    ks = np.zeros(batch, dtype=np.int64)
    for i in range(repeats):
        drafted = ks
        accepted = rng.binomial(drafted, 0.7)
        t0 = time.perf_counter()
        ks = ctl.step(slots, drafted, accepted, 0.02)
        times[i] = time.perf_counter() - t0
    warm = times[repeats // 10:]
    return {
        "batch": batch,
        "median_us": float(np.median(warm) * 1e6),
        "p99_us": float(np.percentile(warm, 99) * 1e6),
        "errors": ctl.errors,
    }
