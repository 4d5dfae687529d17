"""One owner for K: every reason of Controller.plan reached, the plan carried unchanged to the
proposers (ours and vLLM's)."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from adaptspec.classify import RequestInfo
from adaptspec.controller import Controller
from adaptspec.plan import REASONS, StepFeedback
from adaptspec.policy import ClassPolicy, CostModel, Payoff, Policy
from adaptspec.runtime import AdaptiveRuntime

FREE = CostModel(base_ms=10, per_request_ms=0.1, per_draft_token_ms=0.0, spec_overhead_ms=0.0,
                 knee_tokens=1e6, over_knee_ms=0.0, learn=False)
CLASSES = {"code": ClassPolicy(prior_acceptance=0.9, prior_strength=50),
           "short": ClassPolicy(prior_acceptance=0.9, prior_strength=50, k_max=2),
           "chat": ClassPolicy(prior_acceptance=0.9, prior_strength=50),
           "interactive": ClassPolicy(latency_critical=True)}


def make_policy(**kw: Any) -> Policy:
    base: dict = {"classes": CLASSES, "default_class": "chat", "exploration": 0.0,
                  "hysteresis_steps": 1, "cost_model": FREE, "fallback_k": 1,
                  "payoff": Payoff(enabled=False)}
    base.update(kw)
    return Policy(**base)


def runtime(k_cap: int = 8, **kw: Any) -> AdaptiveRuntime:
    rt = AdaptiveRuntime(make_policy(**kw), k_cap=k_cap)
    for rid, cls in (("c", "code"), ("s", "short"), ("i", "interactive")):
        rt.admit(rid, RequestInfo(extra_args={"adaptspec_class": cls}))
    return rt


def reasons(rt: AdaptiveRuntime, ids: str = "csi") -> list[str | None]:
    plan = rt.plan_for(list(ids))
    return [plan.reason_of(r) for r in ids]


def test_new_requests_are_planned_by_their_class() -> None:
    rt = runtime(k_cap=6)
    plan = rt.plan_for(list("csi"))
    assert plan.k.tolist() == [6, 2, 0]
    assert reasons(rt) == ["new_request", "new_request", "latency_critical"]


def test_a_new_request_gets_what_its_class_got_last() -> None:
    """Before any decision a new request gets its class's k_max; once the class has been
    decided, the longest K its requests got then (under async scheduling this K is also
    verified at the request's first decode, scheduled before its prefill's feedback)."""
    rt = runtime(k_cap=6)
    assert rt.k_for("c") == 6
    rt.step(list("csi"), [0, 0, 0], [0, 0, 0], 0.01)
    assert rt.k_for("c") == 6 and reasons(rt, "c") == ["engine_cap"]
    rt.admit("n", RequestInfo(extra_args={"adaptspec_class": "code"}))
    assert rt.k_for("n") == 6  # (the class's decision, 8, within the engine's cap)
    rt.controller.class_k["code"] = 3  # the class's requests got 3 at its last decision
    assert rt.k_for("n") == 3 and reasons(rt, "n") == ["new_request"]


def test_learned_class_cap_and_latency_critical() -> None:
    rt = runtime()
    rt.step(list("csi"), [0, 0, 0], [0, 0, 0], 0.01)
    plan = rt.plan_for(list("csi"))
    # acceptance 0.9 and free drafts: code drafts what the policy allows, short is capped
    assert plan.k.tolist() == [8, 2, 0]
    assert reasons(rt) == ["learned", "class_cap", "latency_critical"]


def test_engine_cap() -> None:
    rt = runtime(k_cap=3)
    rt.step(list("csi"), [0, 0, 0], [0, 0, 0], 0.01)
    assert rt.plan_for(list("cs")).k.tolist() == [3, 2]
    assert reasons(rt, "cs") == ["engine_cap", "class_cap"]


def test_exploring() -> None:
    rt = runtime(exploration=0.5)
    ids = [f"e{i}" for i in range(40)]
    for r in ids:
        rt.admit(r, RequestInfo(extra_args={"adaptspec_class": "code"}))
    rt.step(ids, [0] * 40, [0] * 40, 0.01)
    plan = rt.plan_for(ids)
    assert {plan.reason_of(r) for r in ids} == {"exploring", "learned"}


def test_guard_hold_holds_decided_and_new_requests() -> None:
    rt = runtime(payoff=Payoff(enabled=True))
    rt.step(list("csi"), [0, 0, 0], [0, 0, 0], 0.01)  # no plain step measured yet: held
    assert rt.guard.last_hold == "measure"
    assert rt.plan_for(list("csi")).k.tolist() == [0, 0, 0]
    assert reasons(rt) == ["guard_hold", "guard_hold", "latency_critical"]
    rt.admit("n", RequestInfo(extra_args={"adaptspec_class": "code"}))
    assert rt.k_for("n") == 0 and reasons(rt, "n") == ["guard_hold"]


def test_fallback_within_the_class(monkeypatch: pytest.MonkeyPatch) -> None:
    rt = runtime()

    def boom(*a: object, **k: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(rt.controller, "_step", boom)
    rt.step(list("csi"), [0, 0, 0], [0, 0, 0], 0.01)
    assert rt.plan_for(list("csi")).k.tolist() == [1, 1, 0]
    assert reasons(rt) == ["fallback"] * 3
    assert rt.errors == 1


def run(alpha: float, k: int, rng: np.random.Generator) -> int:
    """Accepted drafts of a draft of k whose every position is accepted with prob alpha."""
    a = 0
    while a < k and rng.random() < alpha:
        a += 1
    return a


def test_pass_cost() -> None:
    """A draft model that pays alone, beside a latency-critical request: its passes are cut
    to the slack, and the plan says so."""
    pol = Policy(classes={"math": ClassPolicy(), "interactive": ClassPolicy(latency_critical=True)},
                 default_class="math", latency_critical_slack=0.25,
                 cost_model=CostModel(base_ms=10, per_request_ms=0.5, per_draft_token_ms=0.3,
                                      spec_overhead_ms=0.0, knee_tokens=0, over_knee_ms=0.0,
                                      learn=False))
    ctl = Controller(pol, seed=0, proposers=("ngram", "suffix", "draft"))
    ids = ["m0", "m1", "m2", "i"]
    for r in ids:
        ctl.admit(r, "interactive" if r == "i" else "math")
    rng = np.random.default_rng(0)
    plan = ctl.plan_for(ids)
    seen: set[str] = set()
    for _ in range(200):
        acc = np.array([run(0.95 if p == 2 else 0.05, k, rng)
                        for p, k in zip(plan.proposer.tolist(), plan.k.tolist(), strict=True)])
        passes = int(plan.k[plan.proposer == 2].sum())
        if passes:
            ctl.record_pass_cost(2, 1.0 * passes, passes)
        plan = ctl.plan(StepFeedback(ids, plan.k, acc, 0.01, plan.proposer))
        seen.update(plan.reason_of(r) for r in ids)
    assert "pass_cost" in seen, seen


def test_every_reason_is_a_bounded_label_of_the_step_counter() -> None:
    from prometheus_client import CollectorRegistry

    from adaptspec.metrics import Metrics

    reg = CollectorRegistry()
    pol = make_policy()
    rt = AdaptiveRuntime(pol, k_cap=3, metrics=Metrics(pol.max_classes, pol.k_max, registry=reg))
    for rid, cls in (("c", "code"), ("s", "short"), ("i", "interactive")):
        rt.admit(rid, RequestInfo(extra_args={"adaptspec_class": cls}))
    rt.step(list("csi"), [0, 0, 0], [0, 0, 0], 0.01)
    labels = {s.labels["reason"] for m in reg.collect() for s in m.samples
              if s.name == "adaptspec_steps_total"}
    assert labels == {"engine_cap", "class_cap", "latency_critical"}
    assert labels <= set(REASONS)


# ------------------------------------------------------------------ the plan, carried


class _Spy:
    def __init__(self) -> None:
        self.asked: dict[str, int] = {}

    def propose(self, req_id: str, token_ids: Any, k: int) -> Any:
        self.asked[req_id] = k
        return SimpleNamespace(tokens=[7] * k, confidence=0.5)

    def remove_request(self, req_id: str) -> None:
        pass


def _fake_vllm_schedule(monkeypatch: pytest.MonkeyPatch, scheduler: type, out: Any) -> None:
    """vLLM's schedule() reduced to what the AdaptiveScheduler relies on: it ends by calling
    _update_after_schedule on the step's output (vLLM's own part of that call is skipped)."""
    monkeypatch.setattr(scheduler, "_update_after_schedule", lambda self, o: None)
    monkeypatch.setattr(scheduler, "schedule",
                        lambda self, *a, **k: (self._update_after_schedule(out), out)[1])


def test_the_proposers_are_asked_for_the_plans_k(monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """The scheduler attaches the plan, and only it: our proposer is asked for each request's K
    (a new one's too), vLLM's draft the plan's longest K; a DEBUG line gives the plan."""
    from adaptspec_vllm import proposer as prop
    from adaptspec_vllm import scheduler as sched
    from vllm.v1.core.sched.scheduler import Scheduler

    rt = runtime(k_cap=8)
    rt.step(list("cs"), [0, 0], [0, 0], 0.01)  # c, s decided; i and n still new
    rt.admit("n", RequestInfo(extra_args={"adaptspec_class": "short"}))
    ids = ["c", "s", "i", "n"]
    out = SimpleNamespace(num_scheduled_tokens={r: 1 for r in ids},
                          num_spec_tokens_to_schedule=8)
    _fake_vllm_schedule(monkeypatch, Scheduler, out)
    s = sched.AdaptiveScheduler.__new__(sched.AdaptiveScheduler)
    s.runtime = rt
    with caplog.at_level(logging.DEBUG, logger="vllm.adaptspec"):
        got = s.schedule()
    plan = got.adaptspec_plan
    expected = rt.plan_for(ids)
    assert plan.k.tolist() == expected.k.tolist() == [8, 2, 0, 2]
    assert [plan.reason_of(r) for r in ids] == ["learned", "class_cap", "latency_critical",
                                                "new_request"]
    assert got.num_spec_tokens_to_schedule == 8  # vLLM's proposers: the longest K
    assert any("n:K=2(new_request)" in r.getMessage() for r in caplog.records)

    spy = _Spy()
    monkeypatch.setattr(prop.NgramProposer, "make_core", lambda self: spy)
    monkeypatch.setattr(prop, "_install_runner_hook", lambda: None)
    p = prop.NgramProposer(SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=8)))
    prop._step.req_ids, prop._step.plan, prop._step.report = ids, plan, None
    try:
        p.propose([[1]] * 4, [10] * 4, np.arange(40).reshape(4, 10))
    finally:
        prop._step.req_ids = prop._step.plan = None
    # asked exactly the plan's K; K = 0 never asked
    assert spy.asked == {r: plan.k_of(r) for r in ids if plan.k_of(r) > 0}


def test_a_plain_plan_asks_vllms_proposers_for_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from adaptspec_vllm import scheduler as sched
    from vllm.v1.core.sched.scheduler import Scheduler

    rt = runtime()
    out = SimpleNamespace(num_scheduled_tokens={"i": 1}, num_spec_tokens_to_schedule=8)
    _fake_vllm_schedule(monkeypatch, Scheduler, out)
    s = sched.AdaptiveScheduler.__new__(sched.AdaptiveScheduler)
    s.runtime = rt
    assert s.schedule().num_spec_tokens_to_schedule == 0
