"""The compiled kernels (adaptspec.fastpath) learn and decide exactly as the numpy path does."""

from __future__ import annotations

import numpy as np
import pytest

from adaptspec import fastpath
from adaptspec.acceptance import AcceptanceEstimator, RequestAcceptance, fit_compiled
from adaptspec.controller import Controller
from adaptspec.policy import ClassPolicy, CostModel, Policy

pytestmark = pytest.mark.skipif(not fastpath.AVAILABLE, reason="numba not installed")


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
        "cpu": Policy(**base, classes=classes(None), cost_model=CostModel(preset="cpu")),
        # per-draft-position costs (maxK, B * maxK) and a hinge, no hysteresis, no exploration
        "custom": Policy(**{**base, "exploration": 0.0, "hysteresis_steps": 1},
                         classes=classes(None),
                         cost_model=CostModel(base_ms=5, per_request_ms=0.05,
                                              per_draft_token_ms=0.01,
                                              per_draft_position_ms=0.2, spec_overhead_ms=0.1,
                                              knee_tokens=40, over_knee_ms=0.03,
                                              per_request_pass_ms=0.01)),
        # Not uniform (a forced draft, a shorter k_max): the numpy decision, on the compiled
        # feedback and class table.
        "mixed": Policy(**base, classes={**classes(9.0),
                                         "code": ClassPolicy(prior_acceptance=0.9, k_min=1),
                                         "chat": ClassPolicy(prior_acceptance=0.7, k_max=3)},
                        cost_model=CostModel(preset="gpu")),
    }


BASE_MS = {"gpu": 6.5, "cpu": 290.0, "custom": 5.0, "mixed": 6.5}


def _run(policy: Policy, fast: bool, steps: int, seed: int, base_ms: float
         ) -> tuple[list[np.ndarray], Controller]:
    """A controller fed the same feedback and batches whatever it decides (so the two paths
    see identical inputs): requests come and go, drafts are random, step times noisy."""
    rng = np.random.default_rng(seed)
    ctl = Controller(policy, seed=seed)
    ctl.use_fastpath = fast
    names = list(policy.classes)
    live: list[str] = []
    cls_of: dict[str, str] = {}
    nxt = 0
    out = []
    for t in range(steps):
        if t % 25 == 0 or not live:  # a new batch now and then, of a varying size
            for r in live[: len(live) // 2]:
                ctl.remove_request(r)
            live = live[len(live) // 2:]
            with_critical = (t // 25) % 2 == 1  # every other batch: latency-critical ones
            for _ in range(int(rng.integers(1, 48))):
                live.append(f"r{nxt}")
                cls_of[live[-1]] = (names[-1] if with_critical and nxt % 10 == 9
                                    else names[nxt % 3])
                nxt += 1
        classes = [cls_of[r] for r in live]
        drafted = rng.integers(0, policy.k_max + 1, size=len(live))
        accepted = rng.binomial(drafted, 0.7)
        if t % 40 == 7:  # bad feedback now and then: clipped alike on both paths
            drafted[0], accepted[-1] = -1, policy.k_max + 3
        elif t % 40 == 23:  # and a step that drafted nothing but nonsense
            drafted[:] = -1
        step_s = float(rng.lognormal(np.log(base_ms * (1 + 0.01 * len(live)) / 1e3), 0.1))
        out.append(ctl.step_by_id(live, classes, drafted, accepted, step_s))
    assert ctl.errors == 0
    return out, ctl


@pytest.mark.parametrize("name", ["gpu", "cpu", "custom", "mixed"])
def test_compiled_decisions_equal_numpy(name: str) -> None:
    policy = _policies()[name]
    fast, ctl_fast = _run(policy, True, 600, seed=3, base_ms=BASE_MS[name])
    slow, ctl_slow = _run(policy, False, 600, seed=3, base_ms=BASE_MS[name])
    # the learned state, to the bit: evidence, records, hysteresis, step-time model
    np.testing.assert_array_equal(ctl_fast.estimator._ev, ctl_slow.estimator._ev)
    np.testing.assert_array_equal(ctl_fast.requests._sn, ctl_slow.requests._sn)
    np.testing.assert_array_equal(ctl_fast.req_prev_k, ctl_slow.req_prev_k)
    np.testing.assert_array_equal(ctl_fast.req_votes, ctl_slow.req_votes)
    np.testing.assert_array_equal(ctl_fast.cost.coef, ctl_slow.cost.coef)
    # and the class table derived from it (the spread rows as the numpy path draws them)
    ctl_slow._class_spread()
    np.testing.assert_array_equal(ctl_fast._cls_tab, ctl_slow._cls_tab)
    steps_differing = [i for i, (a, b) in enumerate(zip(fast, slow, strict=True))
                       if not np.array_equal(a, b)]
    # The plans' times are summed term by term in the kernel and by BLAS in numpy, which may
    # round a last bit differently: a tie between two plans could then break the other way.
    # Anything beyond a rare tie is a bug.
    assert len(steps_differing) <= (0 if name == "mixed" else 1), steps_differing[:10]
    assert sum(int(k.sum()) for k in fast) > 0  # it did speculate


def test_compiled_path_is_used_for_uniform_policies(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = fastpath.decide_uniform

    def spy(*args: object) -> object:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(fastpath, "decide_uniform", spy)
    ctl = Controller(_policies()["gpu"], seed=0)
    slots = np.array([ctl.add_request(f"r{i}", "code") for i in range(8)])
    ctl.step(slots, np.zeros(8, dtype=np.int64), np.zeros(8, dtype=np.int64), 0.01)
    assert calls


def test_compiled_feedback_equals_numpy() -> None:
    """fit_compiled against both estimators' numpy updates, bad feedback included."""
    rng = np.random.default_rng(7)
    kk, n_cls, cap = 4, 3, 32
    ests = [AcceptanceEstimator(n_cls, kk, forgetting=0.9) for _ in range(2)]
    reqs = [RequestAcceptance(cap, forgetting=0.8, k_max=kk) for _ in range(2)]
    for est, req in zip(ests, reqs, strict=True):
        est.use_fastpath = req.use_fastpath = False
    for t in range(60):
        slots = rng.permutation(cap)[:20]
        cls = rng.integers(0, n_cls, 20)
        drafted, accepted = rng.integers(-2, kk + 3, 20), rng.integers(-2, kk + 3, 20)
        if t % 10 == 3:
            drafted[:] = -1  # nothing drafted: nothing learned
        sn, spec, longest = fit_compiled(ests[0], reqs[0], cls, slots, drafted, accepted)
        assert spec == int(drafted.sum())
        assert longest == max(int(drafted.max()), 0)
        if longest:
            ests[1].partial_fit(cls, drafted, accepted)
            np.testing.assert_array_equal(sn, reqs[1].partial_fit(slots, drafted, accepted))
        else:
            assert sn is None
            ests[0].decay()
            ests[1].decay()
        np.testing.assert_array_equal(ests[0]._ev, ests[1]._ev)
        np.testing.assert_array_equal(reqs[0]._sn, reqs[1]._sn)


def test_compiled_path_is_used_for_feedback_and_the_class_table(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    for name in ("feedback", "class_rows", "decide_uniform"):
        real = getattr(fastpath, name)

        def spy(*args: object, _real: object = real, _name: str = name) -> object:
            calls.append(_name)
            return _real(*args)

        monkeypatch.setattr(fastpath, name, spy)
    ctl = Controller(_policies()["gpu"], seed=0)
    slots = np.array([ctl.add_request(f"r{i}", "code") for i in range(8)])
    ctl.step(slots, np.full(8, 2), np.ones(8, dtype=np.int64), 0.01)
    assert calls == ["feedback", "class_rows", "decide_uniform"]
