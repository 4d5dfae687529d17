"""Prometheus metrics of the controller, with names fixed so dashboards can rely on them.

Class labels are capped: the first `max_classes` distinct class names keep their own series,
later ones fold into `other`, so a client inventing class names cannot explode cardinality.

Every series carries vLLM's `engine` label (the data-parallel index, as vLLM's own series do): the
engine cores of a data-parallel server each run a controller of their own, and without it their
gauges would overwrite each other and their counters could not be told apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from adaptspec.plan import DECISIONS, REASONS, decision_kinds
from adaptspec.policy import OTHER_CLASS

if TYPE_CHECKING:
    from adaptspec.controller import Controller



class _Bound:
    """A labelled metric family seen from one engine: `labels` takes the other labels. Its
    children are kept: prometheus-client checks and joins the label values on every `labels`
    call, some twenty times a step here (the label sets are bounded, so is the dict)."""

    def __init__(self, metric: Any, engine: str) -> None:
        self.metric, self.engine = metric, engine
        self._children: dict[tuple[str, ...], Any] = {}

    def labels(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(self.engine, *values)
        return child


class Metrics:
    """The `adaptspec_*` series. `record_step` is called by the controller once per step."""

    def __init__(self, max_classes: int, k_max: int,
                 registry: CollectorRegistry | None = None, engine: int | str = 0) -> None:
        self.max_classes = max_classes
        self.k_max = k_max
        self.engine = str(engine)
        self._labels: dict[str, str] = {}
        self._registry = registry if registry is not None else REGISTRY
        self._families: list[Any] = []

        def family(kind: type, name: str, doc: str, labels: Sequence[str] = (), **extra: Any
                   ) -> Any:
            """A metric with the engine label bound: labels(*rest) for the other labels, or
            the child itself where there are none."""
            metric = kind(name, doc, ["engine", *labels], registry=self._registry, **extra)
            self._families.append(metric)
            return _Bound(metric, self.engine) if labels else metric.labels(self.engine)

        # `proposer`: who drafted (bounded by the engine's proposers; "none" on steps that
        # did not speculate).
        self.draft_tokens = family(
            Counter, "adaptspec_draft_tokens", "Draft tokens verified", ["class", "proposer"])
        self.accepted_tokens = family(
            Counter, "adaptspec_accepted_tokens", "Draft tokens accepted", ["class", "proposer"])
        self.accepted_per_pos = family(
            Counter, "adaptspec_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position", ["class", "position"])
        self.drafted_per_pos = family(
            Counter, "adaptspec_draft_tokens_per_pos",
            "Draft tokens verified at each draft position", ["class", "position"])
        self.steps = family(
            Counter, "adaptspec_steps", "Per-request decisions, one per request per step: the "
            "kind, the reason that settled K (adaptspec/plan.py REASONS) and the proposer "
            "chosen to draft", ["class", "decision", "reason", "proposer"])
        self.chosen_k = family(
            Histogram, "adaptspec_chosen_k", "K chosen per request per step", ["class"],
            buckets=[0.5 + k for k in range(max(k_max, 1))] + [float("inf")])
        self.acceptance = family(
            Gauge, "adaptspec_acceptance_estimate",
            "Posterior mean acceptance of the first draft position", ["class"],
            multiprocess_mode="mostrecent")
        self.confidence_cut = family(
            Counter, "adaptspec_confidence_cut_tokens",
            "Draft tokens dropped because the proposer's confidence in them was low", ["class"])
        self.confidence_drafts = family(
            Counter, "adaptspec_confidence_drafts",
            "Drafts that reached the cut with their proposer's confidence", ["class"])
        self.trimmed = family(
            Counter, "adaptspec_trimmed_tokens",
            "Draft tokens the cut dropped, from any draft: a low confidence or a step shape "
            "that does not pay for them", ["class"])
        self.errors = family(
            Counter, "adaptspec_controller_errors", "Controller faults absorbed (fallback K used)")
        self.step_time = family(
            Gauge, "adaptspec_step_time_ms", "Measured step time of the last step", ["kind"],
            multiprocess_mode="mostrecent")
        self.payoff_held = family(
            Counter, "adaptspec_payoff_held_steps",
            "Engine steps the payoff guard kept plain: to measure the plain step (measure), "
            "because speculation had lost its budget (budget), or because a latency-critical "
            "request was in the batch and steps with drafts measured slower than the policy's "
            "slack allows (latency)", ["reason"])
        self.payoff_lost = family(
            Counter, "adaptspec_payoff_lost_ms",
            "Time speculating steps took beyond plain decoding's for the same tokens (kept "
            "whether or not the payoff guard gates)")
        self.payoff_saved = family(
            Counter, "adaptspec_payoff_saved_ms",
            "Time speculating steps saved against plain decoding for the same tokens (kept "
            "whether or not the payoff guard gates)")
        self.payoff_account = family(
            Gauge, "adaptspec_payoff_account_ms", "The payoff guard's account (speculation allowed "
            "while positive)", multiprocess_mode="mostrecent")

        self.draft_passes = family(
            Counter, "adaptspec_draft_model_passes",
            "Forward passes of the hybrid's draft model (none in a step where no request drafts "
            "with it)")
        self.catchup_tokens = family(
            Counter, "adaptspec_draft_model_catchup_tokens",
            "Tokens the hybrid's draft model fed to bring a request's cache up to date (after "
            "idle steps, rejected drafts, prompts)")
        self.draft_cost = family(
            Gauge, "adaptspec_draft_model_cost_ms",
            "The controller's fit of what the hybrid's draft model costs: ms per draft token and "
            "per catch-up token", ["kind"],
            multiprocess_mode="mostrecent")

    def unregister(self) -> None:
        """Take these series out of their registry, so another Metrics may take the names."""
        for c in self._families:
            try:
                self._registry.unregister(c)
            except KeyError:  # already out
                pass

    def label(self, name: str) -> str:
        lab = self._labels.get(name)
        if lab is None:
            lab = name if len(self._labels) < self.max_classes else OTHER_CLASS
            if len(self._labels) < self.max_classes * 4:
                self._labels[name] = lab
        return lab

    def record_error(self) -> None:
        self.errors.inc()

    def record_payoff(self, held: str | None, loss_ms: float | None,
                      account_ms: float | None) -> None:
        """One step of the payoff guard: why it held the next step plain (None: it did not),
        what the measured step lost (> 0) or saved (< 0), and its account after (None: the
        guard does not gate, its account means nothing)."""
        if held is not None:
            self.payoff_held.labels(held).inc()
        if loss_ms is not None:
            if loss_ms > 0:
                self.payoff_lost.inc(loss_ms)
            else:
                self.payoff_saved.inc(-loss_ms)
        if account_ms is not None:
            self.payoff_account.set(account_ms)

    def record_draft_model(self, passes: int, catchup_tokens: int,
                           cost_ms: tuple[float, float] | None = None) -> None:
        """The draft model's forward passes and catch-up tokens of a step, and the controller's
        fit of its cost after it (ms per draft token, per catch-up token)."""
        self.draft_passes.inc(max(int(passes), 0))
        self.catchup_tokens.inc(max(int(catchup_tokens), 0))
        if cost_ms is not None:
            self.draft_cost.labels("per_token").set(cost_ms[0])
            self.draft_cost.labels("per_catchup_token").set(cost_ms[1])

    def record_confidence_cut(self, arrived: dict[str, int], removed: dict[str, int],
                              trimmed: dict[str, int]) -> None:
        """Drafts that reached Controller.cut with a confidence and the draft tokens it
        dropped from them; `trimmed`: the tokens it dropped from any draft. Per class name."""
        for name, n in arrived.items():
            self.confidence_drafts.labels(self.label(name)).inc(n)
        for name, n in removed.items():
            self.confidence_cut.labels(self.label(name)).inc(n)
        for name, n in trimmed.items():
            self.trimmed.labels(self.label(name)).inc(n)

    def record_fallback(self, class_names: Sequence[str], drafted: Sequence[int],
                        accepted: Sequence[int], proposers: Sequence[str] | None = None
                        ) -> None:
        """Decisions the controller could not make (a fault outside it): one per request.

        The step's drafted and accepted counts are facts about the engine, not the controller,
        so they are counted still: the draft and acceptance series stay equal to vLLM's own.
        `proposers`: who drafted each request's verified drafts."""
        if not class_names:
            return
        names, cls = np.unique(np.asarray(class_names, dtype=str), return_inverse=True)
        props, src = np.unique(np.asarray(proposers or ["unknown"] * len(cls), dtype=str),
                               return_inverse=True)
        self._record_drafts(list(names), cls, np.asarray(drafted, dtype=np.int64),
                            np.asarray(accepted, dtype=np.int64), list(props), src)
        for c, n in enumerate(np.bincount(cls, minlength=len(names))):
            self.steps.labels(self.label(str(names[c])), "fallback", "fallback", "none").inc(
                int(n))

    def _record_drafts(self, names: Sequence[str], cls: np.ndarray, drafted: np.ndarray,
                       accepted: np.ndarray, proposers: Sequence[str], src: np.ndarray
                       ) -> None:
        """Drafted and accepted tokens, in total per (class, proposer) and per position per
        class (cls indexes names, src proposers). Aggregated first so the Python work is per
        class, not per request."""
        n_cls, n_prop = len(names), len(proposers)
        kk = max(self.k_max, 1)
        d = np.clip(drafted, 0, kk)
        a = np.clip(accepted, 0, d)
        pair = cls * n_prop + src
        d_pair = np.bincount(pair, weights=d, minlength=n_cls * n_prop)
        a_pair = np.bincount(pair, weights=a, minlength=n_cls * n_prop)
        for i in np.flatnonzero(d_pair):
            c, p = divmod(int(i), n_prop)
            labels = (self.label(str(names[c])), proposers[p])
            self.draft_tokens.labels(*labels).inc(d_pair[i])
            self.accepted_tokens.labels(*labels).inc(a_pair[i])
        d_sum = np.bincount(cls, weights=d, minlength=n_cls)
        key_a = np.bincount(cls * (kk + 1) + a, minlength=n_cls * (kk + 1)).reshape(n_cls, kk + 1)
        key_d = np.bincount(cls * (kk + 1) + d, minlength=n_cls * (kk + 1)).reshape(n_cls, kk + 1)
        # position j was accepted by requests with a > j, drafted by those with d > j
        acc_pos = np.cumsum(key_a[:, :0:-1], axis=1)[:, ::-1]
        dr_pos = np.cumsum(key_d[:, :0:-1], axis=1)[:, ::-1]
        for c in np.flatnonzero(d_sum):
            lab = self.label(str(names[c]))
            for j in np.flatnonzero(dr_pos[c]):
                self.drafted_per_pos.labels(lab, str(j)).inc(dr_pos[c, j])
                if acc_pos[c, j]:
                    self.accepted_per_pos.labels(lab, str(j)).inc(acc_pos[c, j])

    def record_step(self, ctl: Controller, slots: np.ndarray, drafted: np.ndarray,
                    accepted: np.ndarray, ks: np.ndarray, reasons: np.ndarray,
                    sources: np.ndarray | None = None) -> None:
        """One step: what was verified (drafted by `sources`, None: the first proposer) and
        what was planned (K, its reason, and ctl.req_proposer for who drafts next)."""
        if slots.size == 0:
            return
        cls = ctl.req_class[slots]
        n_cls, n_prop = len(ctl.class_names), ctl.n_prop
        src = np.zeros_like(cls) if sources is None else np.asarray(sources, dtype=np.int64)
        self._record_drafts(ctl.class_names, cls, drafted, accepted, ctl.proposers, src)
        # Decisions per (class, kind, reason, proposer); the proposer only counts where it
        # drafts.
        kinds = decision_kinds(ks, reasons)
        who = np.where(kinds == 0, ctl.req_proposer[slots], n_prop)
        n_r = len(REASONS)
        key = ((cls * 4 + kinds) * n_r + reasons) * (n_prop + 1) + who
        dec = np.bincount(key, minlength=n_cls * 4 * n_r * (n_prop + 1)).reshape(
            n_cls, 4, n_r, n_prop + 1)
        props = (*ctl.proposers, "none")
        means = ctl.estimator.first_mean()  # (every step: not the whole posterior)
        for c in np.unique(cls):
            lab = self.label(ctl.class_names[c])
            for i, r, p in zip(*np.nonzero(dec[c]), strict=True):
                self.steps.labels(lab, DECISIONS[i], REASONS[r], props[p]).inc(dec[c, i, r, p])
            hist = self.chosen_k.labels(lab)
            for k, count in enumerate(np.bincount(ks[cls == c])):
                for _ in range(int(count)):
                    hist.observe(k)
            self.acceptance.labels(lab).set(float(means[c]))
        if np.isfinite(ctl.last_step_ms):
            self.step_time.labels("measured").set(ctl.last_step_ms)
        if np.isfinite(ctl.last_predicted_ms):
            self.step_time.labels("predicted").set(ctl.last_predicted_ms)
