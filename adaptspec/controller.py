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

from adaptspec.acceptance import AcceptanceEstimator, RequestAcceptance, feedback_keys
from adaptspec.cost import StepCostModel
from adaptspec.policy import OTHER_CLASS, ClassPolicy, Policy

log = logging.getLogger(__name__)

# Decision kinds, in the order of the metric label values.
SPECULATE, PLAIN, LATENCY_CRITICAL, FALLBACK = "speculate", "plain", "latency_critical", "fallback"
# Resolution of the increment values when choosing how many draft tokens the batch gets.
_BINS = 128
# Rows of the per-class table (Controller._cls_tab), in this order so that a request's factor
# is two 2-row operations on its (s, n) record: 1 / level of the class's pooled acceptance, 1,
# shrinkage n0, n0 again (rows U and V are 0 for a class that may not draft); then may draft
# (1/0), the decision kind when not drafting (2 latency-critical, else 1), the ITL SLO in ms
# (inf if none); then k_max rows of posterior mean acceptance per position and k_max rows of
# posterior evidence + 1 (the spread of the Thompson draws). Rows U and MEAN are refreshed
# every step, the evidence rows when drawing.
_TAB_U, _TAB_ONE, _TAB_V, _TAB_N0, _TAB_OPEN, _TAB_KIND, _TAB_SLO = range(7)
_TAB_MEAN = 7
_NO_KEYS = np.zeros(0, dtype=np.int64)


class Controller:
    """Chooses K per request per step. Never raises from `step`: faults give the fallback K.

    Public attributes: policy, class_names (index -> name), estimator, requests, cost,
    errors (faults absorbed), last_predicted_ms, last_step_ms.

    A step (feedback + decision) for a batch of 256 is meant to take tens of microseconds
    (`adaptspec bench decide` measures it), and a numpy call costs one or two microseconds
    whatever its size. So the work is a fixed, small number of calls over the whole batch: the
    class settings a request needs are rows of one table gathered in one call, feedback
    updates are look-ups, the per-position arrays are position-major ([k_max, batch]: work
    along the draft runs over contiguous rows), and work a policy does not need is skipped.
    """

    def __init__(self, policy: Policy, *, metrics: Any = None, seed: int | None = 0) -> None:
        self.policy = policy
        self.metrics = metrics
        self.rng = np.random.default_rng(seed)
        self.k_max = policy.k_max
        n_cls = policy.max_classes + 1  # +1 for "other"
        kk = max(self.k_max, 1)
        self.class_names: list[str] = []
        self._class_index: dict[str, int] = {}
        self._class_last_used = np.zeros(n_cls)
        self._dynamic: set[str] = set()
        self.cls_k_min = np.zeros(n_cls, dtype=np.int64)
        self.cls_k_max = np.zeros(n_cls, dtype=np.int64)
        self.cls_latency_critical = np.zeros(n_cls, dtype=bool)
        self.cls_slo_ms = np.full(n_cls, np.inf)
        # Per class and draft position: may the controller choose it (open) or must it (forced)?
        self.cls_open = np.zeros((n_cls, kk), dtype=np.int64)
        self.cls_forced = np.zeros((n_cls, kk), dtype=bool)
        # What a decision needs per request from its class, as rows of one table so that one
        # gather serves them all (see _TAB_*).
        self._cls_tab = np.zeros((_TAB_MEAN + 2 * kk, n_cls))
        self._uniform = True
        self._any_closed = False
        self._any_latency_critical = False
        self._any_slo = False
        self.estimator = AcceptanceEstimator(n_cls, self.k_max, policy.forgetting)
        self.estimator.active = 0  # grows as classes are registered
        for name in policy.classes:
            self._register_class(name, policy.classes[name])
        self._other = self._register_class(OTHER_CLASS, policy.classes[policy.default_class])

        cap = policy.max_requests
        self.requests = RequestAcceptance(cap, policy.request_forgetting, policy.request_shrinkage,
                                          k_max=self.k_max)
        self._slot_of: dict[str, int] = {}
        self._free = list(range(cap - 1, -1, -1))
        self.req_class = np.zeros(cap, dtype=np.int64)
        # Hysteresis state per slot (see the tables below and _hold_increases).
        self._hyst = np.zeros(cap, dtype=np.int64)
        self.req_last_step = np.zeros(cap)
        self.req_id_of = [""] * cap

        self.cost = StepCostModel(policy.cost_model)
        self.errors = 0
        self.steps = 0
        self.last_predicted_ms = float("nan")
        self.last_step_ms = float("nan")
        # Candidate thresholds, best bin first; the first (nb + 1) selects no token.
        self._thresholds = np.arange(_BINS + 1, 0, -1)
        self._neg_thresholds = -self._thresholds
        # The candidate plans, one per threshold: their value (element 0, no bin, stays 0) and
        # their step-time features (rows 2 and 3: draft tokens, longest draft).
        self._value = np.zeros(_BINS + 1)
        self._plans = self.cost.plan_buffer(_BINS + 1)
        # Hysteresis as one look-up: the next state of a request from its state and wanted K.
        # A state is prev_k * steps + votes, votes being how many consecutive steps asked for
        # exactly prev_k + 1 (fewer than `steps`, or the increase would have been granted).
        # Slots store state * (kk + 1), so that adding the wanted K indexes the table.
        steps = self._hyst_steps = policy.hysteresis_steps
        self._hyst_width = kk + 1
        prev, votes = np.divmod(np.arange((kk + 1) * steps), steps)
        wanted = np.arange(kk + 1)
        hold = (wanted - prev[:, None] == 1) & (votes[:, None] + 1 < steps)
        nxt = np.where(hold, prev[:, None] * steps + votes[:, None] + 1, wanted * steps)
        self._hyst_next = (nxt * (kk + 1)).ravel()
        self._hyst_k = np.repeat(prev, kk + 1)  # K granted, by stored state

    @property
    def req_prev_k(self) -> np.ndarray:
        """K granted per slot at its last step (kept with hysteresis only, else 0)."""
        return self._hyst // (self._hyst_width * self._hyst_steps)

    @property
    def req_votes(self) -> np.ndarray:
        """Consecutive steps each slot asked for one more draft than it has (hysteresis)."""
        return self._hyst // self._hyst_width % self._hyst_steps

    # ------------------------------------------------------------------ classes and requests

    def _register_class(self, name: str, cfg: ClassPolicy) -> int:
        idx = len(self.class_names)
        self.class_names.append(name)
        self._class_index[name] = idx
        self.estimator.active = len(self.class_names)
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

        tab = self._cls_tab
        is_open = 1.0 if k_max > 0 else 0.0
        tab[_TAB_OPEN, idx] = is_open
        tab[_TAB_ONE, idx] = 1.0
        tab[_TAB_V, idx] = p.request_shrinkage * is_open
        tab[_TAB_N0, idx] = p.request_shrinkage
        tab[_TAB_KIND, idx] = 2.0 if cfg.latency_critical else 1.0
        tab[_TAB_SLO, idx] = self.cls_slo_ms[idx]
        # Position-major copies for the gathers in `decide`.
        self._open_t = np.ascontiguousarray(self.cls_open.T)
        self._forced_t = np.ascontiguousarray(self.cls_forced.T)
        # The common policy: every class may draft any K up to the policy's k_max, or none.
        # Then no position is forced, a request's open positions are all or nothing, and the
        # decision needs no per-position masks.
        n = len(self.class_names)
        k_min, k_cap = self.cls_k_min[:n], self.cls_k_max[:n]
        self._uniform = bool(((k_min == 0) & ((k_cap == 0) | (k_cap == self.k_max))).all())
        self._any_latency_critical = bool(self.cls_latency_critical[:n].any())
        self._any_closed = bool((k_cap == 0).any())
        self._any_slo = bool(np.isfinite(self.cls_slo_ms[:n]).any())

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
        self._hyst[slot] = 0
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
            cls = self.req_class.take(slots)  # once for both halves
            sn = self._observe(slots, cls, drafted, accepted, step_time_s)
            ks, kinds = self._decide(slots, cls, sn)
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
        self._observe(slots, self.req_class.take(slots), drafted, accepted, step_time_s)

    def _observe(self, slots: np.ndarray, cls: np.ndarray, drafted: np.ndarray,
                 accepted: np.ndarray, step_time_s: float | None) -> np.ndarray | None:
        """Update the estimators; returns the batch's request records, which `_decide` needs."""
        self.steps += 1
        if slots.size == 0:
            return None
        self.req_last_step[slots] = self.steps
        if self.policy.dynamic_classes:  # only the eviction of dynamic classes reads it
            self._class_last_used[cls] = self.steps
        # (ufunc reductions: ndarray.max/sum add a Python layer costing as much as the work)
        longest = max(int(np.maximum.reduce(drafted)), 0)
        if longest:
            # Clip the feedback once for both estimators.
            keys = feedback_keys(drafted, accepted, self.estimator.k_max)
            self.estimator.partial_fit(cls, drafted, accepted, keys=keys)
            sn = self.requests.partial_fit(slots, drafted, accepted, keys=keys)
        else:
            # Nothing was drafted (speculation off, as under high load): nothing to learn but
            # the decay of the class evidence; the request records stay as they are.
            self.estimator.partial_fit(cls, drafted, accepted, keys=_NO_KEYS)
            sn = None
        if step_time_s is not None and step_time_s > 0:
            self.last_step_ms = step_time_s * 1e3
            self.cost.partial_fit(int(slots.size), int(np.add.reduce(drafted)), longest,
                                  self.last_step_ms)
        return sn

    def decide(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """K per request and the kind of each decision (index into DECISIONS)."""
        return self._decide(slots, self.req_class.take(slots))

    def _decide(self, slots: np.ndarray, cls: np.ndarray,
                sn: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """`decide`, given the batch's classes and (optionally) request records [2, n]."""
        n, kk, p = slots.size, self.k_max, self.policy
        tab = self._cls_tab
        if n == 0 or kk == 0:
            return np.zeros(n, dtype=np.int64), tab[_TAB_KIND].take(cls).astype(np.int64)

        # Refresh the class table, then gather everything a request needs from its class.
        post = self.estimator.posterior_sums()  # [2 kk + 2, classes]: a, a + b, their sums
        n_cls = post.shape[1]
        mean = tab[_TAB_MEAN: _TAB_MEAN + kk, :n_cls]
        np.divide(post[:kk], post[kk: 2 * kk], out=mean)
        # A request's own record scales its class's acceptance by f = own / level, with
        # own = (s + n0 level) / (n + n0), i.e. f = (s / level + n0) / (n + n0); the table's
        # rows make that f = (s U + V) / (n + n0), with U = V = 0 if the request may not draft.
        level = post[2 * kk] / post[2 * kk + 1]
        np.maximum(level, 1e-3, out=level)
        np.divide(tab[_TAB_OPEN, :n_cls], level, out=tab[_TAB_U, :n_cls])
        ct = tab[: _TAB_MEAN + kk].take(cls, axis=1)
        kinds = ct[_TAB_KIND].astype(np.int64)
        if self._any_closed and not np.maximum.reduce(ct[_TAB_OPEN]):
            return np.zeros(n, dtype=np.int64), kinds  # no request may draft
        if sn is None:
            sn = self.requests.records(slots)
        f = sn * ct[_TAB_U: _TAB_U + 2]
        f += ct[_TAB_V: _TAB_V + 2]
        f = f[0] / f[1]

        alpha = ct[_TAB_MEAN: _TAB_MEAN + kk] * f  # [kk, n]: position j of request i
        if p.exploration > 0:
            # Thompson draws for a share of the requests (normal approximation of each Beta
            # posterior), replacing their estimates for this step.
            explore = (self.rng.random(n) < p.exploration).nonzero()[0]
            if explore.size:
                np.add(post[kk: 2 * kk], 1.0, out=tab[_TAB_MEAN + kk:, :n_cls])
                draw = tab[_TAB_MEAN:].take(cls.take(explore), axis=1)
                m = draw[:kk]
                sd = 1.0 - m
                sd *= m
                sd /= draw[kk:]
                np.sqrt(sd, out=sd)
                sd *= self.rng.standard_normal((explore.size, kk)).T
                sd += m
                np.maximum(sd, 0.0, out=sd)
                if self._any_closed:  # a request that may not draft keeps alpha 0 (see below)
                    sd *= ct[_TAB_OPEN].take(explore)
                alpha[:, explore] = sd
        np.minimum(alpha, 0.995, out=alpha)
        # inc[j, i]: expected value of request i's (j+1)-th draft, the running product along j.
        inc = np.multiply.accumulate(alpha, axis=0, out=alpha)

        # Taking the S best increments is taking every increment above a threshold. Binning the
        # scores (bin 0 = not allowed) gives, per threshold bin b, the number of tokens S(b) and
        # their value by two bincounts, instead of sorting n * k_max values. Bins are even in
        # sqrt(score): fine near 0, where a memory-bound GPU still finds tokens worth drafting.
        nb = _BINS
        x = np.sqrt(inc)
        x *= nb - 1
        uniform = self._uniform
        if uniform:
            # Open requests are open at every position: bin floor(x) + 1; the others stay in
            # bin 0 (their f, hence inc and x, is 0).
            x += ct[_TAB_OPEN]
            q = x.astype(np.int64)
            k_min = None
            n_forced, forced_gain = 0, 0.0
        else:
            q = x.astype(np.int64)
            q += 1
            q *= self._open_t.take(cls, axis=1)
            k_min = self.cls_k_min.take(cls)
            n_forced = int(k_min.sum())
            forced_gain = (float(inc[self._forced_t.take(cls, axis=1)].sum()) if n_forced
                           else 0.0)
        # Plans by threshold, best bin first (plan 0: no bin, only forced drafts), written into
        # the cost model's feature rows: tokens S, longest draft maxK.
        plans, value = self._plans, self._value
        spec, max_k = plans[2], plans[3]
        qf = q.ravel()
        np.add.accumulate(np.bincount(qf, None, nb + 1)[:0:-1], out=spec[1:])
        spec[0] = 0
        np.add.accumulate(np.bincount(qf, inc.ravel(), nb + 1)[:0:-1], out=value[1:])
        gains = value + (n + forced_gain)
        # Column maxima fall with j (rows do), so the longest draft above a threshold is the
        # number of columns whose best bin reaches it.
        col_best = np.maximum.reduce(q, axis=1)
        thresholds = self._thresholds
        if uniform:
            np.subtract(kk, col_best[::-1].searchsorted(thresholds), out=max_k)
        else:
            spec += n_forced
            np.maximum(np.searchsorted(-col_best, self._neg_thresholds, side="right"),
                       int(k_min.max()), out=max_k)
        t_ms = self.cost.plan_times(n, plans)

        goodput = gains / np.maximum(t_ms, 1e-9)
        best_free = int(goodput.argmax())
        limit = np.inf
        if self._any_latency_critical and np.maximum.reduce(ct[_TAB_KIND]) > 1.5:
            limit = t_ms[0] * (1.0 + p.latency_critical_slack)
        if self._any_slo:
            limit = min(limit, np.minimum.reduce(ct[_TAB_SLO]))
        if limit == np.inf:
            best = best_free
        elif uniform and min(self.cost.coef.tolist()) >= 0:
            # Plans grow with the threshold index (tokens and longest draft both rise), and
            # with non-negative coefficients so does their time: the plans within the limit
            # are a prefix, and plan 0 (no draft) is always allowed.
            n_ok = max(int(t_ms.searchsorted(limit, "right")), 1)
            best = int(goodput[:n_ok].argmax())
        else:
            blocked = t_ms > limit
            blocked[0] = False  # the forced minimum is always allowed, at its own goodput
            goodput[blocked] = -np.inf
            best = int(goodput.argmax())
        self.last_predicted_ms = float(t_ms[best])
        ks = self._plan(q, thresholds[best], k_min, n)
        if p.hysteresis_steps > 1:
            # Hysteresis runs on the plan the controller would want without this step's limit:
            # a latency-critical request passing through forces K down for a step, which is no
            # change of mind, and must not make every request wait again to get its K back.
            wanted = ks if best_free == best else self._plan(q, thresholds[best_free], k_min, n)
            wanted = self._hold_increases(slots, wanted)
            if best_free == best:
                ks = wanted  # held K never exceeds the plan
            elif best or k_min is not None:
                ks = np.minimum(ks, wanted)  # fewer drafts than the limited plan: within it
        if best or k_min is not None:  # else no request drafts
            kinds[ks > 0] = 0
        return ks, kinds

    @staticmethod
    def _plan(q: np.ndarray, threshold: int, k_min: np.ndarray | None, n: int) -> np.ndarray:
        """K per request when every open position whose bin reaches `threshold` is drafted."""
        if threshold > _BINS:  # no bin reaches it: only the forced positions
            return np.zeros(n, dtype=np.int64) if k_min is None else k_min.copy()
        # Summing bytes is cheaper than summing booleans (which numpy widens first).
        ks = np.add.reduce((q >= threshold).view(np.uint8), axis=0, dtype=np.uint8)
        ks = ks.astype(np.int64)
        if k_min is not None:
            ks += k_min
        return ks

    def _hold_increases(self, slots: np.ndarray, ks: np.ndarray) -> np.ndarray:
        """Hysteresis: K rises by one only after `hysteresis_steps` consecutive steps asked
        for more; returns the K granted.

        Decreases apply at once: over-speculating is the costly mistake, and the latency limits
        computed for this step must hold. A jump of 2 or more is a real change, not noise.
        """
        state = self._hyst.take(slots)
        state += ks
        state = self._hyst_next.take(state)
        self._hyst[slots] = state
        return self._hyst_k.take(state)

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
    """Median and p99 time of one controller step (feedback + decision) for a batch, used by
    `adaptspec bench decide`. Wall time (median_us, p99_us) and the thread's CPU time
    (cpu_median_us, cpu_p99_us): on a shared machine the wall clock also counts the time other
    processes hold the core, the CPU clock only the controller's own work."""
    rng = np.random.default_rng(seed)
    ctl = Controller(policy, seed=seed)
    names = list(policy.classes)
    slots = np.array([ctl.add_request(f"r{i}", names[i % len(names)]) for i in range(batch)])
    wall = np.empty(repeats)
    cpu = np.empty(repeats)
    ks = np.zeros(batch, dtype=np.int64)
    for i in range(repeats):
        drafted = ks
        accepted = rng.binomial(drafted, 0.7)
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        ks = ctl.step(slots, drafted, accepted, 0.02)
        wall[i] = time.perf_counter_ns() - t0
        cpu[i] = time.thread_time_ns() - c0
    skip = repeats // 10  # warm-up: caches, allocator, the cost model's first refits
    wall, cpu = wall[skip:] / 1e3, cpu[skip:] / 1e3
    return {
        "batch": batch,
        "median_us": float(np.median(wall)),
        "p99_us": float(np.percentile(wall, 99)),
        "cpu_median_us": float(np.median(cpu)),
        "cpu_p99_us": float(np.percentile(cpu, 99)),
        "errors": ctl.errors,
    }
