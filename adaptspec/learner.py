"""What the controller learns and how it decides: classes, request slots, the estimators, the
step-time model, hysteresis, and the decision over them.

Each step the engine's feedback (drafted k, accepted a, per request, and the step's time)
updates the acceptance posteriors and the step-time model; then every request's K is chosen
jointly, because one request's extra draft tokens slow the whole batch's step. How it chooses:
adaptspec/step_reference.py, the maths in numpy; what runs: the same in compiled kernels
(adaptspec/fastpath.py), about 100 us for a batch of 256 at most (`adaptspec bench decide`).
Controller (controller.py) adds the plan around it: the bounds, the guard, faults.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from adaptspec import fastpath, passcost
from adaptspec import plan as why
from adaptspec.acceptance import AcceptanceEstimator, RequestAcceptance, RequestSpread, learn
from adaptspec.choose import choose_proposers
from adaptspec.confidence import (
    ConfidenceCalibration,
    OutcomeCalibration,
    confidence_values,
    per_position,
    unit_interval,
)
from adaptspec.cost import StepCostModel
from adaptspec.fastpath import BINS
from adaptspec.policy import OTHER_CLASS, Policy

log = logging.getLogger(__name__)

# A plan's step shapes are priced up to this many draft tokens; more share the last price.
SHAPE_PLANS = 512
_NO_DRAWS = np.zeros((0, 1))
_NOBODY = np.zeros(0, dtype=bool)


class Learner:
    """The controller's state and its decision (Controller, controller.py, is the class to use).

    Public attributes: policy, proposers (names; with more than one it also chooses who
    drafts, adaptspec/choose.py), class_names (index -> name), estimator, requests, cost,
    errors (faults absorbed, the engine's one count), steps, probes, last_predicted_ms,
    last_step_ms;
    per class (by index) cls_k_min, cls_k_max (0: may not draft), cls_kind (2:
    latency-critical), cls_slo_ms; per slot req_class, req_k, req_proposer and req_reason (the
    plan made at its last step), req_last_step (LRU age, inf while free), and the hysteresis
    state req_prev_k and req_votes (consecutive steps it asked for one more draft); pass_ms
    and catchup_ms (a model proposer's cost, passcost.py).

    Evidence is kept per (class, proposer): estimator row p * n_cls + c, and per (request,
    proposer): requests record slot * n_proposers + p. With one proposer both are the class
    and the slot.
    """

    def __init__(self, policy: Policy, *, metrics: Any = None, seed: int | None = 0,
                 proposers: Sequence[str] = ("ngram",)) -> None:
        self.policy = policy
        self.metrics = metrics
        self.rng = np.random.default_rng(seed)
        self.k_max = policy.k_max
        self.proposers = tuple(proposers) or ("ngram",)
        n_prop = self.n_prop = len(self.proposers)
        n_cls = self.n_cls = policy.max_classes + 1  # +1 for "other"
        self.class_names: list[str] = []
        self._class_index: dict[str, int] = {}
        self._class_last_used = np.zeros(n_cls)
        self._dynamic: set[str] = set()
        self.cls_k_min = np.zeros(n_cls, dtype=np.int64)
        self.cls_k_max = np.zeros(n_cls, dtype=np.int64)
        self.cls_kind = np.ones(n_cls, dtype=np.int64)
        self.cls_slo_ms = np.full(n_cls, np.inf)
        # The same per estimator row (class and proposer), as the decision kernel reads them.
        self._row_k_min = np.zeros(n_cls * n_prop, dtype=np.int64)
        self._row_k_max = np.zeros(n_cls * n_prop, dtype=np.int64)
        self._row_kind = np.ones(n_cls * n_prop, dtype=np.int64)
        self._row_slo_ms = np.full(n_cls * n_prop, np.inf)
        self.estimator = AcceptanceEstimator(n_cls * n_prop, self.k_max, policy.forgetting)
        self.estimator.active = 0  # grows as classes are registered
        # What each row's proposer confidence is worth (see `cut`)
        self.confidence = ConfidenceCalibration(n_cls * n_prop, forgetting=policy.forgetting)
        # What the values the trim kept drafts at turned into (see `cut`)
        self.outcome = OutcomeCalibration(n_cls * n_prop, positions=self.k_max)
        # How far each row's requests differ, from the finished ones: how far a request's own
        # record moves it from its row (RequestSpread)
        self.spread = RequestSpread(n_cls * n_prop, policy.request_shrinkage)
        for name in policy.classes:
            self._register_class(name, name)
        self._other = self._register_class(OTHER_CLASS, policy.default_class)

        cap = policy.max_requests
        self.requests = RequestAcceptance(cap * n_prop, policy.request_forgetting)
        # each record's undecayed (drafts started right, drafts verified), for `spread`
        self.req_life = np.zeros((2, cap * n_prop))
        self._slot_of: dict[str, int] = {}
        self._free = list(range(cap - 1, -1, -1))
        self.req_class = np.zeros(cap, dtype=np.int64)
        self.req_proposer = np.zeros(cap, dtype=np.int64)
        self.req_k = np.zeros(cap, dtype=np.int64)  # K planned at its last step
        self.req_reason = np.zeros(cap, dtype=np.int64)  # why (index into plan.REASONS)
        self.req_conf = np.full(cap, np.nan)  # confidence of its pending draft (`cut`)
        # the per-position acceptance that draft was cut with (NaN: none, the row's is used)
        self.req_alpha = np.full((cap, self.k_max), np.nan)
        self.req_value = np.full((cap, self.k_max), np.nan)  # the values it was trimmed with
        self._conf_pending = False  # some were set since the last step
        # A proposer that runs a model (the hybrid's draft model) costs time per forward pass,
        # one per draft token, plus its catch-up (the prompt, tokens missed while idle): ms per
        # pass and per catch-up token, fitted to what the worker measured (decayed least
        # squares; the sums in pass_stats), 0 for the model-free ones. The verify-step model
        # (cost) does not see these passes.
        self.pass_ms = np.zeros(n_prop)
        self.catchup_ms = np.zeros(n_prop)
        self.pass_stats = np.zeros((n_prop, 5))  # sums of pp, pc, cc, py, cy
        self.req_last_step = np.zeros(cap)
        self.req_prev_k = np.zeros(cap, dtype=np.int64)
        self.req_votes = np.zeros(cap, dtype=np.int64)
        # A latency-critical request's unspent latency budget, ms (see _latency_slack)
        self.req_budget_ms = np.zeros(cap)
        self.step_slack = policy.latency_critical_slack  # what the last plan might spend
        self.req_id_of = [""] * cap

        self.cost = StepCostModel(policy.cost_model)
        fastpath.warm_up()
        self.errors = 0
        self.steps = 0
        self.last_predicted_ms = float("nan")
        self.last_step_ms = float("nan")
        self.probes = 0  # steps planned as cost probes (see _step)
        self._last_probe = 0
        self._last_cut: tuple | None = None  # see `cut`

    def _register_class(self, name: str, settings: str) -> int:
        """A class named `name` with the settings of the policy's class `settings`."""
        idx = len(self.class_names)
        self.class_names.append(name)
        self._class_index[name] = idx
        # Rows are proposer-major: the active ones run to the last proposer's newest class.
        self.estimator.active = (self.n_prop - 1) * self.n_cls + len(self.class_names)
        self._configure_class(idx, settings)
        return idx

    def _configure_class(self, idx: int, settings: str) -> None:
        p = self.policy
        cfg = p.classes[settings]
        k_max = p.class_k_max(settings)
        self.cls_k_max[idx] = k_max
        self.cls_k_min[idx] = min(cfg.k_min, k_max)
        self.cls_kind[idx] = 2 if cfg.latency_critical else 1
        self.cls_slo_ms[idx] = cfg.itl_slo_ms if cfg.itl_slo_ms else np.inf
        for row in self.rows(idx):
            self._row_k_min[row] = self.cls_k_min[idx]
            self._row_k_max[row] = self.cls_k_max[idx]
            self._row_kind[row] = self.cls_kind[idx]
            self._row_slo_ms[row] = self.cls_slo_ms[idx]
            self.estimator.set_prior(row, p.prior_vector(settings), cfg.prior_strength)
            self.spread.reset(row)

    def record_pass_cost(self, proposer: int, ms: float, passes: int,
                         catchup_tokens: int = 0) -> None:
        """The worker's measurement of a proposer's model for one step's drafts: its time, its
        passes and the tokens it caught up on (a request's first pass feeds its prompt: a
        per-pass mean would price every later draft token as a prefill)."""
        if passes <= 0 or not np.isfinite(ms) or ms < 0:
            return
        a, b = passcost.fit(self.pass_stats[proposer], ms, passes, catchup_tokens)
        self.pass_ms[proposer], self.catchup_ms[proposer] = a, b

    def first_proposer(self, class_name: str) -> int:
        """The proposer for a request's first draft, chosen from its class alone.

        A request's first drafts are proposed in the step that prefilled it, before the
        controller has decided anything for it: K is cut to the decision afterwards, but who
        proposed cannot be changed, so it is chosen at admission (an explored request tries
        the class's least used proposer, as in `step`)."""
        if self.n_prop == 1:
            return 0
        try:
            c = np.array([self.class_index(class_name)])
            kk = self.k_max
            explore = self.rng.random(1) < self.policy.exploration
            z = self.rng.standard_normal((1, kk, self.n_prop)) if explore[0] else _NO_DRAWS
            post = self.estimator.posterior_sums()
            pass_tokens, _ = self._pass_tokens(max(self.num_requests, 1))
            return int(choose_proposers(post, self.n_cls, self.n_prop, c, self.cls_k_max[c],
                                        np.zeros((2, 1, self.n_prop)), self.spread.shrinkage,
                                        explore, z, pass_tokens,
                                        self.estimator.observations()[: post.shape[1]])[0])
        except Exception:
            self.errors += 1
            log.exception("adaptspec controller failed choosing a first proposer; using the first")
            return 0

    def _pass_tokens(self, n: int) -> tuple[np.ndarray | None, float]:
        """What one model pass of each proposer costs a batch of n, in tokens (None while no
        proposer has measured passes), and plain decoding's step time there (ms). A pass of
        c ms delays every request in the batch: it costs the tokens the batch makes in c ms of
        plain decoding."""
        plain_ms = self.cost.predict(n, 0.0, 0.0)
        if not self.pass_ms.any():
            return None, plain_ms
        return self.pass_ms * n / max(plain_ms, 1e-6), plain_ms

    def rows(self, cls: int) -> list[int]:
        """The estimator rows of a class, one per proposer (in self.proposers' order)."""
        return [p * self.n_cls + cls for p in range(self.n_prop)]

    def class_index(self, name: str) -> int:
        """Index of a class; unknown names become dynamic classes (if the policy allows) up to
        max_classes, evicting the least recently used dynamic class, else fold into `other`."""
        idx = self._class_index.get(name)
        if idx is not None:
            return idx
        p = self.policy
        if not p.dynamic_classes:
            return self._class_index[p.default_class]
        if len(self.class_names) < len(self.cls_k_max):
            idx = self._register_class(name, p.default_class)
        elif victims := self._idle_dynamic_classes():
            victim = min(victims, key=lambda n: self._class_last_used[self._class_index[n]])
            idx = self._class_index.pop(victim)
            self._dynamic.discard(victim)
            self.class_names[idx] = name
            self._class_index[name] = idx
            self._configure_class(idx, p.default_class)
        else:
            return self._other
        self._dynamic.add(name)
        return idx

    def restore_class(self, name: str) -> int | None:
        """Index of a class a snapshot names: a known one, or a dynamic class the engine had
        learned, registered again while there is room (restoring never evicts one, so a
        restart loses none of what fits); None for a class the policy no longer names."""
        idx = self._class_index.get(name)
        if idx is None and self.policy.dynamic_classes and name != OTHER_CLASS \
                and len(self.class_names) < len(self.cls_k_max):
            idx = self.class_index(name)
        return idx

    def _idle_dynamic_classes(self) -> list[str]:
        """Dynamic classes no live request belongs to: only those may give up their slot, or a
        running request would silently start feeding another tenant's estimates."""
        live = set(self.req_class[list(self._slot_of.values())].tolist())
        return [n for n in self._dynamic if self._class_index[n] not in live]

    # ------------------------------------------------------------------ classes and requests

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
        self.req_prev_k[slot] = self.req_votes[slot] = self.req_proposer[slot] = 0
        self.req_budget_ms[slot] = 0.0
        self.req_k[slot], self.req_reason[slot] = 0, why.CODE[why.NEW_REQUEST]
        self.req_conf[slot] = self.req_alpha[slot] = self.req_value[slot] = np.nan
        self.req_last_step[slot] = self.steps + 1
        for p in range(self.n_prop):
            self.requests.reset(slot * self.n_prop + p)
            self.req_life[:, slot * self.n_prop + p] = 0.0
        return slot

    def remove_request(self, req_id: str) -> None:
        slot = self._slot_of.pop(req_id, None)
        if slot is not None:
            self.req_last_step[slot] = np.inf  # never chosen as an LRU victim while free
            self.req_id_of[slot] = ""
            self._free.append(slot)
            for p in range(self.n_prop):  # what its drafts said of its row's spread
                rec = slot * self.n_prop + p
                self.spread.add(p * self.n_cls + int(self.req_class[slot]), *self.req_life[:, rec])
                self.req_life[:, rec] = 0.0

    def slot(self, req_id: str) -> int | None:
        return self._slot_of.get(req_id)

    @property
    def num_requests(self) -> int:
        return len(self._slot_of)

    # ------------------------------------------------------------------ the decision

    def _step(self, slots: np.ndarray, drafted: np.ndarray, accepted: np.ndarray,
              step_time_s: float | None, src: np.ndarray, verified: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
        """Feedback, then the decision: K and its reason code per request. `drafted` is what
        acceptance learns from, `verified` what the step verified (the step-time model's
        input)."""
        n = slots.size
        if n and (slots.ndim != 1 or drafted.shape != slots.shape
                  or accepted.shape != slots.shape):
            raise ValueError(f"slots, drafted and accepted must be 1-d of one length: "
                             f"{slots.shape}, {drafted.shape}, {accepted.shape}")
        cls = self.req_class[slots]  # (and an IndexError for a slot out of range)
        self.steps += 1
        if n == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        self.req_last_step[slots] = self.steps
        if self.policy.dynamic_classes:  # only the eviction of dynamic classes reads it
            self._class_last_used[cls] = self.steps
        n_prop = self.n_prop
        rows = src * self.n_cls + cls
        records = slots * n_prop + src
        sn, spec_tokens, longest = learn(self.estimator, self.requests, rows, records, drafted,
                                         accepted)
        tried = drafted > 0
        self.req_life[0, records] += tried & (accepted > 0)
        self.req_life[1, records] += tried
        if verified is not drafted:
            spec_tokens, longest = int(verified.sum()), max(int(verified.max(initial=0)), 0)
        self.confidence.tick()
        if self._conf_pending:  # drafts that went through `cut` were verified now
            self._conf_pending = False
            conf = self.req_conf[slots]
            scored = np.isfinite(conf) & (verified > 0)
            if scored.any():
                alpha = self.req_alpha[slots[scored]]
                unplanned = np.isnan(alpha[:, 0])
                if unplanned.any():  # drafts the last decision did not cover: their row's
                    alpha[unplanned] = self.estimator.mean()[rows[scored][unplanned]]
                self.confidence.partial_fit(rows[scored], conf[scored], verified[scored],
                                            accepted[scored], alpha)
            # what the trim's values turned into, with or without a confidence (`cut` set
            # the values of the drafts the last decision covered)
            trimmed = np.isfinite(self.req_value[slots, 0]) & (verified > 0)
            if trimmed.any():
                self.outcome.partial_fit(rows[trimmed], self.req_value[slots[trimmed]],
                                         verified[trimmed], accepted[trimmed])
            self.req_conf[slots] = self.req_alpha[slots] = self.req_value[slots] = np.nan
        if step_time_s is not None and step_time_s > 0:
            self.last_step_ms = step_time_s * 1e3
            # The measured step also ran the passes of a model proposer for the drafts it
            # proposed (K decided last step for who it was chosen for): the verify-step model
            # learns the step without them.
            passes = self.pass_ms[self.req_proposer[slots]] * self.req_k[slots]
            verify_ms = self.last_step_ms - float(passes.sum())
            if verify_ms > 0:
                self.cost.partial_fit(n, spec_tokens, longest, verify_ms)

        p, kk = self.policy, self.k_max
        self.req_proposer[slots] = self.req_k[slots] = 0
        lc = self.cls_kind[cls] > 1
        slack = self.step_slack = self._latency_slack(slots[lc], n, spec_tokens, step_time_s)
        if kk == 0 or not np.count_nonzero(self.cls_k_max[cls]):  # no request may draft
            return np.zeros(n, dtype=np.int64), np.where(
                lc, why.CODE[why.LATENCY_CRITICAL], why.CODE[why.CLASS_CAP])
        explore, z = _NOBODY, _NO_DRAWS
        if p.exploration > 0:
            # Thompson draws for a share of the requests (normal approximation of each Beta
            # posterior), replacing their estimates for this step.
            explore = self.rng.random(n) < p.exploration
            m = int(np.count_nonzero(explore))
            if m:
                z = self.rng.standard_normal((m, kk))
        post = self.estimator.posterior_sums()
        rows = cls
        pass_tokens = None
        if n_prop > 1:
            pass_tokens, plain_ms = self._pass_tokens(n)
            recs = slots[:, None] * n_prop + np.arange(n_prop)[None, :]
            zp = self.rng.standard_normal((len(z), kk, n_prop)) if len(z) else _NO_DRAWS
            choice = choose_proposers(post, self.n_cls, n_prop, cls, self.cls_k_max[cls],
                                      self.requests.sn[:, recs], self.spread.shrinkage,
                                      explore, zp, pass_tokens,
                                      self.estimator.observations()[: post.shape[1]])
            self.req_proposer[slots] = choice
            rows = choice * self.n_cls + cls
            sn = self.requests.sn[:, slots * n_prop + choice]
        coef = self.cost.coef_at(n)
        # The plans are priced with their step shape's residual too: without it a shape the
        # formula prices over the latency-critical slack, but that runs faster than plain (a
        # CPU's step of 2 requests with 2 drafts), is never drafted and never measured.
        shape_ms = self.cost.shape_offset(n, np.arange(min(kk * n, SHAPE_PLANS) + 1))
        ks, _, inc, threshold, self.last_predicted_ms = fastpath.decide(
            post, self._row_k_min, self._row_k_max, self._row_kind, self._row_slo_ms,
            self.spread.shrinkage, sn, rows, explore, z, coef, self.cost.knee, shape_ms,
            slack, p.hysteresis_steps, self.req_prev_k, self.req_votes, slots)
        reasons = self._reasons(ks, cls, explore, inc, threshold)
        if self._probe_due(ks, rows):
            # The probe: the plan the decision makes if drafting costs probe_margin less than
            # the learned curve says (speculation's terms cut, hysteresis left alone). Against
            # the learned curve it loses at most probe_margin on that step, so at most
            # probe_margin / probe_every of the time; without it a prior dearer than the engine
            # (a GPU preset at large batch) keeps every step plain, and plain steps never
            # measure what a draft costs.
            self._last_probe = self.steps
            optimistic = coef.copy()
            optimistic[2:] *= 1.0 - p.cost_model.probe_margin
            probe, _, p_inc, p_threshold, _ = fastpath.decide(
                post, self._row_k_min, self._row_k_max, self._row_kind, self._row_slo_ms,
                self.spread.shrinkage, sn, rows, explore, z, optimistic, self.cost.knee,
                shape_ms, slack, 1, self.req_prev_k, self.req_votes, slots)
            if probe.any():
                ks, inc, threshold = probe, p_inc, p_threshold
                reasons = np.where(ks > 0, why.CODE[why.COST_PROBE], reasons)
                self.last_predicted_ms = self.cost.predict(n, int(ks.sum()), int(ks.max()))
                self.probes += 1
        if pass_tokens is not None:
            k_min = self.cls_k_min[cls]
            trimmed = passcost.worth_drafting(ks, inc, pass_tokens[self.req_proposer[slots]],
                                              k_min)
            if lc.any():
                trimmed = passcost.within_slack(
                    trimmed, inc, self.pass_ms[self.req_proposer[slots]], k_min,
                    self.cost.coef_at(n), self.cost.knee, slack, plain_ms)
            reasons = np.where(trimmed < ks, why.CODE[why.PASS_COST], reasons)
            ks = trimmed
        self._last_cut = (slots, rows, inc, threshold)
        return ks, reasons

    def _latency_slack(self, critical: np.ndarray, n: int, spec_tokens: int,
                       step_time_s: float | None) -> float:
        """The slack over a plain step that the next step's plan may take, given the
        latency-critical requests (slots) of the batch: each has a budget, which every
        measured decode step it is in raises by latency_critical_slack x the plain step
        (plain_reference_ms) and a step that verified drafts lowers by what it took over
        that plain step (measured). The step may take the policy's slack plus the
        smallest budget of the batch, at most latency_critical_burst; an overspent budget
        keeps it plain until repaid. So over a request's steps the others' drafts slow it by
        at most the slack on average (and one step by at most the burst), instead of capping
        every step at the slack, where on a CPU a single draft token can cost more than a 2%
        slack and none is ever drafted beside a latency-critical request. Without a burst
        over the slack, the slack caps every step and no budget is kept."""
        p = self.policy
        slack, burst = p.latency_critical_slack, self.latency_burst
        if critical.size == 0 or burst <= slack:  # (no burst: the slack caps every step)
            return slack
        plain = self.plain_reference_ms(n)
        if not plain > 0:
            return slack
        if step_time_s is not None and step_time_s > 0:
            took = step_time_s * 1e3 - plain if spec_tokens > 0 else 0.0
            self.req_budget_ms[critical] = np.minimum(
                self.req_budget_ms[critical] + slack * plain - took, (burst - slack) * plain)
        # (below 0 when overspent: then only plans priced faster than plain by as much)
        return min(slack + float(self.req_budget_ms[critical].min()) / plain, burst)

    @property
    def latency_burst(self) -> float:
        """The most one step beside a latency-critical request may take over plain."""
        p = self.policy
        return max(p.latency_critical_burst or 0.0, p.latency_critical_slack)

    def plain_reference_ms(self, n: int) -> float:
        """A plain step of `n` requests (ms), what latency budgets are counted in: the
        step-time model's (the controller uses the plain steps it measured)."""
        return self.cost.predict(n, 0, 0)

    def _probe_due(self, ks: np.ndarray, rows: np.ndarray) -> bool:
        """Is this step a cost probe's (see _step)? When the decision drafts nothing, the
        step-time model learns, and no request of the batch is latency-critical or has an
        SLO (their limits are the learned curve's), at most once every probe_every steps."""
        cm = self.policy.cost_model
        return (cm.learn and cm.probe_every > 0 and not ks.any()
                and self.steps - self._last_probe >= cm.probe_every
                and not (self._row_kind[rows] > 1).any()
                and bool(np.isinf(self._row_slo_ms[rows]).all()))

    def _reasons(self, ks: np.ndarray, cls: np.ndarray, explore: np.ndarray, inc: np.ndarray,
                 threshold: int) -> np.ndarray:
        """Why the decision gave each request its K: latency-critical, the class's k_max where
        the next position would have been drafted without it, else learned (or exploring)."""
        reasons = np.full(ks.shape, why.CODE[why.LEARNED], dtype=np.int64)
        if explore.size:
            reasons[explore] = why.CODE[why.EXPLORING]
        cap = self.cls_k_max[cls]
        at_cap = (ks == cap) & (cap < inc.shape[0])
        if at_cap.any():
            cols = np.flatnonzero(at_cap)
            nxt = inc[cap[cols], cols]
            # the bin of the next position (see fastpath.decide) reaching the plan's threshold
            wanted = np.floor(np.sqrt(nxt) * (BINS - 1)) + 1 >= threshold
            reasons[cols[wanted]] = why.CODE[why.CLASS_CAP]
        reasons[self.cls_kind[cls] > 1] = why.CODE[why.LATENCY_CRITICAL]
        return reasons

    def cut(self, slots: np.ndarray, lengths: np.ndarray, confidence: np.ndarray,
            planned: np.ndarray | None = None) -> np.ndarray:
        """Draft lengths after weighing each draft's own confidence; never longer than given.

        The last decision drafted every token whose expected value (the running product of
        the request's per-position acceptance) reached a threshold. A proposer that knows more
        about this very draft (a long, often-confirmed match, or a weak one) gives a per-token
        confidence c (NaN: it gives none, as vLLM's own proposers). Where its (class, proposer)
        row has calibrated confidences like c
        (adaptspec/confidence.py: the acceptance measured for drafts of that confidence), each
        position's acceptance is moved by that bin's log-odds over what was expected of the
        same positions; until then c only ranks the draft among its row's, moving it by w
        times its log-odds over the row's mean confidence (w = policy.confidence_weight; 0
        turns confidences off), and the draft keeps at least its first token, to calibrate.
        A draft without a confidence keeps its positions' values as planned. Every draft then
        keeps the tokens of the step that makes the most tokens per predicted
        second (StepCostModel.trim, which sees the step's shape; each position's values
        corrected by what the tokens kept there turned into, `OutcomeCalibration`): a
        confident draft keeps what was planned, a doubtful one is cut short. Requests the
        last decision did not cover keep their drafts; forced positions (k_min) are kept.
        Each confidence is kept until its draft is verified, to calibrate. `planned`: the
        K the last decision gave each draft, where `lengths` run past it (Controller.draft_bounds);
        only a draft the plan gave a token keeps its first one uncalibrated.
        """
        slots = np.asarray(slots, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        w = self.policy.confidence_weight
        state = self._last_cut
        # (the early returns keep what the plan granted; only the trim below may go past it)
        if planned is not None:
            planned = np.asarray(planned, dtype=np.int64)
        granted = lengths if planned is None else np.minimum(lengths, planned)
        if slots.size == 0:
            return granted.copy()
        confidence = np.asarray(confidence, dtype=np.float64)
        if w <= 0:
            confidence = np.full(slots.size, np.nan)
        # (NaN stays NaN: a draft without a confidence calibrates none)
        self.req_conf[slots] = np.where(np.isnan(confidence), np.nan,
                                        unit_interval(confidence))
        self._conf_pending = True
        if state is None:
            return granted.copy()
        last_slots, last_rows, inc, threshold = state
        k_min = self._row_k_min[last_rows]
        if threshold > BINS:
            return np.minimum(granted, k_min.max())
        col_of = {int(s): i for i, s in enumerate(last_slots.tolist())}
        cols = np.array([col_of.get(int(s), -1) for s in slots.tolist()], dtype=np.int64)
        known = cols >= 0
        out = granted.copy()
        if not known.any():
            return out
        val, conf = inc[:, cols[known]], self.req_conf[slots[known]]
        rows = last_rows[cols[known]]
        given = np.isfinite(conf)
        shift = np.zeros(rows.size)
        calibrated = ~given  # (nothing to calibrate: nothing forced beyond k_min)
        if given.any():
            r, c = rows[given], conf[given]
            self.confidence.observe(r, c)
            s = self.confidence.shift(r, c)
            calibrated[given] = np.isfinite(s)
            shift[given] = np.where(calibrated[given], s, w * self.confidence.relative(r, c))
        alpha = per_position(val)
        self.req_alpha[slots[known]] = alpha.T
        # The drafts as proposed, each position's value with its draft's confidence weighed
        # in, are cut to the step that pays best by the measured step times, its shape's
        # included: the plan priced every draft token alike, and a step's time jumps between
        # token counts (on a CPU the first draft tokens of a batch can be free, the next dear).
        # The first token of an uncalibrated draft stays, so that it is verified and
        # calibrates.
        first = np.minimum(lengths[known], 1)
        if planned is not None:
            first = np.minimum(first, planned[known])
        forced = np.where(calibrated | (val[0] <= 0), k_min[cols[known]],
                          np.maximum(k_min[cols[known]], first))
        lc = bool((self._row_kind[last_rows] > 1).any())
        values = confidence_values(alpha, shift)
        self.req_value[slots[known]] = values.T
        # Past the K planned (`planned`), a draft spends only what the plan's requests whose
        # drafts did not come left: the plan's draft tokens in all.
        budget = None if planned is None else int(self.req_k[last_slots].sum())
        keep = self.cost.trim(self.outcome.correct(values, last_rows[cols[known]]),
                              lengths[known], last_slots.size, forced,
                              self.step_slack if lc else None, budget)
        out[known] = keep  # (the trim never lengthens a draft)
        return out

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
            **({"proposers": {
                prop: {name: means[p * self.n_cls + i].round(3).tolist()
                       for i, name in enumerate(self.class_names)}
                for p, prop in enumerate(self.proposers)}} if self.n_prop > 1 else {}),
        }
