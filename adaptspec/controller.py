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

from adaptspec import fastpath
from adaptspec.acceptance import AcceptanceEstimator, RequestAcceptance, feedback_keys, fit_compiled
from adaptspec.cost import N_FEATURES, StepCostModel
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
# (inf if none); then k_max rows of posterior mean acceptance per position (0 for a class that
# may not draft) and k_max rows of the posterior's standard deviation (the spread of the
# Thompson draws). Rows U and MEAN are refreshed when the posteriors change (see
# Controller._class_table), the spread rows when drawing.
_TAB_U, _TAB_ONE, _TAB_V, _TAB_N0, _TAB_OPEN, _TAB_KIND, _TAB_SLO = range(7)
_TAB_MEAN = 7
# Scalar operands as 0-d arrays: numpy converts a Python number anew at each ufunc call, which
# costs about as much as the call's work on a few hundred elements.
_ZERO, _ALPHA_CAP, _BIN_SCALE = np.array(0.0), np.array(0.995), np.array(float(_BINS - 1))
_BIN_SHIFT = np.array(_BINS + 1)
_NO_DRAWS = np.zeros((0, 1))
_NO_HYST = np.zeros((0, 0), dtype=np.int64)
# From this batch size on, the running product along the draft is one multiply per position
# (see _running_product).
_ROW_PRODUCT_MIN_BATCH = 96


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

    Nor is work redone whose inputs did not change since the last step. The class table is
    recomputed when the estimator's posteriors change (AcceptanceEstimator.version: not while
    nothing is drafted and no evidence is left to decay). An engine mostly runs the same batch
    from one step to the next, so what depends only on the batch's requests and their classes,
    on the class table (its gather), or on those and the requests' records
    (RequestAcceptance.version: the increments before exploration) is kept with the batch
    (`_Batch`) while the versions it was computed for hold. Decisions are the same, to the
    bit, as if everything were recomputed at each step. (So a request's class changes only
    through add_request, which tells the batch.)
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
        self._tab_rows = self._cls_tab[: _TAB_MEAN + kk]  # what every request needs
        self._tab_draw = self._cls_tab[_TAB_MEAN:]  # what a Thompson draw needs
        # The estimator version the table's posterior rows (and the spread rows) were computed
        # from; None: recompute.
        self._tab_version: int | None = None
        self._spread_version: int | None = None
        self._post = np.zeros((2 * kk + 2, 0))
        # The last step's batch (see _batch_for), and a count of the changes to request
        # classes or class settings that invalidate one.
        self._batch: _Batch | None = None
        self._buffers: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._membership = 0
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
        self._last_step = np.zeros(cap)
        # The batch of the last step, which may hold its slots' last step and hysteresis state
        # in place of _last_step and _hyst (see _flush_live).
        self._live: _Batch | None = None
        self.req_id_of = [""] * cap

        self.cost = StepCostModel(policy.cost_model)
        # Compiled feedback, class table and decisions (adaptspec.fastpath) where numba is
        # installed (the decision for uniform policies); False forces the numpy path (tests
        # compare the two).
        self.use_fastpath = fastpath.AVAILABLE
        if self.use_fastpath:
            fastpath.warm_up()
        self.errors = 0
        self.steps = 0
        self.last_predicted_ms = float("nan")
        self.last_step_ms = float("nan")
        self._last_cut: tuple | None = None  # see `cut`
        # Candidate thresholds, best bin first; the first (nb + 1) selects no token.
        self._thresholds = np.arange(_BINS + 1, 0, -1)
        self._neg_thresholds = -self._thresholds
        # The candidate plans, one per threshold: their value (element 0, no bin, stays 0) and
        # their step-time features (rows 2 and 3: draft tokens, longest draft).
        # (One buffer: the cost model's N_FEATURES rows, then the value, so that the running
        # sums of S (row 2) and of the value are one call on a strided view of the two rows.)
        plan_rows = np.concatenate([self.cost.plan_buffer(_BINS + 1), np.zeros((1, _BINS + 1))])
        self._plans, self._value = plan_rows[:N_FEATURES], plan_rows[N_FEATURES]
        self._spec_value_tail = plan_rows[2::N_FEATURES - 2, 1:]
        self._plan_index = np.arange(_BINS + 1)
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
    def use_fastpath(self) -> bool:
        """Whether feedback, the class table and (uniform-policy) decisions run compiled
        (adaptspec.fastpath)."""
        return self._fast

    @use_fastpath.setter
    def use_fastpath(self, on: bool) -> None:
        self._fast = bool(on) and fastpath.AVAILABLE
        self.estimator.use_fastpath = self.requests.use_fastpath = self._fast

    def _flush_live(self) -> None:
        """Write the per-slot state the last step's batch holds into the per-slot arrays.

        While one batch runs step after step, its slots' last step and hysteresis state stay
        in the batch (a scatter and a gather fewer per step), and are written back when
        another batch comes, or before anything else reads or writes those arrays.
        """
        live = self._live
        if live is None:
            return
        self._live = None
        self._last_step[live.slots] = live.last_step
        if live.hyst is not None:
            self._hyst[live.slots] = live.hyst
            live.hyst = None

    @property
    def req_last_step(self) -> np.ndarray:
        """The last step each slot was in a batch (its LRU age; inf while free)."""
        self._flush_live()
        return self._last_step

    @property
    def req_prev_k(self) -> np.ndarray:
        """K granted per slot at its last step (kept with hysteresis only, else 0)."""
        self._flush_live()
        return self._hyst // (self._hyst_width * self._hyst_steps)

    @property
    def req_votes(self) -> np.ndarray:
        """Consecutive steps each slot asked for one more draft than it has (hysteresis)."""
        self._flush_live()
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
        self._tab_version = None  # rows OPEN and U changed, and the posterior
        self._membership += 1  # and what a batch of this class gathered
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
        self._membership += 1
        self._flush_live()
        self._hyst[slot] = 0
        self._last_step[slot] = self.steps + 1
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
             step_time_s: float | None, allow_speculation: bool = True) -> np.ndarray:
        """Feed back the last step, return K per request for the next one.

        `allow_speculation` False (the payoff guard holds speculation): every K is 0 and the
        decision is recorded as plain; the controller still learns and plans as usual, so its
        hysteresis and cut state stay those of its own plan."""
        slots = np.asarray(slots, dtype=np.int64)
        try:
            drafted = np.asarray(drafted, dtype=np.int64)
            accepted = np.asarray(accepted, dtype=np.int64)
            batch = self._batch_for(slots)  # once for both halves
            sn = self._observe(slots, batch, drafted, accepted, step_time_s)
            ks, kinds = self._decide(slots, batch, sn)
            if not allow_speculation and ks.any():
                ks = np.zeros_like(ks)
                kinds = np.where(kinds == 0, 1, kinds)  # speculate -> plain (see DECISIONS)
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
                   accepted: np.ndarray, step_time_s: float | None,
                   allow_speculation: bool = True) -> np.ndarray:
        """`step` for callers that track requests by id; unknown ids are added."""
        slots = np.fromiter(
            (self.add_request(r, c) for r, c in zip(req_ids, classes, strict=True)),
            dtype=np.int64, count=len(req_ids),
        )
        return self.step(slots, drafted, accepted, step_time_s, allow_speculation)

    def _batch_for(self, slots: np.ndarray) -> _Batch:
        """The batch of these slots (int64), from the last step's if it is the same batch: an
        engine's running batch mostly is, from one decode step to the next."""
        key = slots.tobytes()
        batch = self._batch
        if batch is None or batch.key != key or batch.membership != self._membership:
            batch = self._batch = _Batch(self, slots, key)
        return batch

    def observe(self, slots: np.ndarray, drafted: np.ndarray, accepted: np.ndarray,
                step_time_s: float | None) -> None:
        slots = np.asarray(slots, dtype=np.int64)
        self._observe(slots, self._batch_for(slots), np.asarray(drafted, dtype=np.int64),
                      np.asarray(accepted, dtype=np.int64), step_time_s)

    def _observe(self, slots: np.ndarray, batch: _Batch, drafted: np.ndarray,
                 accepted: np.ndarray, step_time_s: float | None) -> np.ndarray | None:
        """Update the estimators; returns the batch's request records, which `_decide` needs
        (None if they did not change)."""
        self.steps += 1
        if slots.size == 0:
            return None
        if self._live is not batch:
            self._flush_live()
            self._live = batch
        else:
            batch.steps_live += 1
        batch.last_step = self.steps
        cls = batch.cls
        if self.policy.dynamic_classes:  # only the eviction of dynamic classes reads it
            self._class_last_used[cls] = self.steps
        spec_tokens, sn = None, None
        if drafted.tobytes() == batch.zeros:
            # Nothing drafted (speculation off, as under high load): found by comparing bytes,
            # a fraction of any numpy reduction's cost.
            longest = spec_tokens = 0
        elif self.use_fastpath:
            # Both updates and the step's totals in one compiled call; sn is None (nothing
            # learned) where no draft was longer than 0.
            sn, spec_tokens, longest = fit_compiled(self.estimator, self.requests, cls, slots,
                                                    drafted, accepted)
        else:
            # (argmax: a ufunc reduction costs several times more for a few hundred integers)
            longest = max(int(drafted.flat[drafted.argmax()]), 0)
            if longest:
                # Clip the feedback once for both estimators.
                keys = feedback_keys(drafted, accepted, self.estimator.k_max)
                if batch.class_offsets is None:
                    batch.class_offsets = cls * (self.estimator.k_max + 1) ** 2
                self.estimator.partial_fit(cls, drafted, accepted, keys, batch.class_offsets)
                sn = self.requests.partial_fit(slots, drafted, accepted, keys=keys)
        if sn is None:
            # Nothing to learn but the decay of the class evidence; the request records stay as
            # they are.
            self.estimator.decay()
        if step_time_s is not None and step_time_s > 0:
            self.last_step_ms = step_time_s * 1e3
            if spec_tokens is None:
                spec_tokens = int(np.add.reduce(drafted))
            self.cost.partial_fit(int(slots.size), spec_tokens, longest, self.last_step_ms)
        return sn

    def decide(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """K per request and the kind of each decision (index into DECISIONS)."""
        slots = np.asarray(slots, dtype=np.int64)
        return self._decide(slots, self._batch_for(slots))

    def _class_table(self) -> None:
        """Recompute the class table's posterior rows (MEAN and U), when the estimator's
        posteriors changed since they were computed."""
        est = self.estimator
        kk, tab = self.k_max, self._cls_tab
        post = est.posterior_sums()  # [2 kk + 2, classes]: a, a + b, their sums
        self._post = post  # (the spread rows need it)
        self._tab_version = est.version
        if self.use_fastpath:
            # These rows and the spread rows in one call, instead of about ten.
            fastpath.class_rows(post, tab, kk, _TAB_U, _TAB_MEAN, self._any_closed)
            self._spread_version = self._tab_version
            return
        n_cls = post.shape[1]
        mean = tab[_TAB_MEAN: _TAB_MEAN + kk, :n_cls]
        # (positional out=: a ufunc parses the keyword slower than it does this work)
        np.divide(post[:kk], post[kk: 2 * kk], mean)
        if self._any_closed:
            # A class that may not draft gets mean 0: its requests' f is 0 (rows U and V), so
            # their alpha is 0 either way, and so are their Thompson draws (spread 0 too).
            np.multiply(mean, tab[_TAB_OPEN, :n_cls], mean)
        # A request's own record scales its class's acceptance by f = own / level, with
        # own = (s + n0 level) / (n + n0), i.e. f = (s / level + n0) / (n + n0); the table's
        # rows make that f = (s U + V) / (n + n0), with U = V = 0 if the request may not draft.
        level = post[2 * kk] / post[2 * kk + 1]
        np.maximum(level, 1e-3, level)
        np.divide(tab[_TAB_OPEN, :n_cls], level, tab[_TAB_U, :n_cls])

    def _class_spread(self) -> None:
        """The spread rows: the standard deviation of each class's posterior per position
        (the normal approximation of the Beta), sqrt(m (1 - m) / (a + b + 1))."""
        if self._spread_version == self._tab_version:
            return
        kk, post = self.k_max, self._post
        n_cls = post.shape[1]
        mean = self._cls_tab[_TAB_MEAN: _TAB_MEAN + kk, :n_cls]
        sd = self._cls_tab[_TAB_MEAN + kk:, :n_cls]
        np.subtract(1.0, mean, sd)
        np.multiply(sd, mean, sd)
        np.divide(sd, post[kk: 2 * kk] + 1.0, sd)
        np.sqrt(sd, sd)
        self._spread_version = self._tab_version

    def _decide(self, slots: np.ndarray, batch: _Batch,
                sn: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """`decide`, given the batch and (optionally) its request records [2, n]."""
        n, kk, p = batch.n, self.k_max, self.policy
        if n == 0 or kk == 0:
            kinds = self._cls_tab[_TAB_KIND].take(batch.cls).astype(np.int64)
            return np.zeros(n, dtype=np.int64), kinds

        # Everything a request needs from its class is one gather of the class table, kept
        # while neither the table nor the batch changes.
        if self._tab_version != self.estimator.version:
            self._class_table()
        version = self._tab_version
        compiled = self._uniform and self.use_fastpath
        # (the compiled decision reads the class table itself: it gathers once per batch)
        if batch.ct_version != version and not (compiled and batch.kinds is not None):
            batch.ct = self._tab_rows.take(batch.cls, axis=1)
            batch.ct_version = version
            if batch.kinds is None:
                batch.set_classes(self, batch.ct)
        if not batch.any_open:
            return np.zeros(n, dtype=np.int64), batch.kinds.copy()  # no request may draft
        if compiled:
            return self._decide_compiled(slots, batch, sn)
        ct = batch.ct
        # Increments without exploration: reused from the last step if neither the posteriors
        # nor these requests' records changed since (nothing drafted, nothing learned), and
        # kept once they have stayed the same for two steps in a row.
        base_key = (version, self.requests.version)
        base = batch.inc_base if batch.base_key == base_key else None
        if base is None:
            if sn is None:
                sn = self.requests.records(slots)
            # f = (s U + V) / (n + n0) (see _class_table), in place: sn is this step's copy.
            np.multiply(sn, ct[_TAB_U: _TAB_U + 2], sn)
            np.add(sn, ct[_TAB_V: _TAB_V + 2], sn)
            f = np.divide(sn[0], sn[1], sn[0])
            if batch.seen_key == base_key:
                base = np.multiply(ct[_TAB_MEAN: _TAB_MEAN + kk], f)
                np.minimum(base, _ALPHA_CAP, base)
                _running_product(base)
                batch.inc_base, batch.base_key = base, base_key
            else:
                batch.seen_key = base_key
        # inc[j, i]: expected value of request i's (j+1)-th draft, the running product along j
        # of alpha (position j of request i), written where the histogram's weights go.
        inc = batch.weights[1]
        if base is None:
            np.multiply(ct[_TAB_MEAN: _TAB_MEAN + kk], f, inc)
        else:
            np.copyto(inc, base)
        if p.exploration > 0:
            # Thompson draws for a share of the requests (normal approximation of each Beta
            # posterior), replacing their estimates for this step.
            explore = (self.rng.random(n) < p.exploration).nonzero()[0]
            if explore.size:
                self._class_spread()
                if base is None:
                    draw = self._tab_draw.take(batch.cls.take(explore), axis=1)
                else:
                    if batch.draw_version != version:
                        batch.draw = self._tab_draw.take(batch.cls, axis=1)
                        batch.draw_version = version
                    draw = batch.draw.take(explore, axis=1)
                sd = draw[kk:]
                sd *= self.rng.standard_normal((explore.size, kk)).T
                sd += draw[:kk]
                np.maximum(sd, _ZERO, sd)
                if base is None:
                    inc[:, explore] = sd
                else:  # only the drawn requests' increments are new
                    np.minimum(sd, _ALPHA_CAP, sd)
                    np.multiply.accumulate(sd, 0, None, sd)
                    inc[:, explore] = sd
        if base is None:
            np.minimum(inc, _ALPHA_CAP, inc)
            _running_product(inc)

        # Taking the S best increments is taking every increment above a threshold. Binning the
        # scores (bin 0 = not allowed) gives, per threshold bin b, the number of tokens S(b) and
        # their value by one bincount, instead of sorting n * k_max values. Bins are even in
        # sqrt(score): fine near 0, where a memory-bound GPU still finds tokens worth drafting.
        nb = _BINS
        x = np.sqrt(inc, batch.x)
        np.multiply(x, _BIN_SCALE, x)
        bins = batch.bins
        q = bins[0]
        uniform = self._uniform
        if uniform:
            # Open requests are open at every position: bin floor(x) + 1; the others stay in
            # bin 0 (their f, hence inc and x, is 0). The unsafe cast truncates, as astype.
            np.add(x, batch.is_open, q, casting="unsafe")
            k_min = None
            n_forced, forced_gain = 0, 0.0
        else:
            np.copyto(q, x, casting="unsafe")
            q += 1
            q *= batch.open_t
            k_min = batch.k_min
            n_forced = batch.n_forced
            forced_gain = float(inc[batch.forced_t].sum()) if n_forced else 0.0
        # Token counts and values per bin in one weighted bincount: bins[1] = bins[0] shifted by
        # nb + 1 and weights[0] = 1, so the first nb + 1 sums are counts, the next the values.
        np.add(q, _BIN_SHIFT, bins[1])
        hist = np.bincount(bins.ravel(), batch.weights.ravel(), 2 * (nb + 1))
        # Plans by threshold, best bin first (plan 0: no bin, only forced drafts): running sums
        # from the best bin down, written into the cost model's feature row of tokens S and
        # into the value row in one call (two rows of one buffer, see __init__).
        np.add.accumulate(hist.reshape(2, nb + 1)[:, :0:-1], 1, None, self._spec_value_tail)
        plans, value = self._plans, self._value
        spec, max_k = plans[2], plans[3]
        gains = value + (n + forced_gain)
        if not uniform:
            spec[0] = 0
            spec += n_forced
        cost = self.cost
        if cost.uses_max_k:  # (the presets' per-draft-position cost is 0)
            # Column maxima fall with j (rows do), so the longest draft above a threshold is
            # the number of columns whose best bin reaches it.
            col_best = np.maximum.reduce(q, 1)
            if uniform:
                # columns j with col_best[j] >= nb + 1 - t, for plan t
                max_k[:] = np.subtract(nb + 1, col_best).searchsorted(self._plan_index, "right")
            else:
                np.maximum(np.searchsorted(-col_best, self._neg_thresholds, side="right"),
                           batch.k_min_max, max_k)
        t_ms = cost.plan_times(n, plans)
        thresholds = self._thresholds

        if cost.floor_free:  # t_ms >= its constant term > 0 already
            goodput = np.divide(gains, t_ms, gains)
        else:
            goodput = gains / np.maximum(t_ms, 1e-9)
        best_free = int(goodput.argmax())
        limit = np.inf
        if batch.any_latency_critical:
            limit = t_ms[0] * (1.0 + p.latency_critical_slack)
        if self._any_slo:
            limit = min(limit, batch.slo_ms)
        if limit == np.inf:
            best = best_free
        elif uniform and cost.nonnegative:
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
        # What `cut` needs: this step's increments (a buffer that lives until the next step)
        # and the value a draft token had to reach to be planned.
        self._last_cut = (slots, inc, thresholds[best], k_min)
        ks = self._plan(q, thresholds[best], k_min, n)
        if p.hysteresis_steps > 1:
            # Hysteresis runs on the plan the controller would want without this step's limit:
            # a latency-critical request passing through forces K down for a step, which is no
            # change of mind, and must not make every request wait again to get its K back.
            wanted = ks if best_free == best else self._plan(q, thresholds[best_free], k_min, n)
            wanted = self._hold_increases(slots, wanted, batch)
            if best_free == best:
                ks = wanted  # held K never exceeds the plan
            elif best or k_min is not None:
                ks = np.minimum(ks, wanted)  # fewer drafts than the limited plan: within it
        if ks.dtype != np.int64:
            ks = ks.astype(np.int64)
        kinds = batch.kinds.copy()
        if best or k_min is not None:  # else no request drafts
            kinds[ks > 0] = 0
        return ks, kinds

    def _decide_compiled(self, slots: np.ndarray, batch: _Batch,
                         sn: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """`_decide` for a uniform policy in one compiled call (adaptspec.fastpath), hysteresis
        included: the same random draws, arithmetic and rules, without the caches the numpy
        path needs."""
        n, kk, p = batch.n, self.k_max, self.policy
        if sn is None:
            sn = self.requests.records(slots)
        if p.exploration > 0:
            explore = self.rng.random(n) < p.exploration
            m = int(np.count_nonzero(explore))
            if m:
                self._class_spread()
                z = self.rng.standard_normal((m, kk))
            else:
                z = _NO_DRAWS
        else:
            explore, z = np.zeros(n, dtype=bool), _NO_DRAWS
        limit_factor = 1.0 + p.latency_critical_slack if batch.any_latency_critical else 0.0
        if p.hysteresis_steps > 1:
            hyst = np.empty((2, n), dtype=np.int64)
            hyst[0] = self._hyst_state(slots, batch)
        else:
            hyst = _NO_HYST
        inc = batch.weights[1]
        ks = np.empty(n, dtype=np.int64)
        kinds = batch.kinds.copy()
        cost = self.cost
        best, t_best = fastpath.decide_uniform(
            sn, self._cls_tab, batch.cls, _TAB_U, _TAB_MEAN, kk, explore, z, float(_ALPHA_CAP),
            _BINS, cost.coef, cost.knee, limit_factor, batch.slo_ms if self._any_slo else np.inf,
            cost.floor_free, hyst, self._hyst_next, self._hyst_k, inc, ks, kinds)
        if hyst.size:
            self._keep_hyst_state(slots, batch, hyst[1])
        self.last_predicted_ms = float(t_best)
        self._last_cut = (slots, inc, self._thresholds[best], None)
        return ks, kinds

    def cut(self, slots: np.ndarray, lengths: np.ndarray, confidence: np.ndarray) -> np.ndarray:
        """Draft lengths after weighing each draft's own confidence; never longer than given.

        The last decision drafted every token whose expected value (the running product of
        the request's per-position acceptance) reached a threshold. A proposer that knows more
        about this very draft (a long, often-confirmed match, or a weak one) gives a per-token
        confidence c; blending it into each position's acceptance as (1 - w) alpha + w c, with
        w = policy.confidence_weight, the draft keeps the tokens that still reach the threshold.
        A confident draft therefore keeps what was planned, a doubtful one is cut short, and
        the step costs what was predicted or less. Requests the last decision did not cover
        keep their drafts; forced positions (k_min) are kept.
        """
        slots = np.asarray(slots, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        w = self.policy.confidence_weight
        state = self._last_cut
        if state is None or w <= 0 or slots.size == 0:
            return lengths.copy()
        last_slots, inc, threshold, k_min = state
        if threshold > _BINS:
            return np.minimum(lengths, 0 if k_min is None else k_min.max())
        col_of = {int(s): i for i, s in enumerate(last_slots.tolist())}
        cols = np.array([col_of.get(int(s), -1) for s in slots.tolist()], dtype=np.int64)
        known = cols >= 0
        out = lengths.copy()
        if not known.any():
            return out
        c = np.clip(np.nan_to_num(np.asarray(confidence, dtype=np.float64)[known]), 0.0, 1.0)
        val = inc[:, cols[known]]  # [k_max, m]
        # Per-position acceptance back from the running product (0 once a product reached 0).
        prev = np.vstack([np.ones((1, val.shape[1])), val[:-1]])
        alpha = np.divide(val, prev, out=np.zeros_like(val), where=prev > 0)
        blended = np.multiply.accumulate((1.0 - w) * alpha + w * c, axis=0)
        # Bin b of a value v is floor(sqrt(v) * (BINS - 1)) + 1 (see _decide): reaching the
        # threshold bin is reaching this value.
        floor = ((threshold - 1) / (_BINS - 1)) ** 2
        keep = np.add.reduce(blended >= floor, axis=0)
        if k_min is not None:
            last_k_min = k_min[cols[known]]
            keep = np.maximum(keep, last_k_min)
        out[known] = np.minimum(lengths[known], keep)
        return out

    @staticmethod
    def _plan(q: np.ndarray, threshold: int, k_min: np.ndarray | None, n: int) -> np.ndarray:
        """K per request when every open position whose bin reaches `threshold` is drafted
        (as uint8 counts where no K is forced: the caller widens them, if need be)."""
        if threshold > _BINS:  # no bin reaches it: only the forced positions
            return np.zeros(n, dtype=np.int64) if k_min is None else k_min.copy()
        # Summing bytes is cheaper than summing booleans (which numpy widens first).
        ks = np.add.reduce((q >= threshold).view(np.uint8), 0, np.uint8)
        if k_min is not None:
            return k_min + ks
        return ks

    def _hold_increases(self, slots: np.ndarray, ks: np.ndarray,
                        batch: _Batch | None = None) -> np.ndarray:
        """Hysteresis: K rises by one only after `hysteresis_steps` consecutive steps asked
        for more; returns the K granted. `batch`: the batch of `slots`, if known.

        Decreases apply at once: over-speculating is the costly mistake, and the latency limits
        computed for this step must hold. A jump of 2 or more is a real change, not noise.
        """
        # (a new array: a fault below must leave the stored states as they were)
        state = self._hyst_next.take(self._hyst_state(slots, batch) + ks)
        self._keep_hyst_state(slots, batch, state)
        return self._hyst_k.take(state)

    def _hyst_state(self, slots: np.ndarray, batch: _Batch | None) -> np.ndarray:
        """The hysteresis states of `slots` (read only: the live batch's own array)."""
        live = batch is not None and batch is self._live
        if live and batch.hyst is not None:
            return batch.hyst
        if not live:
            self._flush_live()
        return self._hyst.take(slots)

    def _keep_hyst_state(self, slots: np.ndarray, batch: _Batch | None,
                         state: np.ndarray) -> None:
        """Store the next hysteresis states of `slots`: a running batch keeps them (see
        _flush_live)."""
        if batch is not None and batch is self._live and batch.steps_live and batch.unique_slots():
            batch.hyst = state
        else:
            self._hyst[slots] = state

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


def _running_product(a: np.ndarray) -> None:
    """Running product along axis 0, in place. multiply.accumulate runs its inner loop along
    that (short) axis, ~35 ns a column at k_max 8: past a few dozen columns one multiply per
    row is cheaper."""
    if a.shape[1] < _ROW_PRODUCT_MIN_BATCH:
        np.multiply.accumulate(a, 0, None, a)
        return
    prev = a[0]
    for j in range(1, a.shape[0]):
        row = a[j]
        np.multiply(prev, row, row)
        prev = row


class _Batch:
    """One batch of slots, as `_decide` sees it: what holds as long as the batch's requests and
    their classes do (see Controller._batch_for), buffers for the per-step work, and what
    `_decide` may keep from one step to the next.

    cls: class per request. `zeros`: the bytes of an all-zero int64 `drafted`. From the first
    class-table gather (`set_classes`): kinds (the decision kind when not drafting), is_open
    (1/0), any_open, any_latency_critical, slo_ms (the tightest ITL SLO); where the policy
    forces or closes some positions, k_min, k_min_max, n_forced and the position-major masks
    open_t, forced_t.
    """

    # Kept between steps, each with the versions it was computed for: the class-table gather
    # (ct), the Thompson draw rows of every request (draw), the increments without
    # exploration (inc_base, for base_key = class-table and request-record versions; seen_key:
    # the versions of the last step that did not keep them), classes * (k_max + 1) ** 2
    # (class_offsets, see AcceptanceEstimator.partial_fit).
    ct = draw = inc_base = class_offsets = None
    ct_version = draw_version = None
    base_key: tuple[int, int] | None = None
    seen_key: tuple[int, int] | None = None
    kinds: np.ndarray | None = None
    # Per-slot state while this is the live batch (see Controller._flush_live): the last step
    # it ran, the steps it ran since it became live, the hysteresis state.
    last_step = 0
    steps_live = 0
    hyst: np.ndarray | None = None
    _unique: bool | None = None

    def __init__(self, ctl: Controller, slots: np.ndarray, key: bytes) -> None:
        self.key, self.membership = key, ctl._membership
        n = self.n = slots.size
        kk = max(ctl.k_max, 1)
        self.cls = ctl.req_class.take(slots)
        self.zeros = bytes(8 * n)
        # The per-step arrays (see _decide): bins, histogram weights, sqrt scores; shared by
        # the batches of one size, one at a time.
        buffers = ctl._buffers
        if buffers is None or buffers[0].shape[2] != n:
            buffers = ctl._buffers = (np.empty((2, kk, n), dtype=np.int64), np.ones((2, kk, n)),
                                      np.empty((kk, n)))
        self.bins, self.weights, self.x = buffers

    def set_classes(self, ctl: Controller, ct: np.ndarray) -> None:
        """The class settings, from a gather of the class table (whose rows OPEN, KIND and SLO
        change only with the batch's membership)."""
        n, cls = self.n, self.cls
        self.is_open, self.kinds = ct[_TAB_OPEN], ct[_TAB_KIND].astype(np.int64)
        # (argmax and an index: ndarray.max costs several times more on a few hundred values)
        self.any_open = not ctl._any_closed or bool(self.is_open[self.is_open.argmax()])
        self.any_latency_critical = (ctl._any_latency_critical
                                     and bool(self.kinds[self.kinds.argmax()] > 1))
        slo = ct[_TAB_SLO]
        self.slo_ms = float(slo[slo.argmin()]) if ctl._any_slo else np.inf
        if not ctl._uniform:
            self.k_min = ctl.cls_k_min.take(cls)
            self.k_min_max = int(self.k_min.max()) if n else 0
            self.n_forced = int(self.k_min.sum())
            self.open_t = ctl._open_t.take(cls, axis=1)
            self.forced_t = ctl._forced_t.take(cls, axis=1)

    @property
    def slots(self) -> np.ndarray:
        return np.frombuffer(self.key, dtype=np.int64)  # (a read-only copy of the slots)

    def unique_slots(self) -> bool:
        """No slot twice (a batch that repeats one must go through the per-slot arrays)."""
        if self._unique is None:
            self._unique = len(set(self.slots.tolist())) == self.n
        return self._unique


DECISIONS = (SPECULATE, PLAIN, LATENCY_CRITICAL, FALLBACK)


def time_decisions(policy: Policy, batch: int, repeats: int = 2000, seed: int = 0,
                   speculating: bool = False) -> dict:
    """Median and p99 time of one controller step (feedback + decision) for a batch, used by
    `adaptspec bench decide`. Wall time (median_us, p99_us) and the thread's CPU time
    (cpu_median_us, cpu_p99_us): on a shared machine the wall clock also counts the time other
    processes hold the core, the CPU clock only the controller's own work.

    Requests cycle through the policy's classes; `speculating` leaves the latency-critical
    ones out, so that (where the cost model allows) the batch drafts and feeds back every step
    rather than being held at K = 0 by a latency-critical request."""
    rng = np.random.default_rng(seed)
    ctl = Controller(policy, seed=seed)
    names = [n for n, c in policy.classes.items() if not (speculating and c.latency_critical)]
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
        "speculating": speculating,
        "mean_k": float(np.mean(ks)),
        "median_us": float(np.median(wall)),
        "p99_us": float(np.percentile(wall, 99)),
        "cpu_median_us": float(np.median(cpu)),
        "cpu_p99_us": float(np.percentile(cpu, 99)),
        "errors": ctl.errors,
    }
