"""Several proposers in one server: the controller chooses who drafts, per request and step."""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry
from promsamples import value

from adaptspec import snapshot
from adaptspec.choose import choose_proposers
from adaptspec.controller import Controller
from adaptspec.metrics import Metrics
from adaptspec.policy import ClassPolicy, CostModel, Policy

CHEAP = CostModel(base_ms=10, per_request_ms=0.5, per_draft_token_ms=0.3, spec_overhead_ms=0.0,
                  knee_tokens=0, over_knee_ms=0.0, learn=False)
PROPOSERS = ("ngram", "suffix")


def policy(**kw: object) -> Policy:
    base: dict = {"classes": {"code": ClassPolicy(), "math": ClassPolicy(),
                              "interactive": ClassPolicy(latency_critical=True)},
                  "default_class": "code", "cost_model": CHEAP, "exploration": 0.05}
    base.update(kw)
    return Policy(**base)


def chain(alpha: float, k: int, rng: np.random.Generator) -> int:
    """Accepted drafts of a draft of k whose every position is accepted with prob alpha."""
    a = 0
    while a < k and rng.random() < alpha:
        a += 1
    return a


def simulate(ctl: Controller, classes: list[str], truth: dict[tuple[str, int], float],
             steps: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Run `steps` engine steps; truth[(class, proposer)] is the acceptance. Returns the K and
    proposer chosen at each step, [steps, requests]."""
    rng = np.random.default_rng(seed)
    slots = np.array([ctl.add_request(f"r{i}", c) for i, c in enumerate(classes)])
    ks = np.zeros(len(slots), dtype=np.int64)
    props = np.zeros(len(slots), dtype=np.int64)
    k_hist, p_hist = [], []
    for _ in range(steps):
        acc = np.array([chain(truth[(c, int(p))], int(k), rng)
                        for c, k, p in zip(classes, ks, props, strict=True)])
        ks = ctl.step(slots, ks, acc, 0.01, sources=props)
        props = ctl.req_proposer[slots].copy()
        k_hist.append(ks.copy())
        p_hist.append(props.copy())
    return np.array(k_hist), np.array(p_hist)


def test_each_class_gets_the_proposer_that_pays_for_it() -> None:
    """n-gram pays on code, the other on math (shared/MODELS.md measured such a split between
    n-gram and a draft model): the controller learns both, per class, from what it verifies."""
    ctl = Controller(policy(), seed=0, proposers=PROPOSERS)
    classes = ["code"] * 3 + ["math"] * 3
    truth = {("code", 0): 0.9, ("code", 1): 0.2, ("math", 0): 0.1, ("math", 1): 0.9}
    ks, props = simulate(ctl, classes, truth, 400)
    late_p, late_k = props[-150:], ks[-150:]
    drafting = late_k > 0
    code_on_ngram = (late_p[:, :3][drafting[:, :3]] == 0).mean()
    math_on_other = (late_p[:, 3:][drafting[:, 3:]] == 1).mean()
    # exploration (5% of requests draw their scores) may pick the other now and then
    assert code_on_ngram > 0.85 and math_on_other > 0.85, (code_on_ngram, math_on_other)
    assert late_k.mean() > 2.0  # and both classes speculate, each with its good proposer
    means = ctl.estimator.mean()
    code, math = ctl.class_index("code"), ctl.class_index("math")
    assert means[code, 0] > 0.8 and means[ctl.n_cls + math, 0] > 0.8


def test_one_proposer_that_fails_everywhere_is_left_for_the_other() -> None:
    ctl = Controller(policy(), seed=1, proposers=PROPOSERS)
    truth = {("code", 0): 0.05, ("code", 1): 0.85}
    ks, props = simulate(ctl, ["code"] * 4, truth, 300)
    assert (props[-100:][ks[-100:] > 0] == 1).mean() > 0.85


def test_feedback_is_credited_to_the_proposer_that_drafted() -> None:
    ctl = Controller(policy(exploration=0.0), seed=0, proposers=PROPOSERS)
    slot = ctl.add_request("a", "math")
    row0, row1 = ctl.rows(ctl.class_index("math"))
    before0, before1 = ctl.estimator.succ[row0].copy(), ctl.estimator.succ[row1].copy()
    ctl.step(np.array([slot]), np.array([3]), np.array([3]), 0.01, sources=np.array([1]))
    assert (ctl.estimator.succ[row1][:3] > before1[:3]).all()
    assert (ctl.estimator.succ[row0] <= before0).all()  # only decayed
    # the request's own record is per proposer too
    assert ctl.requests.sn[0, slot * 2 + 1] == 1 and ctl.requests.sn[0, slot * 2] == 0


def test_latency_critical_requests_never_draft_with_any_proposer() -> None:
    # (a wide slack, so the others may draft beside them)
    ctl = Controller(policy(latency_critical_slack=0.5), seed=0, proposers=PROPOSERS)
    truth = {(c, p): 0.95 for c in ("code", "interactive") for p in (0, 1)}
    ks, _ = simulate(ctl, ["code", "interactive"] * 2, truth, 100)
    assert ks[:, 1::2].max() == 0 and ks[:, ::2].mean() > 1


def test_choice_scores_the_expected_accepted_tokens() -> None:
    """Per request: argmax over proposers of sum_j prod_{l<=j} alpha_l over the class's K,
    alpha = class posterior, the first position's x the request's own factor; checked against a
    plain loop."""
    rng = np.random.default_rng(3)
    kk, n_cls, n_prop, n = 4, 3, 2, 40
    a = rng.uniform(0.5, 20, (n_prop * n_cls, kk))
    b = rng.uniform(0.5, 20, (n_prop * n_cls, kk))
    post = np.vstack([a.T, (a + b).T])
    cls = rng.integers(0, n_cls, n)
    k_max = rng.integers(0, kk + 1, n)
    sn = np.abs(rng.normal(3, 2, (2, n, n_prop)))
    sn[1] += sn[0]
    n0 = rng.choice([0.5, 6.0, 40.0], n_prop * n_cls)  # the shrinkage per row
    got = choose_proposers(post, n_cls, n_prop, cls, k_max, sn, n0, np.zeros(n, bool),
                           np.zeros((0, kk, n_prop)))
    for i in range(n):
        scores = []
        for p in range(n_prop):
            r = p * n_cls + cls[i]
            level = max(a[r, 0] / (a[r, 0] + b[r, 0]), 1e-3)
            f = (sn[0, i, p] + n0[r] * level) / (sn[1, i, p] + n0[r]) / level
            prod, total = 1.0, 0.0
            for j in range(k_max[i]):
                prod *= min(a[r, j] / (a[r, j] + b[r, j]) * (f if j == 0 else 1.0), 0.995)
                total += prod
            scores.append(total)
        assert got[i] == int(np.argmax(scores)), (i, scores)


def test_snapshot_keeps_each_proposers_evidence() -> None:
    ctl = Controller(policy(), seed=0, proposers=PROPOSERS)
    simulate(ctl, ["code", "math"], {("code", 0): 0.9, ("code", 1): 0.3, ("math", 0): 0.2,
                                     ("math", 1): 0.8}, 60)
    state = snapshot.state_dict(ctl)
    fresh = Controller(policy(), seed=0, proposers=PROPOSERS)
    assert snapshot.load_state_dict(fresh, state) == len(ctl.class_names)
    np.testing.assert_array_equal(fresh.estimator.succ, ctl.estimator.succ)
    np.testing.assert_array_equal(fresh.estimator.fail, ctl.estimator.fail)
    # a one-proposer server reads its proposer's evidence from the same file, and a hybrid
    # reads a one-proposer snapshot into that proposer
    single = Controller(policy(), seed=0, proposers=("suffix",))
    snapshot.load_state_dict(single, state)
    math = ctl.class_index("math")
    np.testing.assert_array_equal(single.estimator.succ[single.class_index("math")],
                                  ctl.estimator.succ[ctl.n_cls + math])
    back = Controller(policy(), seed=0, proposers=PROPOSERS)
    snapshot.load_state_dict(back, snapshot.state_dict(single))
    np.testing.assert_array_equal(back.estimator.succ[back.n_cls + math],
                                  single.estimator.succ[single.class_index("math")])


def test_metrics_say_which_proposer_drafted_and_which_was_chosen() -> None:
    pol = policy(exploration=0.0, latency_critical_slack=0.5)
    reg = CollectorRegistry()
    ctl = Controller(pol, seed=0, proposers=PROPOSERS,
                     metrics=Metrics(pol.max_classes, pol.k_max, registry=reg))
    slots = np.array([ctl.add_request("a", "code"), ctl.add_request("b", "interactive")])
    ctl.step(slots, np.array([4, 0]), np.array([2, 0]), 0.01, sources=np.array([1, 0]))
    code = {"class": "code", "proposer": "suffix"}
    assert value(reg, "adaptspec_draft_tokens_total", code) == 4.0
    assert value(reg, "adaptspec_accepted_tokens_total", code) == 2.0
    chosen = PROPOSERS[int(ctl.req_proposer[slots[0]])]
    assert value(reg, "adaptspec_steps_total",
                 {"class": "code", "decision": "speculate", "proposer": chosen}) == 1.0
    assert value(reg, "adaptspec_steps_total", {"class": "interactive",
                 "decision": "latency_critical", "proposer": "none"}) == 1.0


def _with_draft(pass_ms: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray, Controller]:
    """Three proposers, the third a model (its passes cost pass_ms each, as the worker would
    report them); math accepts 0.95 from the draft model, 0.1 from the others."""
    # The verify-step model learns (from the policy's curve, which is the truth below).
    ctl = Controller(policy(cost_model=CHEAP.model_copy(update={"learn": True})), seed=seed,
                     proposers=PROPOSERS + ("draft",))
    truth = {("math", 0): 0.1, ("math", 1): 0.1, ("math", 2): 0.95}
    rng = np.random.default_rng(seed)
    slots = np.array([ctl.add_request(f"r{i}", "math") for i in range(4)])
    ks = np.zeros(4, dtype=np.int64)
    props = np.zeros(4, dtype=np.int64)
    k_hist, p_hist = [], []
    for _ in range(300):
        acc = np.array([chain(truth[("math", int(p))], int(k), rng)
                        for k, p in zip(ks, props, strict=True)])
        passes = int(ks[props == 2].sum())
        if passes:
            ctl.record_pass_cost(2, pass_ms * passes, passes)
        verify_ms = 10 + 0.5 * len(ks) + 0.3 * ks.sum()  # CHEAP's curve
        ks = ctl.step(slots, ks, acc, (verify_ms + pass_ms * passes) / 1e3, sources=props)
        props = ctl.req_proposer[slots].copy()
        k_hist.append(ks.copy())
        p_hist.append(props.copy())
    return np.array(k_hist), np.array(p_hist), ctl


def test_a_draft_model_that_pays_for_its_passes_is_chosen() -> None:
    ks, props, ctl = _with_draft(pass_ms=0.5)  # a pass costs 1/24 of a ~12 ms step
    late = props[-100:][ks[-100:] > 0]
    assert late.size > 300 and (late == 2).mean() > 0.85
    assert ks[-100:].mean() > 2.5
    assert abs(ctl.pass_ms[2] - 0.5) < 1e-9
    # the verify-step model learned the step without the passes: at 4 requests and 16 draft
    # tokens the truth is 16.8 ms, and the measured steps were 8 ms longer (16 passes)
    from adaptspec.fastpath import step_time

    predicted = float(step_time(ctl.cost.coef, 4.0, 16.0, 4.0, ctl.cost.knee))
    assert abs(predicted - 16.8) < 1.5, (predicted, ctl.cost.coef)


def test_a_draft_model_whose_passes_cost_more_than_they_save_is_left_idle() -> None:
    # a pass costs as much as a whole step: a draft token (worth < 1 token) never pays for it
    ks, props, _ = _with_draft(pass_ms=12.0)
    drafting_with_model = ((props[-100:] == 2) & (ks[-100:] > 0)).sum()
    assert drafting_with_model <= 0.05 * ks[-100:].size, drafting_with_model


def test_draft_model_passes_beside_a_latency_critical_request_stay_within_the_slack() -> None:
    """Math drafts with the draft model (it pays); with an interactive request in the batch
    the model's passes plus the verify plan stay within (1 + slack) x the plain step."""
    pol = policy(latency_critical_slack=0.25)
    ctl = Controller(pol, seed=0, proposers=PROPOSERS + ("draft",))
    math = [ctl.add_request(f"m{i}", "math") for i in range(3)]
    lc = ctl.add_request("i", "interactive")
    rng = np.random.default_rng(0)
    pass_ms = 1.0
    for with_lc in (False, True):
        slots = np.array(math + ([lc] if with_lc else []))
        ks = np.zeros(len(slots), dtype=np.int64)
        props = np.zeros(len(slots), dtype=np.int64)
        for _ in range(200):
            acc = np.array([chain(0.95 if p == 2 else 0.05, int(k), rng)
                            for k, p in zip(ks, props, strict=True)])
            passes = int(ks[props == 2].sum())
            if passes:
                ctl.record_pass_cost(2, pass_ms * passes, passes)
            ks = ctl.step(slots, ks, acc, 0.01, sources=props)
            props = ctl.req_proposer[slots].copy()
            if with_lc:
                plain = 10 + 0.5 * len(slots)  # CHEAP's curve at this batch, no drafts
                verify = plain + 0.3 * ks.sum()
                assert verify + pass_ms * ks[props == 2].sum() <= 1.25 * plain + 1e-9
                assert ks[-1] == 0
        if not with_lc:
            free_passes = int(ks[props == 2].sum())
    assert free_passes > 4  # alone, math drafts well beyond the slack's 3.5 ms of passes
    assert ks[:3][props[:3] == 2].sum() > 0  # and beside the LC request it still drafts some


def test_a_proposer_that_finds_nothing_is_left_for_one_that_drafts() -> None:
    """n-gram lookups that find no match verify nothing, so without being told the controller
    would never see them fail: `missed` counts them as a first-position rejection."""
    ctl = Controller(policy(exploration=0.0), seed=0, proposers=PROPOSERS)
    rng = np.random.default_rng(0)
    slots = np.array([ctl.add_request(f"r{i}", "math") for i in range(4)])
    ks = np.zeros(4, dtype=np.int64)
    props = np.zeros(4, dtype=np.int64)
    for _ in range(100):
        found = props == 1  # n-gram (0) finds nothing for math; suffix drafts and is right
        drafted = np.where(found, ks, 0)
        acc = np.array([chain(0.8, int(d), rng) for d in drafted])
        ks = ctl.step(slots, drafted, acc, 0.01, sources=props, missed=(ks > 0) & ~found)
        props = ctl.req_proposer[slots].copy()
    assert (props == 1).all() and ks.mean() > 2
    # without `missed` the n-gram rows never learn and, first among equals, keep winning
    ctl = Controller(policy(exploration=0.0), seed=0, proposers=PROPOSERS)
    slots = np.array([ctl.add_request(f"r{i}", "math") for i in range(4)])
    ks = np.zeros(4, dtype=np.int64)
    props = np.zeros(4, dtype=np.int64)
    for _ in range(100):
        ks = ctl.step(slots, np.zeros(4, dtype=np.int64), np.zeros(4, dtype=np.int64), 0.01,
                      sources=props)
        props = ctl.req_proposer[slots].copy()
    assert (props == 0).all()


def test_pass_cost_is_told_apart_from_catch_up() -> None:
    """A request's first draft feeds its prompt (catch-up) in its first pass: the cost per
    later draft token is the pass, not the prompt averaged over the passes."""
    ctl = Controller(policy(), seed=0, proposers=PROPOSERS + ("draft",))
    rng = np.random.default_rng(0)
    for _ in range(40):
        passes, catchup = int(rng.integers(1, 9)), int(rng.choice([0, 0, 0, 3, 150]))
        ctl.record_pass_cost(2, 20.0 * passes + 2.0 * catchup, passes, catchup)
    assert abs(ctl.pass_ms[2] - 20.0) < 1e-6 and abs(ctl.catchup_ms[2] - 2.0) < 1e-6
    only = Controller(policy(), seed=0, proposers=PROPOSERS + ("draft",))
    only.record_pass_cost(2, 60.0, 3)  # no catch-up seen yet: the mean per pass
    assert only.pass_ms[2] == 20.0


def test_an_untried_proposer_gets_its_turn_on_explored_requests() -> None:
    """n-gram and suffix accept well and are well measured; the draft model, never tried, is
    tried on the first explored requests (Thompson draws alone rarely pick it: its prior is
    wide and low next to their measured acceptance), and then only now and then."""
    # a confident, low prior: a draw for the untried draft model rarely beats 0.9
    pol = policy(exploration=0.1, classes={"code": ClassPolicy(prior_acceptance=0.3,
                                                                 prior_strength=40)})
    ctl = Controller(pol, seed=0, proposers=PROPOSERS + ("draft",))
    truth = {("code", 0): 0.9, ("code", 1): 0.9, ("code", 2): 0.9}
    ks, props = simulate(ctl, ["code"] * 4, truth, 200)
    tried = props[ks > 0]
    first = int(np.flatnonzero((props == 2).any(axis=1))[0])
    assert first < 15, first
    assert 0 < (tried == 2).mean() < 0.5


def test_a_new_requests_first_draft_comes_from_its_classs_best_proposer() -> None:
    """The first drafts are proposed before any decision for the request (in its prefill
    step): the runtime picks their proposer at admission, from the class."""
    from adaptspec.classify import RequestInfo
    from adaptspec.runtime import AdaptiveRuntime

    rt = AdaptiveRuntime(policy(exploration=0.0), k_cap=4, proposers=PROPOSERS)
    ctl = rt.controller
    simulate(ctl, ["math"] * 3, {("math", 0): 0.1, ("math", 1): 0.9}, 100)
    rt.admit("new", RequestInfo(extra_args={"adaptspec_class": "math"}))
    assert rt.proposer_for("new") == 1 and rt.plan_for(["new"]).proposer_of("new") == 1
    rt.finish("new")
    assert rt.controller.num_new_requests == 0
