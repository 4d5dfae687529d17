"""The compiled kernels (adaptspec.fastpath) learn and decide exactly as the numpy reference
(adaptspec.step_reference) does: the same bits, on random batches of 1..512 requests and
random policies, uniform and not, with hysteresis, latency-critical classes, SLOs and
exploration; and the controller feeds them what the reference would be fed."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from adaptspec import fastpath
from adaptspec import step_reference as ref
from adaptspec.acceptance import PRIOR_MIN, AcceptanceEstimator
from adaptspec.controller import Controller
from adaptspec.cost import N_FEATURES
from adaptspec.learner import SHAPE_PLANS
from adaptspec.policy import ClassPolicy, CostModel, Policy

SIZES = [1, 2, 3, 7, 16, 64, 100, 256, 511, 512]


def _feedback_case(rng: np.random.Generator, n: int) -> tuple:
    kk, n_cls, cap = int(rng.integers(1, 13)), int(rng.integers(1, 8)), n + 8
    ev = rng.random((n_cls, 4 * kk)) * rng.choice([0.0, 1.0, 50.0], (n_cls, 4 * kk))
    records = rng.random((2, cap)) * 20
    # slots may repeat (the last write wins on both paths); feedback may be nonsense
    slots = rng.integers(0, cap, n) if rng.random() < 0.2 else rng.permutation(cap)[:n]
    drafted = rng.integers(-2, kk + 3, n)
    accepted = rng.integers(-2, kk + 3, n)
    if rng.random() < 0.2:
        drafted[:] = rng.integers(-1, 1)  # nothing drafted: only the class evidence decays
    decay = float(rng.choice([1.0, 0.98, 0.5]))
    return (ev, kk, decay, rng.integers(0, n_cls, n), records, slots, drafted, accepted,
            float(rng.choice([1.0, 0.9])))


@pytest.mark.parametrize("n", SIZES)
def test_feedback_equals_reference(n: int) -> None:
    rng = np.random.default_rng(n)
    for _ in range(20):
        ev, kk, decay, cls, records, slots, drafted, accepted, req_decay = _feedback_case(rng, n)
        ev2, records2 = ev.copy(), records.copy()
        got = fastpath.feedback(ev, ev.shape[0], kk, decay, cls, records, slots, drafted,
                                accepted, req_decay)
        want = ref.feedback(ev2, kk, decay, cls, records2, slots, drafted, accepted, req_decay)
        np.testing.assert_array_equal(got[0], want[0])
        assert got[1:] == want[1:]
        np.testing.assert_array_equal(ev, ev2)
        np.testing.assert_array_equal(records, records2)


@pytest.mark.parametrize("seed", range(5))
def test_posterior_equals_reference(seed: int) -> None:
    """The posterior kernel reads what the numpy reference reads, priors moved along the
    draft, on random evidence (none, some, much; priors near 0 and 1)."""
    rng = np.random.default_rng(seed)
    for _ in range(20):
        kk, n_cls = int(rng.integers(1, 13)), int(rng.integers(1, 9))
        est = AcceptanceEstimator(n_cls + 2, kk)
        for c in range(n_cls):
            est.set_prior(c, rng.uniform(0.0, 1.0, kk), float(rng.choice([0.5, 1.0, 20.0])))
        est.succ[:] = rng.random(est.succ.shape) * rng.choice([0.0, 3.0, 300.0])
        est.fail[:] = rng.random(est.fail.shape) * rng.choice([0.0, 3.0, 300.0])
        est.active = n_cls
        want = ref.posterior(est.ev[:n_cls], kk, PRIOR_MIN)
        np.testing.assert_array_equal(est.posterior_sums(), want)


def _decide_case(rng: np.random.Generator, n: int) -> tuple:
    """Arguments of decide for a random batch under a random policy."""
    kk, n_cls = int(rng.integers(1, 13)), int(rng.integers(1, 7))
    if rng.random() < 0.5:  # uniform: every class may draft 0..k_max, or nothing
        k_min = np.zeros(n_cls, dtype=np.int64)
        k_max = np.where(rng.random(n_cls) < 0.2, 0, kk)
    else:
        k_max = np.where(rng.random(n_cls) < 0.2, 0, rng.integers(1, kk + 1, n_cls))
        k_min = np.minimum(rng.integers(0, 3, n_cls) * (rng.random(n_cls) < 0.4), k_max)
    kind = np.where(k_max == 0, rng.integers(1, 3, n_cls), 1)  # latency-critical or closed
    coef = rng.random(N_FEATURES) * rng.choice([0.0, 0.01, 1.0, 40.0], N_FEATURES)
    coef[0] = float(rng.choice([0.0, 5.0, 250.0]))  # (0: the floor under step times)
    slo = np.where(rng.random(n_cls) < 0.3, coef[0] * rng.uniform(0.9, 1.3, n_cls), np.inf)
    est = AcceptanceEstimator(n_cls, kk)
    for c in range(n_cls):
        est.set_prior(c, rng.uniform(0.05, 0.99, kk), float(rng.choice([1.0, 20.0])))
    est.succ[:] = rng.random((n_cls, kk)) * rng.choice([0.0, 30.0])
    est.fail[:] = rng.random((n_cls, kk)) * rng.choice([0.0, 10.0])
    cap = n + 8
    slots = rng.integers(0, cap, n) if rng.random() < 0.1 else rng.permutation(cap)[:n]
    sn = rng.random((2, n)) * rng.choice([0.0, 5.0, 40.0])
    sn[0] = np.minimum(sn[0], sn[1])
    if rng.random() < 0.3:  # one record for all: a class's requests tie in every bin
        sn[:] = sn[:, :1]
    explore = rng.random(n) < float(rng.choice([0.0, 0.05, 0.5]))
    if rng.random() < 0.2:
        explore = np.zeros(0, dtype=bool)  # exploration off
    z = rng.standard_normal((int(explore.sum()), kk)) if explore.any() else np.zeros((0, 1))
    # the shape residuals: none, or some (negative ones too: a shape faster than the formula),
    # shorter than the plans at times (the last entry prices the rest)
    shape = np.zeros(1 + int(rng.integers(0, kk * n + 3)))
    if rng.random() < 0.6:
        shape[1:] = rng.normal(0.0, coef[0] * 0.2 + 1.0, shape.size - 1)
    hyst = (int(rng.choice([1, 2, 3])), rng.integers(0, kk + 1, cap), rng.integers(0, 2, cap))
    n0 = rng.choice([1e-3, 1.0, 6.0, 1e3], n_cls)  # the shrinkage per class (RequestSpread)
    return (est.posterior_sums(), k_min, k_max, kind, slo, n0, sn,
            rng.integers(0, n_cls, n), explore, z, coef, float(rng.choice([0.0, 1.0, 40.5])),
            shape, float(rng.choice([0.0, 0.05, 0.3])), *hyst, slots)


@pytest.mark.parametrize("n", SIZES)
def test_decide_equals_reference(n: int) -> None:
    rng = np.random.default_rng(1000 + n)
    drafting = 0
    for _ in range(40):
        args = _decide_case(rng, n)
        prev_k, votes = args[15], args[16]
        copies = (prev_k.copy(), votes.copy())
        got = fastpath.decide(*args)
        want = ref.decide(*args[:15], *copies, args[17])
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(prev_k, copies[0])
        np.testing.assert_array_equal(votes, copies[1])
        drafting += int(got[0].any())
    assert drafting > 5  # the cases are not all K = 0


def _tied_beside_critical(slack: float) -> tuple:
    """decide's arguments for four requests of one class without records (tied in every bin)
    beside a latency-critical one; a step costs 80 ms plus 3.5 ms a draft token."""
    kk = 4
    est = AcceptanceEstimator(2, kk)
    est.set_prior(0, np.full(kk, 0.6), 20.0)
    est.set_prior(1, np.full(kk, 0.6), 20.0)
    coef = np.zeros(N_FEATURES)
    coef[0], coef[2] = 80.0, 3.5
    cap = 8
    return (est.posterior_sums(), np.zeros(2, dtype=np.int64), np.array([kk, 0]),
            np.array([1, 2]), np.full(2, np.inf), np.ones(2), np.zeros((2, 5)),
            np.array([0, 0, 0, 0, 1]), np.zeros(0, dtype=bool), np.zeros((0, 1)), coef,
            1000.0, np.zeros(1), slack, 1, np.zeros(cap, dtype=np.int64),
            np.zeros(cap, dtype=np.int64), np.arange(5))


@pytest.mark.parametrize(("slack", "drafts"), [(0.0, 0), (0.05, 1), (0.1, 2), (0.2, 4)])
def test_a_limit_takes_part_of_a_tied_bin(slack: float, drafts: int) -> None:
    """Beside a latency-critical request the step may take `slack` over plain: as many draft
    tokens as fit (3.5 ms each over 80), where the four tied first positions go in together
    or not at all (a 5% slack fits one, 10% two), first positions before second ones."""
    args = _tied_beside_critical(slack)
    ks, kinds, _, _, ms = fastpath.decide(*args)
    assert int(ks.sum()) == drafts and ks[4] == 0
    assert ks.max() <= max(1, drafts - 3)  # the first positions go in before any second
    assert ms == pytest.approx(80.0 + 3.5 * drafts) and ms <= 80.0 * (1 + slack)
    assert kinds[4] == 2
    want = ref.decide(*args)
    for a, b in zip((ks, kinds, *fastpath.decide(*args)[2:]), want, strict=True):
        np.testing.assert_array_equal(a, b)


def _policies() -> dict[str, Policy]:
    def classes(slo_ms: float | None) -> dict[str, ClassPolicy]:
        return {
            "code": ClassPolicy(prior_acceptance=0.9),
            "chat": ClassPolicy(prior_acceptance=[0.8, 0.7, 0.6, 0.5]),
            "creative": ClassPolicy(prior_acceptance=0.5, itl_slo_ms=slo_ms),
            "interactive": ClassPolicy(latency_critical=True),
        }

    base = {"default_class": "chat", "exploration": 0.2, "hysteresis_steps": 3,
            "latency_critical_slack": 0.05}
    return {
        "gpu": Policy(**base, classes=classes(9.0), cost_model=CostModel(preset="gpu")),
        # per-draft-position costs (maxK, B * maxK) and a hinge, no hysteresis, no exploration
        "custom": Policy(**{**base, "exploration": 0.0, "hysteresis_steps": 1},
                         classes=classes(None),
                         cost_model=CostModel(base_ms=5, per_request_ms=0.05,
                                              per_draft_token_ms=0.01,
                                              per_draft_position_ms=0.2, spec_overhead_ms=0.1,
                                              knee_tokens=40, over_knee_ms=0.03,
                                              per_request_pass_ms=0.01)),
        # not uniform: a forced draft, a shorter k_max
        "mixed": Policy(**base, classes={**classes(9.0),
                                         "code": ClassPolicy(prior_acceptance=0.9, k_min=1),
                                         "chat": ClassPolicy(prior_acceptance=0.7, k_max=3)},
                        cost_model=CostModel(preset="cpu")),
    }


def _reference_step(ctl: Controller, slots: np.ndarray, drafted: np.ndarray,
                    accepted: np.ndarray, step_s: float) -> np.ndarray:
    """Controller.step through the reference, on `ctl` (a copy of the controller before the
    step): the same feedback, step-time model update, random draws and decision."""
    est, p, kk = ctl.estimator, ctl.policy, ctl.k_max
    ctl.steps += 1
    cls = ctl.req_class[slots]
    sn, spec, longest = ref.feedback(est.ev[: est.active], est.k_max, est.forgetting, cls,
                                     ctl.requests.sn, slots, drafted, accepted,
                                     ctl.requests.forgetting)
    ctl.cost.partial_fit(len(slots), spec, longest, step_s * 1e3)
    # (a latency-critical request's budget is the learner's own bookkeeping, not the kernel's)
    slack = ctl._latency_slack(slots[ctl.cls_kind[cls] > 1], len(slots), spec, step_s)
    if not ctl.cls_k_max[cls].any():
        return np.zeros(len(slots), dtype=np.int64)
    explore, z = np.zeros(0, dtype=bool), np.zeros((0, 1))
    if p.exploration > 0:
        explore = ctl.rng.random(len(slots)) < p.exploration
        if explore.any():
            z = ctl.rng.standard_normal((int(explore.sum()), kk))
    return ref.decide(est.posterior_sums(), ctl.cls_k_min, ctl.cls_k_max, ctl.cls_kind,
                      ctl.cls_slo_ms, ctl.spread.shrinkage, sn, cls, explore, z,
                      ctl.cost.coef_at(len(slots)), ctl.cost.knee,
                      ctl.cost.shape_offset(len(slots),
                                            np.arange(min(kk * len(slots), SHAPE_PLANS) + 1)),
                      slack, p.hysteresis_steps, ctl.req_prev_k, ctl.req_votes, slots)[0]


@pytest.mark.parametrize("name", ["gpu", "custom", "mixed"])
def test_controller_steps_as_the_reference(name: str) -> None:
    """A controller fed changing batches, random and bad feedback, decides at every step what
    the reference decides from the same state and the same random draws, and learns the same."""
    policy = _policies()[name]
    rng = np.random.default_rng(3)
    ctl = Controller(policy, seed=3)
    names = list(policy.classes)
    live: list[str] = []
    nxt, total = 0, 0
    for t in range(300):
        if t % 25 == 0 or not live:  # a new batch now and then, of a varying size
            for r in live[: len(live) // 2]:
                ctl.remove_request(r)
            live = live[len(live) // 2:]
            for _ in range(int(rng.integers(1, 300 if t % 100 == 50 else 48))):
                cls = names[-1] if (t // 25) % 2 and nxt % 10 == 9 else names[nxt % 3]
                live.append(f"r{nxt}")
                ctl.add_request(live[-1], cls)
                nxt += 1
        slots = np.array([ctl.slot(r) for r in live], dtype=np.int64)
        drafted = rng.integers(0, policy.k_max + 1, size=len(live))
        accepted = rng.binomial(drafted, 0.7)
        if t % 40 == 7:  # bad feedback now and then
            drafted[0], accepted[-1] = -1, policy.k_max + 3
        step_s = float(rng.lognormal(np.log(0.005 * (1 + 0.01 * len(live))), 0.1))
        shadow = copy.deepcopy(ctl)
        got = ctl.step(slots, drafted, accepted, step_s)
        np.testing.assert_array_equal(got, _reference_step(shadow, slots, drafted, accepted,
                                                           step_s))
        total += int(got.sum())
    for a, b in [(ctl.estimator.ev, shadow.estimator.ev), (ctl.requests.sn, shadow.requests.sn),
                 (ctl.req_prev_k, shadow.req_prev_k), (ctl.req_votes, shadow.req_votes),
                 (ctl.cost.coef, shadow.cost.coef)]:
        np.testing.assert_array_equal(a, b)
    assert ctl.errors == 0 and total > 0
