"""The controller: estimator arithmetic, cost model, joint decisions, safety."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from controller_cases import COSTLY_TOKENS, fit, policy, predict, run_chain

from adaptspec.acceptance import AcceptanceEstimator, RequestAcceptance, learn
from adaptspec.controller import Controller
from adaptspec.cost import StepCostModel, step_time
from adaptspec.policy import ClassPolicy, CostModel, Policy


def test_estimator_counts_prefix_successes_and_first_failure() -> None:
    est = AcceptanceEstimator(2, 4, forgetting=1.0)
    fit(est, [0, 0, 1], [3, 4, 2], [1, 4, 2])
    # request 0: accepted pos 0, rejected pos 1, pos 2 unobserved
    # request 1: accepted all 4; request 2 (class 1): accepted both of 2
    np.testing.assert_array_equal(est.succ[0], [2, 1, 1, 1])
    np.testing.assert_array_equal(est.fail[0], [0, 1, 0, 0])
    np.testing.assert_array_equal(est.succ[1], [1, 1, 0, 0])
    np.testing.assert_array_equal(est.fail[1], [0, 0, 0, 0])


def test_estimator_learns_per_position_and_tracks_drift() -> None:
    rng = np.random.default_rng(1)
    est = AcceptanceEstimator(1, 4, forgetting=0.98)
    est.set_prior(0, [0.5] * 4, 2.0)
    truth = np.array([0.9, 0.8, 0.7, 0.6])
    cls = np.zeros(32, dtype=np.int64)
    k = np.full(32, 4)
    for _ in range(300):
        fit(est, cls, k, run_chain(truth, k, rng))
    np.testing.assert_allclose(est.mean()[0], truth, atol=0.05)
    for _ in range(300):  # acceptance drifts down: forgetting lets the estimate follow
        fit(est, cls, k, run_chain(truth - 0.4, k, rng))
    np.testing.assert_allclose(est.mean()[0, :2], (truth - 0.4)[:2], atol=0.06)
    # A position ages as far as it is observed: position 3, now reached by 6% of the drafts
    # (0.5 * 0.4 * 0.3), has aged 300 * 0.06 = 18 steps; 2700 more make 160.
    for _ in range(2700):
        fit(est, cls, k, run_chain(truth - 0.4, k, rng))
    np.testing.assert_allclose(est.mean()[0], truth - 0.4, atol=0.06)


def test_positions_few_drafts_reach_are_not_read_as_the_prior() -> None:
    # An n-gram's shape (issue 34's measurement): the first tokens accepted at 0.7, a run
    # that reached the third almost always continues. A batch of 4 drafting 8 tokens reaches
    # position 8 in about a third of its drafts; aged every step, that evidence would be a
    # third of the first position's, and the flat prior would pull the estimate down.
    rng = np.random.default_rng(2)
    truth = np.array([0.7, 0.7, 0.95, 0.95, 0.95, 0.95, 0.95, 0.95])
    est = AcceptanceEstimator(1, 8, forgetting=0.98)
    est.set_prior(0, [0.65] * 8, 10.0)
    cls, k = np.zeros(4, dtype=np.int64), np.full(4, 8)
    for _ in range(600):
        fit(est, cls, k, run_chain(truth, k, rng))
    held = est.succ[0] + est.fail[0]
    # every position holds as much evidence as the first: 4 drafts a step, 1 / (1 - 0.98)
    # steps (within the sampling noise of the shares reached)
    np.testing.assert_allclose(held, 4 / 0.02, rtol=0.2)
    # so the estimate is within a few standard deviations of the truth (sd <= 0.04 at 200)
    np.testing.assert_allclose(est.mean()[0], truth, atol=0.08)


def test_cost_model_learns_both_regimes() -> None:
    rng = np.random.default_rng(0)
    cfg = CostModel(preset="gpu")  # prior says tokens are nearly free up to a knee of 190

    def truth(b: int, s: int) -> float:  # a machine that is compute-bound from the start
        return 20.0 + 1.0 * b + 2.0 * s

    def plan() -> tuple[int, int]:
        # plain steps are common in real traffic (K=0 requests); they separate the fixed cost
        # of speculating from the base cost
        b = int(rng.integers(1, 64))
        return b, 0 if rng.random() < 0.3 else int(rng.integers(1, 200))

    m = StepCostModel(cfg)
    for _ in range(400):
        b, s = plan()
        m.partial_fit(b, s, min(s, 8), truth(b, s) * rng.lognormal(0, 0.03))
    # The prior prices (16, 64) at a thirteenth of the truth; learned, the plans that draft are
    # within 5%. The smallest plain step (24 ms) shares its intercept with steps up to 20
    # times longer: over seeds 0-5 it is missed by up to 14%, so it is held to 15%.
    for b, s in [(16, 64), (48, 150)]:
        assert predict(m, b, s, min(s, 8)) == pytest.approx(truth(b, s), rel=0.05)
    assert predict(m, 4, 0, 0) == pytest.approx(truth(4, 0), rel=0.15)
    # and a memory-bound machine keeps extra tokens cheap
    m2 = StepCostModel(CostModel(preset="cpu"))
    for _ in range(400):
        b, s = plan()
        t = 6.5 + 0.02 * b + 0.027 * max(0, b + s - 180)
        m2.partial_fit(b, s, min(s, 8), t * rng.lognormal(0, 0.03))
    assert predict(m2, 8, 64, 8) - predict(m2, 8, 0, 0) < 1.0


def test_prior_weighs_as_many_steps_as_said_in_the_drafts_a_server_makes() -> None:
    # A server's plans draft a few tokens a step (1-4 at 4 requests, as served on this CPU),
    # far fewer than the prior's reference plan (16 at 8): weighed at the reference, the
    # prior of 40 ms a draft token held the learned price at 27-28 ms over seeds 0-11 where
    # the steps say 18; worth `prior_weight` of the measured steps, 21-23. (25: between.)
    rng = np.random.default_rng(0)
    m = StepCostModel(CostModel(preset="cpu"))
    for _ in range(400):
        b = int(rng.integers(3, 6))
        s = 0 if rng.random() < 0.5 else int(rng.integers(1, 5))
        m.partial_fit(b, s, min(s, 2), (300 + 20 * b + 18 * s) * rng.lognormal(0, 0.05))
    assert 18 * 0.9 < m.coef[2] < 25.0, m.coef


# Plain decoding's step time on two CPU cores (issue 16): 4 requests step faster than 1.
PLAIN_CPU = {1: 412.0, 4: 312.0, 16: 655.0}


def test_plain_step_time_is_learned_as_a_table_by_batch_size() -> None:
    rng = np.random.default_rng(0)

    def truth(b: int, s: int) -> float:
        return PLAIN_CPU[b] + 20.0 * s + 15.0 * (s > 0)

    m = StepCostModel(CostModel(preset="cpu"))
    for _ in range(600):
        b = int(rng.choice(list(PLAIN_CPU)))
        s = 0 if rng.random() < 0.4 else int(rng.integers(1, 4 * b + 1))
        m.partial_fit(b, s, min(s, 8), truth(b, s) * rng.lognormal(0, 0.03))
    line = {b: float(step_time(m.coef, b, 0.0, 0.0, m.knee)) for b in PLAIN_CPU}
    # No line with a non-negative slope passes through 412, 312 and 655 ...
    assert max(abs(line[b] / PLAIN_CPU[b] - 1) for b in PLAIN_CPU) > 0.1, line
    # ... the table does, and a speculating step keeps the linear terms on top of it.
    for b, ms in PLAIN_CPU.items():
        assert m.predict(b, 0, 0) == pytest.approx(ms, rel=0.05), b
        assert m.predict(b, 2 * b, 2) == pytest.approx(truth(b, 2 * b), rel=0.08), b


def test_the_controller_plans_with_the_table() -> None:
    rng = np.random.default_rng(1)
    ctl = Controller(policy(cost_model=CostModel(preset="cpu")))
    slots = np.array([ctl.add_request(f"r{i}", "creative") for i in range(16)])
    drafted = {b: np.zeros(b, dtype=np.int64) for b in PLAIN_CPU}
    for _ in range(300):
        b = int(rng.choice(list(PLAIN_CPU)))
        d = drafted[b]
        ms = PLAIN_CPU[b] + 20.0 * d.sum() + 15.0 * (d.sum() > 0)
        drafted[b] = ctl.step(slots[:b], d, np.zeros(b, dtype=np.int64), ms / 1e3)
    # Nothing is ever accepted: the controller stops drafting, and its plan for each batch
    # size is plain decoding at that size's measured time.
    for b, ms in PLAIN_CPU.items():
        ks = ctl.step(slots[:b], drafted[b], np.zeros(b, dtype=np.int64), ms / 1e3)
        assert not ks.any()
        assert ctl.last_predicted_ms == pytest.approx(ms, rel=0.05), b


def test_free_tokens_and_high_acceptance_speculate_fully() -> None:
    ctl = Controller(policy())
    slots = np.array([ctl.add_request("a", "code")])
    ks = ctl.step(slots, np.zeros(1), np.zeros(1), None)
    assert ks.tolist() == [8]


def test_costly_tokens_turn_speculation_off_at_high_load() -> None:
    ctl = Controller(policy(cost_model=COSTLY_TOKENS))
    one = np.array([ctl.add_request("solo", "code")])
    assert ctl.step(one, np.zeros(1), np.zeros(1), None)[0] > 0  # batch of 1: worth it
    many = np.array([ctl.add_request(f"r{i}", "code") for i in range(64)])
    ks = ctl.step(many, np.zeros(64), np.zeros(64), None)
    assert ks.sum() == 0  # 64 requests: each extra token slows all 64


def test_joint_choice_prefers_the_class_that_accepts() -> None:
    cost = CostModel(base_ms=10, per_request_ms=0.5, per_draft_token_ms=0.8,
                     spec_overhead_ms=0.0, knee_tokens=0, over_knee_ms=0.0, learn=False)
    ctl = Controller(policy(cost_model=cost))
    slots = np.array([ctl.add_request(f"c{i}", "code") for i in range(8)]
                     + [ctl.add_request(f"w{i}", "creative") for i in range(8)])
    ks = ctl.step(slots, np.zeros(16), np.zeros(16), None)
    assert ks[:8].min() > ks[8:].max()


def _brute_force(alpha: np.ndarray, kmax: int, cost: StepCostModel) -> float:
    best = 0.0
    n = alpha.shape[0]
    inc = np.cumprod(alpha, axis=1)
    for ks in itertools.product(range(kmax + 1), repeat=n):
        gain = n + sum(inc[i, :k].sum() for i, k in enumerate(ks))
        t = predict(cost, n, sum(ks), max(ks))
        best = max(best, gain / t)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_decision_matches_exhaustive_search(seed: int) -> None:
    rng = np.random.default_rng(seed)
    cost = CostModel(base_ms=10, per_request_ms=1.0, per_draft_token_ms=float(rng.uniform(0.2, 3)),
                     per_draft_position_ms=float(rng.uniform(0, 2)), spec_overhead_ms=1.0,
                     knee_tokens=4, over_knee_ms=float(rng.uniform(0, 2)), learn=False)
    classes = {f"c{i}": ClassPolicy(prior_acceptance=float(rng.uniform(0.2, 0.95)),
                                    prior_strength=1e5) for i in range(3)}
    p = Policy(classes=classes, default_class="c0", k_max=4, exploration=0.0, hysteresis_steps=1,
               cost_model=cost, request_shrinkage=1e6)
    ctl = Controller(p)
    slots = np.array([ctl.add_request(f"r{i}", f"c{i}") for i in range(3)])
    ks = ctl.step(slots, np.zeros(3), np.zeros(3), None)
    alpha = ctl.estimator.mean()[ctl.req_class[slots]]
    inc = np.cumprod(alpha, axis=1)
    gain = 3 + sum(inc[i, :k].sum() for i, k in enumerate(ks))
    chosen = gain / predict(ctl.cost, 3, ks.sum(), ks.max())
    # binning the increments may cost a hair of goodput, never more
    assert chosen >= 0.995 * _brute_force(alpha, 4, ctl.cost)


def test_latency_critical_never_speculates_and_limits_the_step() -> None:
    ctl = Controller(policy(cost_model=COSTLY_TOKENS, latency_critical_slack=0.0))
    slots = np.array([ctl.add_request("i", "interactive"), ctl.add_request("c", "code")])
    for _ in range(20):
        ks = ctl.step(slots, np.zeros(2), np.zeros(2), 0.02)
        assert ks.tolist() == [0, 0]  # any draft would slow the interactive stream
    free = Controller(policy())
    slots = np.array([free.add_request("i", "interactive"), free.add_request("c", "code")])
    ks = free.step(slots, np.zeros(2), np.zeros(2), None)
    assert ks[0] == 0 and ks[1] > 0  # drafts that cost nothing are still taken by others


def test_k_bounds_per_class() -> None:
    p = policy(classes={"a": ClassPolicy(k_min=2, k_max=3, prior_acceptance=0.05)},
               default_class="a", cost_model=COSTLY_TOKENS)
    ctl = Controller(p)
    slots = np.array([ctl.add_request(f"r{i}", "a") for i in range(32)])
    ks = ctl.step(slots, np.zeros(32), np.zeros(32), None)
    assert (ks == 2).all()  # k_min holds even where drafting does not pay
    ctl2 = Controller(policy(classes={"a": ClassPolicy(k_max=3, prior_acceptance=0.95)},
                             default_class="a"))
    assert ctl2.step(np.array([ctl2.add_request("x", "a")]), [0], [0], None)[0] == 3


def test_learned_k_follows_acceptance() -> None:
    rng = np.random.default_rng(0)
    cost = CostModel(base_ms=10, per_request_ms=0.5, per_draft_token_ms=1.0,
                     spec_overhead_ms=0.0, knee_tokens=0, over_knee_ms=0.0, learn=False)
    p = Policy(classes={"good": ClassPolicy(), "bad": ClassPolicy()}, default_class="good",
               cost_model=cost, exploration=0.05)
    ctl = Controller(p, seed=1)
    slots = np.array([ctl.add_request(f"g{i}", "good") for i in range(4)]
                     + [ctl.add_request(f"b{i}", "bad") for i in range(4)])
    truth = np.array([0.95] * 4 + [0.15] * 4)
    ks = np.zeros(8, dtype=np.int64)
    history = []
    for _ in range(300):
        acc = np.array([run_chain(np.array([a]), np.array([k]), rng)[0]
                        for a, k in zip(truth, ks, strict=True)])
        ks = ctl.step(slots, ks, acc, 0.01)
        history.append(ks.copy())
    late = np.array(history[-100:])
    assert late[:, :4].mean() > 2.5 and late[:, 4:].mean() < 0.5


def test_switched_off_class_is_retested() -> None:
    """A class whose drafts failed is turned off, then re-tested once evidence has decayed."""
    p = Policy(classes={"a": ClassPolicy(prior_acceptance=0.9)}, default_class="a",
               cost_model=CostModel(base_ms=10, per_request_ms=0.5, per_draft_token_ms=1.0,
                                    spec_overhead_ms=0.0, knee_tokens=0, over_knee_ms=0,
                                    learn=False),
               forgetting=0.95, exploration=0.05)
    ctl = Controller(p, seed=0)
    slots = np.array([ctl.add_request(f"r{i}", "a") for i in range(4)])
    ks = ctl.step(slots, np.zeros(4), np.zeros(4), None)
    for _ in range(30):  # every draft rejected
        ks = ctl.step(slots, ks, np.zeros(4, dtype=np.int64), 0.01)
    assert ks.sum() == 0
    speculated = 0
    for _ in range(300):  # still every draft rejected: re-tests are rare, but they happen
        ks = ctl.step(slots, ks, np.zeros(4, dtype=np.int64), 0.01)
        speculated += int(ks.sum() > 0)
    assert 0 < speculated < 0.25 * 300, speculated


def test_hysteresis_reduces_flapping() -> None:
    def flips(steps: int) -> int:
        rng = np.random.default_rng(3)
        cost = CostModel(base_ms=10, per_request_ms=0.5, per_draft_token_ms=0.5,
                         spec_overhead_ms=0.0, knee_tokens=0, over_knee_ms=0, learn=False)
        p = Policy(classes={"a": ClassPolicy(prior_acceptance=0.6)}, default_class="a",
                   cost_model=cost, hysteresis_steps=steps, exploration=0.0)
        ctl = Controller(p)
        slots = np.array([ctl.add_request(f"r{i}", "a") for i in range(8)])
        ks, n = np.zeros(8, dtype=np.int64), 0
        for _ in range(300):
            acc = np.array([run_chain(np.array([0.6]), np.array([k]), rng)[0] for k in ks])
            new = ctl.step(slots, ks, acc, 0.01)
            n += int((new != ks).sum())
            ks = new
        return n

    plain, held = flips(1), flips(3)
    assert plain > 50  # the case is near a boundary: without hysteresis K moves a lot
    assert held < 0.7 * plain


def test_hysteresis_never_holds_a_request_below_its_k_min() -> None:
    """A new request's K starts from 0: a rise to k_min is no change of mind to wait for."""
    # Drafts priced so dear that the plan is the forced minimum alone, or one more for 'b'.
    cost = CostModel(base_ms=10, per_request_ms=0.0, per_draft_token_ms=3.0,
                     spec_overhead_ms=0.0, knee_tokens=0, over_knee_ms=0, learn=False)
    p = Policy(classes={"a": ClassPolicy(prior_acceptance=0.2, k_min=1),
                        "b": ClassPolicy(prior_acceptance=0.2, k_min=2)},
               default_class="a", cost_model=cost, hysteresis_steps=3, exploration=0.0)
    for steps in range(3):
        ctl = Controller(p)
        slots = np.array([ctl.add_request("x", "a"), ctl.add_request("y", "b")])
        ks = np.zeros(2, dtype=np.int64)
        for _ in range(steps + 1):
            ks = ctl.step(slots, ks, np.zeros(2, dtype=np.int64), 0.01)
            assert ks[0] >= 1 and ks[1] >= 2, ks


def test_faults_give_fallback_and_are_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    ctl = Controller(policy(fallback_k=2))
    slots = np.array([ctl.add_request("c", "code"), ctl.add_request("i", "interactive")])

    def boom(*a: object, **k: object) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(ctl.cost, "partial_fit", boom)
    ks = ctl.step(slots, np.array([1, 0]), np.array([1, 0]), 0.01)
    assert ks.tolist() == [2, 0]  # fallback K, still none for the latency-critical request
    assert ctl.errors == 1


def test_bad_feedback_never_raises() -> None:
    ctl = Controller(policy())
    slots = np.array([ctl.add_request("c", "code")])
    for drafted, accepted, t in [([99], [120], 0.1), ([-3], [5], -1.0), ([2], [1], float("nan")),
                                 ([2], [1], float("inf"))]:
        ks = ctl.step(slots, drafted, accepted, t)
        assert 0 <= ks[0] <= 8


def test_request_state_is_bounded() -> None:
    ctl = Controller(policy(max_requests=50))
    for i in range(5000):
        ctl.add_request(f"r{i}", "code")
    assert ctl.num_requests == 50
    assert ctl.slot("r4999") is not None and ctl.slot("r0") is None


def test_dynamic_classes_are_capped_with_lru() -> None:
    p = Policy(classes={"d": ClassPolicy()}, default_class="d", dynamic_classes=True,
               max_classes=4)
    ctl = Controller(p)
    for i in range(100):
        ctl.add_request(f"r{i}", f"tenant{i}")
    assert len(ctl.class_names) <= 5  # the cap plus "other"
    assert "d" in ctl.class_names and "other" in ctl.class_names


def test_per_request_evidence_shrinks_toward_class() -> None:
    ctl = Controller(policy(cost_model=COSTLY_TOKENS, request_shrinkage=4.0))
    a, b = ctl.add_request("a", "code"), ctl.add_request("b", "code")
    slots = np.array([a, b])
    for _ in range(20):  # request a's drafts always fail; b's always pass
        ctl.step(slots, np.array([4, 4]), np.array([0, 4]), None)
    kk, post = ctl.k_max, ctl.estimator.posterior_sums()
    level = post[0, ctl.req_class[slots]] / post[kk, ctl.req_class[slots]]
    s, n = ctl.requests.sn[:, slots]
    own = (s + 4.0 * level) / (n + 4.0)
    f = own / level  # the factor on the class's acceptance (step_reference.decide)
    assert f[0] < 0.5 < 1.0 < f[1]


# ---------------------------------------------------------------- feedback, request by request
# The kernel updates a whole batch at once (adaptspec.fastpath.feedback); these check it against
# the plain per-request rules.


def test_estimator_update_matches_per_request_rule_with_bad_feedback() -> None:
    rng = np.random.default_rng(5)
    kk, n_cls = 4, 3
    est = AcceptanceEstimator(n_cls, kk, forgetting=0.9)
    succ, fail = np.zeros((n_cls, kk)), np.zeros((n_cls, kk))
    for _ in range(20):
        cls = rng.integers(0, n_cls, 40)
        drafted = rng.integers(-2, kk + 3, 40)  # includes nonsense: negative, beyond k_max
        accepted = rng.integers(-2, kk + 3, 40)
        fit(est, cls, drafted, accepted)
        step_succ, step_fail = np.zeros((n_cls, kk)), np.zeros((n_cls, kk))
        for c, d, a in zip(cls, drafted, accepted, strict=True):
            d = min(max(d, 0), kk)
            a = min(max(a, 0), d)
            step_succ[c, :a] += 1
            if a < d:
                step_fail[c, a] += 1
        # the first position ages a step, position j the share of the drafts that reached it
        seen = step_succ + step_fail
        for c in range(n_cls):
            for j in range(kk):
                share = 1.0 if j == 0 else (seen[c, j] / seen[c, 0] if seen[c, 0] else 0.0)
                succ[c, j] = succ[c, j] * 0.9**share + step_succ[c, j]
                fail[c, j] = fail[c, j] * 0.9**share + step_fail[c, j]
    np.testing.assert_allclose(est.succ, succ)
    np.testing.assert_allclose(est.fail, fail)
    sums = est.posterior_sums()
    np.testing.assert_allclose((sums[:kk] / sums[kk:]).T, est.mean())
    np.testing.assert_allclose(est.first_mean(), est.mean()[:, 0])
    # Per class, position by position: the prior moved in log-odds as far as the position
    # before moved from its own prior.
    for c in range(n_cls):
        shift = 0.0
        for j in range(kk):
            pa, pb = est.prior_a[c, j], est.prior_b[c, j]
            logit = np.log(pa / pb) + shift
            a = (pa + pb) * np.clip(1 / (1 + np.exp(-logit)), 1e-3, 1 - 1e-3) + succ[c, j]
            t = pa + pb + succ[c, j] + fail[c, j]
            assert np.isclose(sums[j, c], a) and np.isclose(sums[kk + j, c], t)
            shift = np.log(a / (t - a)) - np.log(pa / pb)


def test_an_undrafted_position_expects_what_was_learned_before_it() -> None:
    kk = 6
    est = AcceptanceEstimator(2, kk, forgetting=1.0)
    est.set_prior(0, [0.6] * kk, 8.0)  # a flat prior, found wrong on the first 2 positions
    est.set_prior(1, [0.3] + [0.9] * (kk - 1), 8.0)  # an n-gram's shape, confirmed
    for _ in range(200):  # class 0: drafts of 2 start right, the second token 4 times in 5
        fit(est, [0] * 5 + [1], [2] * 6, [2, 2, 2, 2, 1, 0])  # class 1's start wrong
    for _ in range(90):
        fit(est, [1], [2], [2])  # class 1: 30% of its drafts start right, then continue
    mean = est.mean()
    assert mean[0, 0] > 0.99 and 0.78 < mean[0, 1] < 0.82  # measured
    np.testing.assert_allclose(mean[0, 2:], mean[0, 1], rtol=1e-9)  # carried forward
    # class 1's later positions keep their prior's shape: high after a right start
    assert 0.25 < mean[1, 0] < 0.35 and mean[1, 1] > 0.95 and (mean[1, 2:] > 0.9).all()


def test_request_records_match_per_request_rule() -> None:
    rng = np.random.default_rng(6)
    req = RequestAcceptance(16, forgetting=0.8)
    est = AcceptanceEstimator(2, 4)  # (its k_max clips the feedback)
    s, n = np.zeros(16), np.zeros(16)
    for _ in range(30):
        slots = rng.permutation(16)[:10]
        drafted, accepted = rng.integers(-1, 7, 10), rng.integers(-1, 7, 10)
        rec, _, _ = learn(est, req, np.zeros(10, dtype=np.int64), slots, drafted, accepted)
        for slot, d, a in zip(slots, drafted, accepted, strict=True):
            d = min(max(d, 0), 4)
            a = min(max(a, 0), d)
            if d > 0:  # a request that drafted nothing keeps its record
                s[slot] = s[slot] * 0.8 + (a > 0)
                n[slot] = n[slot] * 0.8 + 1
        np.testing.assert_allclose(rec, np.stack([s[slots], n[slots]]))
    np.testing.assert_allclose(req.sn, [s, n])


def test_cost_model_learns_a_draft_model_pass_over_the_batch() -> None:
    """vLLM runs a draft model maxK times over every request of the batch: a step costs per
    request and pass (B * maxK), which no sum of per-request and per-pass terms can express.
    Requests of one batch draft different K (S < B * maxK), which tells the two apart. (The
    cpu prior says 0 per request and pass; a weak prior lets 600 steps say otherwise.)"""
    rng = np.random.default_rng(1)

    def truth(b: int, s: int, m: int) -> float:
        return 300.0 + 40.0 * b + 100.0 * m + 20.0 * b * m + 5.0 * s

    m = StepCostModel(CostModel(preset="cpu", prior_weight=1.0, forgetting=1.0))
    for _ in range(600):
        ks = rng.integers(0, int(rng.integers(0, 5)) + 1, int(rng.integers(1, 9)))
        b, s, k = len(ks), int(ks.sum()), int(ks.max())
        m.partial_fit(b, s, k, truth(b, s, k) * rng.lognormal(0, 0.02))
    assert m.coef[6] == pytest.approx(20.0, rel=0.25)
    # one long draft in a batch of eight costs nearly what eight long drafts do
    for b, s, k in [(1, 4, 4), (8, 4, 4), (8, 32, 4), (8, 8, 1)]:
        assert predict(m, b, s, k) == pytest.approx(truth(b, s, k), rel=0.08)


def test_thompson_draws_never_make_a_request_that_may_not_draft_draft() -> None:
    ctl = Controller(policy(exploration=0.5), seed=0)
    slots = np.array([ctl.add_request(f"i{i}", "interactive") for i in range(32)]
                     + [ctl.add_request(f"c{i}", "code") for i in range(32)])
    for _ in range(20):
        ks = ctl.step(slots, np.zeros(64), np.zeros(64), 0.01)
        assert (ks[:32] == 0).all()


# ------------------------------------------------------------------ confidence cuts
