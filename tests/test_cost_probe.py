"""The cost probe: a step-time prior dearer than the engine cannot keep speculation off.

In the controller (learner.py): when the learned curve says no draft pays, a step every
probe_every is planned as if drafting cost probe_margin less, never beside a latency-critical
request. In the simulator (tools/simulator/prior.py): the gpu preset as prior, a true curve
20-30% cheaper at large batch, and the steps the controller takes to find the K that pays.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from controller_cases import policy

from adaptspec import plan as why
from adaptspec.controller import Controller
from adaptspec.policy import ClassPolicy, CostModel, Policy, load_policy
from adaptspec.tools.simulator.engine import step_ms
from adaptspec.tools.simulator.prior import cheaper_at_scale, settle

ROOT = Path(__file__).resolve().parents[1]


def _costly(per_token: float = 100, **kw: object) -> CostModel:
    """A 100 ms step, whatever the batch. One request at 0.9 acceptance: a first draft that
    costs 100 ms does not pay (1.9 tokens / 200 ms < 1 / 100); at 30% less it does (1.9 / 170).
    Beside a second request that does not draft the same holds at 50 ms (2.9 / 150 < 2 / 100,
    2.9 / 135 > 2 / 100)."""
    return CostModel(base_ms=100, per_request_ms=0, per_draft_token_ms=per_token,
                     spec_overhead_ms=0, knee_tokens=0, over_knee_ms=0, **kw)


def _steps(ctl: Controller, classes: list[str], n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """n steps of the same batch, nothing verified and no step time (nothing is learned)."""
    slots = np.array([ctl.add_request(f"r{i}", c) for i, c in enumerate(classes)])
    zero = np.zeros(len(slots), dtype=np.int64)
    out = []
    for _ in range(n):
        ks = ctl.step(slots, zero, zero, None)
        out.append((ks, ctl.req_reason[slots].copy()))
    return out


def test_a_probe_every_probe_every_steps_while_no_draft_pays() -> None:
    ctl = Controller(policy(cost_model=_costly(probe_every=8)))
    steps = _steps(ctl, ["code"], 40)
    probed = [i for i, (ks, _) in enumerate(steps) if ks.any()]
    assert probed == [7, 15, 23, 31, 39]  # steps 8, 16, ... (the counter starts at 1)
    for i in probed:
        assert steps[i][1][0] == why.CODE[why.COST_PROBE]
    assert ctl.probes == len(probed)


def test_no_probe_when_off_when_the_curve_is_fixed_or_beside_a_latency_critical_request(
        ) -> None:
    for cost in (_costly(probe_every=0), _costly(probe_every=8, learn=False)):
        assert not any(ks.any() for ks, _ in _steps(Controller(policy(cost_model=cost)),
                                                    ["code"], 40))
    # slack 1: the learned curve lets the step run 2x plain's (150 ms of 100 would do), so only
    # the rule that probes never run beside a latency-critical request keeps these steps plain
    ctl = Controller(policy(cost_model=_costly(50, probe_every=8), latency_critical_slack=1.0))
    assert not any(ks.any() for ks, _ in _steps(ctl, ["code", "interactive"], 40))
    assert ctl.probes == 0
    # ... where beside a request that is not latency-critical (and may not draft) it probes
    ctl = Controller(policy(cost_model=_costly(50, probe_every=8),
                            classes={"code": ClassPolicy(prior_acceptance=0.9, prior_strength=50),
                                     "creative": ClassPolicy(k_max=0)}))
    assert sum(ks.any() for ks, _ in _steps(ctl, ["code", "creative"], 40)) == 5


def test_no_probe_where_even_a_cheaper_draft_would_not_pay() -> None:
    cheap_prior = policy(cost_model=_costly(probe_every=8),
                         classes={"code": ClassPolicy(prior_acceptance=0.3, prior_strength=50)})
    assert not any(ks.any() for ks, _ in _steps(Controller(cheap_prior), ["code"], 40))


def test_the_true_curve_is_cheaper_where_asked() -> None:
    prior = CostModel(preset="gpu")
    for share in (0.2, 0.3):
        truth = cheaper_at_scale(prior, share)
        assert step_ms(truth, 128, 384, 3) == pytest.approx(
            (1 - share) * step_ms(prior, 128, 384, 3))
        for b in (1, 16, 64):  # below the knee nothing changes
            assert step_ms(truth, b, 0, 0) == pytest.approx(step_ms(prior, b, 0, 0))


@pytest.fixture(scope="module")
def default() -> Policy:
    return load_policy(ROOT / "policies" / "default.yaml")


@pytest.mark.parametrize("cheaper", [0.2, 0.3])
def test_the_gpu_prior_would_lock_speculation_off_at_256_without_probes(
        default: Policy, cheaper: float) -> None:
    cost = default.cost_model.model_copy(update={"probe_every": 0})
    r = settle(default.model_copy(update={"cost_model": cost}), cheaper, 256)
    assert r["prior_best_static_k"] == 0 and r["best_static_k"] > 0
    assert r["static_over_none"][r["best_static_k"]] > 1.10  # what is left on the table
    assert r["found_at"] is None and r["adaptive_over_none"] == 1.0


@pytest.mark.parametrize("cheaper", [0.2, 0.3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_with_probes_the_controller_finds_the_k_that_pays(default: Policy, cheaper: float,
                                                          seed: int) -> None:
    """The bound: the first probe at step probe_every, and the step after it drafts by the
    controller's own decision (one probe outweighs the prior here); it then keeps most of
    what the best static K gains."""
    every = default.cost_model.probe_every
    r = settle(default, cheaper, 256, seed=seed)
    assert r["first_probe"] == every - 1
    assert r["found_at"] is not None and r["found_at"] <= every + 1, r
    gain = r["static_over_none"][r["best_static_k"]] - 1
    assert r["adaptive_over_none"] - 1 > 0.8 * gain, r


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_probing_where_no_draft_pays_costs_within_its_bound(default: Policy, seed: int) -> None:
    """Truth = prior at 256, where plain decoding is best: the probes lose at most
    probe_margin / probe_every, and a decision they lead into drafting loses at most what
    the cheapest drafting plan (K=1) loses against plain."""
    cm = default.cost_model
    r = settle(default, 0.0, 256, seed=seed)
    assert r["best_static_k"] == 0
    bound = cm.probe_margin / cm.probe_every + (1 - r["static_over_none"][1])
    assert r["adaptive_over_none"] >= 1 - bound, r
