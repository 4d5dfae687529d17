"""Acceptance estimates per (class, draft position), with forgetting, and per-request shrinkage.

Position j's acceptance is conditional: the chance that draft j is accepted given drafts 0..j-1
were. A verification that drafted k and accepted a is a run of a successes followed, if a < k,
by one failure at position a; positions after the failure say nothing and are not counted.
"""

from __future__ import annotations

import numpy as np


class AcceptanceEstimator:
    """Beta posteriors per (class, position) whose evidence decays each step.

    Decay pulls a class back to its prior when it stops being observed (e.g. because the
    controller turned its speculation off), which is what makes a switched-off class get
    re-tested once the prior says speculating could pay.

    Attributes (plain arrays, shape [n_classes, k_max]): prior_a, prior_b, succ, fail.
    """

    def __init__(self, n_classes: int, k_max: int, forgetting: float = 0.98) -> None:
        self.k_max = max(k_max, 1)
        self.forgetting = forgetting
        self.prior_a = np.ones((n_classes, self.k_max))
        self.prior_b = np.ones((n_classes, self.k_max))
        self.succ = np.zeros((n_classes, self.k_max))
        self.fail = np.zeros((n_classes, self.k_max))
        self._pos = np.arange(self.k_max)

    def set_prior(self, cls: int, acceptance: np.ndarray | list[float], strength: float) -> None:
        p = np.clip(np.asarray(acceptance, dtype=float)[: self.k_max], 1e-3, 1 - 1e-3)
        self.prior_a[cls] = strength * p
        self.prior_b[cls] = strength * (1.0 - p)
        self.succ[cls] = 0.0
        self.fail[cls] = 0.0

    def partial_fit(self, classes: np.ndarray, drafted: np.ndarray, accepted: np.ndarray) -> None:
        """Decay all evidence once (one engine step) and add this step's verifications."""
        self.succ *= self.forgetting
        self.fail *= self.forgetting
        mask = drafted > 0
        if not mask.any():
            return
        kk, n_cls = self.k_max, self.succ.shape[0]
        d = np.minimum(drafted[mask], kk)
        a = np.minimum(accepted[mask], d)
        # Histogram of accepted counts per class; "position j accepted" is "a > j", a reverse
        # cumulative sum of that histogram, so the update costs two bincounts over requests.
        key = classes[mask] * (kk + 1) + a
        size = n_cls * (kk + 1)
        hist = np.bincount(key, minlength=size).reshape(n_cls, kk + 1)
        self.succ += np.cumsum(hist[:, :0:-1], axis=1)[:, ::-1]
        rejected = np.bincount(key, weights=a < d, minlength=size).reshape(n_cls, kk + 1)
        self.fail += rejected[:, :kk]

    def mean(self) -> np.ndarray:
        """Posterior mean acceptance, [n_classes, k_max]."""
        a = self.prior_a + self.succ
        return a / (a + self.prior_b + self.fail)

    def sample(self, classes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One Thompson draw of the per-position acceptance for each given class index.

        A normal approximation of the Beta posterior: a Beta draw costs ~30 us for a handful
        of requests here, the normal one ~2 us, and exploration only needs the right spread.
        """
        a = self.prior_a[classes] + self.succ[classes]
        total = a + self.prior_b[classes] + self.fail[classes]
        m = a / total
        sd = np.sqrt(m * (1.0 - m) / (total + 1.0))
        return np.clip(m + sd * rng.standard_normal(m.shape), 0.0, 1.0)

    def pooled(self) -> np.ndarray:
        """Acceptance per class pooled over positions (the level a request is compared with)."""
        a = (self.prior_a + self.succ).sum(axis=1)
        return a / (a + (self.prior_b + self.fail).sum(axis=1))

    def observations(self) -> np.ndarray:
        """Decayed count of verified positions per class (evidence beyond the prior)."""
        return (self.succ + self.fail).sum(axis=1)


class RequestAcceptance:
    """A request's own decayed acceptance record, shrunk toward its class.

    A request's estimate is (s + n0 * m_class) / (n + n0): with few observations it is its
    class's level, and its own rate takes over as evidence accumulates (n0 = shrinkage).
    """

    def __init__(self, capacity: int, forgetting: float = 0.9, shrinkage: float = 6.0) -> None:
        self.forgetting = forgetting
        self.shrinkage = shrinkage
        self.s = np.zeros(capacity)
        self.n = np.zeros(capacity)

    def reset(self, slot: int) -> None:
        self.s[slot] = 0.0
        self.n[slot] = 0.0

    def partial_fit(self, slots: np.ndarray, drafted: np.ndarray, accepted: np.ndarray) -> None:
        observed = drafted > 0
        if not observed.any():
            return
        sl = slots[observed]
        d = drafted[observed]
        a = np.minimum(accepted[observed], d)
        self.s[sl] = self.s[sl] * self.forgetting + a
        # positions observed: the accepted ones plus the one rejected (if any)
        self.n[sl] = self.n[sl] * self.forgetting + a + (a < d)

    def factor(self, slots: np.ndarray, class_level: np.ndarray) -> np.ndarray:
        """Multiplier of the class's per-position acceptance for each request."""
        level = np.maximum(class_level, 1e-3)
        own = (self.s[slots] + self.shrinkage * level) / (self.n[slots] + self.shrinkage)
        return own / level
