"""The controller: a draft's own confidence cuts it short, and a prior for another engine."""

from __future__ import annotations

import numpy as np
from controller_cases import policy, predict

from adaptspec.controller import Controller
from adaptspec.cost import OFFSET_PRIOR_STEPS
from adaptspec.policy import ClassPolicy, CostModel, Policy

PRICED_TOKENS = CostModel(base_ms=10, per_request_ms=0.5, per_draft_token_ms=0.8,
                          spec_overhead_ms=0.0, knee_tokens=0, over_knee_ms=0.0, learn=False)


def _planned(**kw: object) -> tuple[Controller, np.ndarray, np.ndarray]:
    ctl = Controller(policy(cost_model=PRICED_TOKENS, **kw))
    slots = np.array([ctl.add_request(f"c{i}", "code") for i in range(8)])
    ks = ctl.step(slots, np.zeros(8), np.zeros(8), None)
    assert 0 < ks.min() and ks.max() < 8  # the price of a token binds: a real threshold
    return ctl, slots, ks


def test_an_uncalibrated_confidence_ranks_drafts_and_sets_no_level() -> None:
    # One confidence for every draft says nothing about the level of acceptance: read as a
    # level, an n-gram's prior of 0.4 cut chat drafts accepted at 0.7 on a fresh server.
    for c in (0.05, 0.4, 1.0):
        ctl, slots, ks = _planned()
        assert ctl.cut(slots, ks, np.full(8, c)).tolist() == ks.tolist()
    # Mixed, the doubtful drafts are cut short and the confident ones keep the plan;
    # monotone in the confidence and never above what was drafted.
    ctl, slots, ks = _planned()
    conf = np.linspace(0.0, 1.0, 8)
    got = ctl.cut(slots, ks, conf)
    assert got[0] < ks[0] and got[-1] == ks[-1], (got, ks)
    assert (np.diff(got) >= 0).all() and (got <= ks).all()
    # shorter drafts than planned (a proposer that found fewer tokens) are never lengthened
    assert ctl.cut(slots, np.ones(8, dtype=np.int64), np.ones(8)).tolist() == [1] * 8


def test_a_larger_weight_moves_uncalibrated_drafts_further() -> None:
    conf = np.linspace(0.0, 1.0, 8)
    kept = []
    for w in (0.25, 0.5, 1.0):
        ctl, slots, ks = _planned(confidence_weight=w)
        kept.append(int(ctl.cut(slots, ks, conf)[:4].sum()))
    assert kept[0] >= kept[1] >= kept[2] and kept[0] > kept[2], kept


def test_confidence_weight_zero_or_unknown_requests_leave_drafts_alone() -> None:
    ctl, slots, ks = _planned(confidence_weight=0.0)
    assert ctl.cut(slots, ks, np.linspace(0.0, 1.0, 8)).tolist() == ks.tolist()
    ctl, slots, ks = _planned(confidence_weight=1.0)
    # all weight on a confidence of 0 far below its row's others, and nothing calibrated: the
    # first token stays, the least that measures it (a cut token is never verified, and never
    # calibrates)
    conf = np.where(np.arange(8) < 4, 0.0, 1.0)
    assert ctl.cut(slots, ks, conf)[:4].tolist() == [1] * 4
    other = np.array([ctl.add_request("late", "code")])  # joined after the decision
    assert ctl.cut(other, np.array([5]), np.zeros(1)).tolist() == [5]
    assert Controller(policy()).cut(slots, ks, np.zeros(8)).tolist() == ks.tolist()


def test_drafts_without_a_confidence_are_trimmed_to_the_step_shape() -> None:
    # vLLM's own proposers give no confidence (NaN): their drafts keep the plan's values, as
    # drafts of one shared confidence do, and are trimmed to the step shape that pays.
    none = np.full(8, np.nan)
    ctl, slots, ks = _planned()
    assert ctl.cut(slots, ks, none).tolist() == ks.tolist()  # prices linear: the plan stands
    for w in (0.5, 0.0):  # (confidence_weight 0 turns confidences off, not the trim)
        ctl, slots, ks = _planned(confidence_weight=w)
        total = int(ks.sum())
        # a step of 8 requests costs 1 s more from half the planned draft tokens on (a jump
        # like a kernel's tile size): far more than the tokens past it can make
        ctl.cost.shape_sum[8, total // 2:] = 1000.0 * OFFSET_PRIOR_STEPS
        got = ctl.cut(slots, ks, none)
        assert 0 < got.sum() < total // 2 and (got <= ks).all(), (got, ks)
        assert ctl.cut(slots, ks, np.full(8, 0.5)).tolist() == got.tolist()
    # nothing calibrates on drafts without a confidence
    ctl, slots, ks = _planned()
    ctl.cut(slots, ks, none)
    assert ctl.confidence.seen_n.sum() == 0


def test_confidence_cut_keeps_forced_positions() -> None:
    classes = {"code": ClassPolicy(prior_acceptance=0.9, prior_strength=50, k_min=2)}
    ctl = Controller(Policy(classes=classes, default_class="code", exploration=0.0,
                            hysteresis_steps=1, cost_model=PRICED_TOKENS, confidence_weight=1.0))
    slots = np.array([ctl.add_request(f"c{i}", "code") for i in range(8)])
    ks = ctl.step(slots, np.zeros(8), np.zeros(8), None)
    assert ks.min() >= 2
    conf = np.where(np.arange(8) < 4, 0.0, 1.0)
    assert ctl.cut(slots, ks, conf)[:4].tolist() == [2] * 4


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


def test_a_learned_k_bounds_nothing_once_the_drafts_show_who_has_none() -> None:
    """The plan gave every request its K as if each drafted; where only two drafts come (the
    others found no match), the cut may spend on those two what the others left, never more
    than the plan's draft tokens in all, and a draft the plan gave nothing keeps no token on
    an uncalibrated confidence alone."""
    ctl, slots, ks = _planned()
    plan = ctl.plan_for([f"c{i}" for i in range(8)])
    bounds = ctl.draft_bounds(plan)
    assert (bounds == ctl.policy.class_k_max("code")).all() and (bounds >= ks).all()
    none = np.full(2, np.nan)
    two = np.full(2, 8, dtype=np.int64)
    got = ctl.cut(slots[:2], two, none, ks[:2])
    assert (got > ks[:2]).any() and (got <= two).all() and got.sum() <= ks.sum(), (got, ks)
    # every draft came: the plan's draft tokens bound the step as before
    got = ctl.cut(slots, np.full(8, 8, dtype=np.int64), np.full(8, np.nan), ks)
    assert got.sum() <= ks.sum()
    # planned nothing, doubtful, uncalibrated: not forced to its first token
    ctl, slots, ks = _planned(confidence_weight=1.0)
    conf = np.where(np.arange(8) < 4, 0.0, 1.0)
    assert ctl.cut(slots, ks, conf)[:4].tolist() == [1] * 4  # (planned: forced to one)
    assert ctl.cut(slots, ks, conf, np.zeros(8, dtype=np.int64))[:4].tolist() == [0] * 4


def test_bounds_and_holds_stay_the_draft_bound() -> None:
    from adaptspec import plan as why
    from adaptspec.plan import StepPlan

    ctl, slots, ks = _planned()
    ids = [f"c{i}" for i in range(4)]
    reasons = [why.LEARNED, why.GUARD_HOLD, why.CLASS_CAP, why.EXPLORING]
    plan = StepPlan(ids, np.array([0, 0, 3, 1]), np.zeros(4),
                    np.array([why.CODE[r] for r in reasons]))
    k_max = ctl.policy.class_k_max("code")
    assert ctl.draft_bounds(plan).tolist() == [k_max, 0, 3, k_max]
    lc = ctl.add_request("lc", "interactive")
    ctl.step(np.array([lc]), np.zeros(1), np.zeros(1), None)
    assert ctl.draft_bounds(ctl.plan_for(["lc"])).tolist() == [0]
