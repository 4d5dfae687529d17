"""The controller: a draft's own confidence cuts it short, and a prior for another engine."""

from __future__ import annotations

import numpy as np
from controller_cases import policy, predict

from adaptspec.controller import Controller
from adaptspec.policy import ClassPolicy, CostModel, Policy

PRICED_TOKENS = CostModel(base_ms=10, per_request_ms=0.5, per_draft_token_ms=0.8,
                          spec_overhead_ms=0.0, knee_tokens=0, over_knee_ms=0.0, learn=False)


def _planned(**kw: object) -> tuple[Controller, np.ndarray, np.ndarray]:
    ctl = Controller(policy(cost_model=PRICED_TOKENS, **kw))
    slots = np.array([ctl.add_request(f"c{i}", "code") for i in range(8)])
    ks = ctl.step(slots, np.zeros(8), np.zeros(8), None)
    assert 0 < ks.min() and ks.max() < 8  # the price of a token binds: a real threshold
    return ctl, slots, ks


def test_confident_drafts_keep_the_plan_and_doubtful_ones_are_cut() -> None:
    ctl, slots, ks = _planned()
    assert ctl.cut(slots, ks, np.ones(8)).tolist() == ks.tolist()
    assert ctl.cut(slots, ks, np.full(8, 0.9)).tolist() == ks.tolist()  # as estimated
    low = ctl.cut(slots, ks, np.full(8, 0.05))
    assert (low < ks).all()
    # monotone in the confidence, never above what was drafted
    prev = np.zeros(8, dtype=np.int64)
    for c in np.linspace(0, 1, 21):
        got = ctl.cut(slots, ks, np.full(8, c))
        assert (got >= prev).all() and (got <= ks).all()
        prev = got
    # shorter drafts than planned (a proposer that found fewer tokens) are never lengthened
    assert ctl.cut(slots, np.ones(8, dtype=np.int64), np.ones(8)).tolist() == [1] * 8


def test_confidence_weight_zero_or_unknown_requests_leave_drafts_alone() -> None:
    ctl, slots, ks = _planned(confidence_weight=0.0)
    assert ctl.cut(slots, ks, np.zeros(8)).tolist() == ks.tolist()
    ctl, slots, ks = _planned(confidence_weight=1.0)
    # all weight on a confidence of 0 that nothing has calibrated: the first token stays, the
    # least that measures it (a cut token is never verified, and never calibrates)
    assert ctl.cut(slots, ks, np.zeros(8)).tolist() == [1] * 8
    other = np.array([ctl.add_request("late", "code")])  # joined after the decision
    assert ctl.cut(other, np.array([5]), np.zeros(1)).tolist() == [5]
    assert Controller(policy()).cut(slots, ks, np.zeros(8)).tolist() == ks.tolist()


def test_confidence_cut_keeps_forced_positions() -> None:
    classes = {"code": ClassPolicy(prior_acceptance=0.9, prior_strength=50, k_min=2)}
    ctl = Controller(Policy(classes=classes, default_class="code", exploration=0.0,
                            hysteresis_steps=1, cost_model=PRICED_TOKENS, confidence_weight=1.0))
    slots = np.array([ctl.add_request(f"c{i}", "code") for i in range(8)])
    ks = ctl.step(slots, np.zeros(8), np.zeros(8), None)
    assert ks.min() >= 2
    assert ctl.cut(slots, ks, np.zeros(8)).tolist() == [2] * 8


def test_a_prior_for_a_slower_engine_is_scaled_to_the_measured_steps() -> None:
    # The cpu preset is written for a 1.5B model (~290 ms steps, 40 ms a draft token). Under
    # a model 50x faster, steps measured without drafts must not leave a draft token at 40 ms:
    # then speculation would look ruinous forever and never be tried (bench --quick saw this).
    ctl = Controller(policy(cost_model=CostModel(preset="cpu"), exploration=0.0,
                            classes={"code": ClassPolicy(prior_acceptance=0.9)},
                            default_class="code"))
    slots = np.array([ctl.add_request(f"r{i}", "code") for i in range(4)])
    zeros = np.zeros(4, dtype=np.int64)
    ks = zeros
    for _ in range(40):  # plain steps at 6 ms, until the controller tries drafting
        ks = ctl.step(slots, zeros, zeros, 0.006)
        if ks.any():
            break
    assert ctl.cost.prior_scale < 0.05
    per_token = predict(ctl.cost, 4, 8, 2) - predict(ctl.cost, 4, 0, 0)
    assert per_token < 6.0  # the preset's shape (8 tokens ~ 0.8 of a step at B=4), not 320 ms
    assert ks.min() > 0, ks
