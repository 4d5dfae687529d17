"""How far a request's own record moves it from its class: the shrinkage learned from how far
finished requests differ (adaptspec.acceptance.RequestSpread), and what the controller does
with it."""

from __future__ import annotations

import numpy as np
import pytest
from controller_cases import COSTLY_TOKENS, policy

from adaptspec.acceptance import RequestSpread
from adaptspec.controller import Controller


def _finish(spread: RequestSpread, rates: np.ndarray, rng: np.random.Generator,
            drafts: tuple[int, int] = (4, 30)) -> None:
    """Requests with these true rates, each verifying a random number of drafts."""
    for p in rates:
        n = int(rng.integers(*drafts))
        spread.add(0, float(rng.binomial(n, p)), float(n))


@pytest.mark.parametrize("strength", [3.0, 12.0, 40.0])
def test_the_shrinkage_is_the_strength_of_the_spread_requests_were_drawn_with(
        strength: float) -> None:
    """Rates drawn from Beta(strength p, strength (1 - p)): a beta prior worth `strength`
    draws is what shrinks a record by as much as the requests really differ."""
    rng = np.random.default_rng(0)
    spread = RequestSpread(1, default=6.0, forgetting=1.0)
    _finish(spread, rng.beta(0.7 * strength, 0.3 * strength, 20000), rng)
    assert spread.shrinkage[0] == pytest.approx(strength, rel=0.15)


def test_requests_that_differ_by_chance_alone_leave_their_records_no_weight() -> None:
    rng = np.random.default_rng(1)
    spread = RequestSpread(1, default=6.0, forgetting=1.0)
    _finish(spread, np.full(4000, 0.7), rng)
    assert spread.shrinkage[0] > 300.0  # chance spreads 4000 such rates this far (tau2 ~ 0)


def test_the_policy_value_holds_until_enough_requests_finished() -> None:
    rng = np.random.default_rng(2)
    spread = RequestSpread(2, default=6.0, min_requests=16)
    _finish(spread, np.full(15, 0.7), rng)
    assert spread.shrinkage[0] == 6.0
    _finish(spread, np.full(40, 0.7), rng)
    assert spread.shrinkage[0] != 6.0 and spread.shrinkage[1] == 6.0  # (row 1 saw none)
    spread.add(1, 0.0, 0.0)  # a request that verified nothing says nothing
    assert spread.sums[1].sum() == 0.0


def test_older_requests_fade_so_the_estimate_follows_the_mix() -> None:
    """A class whose requests stop differing (a tenant's code edits gave way to prose): the
    records lose their weight within a few hundred requests."""
    rng = np.random.default_rng(3)
    spread = RequestSpread(1, default=6.0, forgetting=0.99)
    _finish(spread, np.where(rng.random(600) < 0.5, 0.95, 0.2), rng)
    split = spread.shrinkage[0]
    _finish(spread, np.full(600, 0.6), rng)
    assert split < 2.0 and spread.shrinkage[0] > 30.0


def _serve(ctl: Controller, rates: list[float], steps: int, rng: np.random.Generator,
           first: int, cls: str = "code") -> list[str]:
    """Requests of a class drafting 2 tokens every step, each started right at its rate."""
    ids = [f"r{first + i}" for i in range(len(rates))]
    slots = np.array([ctl.add_request(r, cls) for r in ids])
    for _ in range(steps):
        right = rng.random(len(ids)) < np.array(rates)
        ctl.step(slots, np.full(len(ids), 2), np.where(right, 2, 0), None)
    return ids


@pytest.mark.parametrize("differ", [True, False])
def test_a_few_misses_stop_a_request_only_where_requests_differ(differ: bool) -> None:
    """After 64 finished requests: where half always start right and half never, a request
    whose first drafts missed is taken as one of the bad half and stops; where all start right
    at one rate (0.7), the same misses are chance and it keeps drafting."""
    rng = np.random.default_rng(4)
    ctl = Controller(policy(cost_model=COSTLY_TOKENS))
    for batch in range(16):
        rates = [0.98, 0.02] * 2 if differ else [0.7] * 4
        for r in _serve(ctl, rates, 12, rng, 4 * batch):
            ctl.remove_request(r)
    n0 = ctl.spread.shrinkage[ctl.class_index("code")]
    slot = ctl.add_request("new", "code")
    for _ in range(3):  # three misses in a row
        k = ctl.step(np.array([slot]), np.array([2]), np.array([0]), None)
    if differ:
        assert n0 < 1.0 and k[0] == 0
    else:
        assert n0 > 20.0 and k[0] > 0


def test_a_class_row_given_to_another_class_starts_from_the_policy_value() -> None:
    """A dynamic class evicted for another: the newcomer's requests are not judged by how far
    the old tenant's differed."""
    rng = np.random.default_rng(5)
    ctl = Controller(policy(cost_model=COSTLY_TOKENS, dynamic_classes=True, max_classes=4))
    for batch in range(8):
        for r in _serve(ctl, [0.98, 0.02] * 2, 6, rng, 4 * batch, cls="tenant-a"):
            ctl.remove_request(r)
    row = ctl.class_index("tenant-a")
    assert ctl.spread.shrinkage[row] < 1.0
    assert ctl.class_index("tenant-b") == row  # (tenant-a is idle: its row is reused)
    assert ctl.spread.shrinkage[row] == ctl.policy.request_shrinkage
