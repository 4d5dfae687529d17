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


class AcceptanceEstimator:
    """Beta posteriors per (class, position) whose evidence decays each step.

    Decay pulls a class back to its prior when it stops being observed (e.g. because the
    controller turned its speculation off), which is what makes a switched-off class get
    re-tested once the prior says speculating could pay.

    Attributes succ, fail, prior_a, prior_b ([n_classes, k_max]) are views of one array `ev`
    (succ | fail | prior_a | prior_b per class), so that one matrix product turns all of them
    into the posterior tables; write into them, never rebind them. `active`: leading class
    rows in use (a controller registers classes in order); the rest are skipped.
    """

    def __init__(self, n_classes: int, k_max: int, forgetting: float = 0.98) -> None:
        kk = self.k_max = max(k_max, 1)
        self.forgetting = forgetting
        self.active = n_classes
        self.ev = np.zeros((n_classes, 4 * kk))
        self.ev[:, 2 * kk:] = 1.0  # prior_a = prior_b = 1
        self.succ, self.fail, self.prior_a, self.prior_b = (
            self.ev[:, i * kk: (i + 1) * kk] for i in range(4))
        # Posterior tables as one linear map of a class's row (succ | fail | prior_a | prior_b):
        # A = prior_a + succ and T = A + prior_b + fail per position, then sum(A) and sum(T).
        m = np.zeros((2 * kk + 2, 4 * kk))
        eye = np.eye(kk)
        m[:kk, :kk] = m[:kk, 2 * kk: 3 * kk] = eye
        m[kk: 2 * kk] = np.tile(eye, 4)
        m[2 * kk, :kk] = m[2 * kk, 2 * kk: 3 * kk] = 1.0
        m[2 * kk + 1] = 1.0
        self._tables_map = m

    def set_prior(self, cls: int, acceptance: np.ndarray | list[float], strength: float) -> None:
        p = np.clip(np.asarray(acceptance, dtype=float)[: self.k_max], 1e-3, 1 - 1e-3)
        self.prior_a[cls] = strength * p
        self.prior_b[cls] = strength * (1.0 - p)
        self.succ[cls] = 0.0
        self.fail[cls] = 0.0

    def mean(self) -> np.ndarray:
        """Posterior mean acceptance, [n_classes, k_max]."""
        a = self.prior_a + self.succ
        return a / (a + self.prior_b + self.fail)

    def posterior_sums(self) -> np.ndarray:
        """Posterior sums of the active classes, position-major: rows [0, k_max) a = prior_a +
        succ per position, [k_max, 2 k_max) a + b, then the two summed over positions (pooled
        acceptance = row 2 k_max / row 2 k_max + 1). The decision's input."""
        return np.dot(self._tables_map, self.ev[: self.active].T)

    def observations(self) -> np.ndarray:
        """Decayed count of verified positions per class (evidence beyond the prior)."""
        return (self.succ + self.fail).sum(axis=1)


class RequestAcceptance:
    """A request's own decayed acceptance record, shrunk toward its class.

    A request's estimate is (s + n0 * m_class) / (n + n0): with few observations it is its
    class's level, and its own rate takes over as evidence accumulates (n0 = shrinkage).
    `sn` [2, capacity]: s and n per slot.
    """

    def __init__(self, capacity: int, forgetting: float = 0.9, shrinkage: float = 6.0) -> None:
        self.forgetting = forgetting
        self.shrinkage = shrinkage
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
