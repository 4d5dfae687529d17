"""The compiled decision (adaptspec.fastpath) decides exactly as the numpy path does."""

from __future__ import annotations

import numpy as np
import pytest

from adaptspec import fastpath
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
        # per-draft-position cost (maxK) and a hinge, no hysteresis, no exploration
        "custom": Policy(**{**base, "exploration": 0.0, "hysteresis_steps": 1},
                         classes=classes(None),
                         cost_model=CostModel(base_ms=5, per_request_ms=0.05,
                                              per_draft_token_ms=0.01,
                                              per_draft_position_ms=0.2, spec_overhead_ms=0.1,
                                              knee_tokens=40, over_knee_ms=0.03)),
    }


BASE_MS = {"gpu": 6.5, "cpu": 290.0, "custom": 5.0}


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
        step_s = float(rng.lognormal(np.log(base_ms * (1 + 0.01 * len(live)) / 1e3), 0.1))
        out.append(ctl.step_by_id(live, classes, drafted, accepted, step_s))
    assert ctl.errors == 0
    return out, ctl


@pytest.mark.parametrize("name", ["gpu", "cpu", "custom"])
def test_compiled_decisions_equal_numpy(name: str) -> None:
    policy = _policies()[name]
    fast, ctl_fast = _run(policy, True, 600, seed=3, base_ms=BASE_MS[name])
    slow, ctl_slow = _run(policy, False, 600, seed=3, base_ms=BASE_MS[name])
    # the learned state, to the bit
    np.testing.assert_array_equal(ctl_fast.estimator._ev, ctl_slow.estimator._ev)
    np.testing.assert_array_equal(ctl_fast.requests._sn, ctl_slow.requests._sn)
    steps_differing = [i for i, (a, b) in enumerate(zip(fast, slow, strict=True))
                       if not np.array_equal(a, b)]
    # The plans' times are summed term by term in the kernel and by BLAS in numpy, which may
    # round a last bit differently: a tie between two plans could then break the other way.
    # Anything beyond a rare tie is a bug.
    assert len(steps_differing) <= 1, steps_differing[:10]
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
