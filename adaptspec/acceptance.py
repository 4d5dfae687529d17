"""Acceptance estimates per (class, draft position), with forgetting, and per-request shrinkage.

Position j's acceptance is conditional: the chance that draft j is accepted given drafts 0..j-1
were. A verification that drafted k and accepted a is a run of a successes followed, if a < k,
by one failure at position a; positions after the failure say nothing and are not counted.

The classes here hold the state; `learn` updates both from one step's verifications, in the
compiled kernel adaptspec.fastpath.feedback (the maths: adaptspec.step_reference.feedback).
"""

from __future__ import annotations

import numpy as np

from adaptspec import fastpath

# A prior acceptance is kept this far from 0 and 1 (it is a guess, never a certainty).
PRIOR_MIN = 1e-3


class AcceptanceEstimator:
    """Beta posteriors per (class, position) whose evidence ages as it is replaced.

    The first position's evidence decays by `forgetting` every step. That pulls a class back
    to its prior when it stops being observed (e.g. because the controller turned its
    speculation off), which is what makes a switched-off class get re-tested once the prior
    says speculating could pay. A later position ages only as far as it was observed: by
    forgetting^r in a step where a share r of the class's verified drafts reached it. So every
    position holds about as much evidence as the first (1 / (1 - forgetting) steps of the
    class's drafts), where decaying each step would leave a position that few drafts reach
    (an n-gram's run past its first tokens, 85-100% accepted) with a few observations against
    its prior, and read it as the prior.

    A position's prior is the class's (`set_prior`: one value per position), moved in log-odds
    by as much as the position before it has moved from its own prior: a position the
    controller has not drafted lately (past the K it chose) expects what was last learned
    before it, not the policy's guess. So a class found better than its prior is drafted
    further, and the longer drafts are measured (with only the class prior there, a draft K
    long measures K positions, and the next one is never worth drafting: drafts stay short).
    The prior's shape (a first position below the later ones, as an n-gram's) is kept.

    Attributes succ, fail, prior_a, prior_b ([n_classes, k_max]) are views of one array `ev`
    (succ | fail | prior_a | prior_b per class); write into them, never rebind them. `active`:
    leading class rows in use (a controller registers classes in order); the rest are skipped.
    """

    def __init__(self, n_classes: int, k_max: int, forgetting: float = 0.98) -> None:
        kk = self.k_max = max(k_max, 1)
        self.forgetting = forgetting
        self.active = n_classes
        self.ev = np.zeros((n_classes, 4 * kk))
        self.ev[:, 2 * kk:] = 1.0  # prior_a = prior_b = 1
        self.succ, self.fail, self.prior_a, self.prior_b = (
            self.ev[:, i * kk: (i + 1) * kk] for i in range(4))

    def set_prior(self, cls: int, acceptance: np.ndarray | list[float], strength: float) -> None:
        p = np.clip(np.asarray(acceptance, dtype=float)[: self.k_max], PRIOR_MIN, 1 - PRIOR_MIN)
        self.prior_a[cls] = strength * p
        self.prior_b[cls] = strength * (1.0 - p)
        self.succ[cls] = 0.0
        self.fail[cls] = 0.0

    def mean(self) -> np.ndarray:
        """Posterior mean acceptance, [n_classes, k_max] (the active classes' rows)."""
        post, kk = self.posterior_sums(), self.k_max
        return (post[:kk] / post[kk:]).T

    def first_mean(self) -> np.ndarray:
        """The first position's posterior mean per active class (no position before it moves
        its prior): what a draft's first token is accepted at, without the others' work."""
        ev, kk = self.ev[: self.active], self.k_max
        a = ev[:, 2 * kk] + ev[:, 0]
        return a / (a + ev[:, 3 * kk] + ev[:, kk])

    def posterior_sums(self) -> np.ndarray:
        """The active classes' posteriors, position-major [2 k_max, classes]: rows [0, k_max)
        a (the prior's share plus successes) per position, [k_max, 2 k_max) a + b (prior
        strength plus verifications); mean = a / (a + b). The decision's input, computed every
        step by the compiled kernel fastpath.posterior (the maths, moving each position's prior
        by the one before it: adaptspec.step_reference.posterior)."""
        return fastpath.posterior(self.ev, self.active, self.k_max, PRIOR_MIN)

    def observations(self) -> np.ndarray:
        """Decayed count of verified positions per class (evidence beyond the prior)."""
        return (self.succ + self.fail).sum(axis=1)


class RequestAcceptance:
    """A request's own decayed record of how often its drafts started right, shrunk toward
    its class.

    s counts its verifications that accepted at least one draft token, n those that verified
    any. Its first-position estimate is (s + n0 * m_class) / (n + n0), m_class its class's
    first-position acceptance: with few observations it is its class's, and its own rate takes
    over as evidence accumulates (n0: the shrinkage of its row, RequestSpread). The later
    positions keep the class's acceptance given the earlier (step_reference.decide says why).
    `sn` [2, capacity]: s and n per slot.
    """

    def __init__(self, capacity: int, forgetting: float = 0.9) -> None:
        self.forgetting = forgetting
        self.sn = np.zeros((2, capacity))

    def reset(self, slot: int) -> None:
        self.sn[:, slot] = 0.0


def learn(estimator: AcceptanceEstimator, requests: RequestAcceptance, classes: np.ndarray,
          slots: np.ndarray, drafted: np.ndarray, accepted: np.ndarray
          ) -> tuple[np.ndarray, int, int]:
    """One engine step's verifications into both estimators: the class evidence decays once
    and gains the step's, the requests that drafted update their records. Drafted and accepted
    counts are clipped to 0..k_max (bad feedback is bounded, never raises); all arrays int64,
    of one length, slots and classes valid (the compiled kernel does not check).

    Returns (the records of `slots` after the update [2, n], the sum of `drafted`, the longest
    draft): what the decision and the step-time model need."""
    return fastpath.feedback(estimator.ev, estimator.active, estimator.k_max,
                             estimator.forgetting, classes, requests.sn, slots, drafted,
                             accepted, requests.forgetting)


class RequestSpread:
    """How far the requests of each row (class and proposer) differ in how often their drafts
    start right, so how far a request's own record may move it from its row: the shrinkage
    n0 of RequestAcceptance, estimated per row from the requests that finished (empirical
    Bayes: the beta-binomial's method of moments).

    A finished request that verified n drafts, s of which started right, adds (1, n, s,
    s^2 / n, n^2) to its row's sums (older requests decayed by `forgetting` a request). With
    p the pooled rate, k the requests and N their drafts, their rates spread beyond what n
    draws each show by chance by tau^2 = (sum n (s / n - p)^2 - p (1 - p) (k - 1)) /
    (N - sum n^2 / N), and a beta prior with that spread weighs p (1 - p) / tau^2 - 1 draws:
    that is n0. Requests that differ no more than chance get MAX_SHRINKAGE (their records
    move nothing); until `min_requests` have finished, a row keeps the policy's
    request_shrinkage (`default`). A fixed n0 is right for one workload only: where requests
    differ (code edits beside free prose in one class) records should move them, where they
    do not (chat) a record of a few misses is chance, and acting on it leaves a request
    undrafted to the end of its batch (docs/unseen.md).

    Attributes: default, forgetting, min_requests, sums [rows, 5], shrinkage [rows] (n0 per
    row, what the decision reads).
    """

    MAX_SHRINKAGE = 1e3
    # (above 0: a record of no drafts would read 0 / 0)
    MIN_SHRINKAGE = 1e-3

    def __init__(self, n_rows: int, default: float, forgetting: float = 0.99,
                 min_requests: int = 16) -> None:
        self.default = max(float(default), self.MIN_SHRINKAGE)
        self.forgetting = forgetting
        self.min_requests = min_requests
        self.sums = np.zeros((n_rows, 5))
        self.shrinkage = np.full(n_rows, self.default)

    def reset(self, row: int) -> None:
        """A row given to another class: what its requests said is forgotten."""
        self.sums[row] = 0.0
        self.shrinkage[row] = self.default

    def add(self, row: int, started_right: float, drafts: float) -> None:
        """One finished request's record in its row: drafts verified, how many started right
        (undecayed). A request that verified none says nothing."""
        if drafts < 1:
            return
        s, n = float(started_right), float(drafts)
        x = self.sums[row]
        x *= self.forgetting
        x += (1.0, n, s, s * s / n, n * n)
        self.shrinkage[row] = self.estimate(row)

    def estimate(self, row: int) -> float:
        """n0 for a row from its sums (see the class)."""
        k, n, s, q, n2 = self.sums[row]
        if k < self.min_requests:
            return self.default
        p = s / n
        chance = p * (1.0 - p)
        spread_n = n - n2 / n
        if chance <= 0.0 or spread_n <= 0.0:
            return self.default
        tau2 = (q - s * s / n - chance * (k - 1.0)) / spread_n
        if tau2 <= 0.0:
            return self.MAX_SHRINKAGE
        return float(min(max(chance / tau2 - 1.0, self.MIN_SHRINKAGE), self.MAX_SHRINKAGE))
