"""The payoff guard on synthetic engines whose true costs the test knows.

Each engine has a plain step time per batch size and a speculative step's extra cost the
controller's cost model does not know (a fixed cost of any step with drafts, and a cost per
draft token), multiplicative noise, and acceptance drawn per draft token. The guard sees only
what an engine integration sees: batch size, whether the step speculated, accepted drafts and
the measured time. Losses are measured against the same engine's true plain step time.
"""

from __future__ import annotations

import numpy as np
import pytest
from promsamples import value

from adaptspec.classify import RequestInfo
from adaptspec.payoff import PayoffGuard
from adaptspec.policy import ClassPolicy, CostModel, Payoff, Policy
from adaptspec.runtime import AdaptiveRuntime


class Engine:
    """Step time = plain(B) (+ fixed + per_token * S if drafts), times lognormal noise of
    mean 1."""

    def __init__(self, fixed_ms: float, per_token_ms: float, acceptance: float,
                 noise: float = 0.1, seed: int = 0) -> None:
        self.fixed_ms, self.per_token_ms, self.acceptance = fixed_ms, per_token_ms, acceptance
        self.noise = noise
        self.rng = np.random.default_rng(seed)

    @staticmethod
    def plain(batch: int) -> float:
        return 300.0 + 25.0 * batch

    def step(self, ks: list[int]) -> tuple[list[int], float, float]:
        """Accepted drafts per request, the measured step time, and the true plain time of
        emitting the same tokens (what plain decoding would have spent)."""
        b, s = len(ks), sum(ks)
        accepted = []
        for k in ks:
            a = 0
            while a < k and self.rng.random() < self.acceptance:
                a += 1
            accepted.append(a)
        t = self.plain(b) + ((self.fixed_ms + self.per_token_ms * s) if s else 0.0)
        t *= float(np.exp(self.rng.normal(-self.noise**2 / 2, self.noise)))
        return accepted, t, (b + sum(accepted)) / b * self.plain(b)


def run_guard(engine: Engine, steps: int, k: int, batch: int = 4,
              guard: PayoffGuard | None = None, lc: bool = False) -> dict[str, float]:
    """A controller that always wants K=k for every request, behind the guard (or not)."""
    time_ms = plain_ms = 0.0
    spec = 0
    for _ in range(steps):
        go = guard is None or guard.allow(batch)
        ks = [k if go else 0] * batch
        accepted, t, plain = engine.step(ks)
        time_ms += t
        plain_ms += plain
        spec += go
        if guard is not None:
            guard.observe(batch, go, sum(accepted), t, latency_critical=lc, slack=0.02)
    # throughput relative to plain decoding: tokens are the same, so the time ratio
    return {"speedup": plain_ms / time_ms, "spec_share": spec / steps}


def test_speculation_that_does_not_pay_stops_and_costs_at_most_the_budget() -> None:
    # Every draft step costs 240 ms (60%) more than plain and gains ~0.24 tokens per request:
    # static speculation is ~22% slower than plain decoding.
    static = run_guard(Engine(200.0, 5.0, 0.2), 3000, k=2)
    assert static["speedup"] < 0.8
    guard = PayoffGuard(budget=0.01)
    guarded = run_guard(Engine(200.0, 5.0, 0.2), 3000, k=2, guard=guard)
    # The guard's own account bounds what it charged: 1% of the time, the opening credit
    # (cap_steps plain steps) and the last run's overdraft (its two steps, up to 1.5 plain
    # steps' loss each here).
    assert guard.loss_ms <= 0.01 * guard.time_ms + (guard.cap_steps + 3) * Engine.plain(4)
    # Against the engine's true plain time, the charge was estimated from noisy plain steps;
    # 1% budget plus 1% for that estimate's error.
    assert guarded["speedup"] >= 0.98
    assert guarded["spec_share"] < 0.05


def test_speculation_that_pays_is_not_held_back() -> None:
    # 15 ms per draft token, 0.85 acceptance at K=3: ~2.2 tokens a step for ~1.1x the time.
    static = run_guard(Engine(10.0, 15.0, 0.85), 2000, k=3)
    assert static["speedup"] > 1.5
    guard = PayoffGuard()
    guarded = run_guard(Engine(10.0, 15.0, 0.85), 2000, k=3, guard=guard)
    # Only the plain steps it takes to measure the plain reference (2 per 256 steps).
    assert guarded["spec_share"] > 0.97
    assert guarded["speedup"] > 0.97 * static["speedup"]


def test_stops_within_a_few_dozen_steps_when_the_engine_changes() -> None:
    guard = PayoffGuard()
    eng = Engine(10.0, 15.0, 0.85, seed=1)
    run_guard(eng, 500, k=3, guard=guard)
    assert guard.account_ms > 0
    eng.fixed_ms, eng.acceptance = 200.0, 0.2  # now every draft step loses ~40%
    spec_after = []
    for _ in range(400):
        go = guard.allow(4)
        accepted, t, _ = eng.step([3 if go else 0] * 4)
        guard.observe(4, go, sum(accepted), t)
        spec_after.append(go)
    # The account (at most 8 plain steps' worth, ~3.4 s) is spent in ~12 steps that lose
    # ~280 ms each; from then on a probe of 2 steps every ~120 steps (such losses repaid by 1%
    # of each step).
    assert sum(spec_after[:40]) <= 15
    assert sum(spec_after[40:]) / len(spec_after[40:]) < 0.05


def test_latency_critical_batch_is_charged_the_slowdown() -> None:
    # Drafts pay for throughput (acceptance 0.9) but make the step 20% slower than plain: a
    # latency-critical request in the batch gets one token a step and would be 20% slower.
    thr = run_guard(Engine(60.0, 5.0, 0.9, seed=2), 1000, k=2, guard=PayoffGuard())
    assert thr["spec_share"] > 0.9
    lc = run_guard(Engine(60.0, 5.0, 0.9, seed=2), 1000, k=2, guard=PayoffGuard(), lc=True)
    assert lc["spec_share"] < 0.1


def test_plain_reference_is_measured_before_speculating_and_refreshed() -> None:
    g = PayoffGuard(refresh_steps=10)
    assert not g.allow(2)  # nothing measured at batch 2
    g.observe(2, False, 0, 300.0)
    assert not g.allow(2)  # one sample is not enough
    g.observe(2, False, 0, 310.0)
    assert g.allow(2)
    assert g.allow(3)  # near a measured size: interpolated
    assert not g.allow(5)  # far from any: measured first
    for _ in range(11):
        g.observe(2, True, 4, 305.0)  # speculating steps that pay
    assert g.account_ms > 0
    assert not g.allow(2)  # the plain reference is 11 steps old: measure again
    assert g.plain_estimate(3) == pytest.approx(g.plain_ms[2] * 1.5)  # scaled up from 2
    g.observe(4, False, 0, 400.0)
    g.observe(4, False, 0, 400.0)
    assert g.plain_estimate(3) == pytest.approx((g.plain_ms[2] + 400.0) / 2)  # interpolated
    assert g.observe(2, True, 0, None) is None  # a prefill step is not charged


def _runtime_run(engine: Engine, payoff: Payoff, steps: int = 1500, propose_ms: float = 0.0,
                 draft_rate: float = 1.0) -> dict[str, float]:
    """AdaptiveRuntime (shipped cpu cost prior) driving `engine` with 4 chat requests. The
    proposer finds a draft for a request with probability `draft_rate`, and costs
    `propose_ms` x the longest K in every step after one that asked for drafts: work the
    controller's step-time features (draft tokens verified) cannot see when drafts are empty."""
    policy = Policy(
        classes={"chat": ClassPolicy(prior_acceptance=0.65),
                 "interactive": ClassPolicy(latency_critical=True)},
        default_class="chat", exploration=0.05, payoff=payoff, cost_model=CostModel(preset="cpu"))
    rt = AdaptiveRuntime(policy, k_cap=8)
    rng = np.random.default_rng(7)
    ids = [f"r{i}" for i in range(4)]
    for r in ids:
        rt.admit(r, RequestInfo(extra_args={"adaptspec_class": "chat"}))
    ks = dict.fromkeys(ids, 0)
    time_ms = plain_ms = 0.0
    spec = 0
    for _ in range(steps):
        want = [ks[r] for r in ids]
        drafted = [k if rng.random() < draft_rate else 0 for k in want]
        accepted, t, plain = engine.step(drafted)
        t += propose_ms * max(want)
        time_ms += t
        plain_ms += plain
        spec += any(want)
        ks = rt.step(ids, drafted, accepted, t / 1e3)
    return {"speedup": plain_ms / time_ms, "spec_share": spec / steps}


def test_runtime_with_the_guard_is_never_much_slower_than_plain() -> None:
    # A proposer that rarely finds a draft (5% of requests) but costs 40 ms per draft
    # position whenever asked: the controller alone keeps asking, its cost model blind to it.
    slow = {"propose_ms": 40.0, "draft_rate": 0.05}
    off = _runtime_run(Engine(10.0, 5.0, 0.3, seed=3), Payoff(enabled=False), **slow)
    on = _runtime_run(Engine(10.0, 5.0, 0.3, seed=3), Payoff(enabled=True), **slow)
    # 1% budget, and 1% for the error of the plain reference under 10% noise per step: the
    # guard's bound, which the controller alone does not keep here
    assert off["speedup"] < 0.98 <= on["speedup"]
    # ...and where drafts are cheap and accepted, the guard leaves the gain in place.
    off = _runtime_run(Engine(5.0, 10.0, 0.9, seed=4), Payoff(enabled=False))
    on = _runtime_run(Engine(5.0, 10.0, 0.9, seed=4), Payoff(enabled=True))
    assert off["speedup"] > 1.3
    assert on["speedup"] > 0.95 * off["speedup"]


def test_runtime_records_why_it_held_and_what_speculation_lost() -> None:
    from prometheus_client import CollectorRegistry

    from adaptspec.metrics import Metrics

    reg = CollectorRegistry()
    policy = Policy(classes={"code": ClassPolicy(prior_acceptance=0.9)}, default_class="code",
                    exploration=0.0, hysteresis_steps=1,
                    # the account opens with one plain step's credit (100 ms)
                    payoff=Payoff(enabled=True, cap_steps=1.0),
                    cost_model=CostModel(
                        base_ms=10, per_draft_token_ms=0.0, spec_overhead_ms=0.0, learn=False))
    rt = AdaptiveRuntime(policy, k_cap=4, metrics=Metrics(policy.max_classes, policy.k_max,
                                                          registry=reg))
    rt.admit("a", RequestInfo())
    # no plain step measured yet: held, and the decision is counted as plain
    assert rt.step(["a"], [0], [0], 0.1) == {"a": 0}
    assert rt.guard.last_hold == "measure"
    assert rt.step(["a"], [0], [0], 0.1) == {"a": 4}  # two plain steps measured: speculate
    # drafts all rejected, the step twice as long: 100 ms lost, but a run lasts two decisions
    assert rt.step(["a"], [4], [0], 0.2) == {"a": 4}
    assert rt.step(["a"], [4], [0], 0.2) == {"a": 0}  # 200 ms lost: held
    rt.step(["a"], [0], [0], 0.1)  # the account is still below 0: held again
    assert value(reg, "adaptspec_payoff_held_steps_total", {"reason": "measure"}) == 1.0
    assert value(reg, "adaptspec_payoff_held_steps_total", {"reason": "budget"}) == 2.0
    assert value(reg, "adaptspec_payoff_lost_ms_total") == 200.0
    # steps 1, 4, 5
    steps = value(reg, "adaptspec_steps_total",
                  {"class": "code", "decision": "plain", "proposer": "none"})
    assert steps == 3.0
    assert rt.guard.account_ms < 0


def test_a_stall_is_charged_as_three_plain_steps_at_most() -> None:
    g = PayoffGuard()
    g.observe(4, False, 0, 400.0)
    g.observe(4, False, 0, 400.0)
    assert g.observe(4, True, 0, 5000.0) == pytest.approx(3 * 400.0 - 400.0)
    assert g.observe(4, True, 4, 600.0) == pytest.approx(600.0 - 800.0)


def test_a_draft_model_run_is_not_cut_before_its_drafts_are_verified() -> None:
    """The engine's pipeline: a step proposes with this decision's K (a draft model: 90 ms a
    pass, most of a 400 ms plain step for K=4) and verifies what the step before proposed."""
    rng = np.random.default_rng(5)
    guard = PayoffGuard()
    pending = 0  # drafts proposed last step, to verify now
    time_ms = plain_ms = 0.0
    verified = 0
    for _ in range(600):
        k = 4 if guard.allow(1) else 0
        drafts = min(pending, k)  # the scheduler cuts last step's drafts to the new K
        a = 0
        while a < drafts and rng.random() < 0.9:
            a += 1
        t = (400.0 + 20.0 * drafts + 90.0 * k) * float(np.exp(rng.normal(-0.005, 0.1)))
        time_ms += t
        plain_ms += (1 + a) * 400.0
        verified += drafts > 0
        guard.observe(1, k > 0 or drafts > 0, a, t)
        pending = k
    # Static K=4 would emit ~4.1 tokens per ~780 ms step: 2.1x plain. A guard that judged the
    # first proposing step alone would never verify a draft.
    assert verified > 500
    assert plain_ms / time_ms > 1.9


def test_the_account_opens_full_so_a_draft_models_first_run_is_not_its_last() -> None:
    """A draft model's first proposing step catches up on the context (here 2.5 plain steps
    lost, no gain yet); the drafts it proposed then pay. An empty opening account would hold
    speculation for ~250 steps after that one step."""
    g = PayoffGuard()
    g.observe(1, False, 0, 100.0)
    assert g.account_ms == pytest.approx(g.cap_steps * 100.0)
    g.observe(1, False, 0, 100.0)
    assert g.allow(1)
    g.observe(1, True, 0, 350.0)  # the catch-up: 250 ms lost
    assert g.allow(1)  # the run's second decision
    g.observe(1, True, 3, 150.0)  # 3 accepted: 4 tokens in 150 ms, 250 ms gained
    assert g.allow(1) and g.account_ms > 0


def test_the_account_is_kept_when_the_guard_does_not_gate() -> None:
    """Off (the default), the guard holds nothing but still exports what speculating steps lost
    or saved, from the steps that verified nothing as its plain reference."""
    from prometheus_client import CollectorRegistry, generate_latest

    from adaptspec.metrics import Metrics

    reg = CollectorRegistry()
    policy = Policy(classes={"code": ClassPolicy(prior_acceptance=0.9)}, default_class="code",
                    exploration=0.0, hysteresis_steps=1, payoff=Payoff(enabled=False),
                    cost_model=CostModel(
                        base_ms=10, per_draft_token_ms=0.0, spec_overhead_ms=0.0, learn=False))
    rt = AdaptiveRuntime(policy, k_cap=4, metrics=Metrics(policy.max_classes, policy.k_max,
                                                          registry=reg))
    rt.admit("a", RequestInfo())
    assert rt.step(["a"], [0], [0], 0.1) == {"a": 4}  # no plain step measured: not held
    rt.step(["a"], [0], [0], 0.1)  # proposed, verified nothing: a plain sample (100 ms)
    rt.step(["a"], [4], [0], 0.2)  # all rejected, twice as long: 100 ms lost
    rt.step(["a"], [4], [3], 0.2)  # 4 tokens in 200 ms against 400 ms: 200 ms saved
    rt.step(["a"], [4], [0], 0.3)  # 200 ms lost, and still speculating
    assert rt.step(["a"], [4], [0], 0.3) == {"a": 4}
    text = generate_latest(reg).decode()
    assert value(reg, "adaptspec_payoff_lost_ms_total") == 500.0
    assert value(reg, "adaptspec_payoff_saved_ms_total") == 200.0
    assert "adaptspec_payoff_held_steps_total{" not in text
    # never set: it means nothing here
    assert value(reg, "adaptspec_payoff_account_ms") == 0.0


def _beside_latency_critical(spec_ms: float, steps: int, slack: float = 0.02,
                              token_ms: float = 0.0, **policy: object) -> tuple[list[int], str]:
    """A code request beside a latency-critical one, `steps` steps after four plain ones. The
    controller's cost model is fixed (not learned) and prices a draft token at `token_ms`; the
    engine measures a plain step of 2 at 100 ms and one with K drafts at `spec_ms` + K x
    `token_ms`. Returns the code request's K for each step and the metrics' text."""
    ks, text, _ = _run_beside_latency_critical(spec_ms, steps, slack, token_ms, **policy)
    return ks, text


def _run_beside_latency_critical(spec_ms: float, steps: int, slack: float, token_ms: float,
                                 **policy: object
                                 ) -> tuple[list[int], str, AdaptiveRuntime]:
    """`_beside_latency_critical`, and the runtime after it."""
    from prometheus_client import CollectorRegistry, generate_latest

    from adaptspec.metrics import Metrics

    reg = CollectorRegistry()
    p = Policy(classes={"code": ClassPolicy(prior_acceptance=0.9),
                        "lc": ClassPolicy(latency_critical=True)},
               default_class="code", exploration=0.0, hysteresis_steps=1,
               latency_critical_slack=slack, payoff=Payoff(enabled=False),
               cost_model=CostModel(base_ms=100, per_request_ms=0.0,
                                    per_draft_token_ms=token_ms, spec_overhead_ms=0.0,
                                    learn=False), **policy)
    rt = AdaptiveRuntime(p, k_cap=4, metrics=Metrics(p.max_classes, p.k_max, registry=reg))
    rt.admit("a", RequestInfo())
    rt.admit("i", RequestInfo(extra_args={"adaptspec_class": "lc"}))
    for _ in range(4):
        rt.step(["a", "i"], [0, 0], [0, 0], 0.1)
    ks, k = [], 0
    for _ in range(steps):
        ms = spec_ms + k * token_ms if k else 100.0
        k = rt.step(["a", "i"], [k, 0], [k // 2, 0], ms / 1e3)["a"]
        ks.append(k)
    return ks, generate_latest(reg).decode(), rt


def test_a_latency_critical_request_is_slowed_by_the_slack_on_average() -> None:
    """Steps with drafts measure 10% slower than plain ones, though the cost model prices
    drafts as free. Beside a latency-critical request (slack 2%, burst 25%) the code request
    drafts on
    about one step in five: each step adds 2% of a plain step to that request's budget, and a
    step with drafts spends the 10% it measured. So the request's steps average at most the
    slack over plain, plus what one drafted step overspends; and the budget is spent, not
    left: at the end less than one drafted step and one step's 2 ms remain unspent."""
    steps, plain, extra, slack = 200, 100.0, 10.0, 0.02
    ks, text = _beside_latency_critical(plain + extra, steps, latency_critical_burst=0.25)
    drafted = sum(1 for k in ks if k)
    # the last plan's drafts never ran: their step is not counted
    spent = extra * (drafted - (1 if ks[-1] else 0))
    assert spent <= slack * plain * steps + extra
    assert spent >= slack * plain * steps - extra - slack * plain
    assert max(ks) == 4  # a drafted step takes the whole draft: its shape is priced free
    assert 'reason="latency"' not in text  # 1.1x plain is within the burst


def test_a_step_over_the_burst_holds_drafts_beside_a_latency_critical_request() -> None:
    """The budget bounds the average; `latency_critical_burst` bounds one step. Drafted steps
    measured over it (1.3x plain; the burst unset is the slack, 20%) hold the drafts of steps
    with a latency-critical request, whatever budget is left; with a burst of 40% they go on."""
    ks, text = _beside_latency_critical(130.0, 40, slack=0.2)
    assert 'reason="latency"' in text
    assert ks[-10:] == [0] * 10
    ks, text = _beside_latency_critical(130.0, 40, slack=0.2, latency_critical_burst=0.4)
    assert 'reason="latency"' not in text
    assert sum(1 for k in ks if k) >= 2


def test_a_latency_hold_keeps_a_new_request_plain_too() -> None:
    """Held plain for latency, the step's newcomers are held too: a request admitted then is
    planned K = 0 for its prefill step (which proposes its first drafts), not its class's K."""
    ks, _, rt = _run_beside_latency_critical(130.0, 40, 0.2, 0.0)
    assert ks[-1] == 0
    rt.admit("b", RequestInfo())
    assert rt.k_for("b") == 0


def test_the_burst_caps_the_step_a_plan_may_take() -> None:
    """A cost model that prices each draft token at its measured 2.5% of a plain step. With a
    burst of 25% the budget buys a draft of 4 (10%) now and then, and plain steps between;
    with the burst at the slack
    (2%, as when it is unset) no draft token fits any step, however much budget is left: the
    slack is then a cap on every step."""
    ks, _ = _beside_latency_critical(100.0, 60, token_ms=2.5, latency_critical_burst=0.25)
    assert max(ks) == 4 and 0 in ks
    for burst in (0.02, None):
        ks, _ = _beside_latency_critical(100.0, 60, token_ms=2.5, latency_critical_burst=burst)
        assert set(ks) == {0}


def test_the_latency_check_judges_drafts_at_about_the_batch_size() -> None:
    """On two CPU cores a draft can make a step of 2 requests faster than plain (it runs 4
    rows, a cheaper shape) and a step of 4 slower: steps measured slow at 4 hold drafts beside
    a latency-critical request at 4 and 5, not at 2."""
    guard = PayoffGuard()
    for _ in range(4):
        guard.observe(2, False, 0, 500.0)
        guard.observe(4, False, 0, 310.0)
    for _ in range(guard.min_ratio_samples):
        guard.observe(4, True, 1, 372.0)  # 1.2x plain at 4
    assert guard.drafts_slow_steps(0.02, 4)
    assert guard.drafts_slow_steps(0.02, 5)
    assert not guard.drafts_slow_steps(0.02, 2)  # nothing measured there: the cost model's
    for _ in range(guard.min_ratio_samples):
        guard.observe(2, True, 1, 340.0)  # 0.68x plain at 2
    assert not guard.drafts_slow_steps(0.02, 2)
    assert guard.drafts_slow_steps(0.02, 4)


def test_the_latency_check_judges_a_plan_by_steps_of_as_few_drafts() -> None:
    """Steps of 4 with three drafts measured 1.2x plain, with one draft as fast as plain: a
    plan of one draft is judged by the one-draft steps and goes on, a plan of three (or any
    plan, judged without its drafts) is held."""
    guard = PayoffGuard()
    for _ in range(4):
        guard.observe(4, False, 0, 300.0)
    for _ in range(guard.min_ratio_samples):
        guard.observe(4, True, 1, 360.0, spec_tokens=3)
    assert guard.drafts_slow_steps(0.02, 4, 3) and guard.drafts_slow_steps(0.02, 4)
    assert not guard.drafts_slow_steps(0.02, 4, 1)  # none measured: not enough to say
    for _ in range(guard.min_ratio_samples):
        guard.observe(4, True, 1, 300.0, spec_tokens=1)
    assert not guard.drafts_slow_steps(0.02, 4, 1)
    assert not guard.drafts_slow_steps(0.02, 5, 2)  # (near 4: the one-draft steps only)
    assert guard.drafts_slow_steps(0.02, 4, 3)  # pooled, 1.1x plain


def test_a_latency_critical_request_beside_one_gets_drafts_that_make_the_step_faster() -> None:
    """An engine whose step costs by its rows (a request or a draft token each), where 2 rows
    take longer than 4 (the 1.5B on two CPU cores). Beside a latency-critical request the
    other request drafts: 2 drafts make the step 0.66x a plain one, though a line through the
    batch sizes prices them over the slack; the drafted steps are measured that fast."""
    rows_ms = {1: 410.0, 2: 500.0, 3: 340.0, 4: 310.0, 5: 320.0, 6: 360.0}
    policy = Policy(classes={"code": ClassPolicy(prior_acceptance=0.9),
                             "lc": ClassPolicy(latency_critical=True)},
                    default_class="code", exploration=0.0, hysteresis_steps=1,
                    latency_critical_slack=0.02, cost_model=CostModel(preset="cpu"))
    rt = AdaptiveRuntime(policy, k_cap=4)
    for b in (1, 2, 3, 4):  # plain steps at every batch size first (a server's warm-up)
        ids = [f"w{b}{i}" for i in range(b)]
        for r in ids:
            rt.admit(r, RequestInfo(extra_args={"adaptspec_class": "lc"}))
        for _ in range(6):
            rt.step(ids, [0] * b, [0] * b, rows_ms[b] / 1e3)
        for r in ids:
            rt.finish(r)
    rt.admit("a", RequestInfo())
    rt.admit("i", RequestInfo(extra_args={"adaptspec_class": "lc"}))
    ks = rt.step(["a", "i"], [0, 0], [0, 0], rows_ms[2] / 1e3)
    times = []
    for _ in range(30):
        k = ks["a"]
        assert ks["i"] == 0
        times.append(rows_ms[2 + k] + (10.0 if k else 0.0))
        ks = rt.step(["a", "i"], [k, 0], [k, 0], times[-1] / 1e3)
    assert np.median(times) < 0.8 * rows_ms[2]
