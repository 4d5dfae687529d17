"""Acceptance estimates per (class, draft position), with forgetting, and per-request shrinkage.

Position j's acceptance is conditional: the chance that draft j is accepted given drafts 0..j-1
were. A verification that drafted k and accepted a is a run of a successes followed, if a < k,
by one failure at position a; positions after the failure say nothing and are not counted.

Both estimators sit on the controller's per-step path, which has a budget of tens of
microseconds for a whole batch: a numpy call costs about a microsecond whatever its size, so
the updates are written as a few calls over the batch (table look-ups keyed by what a
verification reported, one histogram, one small matrix product) rather than many.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np

from adaptspec import fastpath

# Versions of estimator state, unique across estimators, so that a cache keyed on one can never
# mistake another estimator's (or an earlier) state for the current one.
_VERSIONS = itertools.count(1)


@functools.lru_cache(maxsize=8)
def _clip_tables(k_max: int) -> tuple[np.ndarray, np.ndarray]:
    """Look-up tables that clip to 0..k_max by index (take(mode="clip")): d -> d * (k_max + 1)
    and a -> a, one call each instead of a minimum and a maximum."""
    return np.arange(k_max + 1) * (k_max + 1), np.arange(k_max + 1)


def feedback_keys(drafted: np.ndarray, accepted: np.ndarray, k_max: int) -> np.ndarray:
    """One integer per verification, d * (k_max + 1) + a, with d drafted and a accepted each
    clipped to 0..k_max (bad feedback is bounded, never raises). Everything a verification
    contributes to either estimator depends only on (d, a), so the updates are look-ups in
    tables indexed by this key; the tables read a > d as a = d."""
    d_tab, a_tab = _clip_tables(k_max)
    keys = d_tab.take(drafted, mode="clip")
    keys += a_tab.take(accepted, mode="clip")
    return keys


def _key_grid(k_max: int) -> tuple[np.ndarray, np.ndarray]:
    """(d, a) of every key of feedback_keys, with a > d read as a = d."""
    d, a = np.divmod(np.arange((k_max + 1) ** 2), k_max + 1)
    return d, np.minimum(a, d)


class AcceptanceEstimator:
    """Beta posteriors per (class, position) whose evidence decays each step.

    Decay pulls a class back to its prior when it stops being observed (e.g. because the
    controller turned its speculation off), which is what makes a switched-off class get
    re-tested once the prior says speculating could pay.

    Attributes (plain arrays, shape [n_classes, k_max]): prior_a, prior_b, succ, fail. They are
    views of one array (succ | fail | prior_a | prior_b), so that a single matrix product turns
    all of them into the posterior tables; assigning to an attribute copies into its view.
    `active`: leading class rows in use (a controller registers classes in order); rows past it
    are all zero and are skipped by the per-step work.
    `version`: changes whenever the posteriors may have changed, so that derived tables can be
    kept until it does. Reading one of the four attributes counts as a change (the caller may
    write through the view it gets); the read-only methods below do not.
    """

    def __init__(self, n_classes: int, k_max: int, forgetting: float = 0.98) -> None:
        kk = self.k_max = max(k_max, 1)
        self.forgetting = forgetting
        self.active = n_classes
        self._ev = np.zeros((n_classes, 4 * kk))
        self._ev[:, 2 * kk:] = 1.0  # prior_a = prior_b = 1
        self.version = next(_VERSIONS)
        # Whether succ and fail may hold anything but zeros. Until they do, the per-step decay
        # is a no-op and is skipped, and the posteriors (hence `version`) stay as they are: a
        # server that never speculates keeps its class tables from step to step.
        self._has_evidence = False
        # partial_fit runs compiled (adaptspec.fastpath) when given no keys
        self.use_fastpath = fastpath.AVAILABLE
        self._pos = np.arange(kk)
        self._ones = np.ones(256)
        # Evidence a verification with key d * (kk + 1) + a adds: successes at positions < a,
        # a failure at position a if a < d.
        d, a = _key_grid(kk)
        self._contrib = np.concatenate(
            [self._pos < a[:, None], (self._pos == a[:, None]) & (a < d)[:, None]], axis=1
        ).astype(float)
        # Posterior tables as one linear map of a class's row (succ | fail | prior_a | prior_b):
        # A = prior_a + succ and T = A + prior_b + fail per position, then sum(A) and sum(T).
        m = np.zeros((2 * kk + 2, 4 * kk))
        eye = np.eye(kk)
        m[:kk, :kk] = m[:kk, 2 * kk: 3 * kk] = eye
        m[kk: 2 * kk] = np.tile(eye, 4)
        m[2 * kk, :kk] = m[2 * kk, 2 * kk: 3 * kk] = 1.0
        m[2 * kk + 1] = 1.0
        self._tables_map = m

    def _touch(self) -> None:
        self.version = next(_VERSIONS)
        self._has_evidence = True

    # The four public arrays are views into _ev; assignment writes through.
    @property
    def succ(self) -> np.ndarray:
        self._touch()
        return self._ev[:, : self.k_max]

    @succ.setter
    def succ(self, value: np.ndarray) -> None:
        self._touch()
        self._ev[:, : self.k_max] = value

    @property
    def fail(self) -> np.ndarray:
        self._touch()
        return self._ev[:, self.k_max: 2 * self.k_max]

    @fail.setter
    def fail(self, value: np.ndarray) -> None:
        self._touch()
        self._ev[:, self.k_max: 2 * self.k_max] = value

    @property
    def prior_a(self) -> np.ndarray:
        self._touch()
        return self._ev[:, 2 * self.k_max: 3 * self.k_max]

    @prior_a.setter
    def prior_a(self, value: np.ndarray) -> None:
        self._touch()
        self._ev[:, 2 * self.k_max: 3 * self.k_max] = value

    @property
    def prior_b(self) -> np.ndarray:
        self._touch()
        return self._ev[:, 3 * self.k_max:]

    @prior_b.setter
    def prior_b(self, value: np.ndarray) -> None:
        self._touch()
        self._ev[:, 3 * self.k_max:] = value

    def set_prior(self, cls: int, acceptance: np.ndarray | list[float], strength: float) -> None:
        p = np.clip(np.asarray(acceptance, dtype=float)[: self.k_max], 1e-3, 1 - 1e-3)
        # Through _views: clearing a class's evidence adds none (see _has_evidence).
        succ, fail, prior_a, prior_b = self._views()
        prior_a[cls] = strength * p
        prior_b[cls] = strength * (1.0 - p)
        succ[cls] = 0.0
        fail[cls] = 0.0
        self.version = next(_VERSIONS)

    def partial_fit(self, classes: np.ndarray, drafted: np.ndarray, accepted: np.ndarray,
                    keys: np.ndarray | None = None,
                    class_offsets: np.ndarray | None = None) -> None:
        """Decay all evidence once (one engine step) and add this step's verifications.

        `keys`: feedback_keys(drafted, accepted, k_max), where the caller has them already;
        `class_offsets`: classes * (k_max + 1) ** 2, likewise.
        """
        kk, n = self.k_max, self.active
        if self.use_fastpath and keys is None:
            decay = self.forgetting if self._has_evidence else 1.0
            fastpath.credit_classes(self._ev, n, kk, decay, classes, drafted, accepted)
            self.version = next(_VERSIONS)
            self._has_evidence = True
            return
        evidence = self._ev[:n, : 2 * kk]
        if self._has_evidence and self.forgetting != 1.0:  # (zeros decay to themselves)
            evidence *= self.forgetting
            self.version = next(_VERSIONS)
        if keys is None:
            keys = feedback_keys(drafted, accepted, kk)
        if keys.size == 0:
            return
        # Histogram of (class, d, a) over the batch, then each cell's fixed contribution: one
        # bincount and one small matrix product whatever the batch size.
        n_keys = (kk + 1) ** 2
        if class_offsets is None:
            class_offsets = classes * n_keys
        cells = class_offsets + keys
        if self._ones.size < cells.size:
            self._ones = np.ones(2 * cells.size)
        # (Counts as floats, weighted by ones: np.dot would convert integer counts first.)
        hist = np.bincount(cells, self._ones[: cells.size], n * n_keys).reshape(n, n_keys)
        evidence += np.dot(hist, self._contrib)  # np.dot: less overhead than @ here
        self.version = next(_VERSIONS)
        self._has_evidence = True

    def decay(self) -> None:
        """One engine step without verifications: partial_fit with none, without its checks."""
        if self._has_evidence and self.forgetting != 1.0:
            evidence = self._ev[: self.active, : 2 * self.k_max]
            evidence *= self.forgetting
            self.version = next(_VERSIONS)

    def _views(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """succ, fail, prior_a, prior_b without counting as a change (for reading only)."""
        kk, ev = self.k_max, self._ev
        return ev[:, :kk], ev[:, kk: 2 * kk], ev[:, 2 * kk: 3 * kk], ev[:, 3 * kk:]

    def mean(self) -> np.ndarray:
        """Posterior mean acceptance, [n_classes, k_max]."""
        succ, fail, prior_a, prior_b = self._views()
        a = prior_a + succ
        return a / (a + prior_b + fail)

    def posterior_sums(self) -> np.ndarray:
        """Posterior sums of the active classes, position-major for gathers over a batch:
        rows [0, k_max) a = prior_a + succ per position, [k_max, 2 k_max) a + b, then the two
        summed over positions (pooled acceptance = row 2 k_max / row 2 k_max + 1). One call."""
        return np.dot(self._tables_map, self._ev[: self.active].T)

    def sample(self, classes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One Thompson draw of the per-position acceptance for each given class index.

        A normal approximation of the Beta posterior: a Beta draw costs ~30 us for a handful
        of requests here, the normal one ~2 us, and exploration only needs the right spread.
        """
        succ, fail, prior_a, prior_b = self._views()
        a = prior_a[classes] + succ[classes]
        total = a + prior_b[classes] + fail[classes]
        m = a / total
        sd = np.sqrt(m * (1.0 - m) / (total + 1.0))
        return np.clip(m + sd * rng.standard_normal(m.shape), 0.0, 1.0)

    def pooled(self) -> np.ndarray:
        """Acceptance per class pooled over positions (the level a request is compared with)."""
        succ, fail, prior_a, prior_b = self._views()
        a = (prior_a + succ).sum(axis=1)
        return a / (a + (prior_b + fail).sum(axis=1))

    def observations(self) -> np.ndarray:
        """Decayed count of verified positions per class (evidence beyond the prior)."""
        succ, fail, _, _ = self._views()
        return (succ + fail).sum(axis=1)


class RequestAcceptance:
    """A request's own decayed acceptance record, shrunk toward its class.

    A request's estimate is (s + n0 * m_class) / (n + n0): with few observations it is its
    class's level, and its own rate takes over as evidence accumulates (n0 = shrinkage).
    `s` and `n` (per slot) are the two rows of one array, so a batch's records are one gather.
    """

    def __init__(self, capacity: int, forgetting: float = 0.9, shrinkage: float = 6.0,
                 k_max: int = 64) -> None:
        self.forgetting = forgetting
        self.shrinkage = shrinkage
        self._sn = np.zeros((2, capacity))
        # Changes whenever a record may have (as AcceptanceEstimator.version; reading s or n
        # counts as a change, `records` does not).
        self.version = next(_VERSIONS)
        self.use_fastpath = fastpath.AVAILABLE  # as AcceptanceEstimator's
        # Per feedback key (d, a): the decay applied (none if nothing was drafted), and what is
        # added to s (accepted) and to n (positions observed: accepted plus the rejected one).
        kk = self.k_max = max(k_max, 1)
        d, a = _key_grid(kk)
        self._update = np.stack([np.where(d > 0, forgetting, 1.0), a, a + (a < d)]).astype(float)

    @property
    def s(self) -> np.ndarray:
        self.version = next(_VERSIONS)
        return self._sn[0]

    @s.setter
    def s(self, value: np.ndarray) -> None:
        self.version = next(_VERSIONS)
        self._sn[0] = value

    @property
    def n(self) -> np.ndarray:
        self.version = next(_VERSIONS)
        return self._sn[1]

    @n.setter
    def n(self, value: np.ndarray) -> None:
        self.version = next(_VERSIONS)
        self._sn[1] = value

    def reset(self, slot: int) -> None:
        self._sn[:, slot] = 0.0
        self.version = next(_VERSIONS)

    def partial_fit(self, slots: np.ndarray, drafted: np.ndarray, accepted: np.ndarray,
                    keys: np.ndarray | None = None) -> np.ndarray:
        """Add one step's verifications (drafted and accepted clipped to 0..k_max); requests
        that drafted nothing keep their record as it was. `keys`: see AcceptanceEstimator.
        Returns the updated records of `slots`, [2, len(slots)] (s, n), for the decision."""
        if self.use_fastpath and keys is None:
            self.version = next(_VERSIONS)
            return fastpath.update_records(self._sn, slots, drafted, accepted, self.k_max,
                                           self.forgetting)
        if keys is None:
            keys = feedback_keys(drafted, accepted, self.k_max)
        update = self._update.take(keys, axis=1)  # decay, then what s and n gain
        sn = self._sn.take(slots, axis=1)
        sn *= update[0]
        sn += update[1:]
        # two 1-d scatters: a 2-d fancy assignment costs several times more
        self._sn[0, slots] = sn[0]
        self._sn[1, slots] = sn[1]
        self.version = next(_VERSIONS)
        return sn

    def records(self, slots: np.ndarray) -> np.ndarray:
        """The records of `slots`, [2, len(slots)] (s, n)."""
        return self._sn.take(slots, axis=1)

    def factor(self, slots: np.ndarray, class_level: np.ndarray) -> np.ndarray:
        """Multiplier of the class's per-position acceptance for each request."""
        level = np.maximum(class_level, 1e-3)
        s, n = self._sn
        own = (s[slots] + self.shrinkage * level) / (n[slots] + self.shrinkage)
        return own / level


def fit_compiled(estimator: AcceptanceEstimator, requests: RequestAcceptance,
                 classes: np.ndarray, slots: np.ndarray, drafted: np.ndarray,
                 accepted: np.ndarray) -> tuple[np.ndarray | None, int, int]:
    """`estimator.partial_fit` and `requests.partial_fit` for one step in one compiled call
    (adaptspec.fastpath.feedback; only where numba is installed), which also reads off what
    the step-time model needs: two numpy reductions cost as much as the updates.

    Returns (the records of `slots` as RequestAcceptance.partial_fit returns them, the sum
    of `drafted`, the longest draft). Where nothing was drafted (longest 0) nothing is
    learned and the records are None: the caller decays the class evidence instead.
    """
    decay = estimator.forgetting if estimator._has_evidence else 1.0
    sn, spec_tokens, longest = fastpath.feedback(
        estimator._ev, estimator.active, estimator.k_max, decay, classes, requests._sn, slots,
        drafted, accepted, requests.k_max, requests.forgetting)
    if longest <= 0:
        return None, int(spec_tokens), 0
    estimator.version = next(_VERSIONS)
    estimator._has_evidence = True
    requests.version = next(_VERSIONS)
    return sn, int(spec_tokens), int(longest)
