"""What a proposer's confidence in a draft is worth: calibrated per (class, proposer), online.

A proposer sends each draft with its own per-token signal (an n-gram's posterior for its match,
the draft model's geometric mean probability of its tokens). The raw number is not an
acceptance rate: a draft model's probabilities are over-confident on one class and fine on
another. So each (class, proposer) row keeps, per confidence bin, decayed counts of the draft
tokens that were verified: a draft of d tokens of which a were accepted is a successes and, if
a < d, one failure (positions after the first rejection say nothing), as for the class
estimates (adaptspec/acceptance.py); and beside them the successes the controller's own
per-position estimates expected of those same trials. A bin's posterior mean is the calibrated
per-token acceptance of drafts with that confidence; its log-odds over what was expected of the
same positions is how far such a draft sits from the per-position estimates. Matching the
positions matters: the cut makes doubtful drafts short, so a low bin's trials are mostly first
positions, the weakest, and against the row's pooled rate it would read as worse than it is and
be cut shorter still. A bin with too little evidence gives no level: the raw number may only
rank a draft against the other drafts of its row (`relative`: its log-odds over the row's mean
confidence), and such a draft is never cut below its first token (only verified tokens
calibrate). Read as a level, an n-gram's prior n/(n+3) says 0.4 for a 2-token match that chat
accepts at 0.7, and a fresh server would cut drafts that pay until its bins fill.

Bins rather than a fitted curve: the counts decay every step like the rest of the controller's
evidence, update in place on the hot path, and need no refit. `OutcomeCalibration` then checks
the values the trim kept tokens at against what those tokens turned into, per value bin (a
draft's first token apart).
"""

from __future__ import annotations

import numpy as np


class _Decaying:
    """Evidence arrays (named in `_arrays`) that decay by `forgetting` every `tick`, i.e. every
    engine step; the decay is applied when they are next read or written, so a step that
    touches none of them costs nothing."""

    _arrays: tuple[str, ...] = ()
    forgetting: float
    pending: int

    def tick(self) -> None:
        """One engine step passed: all evidence decays once (lazily)."""
        self.pending += 1

    def _decay(self) -> None:
        if self.pending:
            f = self.forgetting ** self.pending
            for name in self._arrays:
                getattr(self, name)[...] *= f
            self.pending = 0


class ConfidenceCalibration(_Decaying):
    """Per row and confidence bin, decayed counts of accepted and rejected draft tokens.

    Attributes: bins (equal-width bins of [0, 1]), forgetting (per `tick`, i.e. per engine
    step), min_evidence (decayed tokens a bin needs before `predict` trusts it), succ and fail
    ([n_rows, bins]), expected (successes the per-position estimates expected of the same
    trials, [n_rows, bins]), seen_sum and seen_n (decayed sum and count of the confidences
    `observe`d per row, [n_rows]), pending (ticks not yet applied to them: see `_Decaying`)."""

    _arrays = ("succ", "fail", "expected", "seen_sum", "seen_n")

    def __init__(self, n_rows: int, bins: int = 10, forgetting: float = 0.98,
                 min_evidence: float = 8.0) -> None:
        self.bins = bins
        self.forgetting = forgetting
        self.min_evidence = min_evidence
        self.succ = np.zeros((n_rows, bins))
        self.fail = np.zeros((n_rows, bins))
        self.expected = np.zeros((n_rows, bins))
        self.seen_sum = np.zeros(n_rows)
        self.seen_n = np.zeros(n_rows)
        self.pending = 0

    def _bin(self, confidence: np.ndarray) -> np.ndarray:
        return equal_bins(confidence, self.bins)

    def partial_fit(self, rows: np.ndarray, confidence: np.ndarray, drafted: np.ndarray,
                    accepted: np.ndarray, alpha: np.ndarray) -> None:
        """Verified drafts whose confidence was known (after the decay of the steps passed);
        alpha [n, >= longest draft] is the per-position acceptance each draft was planned with
        (what `shift` is measured against)."""
        self._decay()
        d = np.asarray(drafted, dtype=np.int64)
        keep = d > 0
        if not keep.any():
            return
        d = d[keep]
        cell = np.asarray(rows, dtype=np.int64)[keep] * self.bins + \
            self._bin(np.asarray(confidence)[keep])
        a = np.minimum(np.maximum(np.asarray(accepted, dtype=np.int64)[keep], 0), d)
        trials = a + (a < d)
        exp = np.cumsum(np.fmax(np.asarray(alpha, dtype=np.float64)[keep], 0.0), axis=1)
        exp = exp[np.arange(d.size), np.minimum(trials, exp.shape[1]) - 1]
        size, shape = self.succ.size, self.succ.shape
        self.succ += np.bincount(cell, weights=a, minlength=size).reshape(shape)
        self.fail += np.bincount(cell, weights=(a < d).astype(np.float64),
                                 minlength=size).reshape(shape)
        self.expected += np.bincount(cell, weights=exp, minlength=size).reshape(shape)

    def shift(self, rows: np.ndarray, confidence: np.ndarray) -> np.ndarray:
        """Log-odds of drafts with this confidence over what the per-position estimates
        expected of the same trials: how far this draft's acceptance sits from its row's at
        every position (NaN where the bin has too little evidence). Applied to the row's
        per-position acceptance, it keeps the position shape (an n-gram's first position is
        its weakest) and moves the level."""
        rows = np.asarray(rows, dtype=np.int64)
        rate = self.predict(rows, confidence)  # (decays first)
        b = self._bin(confidence)
        n = self.succ[rows, b] + self.fail[rows, b]
        return _logit(rate) - _logit((self.expected[rows, b] + 1.0) / (n + 2.0))

    def observe(self, rows: np.ndarray, confidence: np.ndarray) -> None:
        """Confidences of drafts as proposed (before any cut), for `relative`."""
        self._decay()
        rows = np.asarray(rows, dtype=np.int64)
        np.add.at(self.seen_sum, rows, unit_interval(confidence))
        np.add.at(self.seen_n, rows, 1.0)

    def relative(self, rows: np.ndarray, confidence: np.ndarray) -> np.ndarray:
        """Log-odds of each confidence over the mean confidence `observe`d in its row (0 where
        the row has seen none): where a draft ranks among its row's, with no claim on the
        level of acceptance."""
        self._decay()
        rows = np.asarray(rows, dtype=np.int64)
        n = self.seen_n[rows]
        mean = np.divide(self.seen_sum[rows], n, out=np.zeros_like(n), where=n > 0)
        lo, hi = 1e-2, 1.0 - 1e-2  # (a confidence of 0 or 1 would be infinitely far)
        c = np.clip(unit_interval(confidence), lo, hi)
        return np.where(n > 0, _logit(c) - _logit(np.clip(mean, lo, hi)), 0.0)

    def predict(self, rows: np.ndarray, confidence: np.ndarray) -> np.ndarray:
        """Calibrated per-token acceptance of drafts with this confidence from these rows; NaN
        where the bin has less than min_evidence."""
        self._decay()
        rows = np.asarray(rows, dtype=np.int64)
        b = self._bin(confidence)
        s, f = self.succ[rows, b], self.fail[rows, b]
        n = s + f
        return np.where(n >= self.min_evidence, (s + 1.0) / (n + 2.0), np.nan)


def unit_interval(x: np.ndarray) -> np.ndarray:
    """x as floats clipped to [0, 1], NaN read as 0 (fmax and fmin skip NaN: two ufunc calls,
    where nan_to_num and clip take a dozen on the per-step path)."""
    return np.fmin(np.fmax(np.asarray(x, dtype=np.float64), 0.0), 1.0)


def equal_bins(x: np.ndarray, bins: int) -> np.ndarray:
    """Index of x's bin among `bins` equal-width bins of [0, 1] (`unit_interval` first)."""
    return np.minimum((unit_interval(x) * bins).astype(np.int64), bins - 1)


def _logit(p: np.ndarray) -> np.ndarray:
    return np.log(p) - np.log1p(-p)


def confidence_values(alpha: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """The plan's per-position acceptance `alpha` [k_max, m] (`per_position` of its running
    products) moved by each draft's log-odds `shift` [m] (Controller.cut), as running products:
    per position the expected accepted tokens of keeping it."""
    a = np.clip(alpha, 1e-9, 1.0 - 1e-9)
    moved = np.where(alpha > 0, 1.0 / (1.0 + (1.0 - a) / a * np.exp(-shift)), 0.0)
    return np.multiply.accumulate(moved, axis=0)


def per_position(val: np.ndarray) -> np.ndarray:
    """Per-position acceptance [k_max, m] back from running products `val` (0 once a product
    reached 0)."""
    prev = np.vstack([np.ones((1, val.shape[1])), val[:-1]])
    return np.divide(val, prev, out=np.zeros_like(val), where=prev > 0)


class OutcomeCalibration:
    """What the trim's values turned into, per (row, draft position, value bin): sums of the
    values verified draft tokens were kept at (a running product: the token's expected
    acceptance) and of the tokens accepted among them.

    The trim keeps the tokens it values most, and values are estimates: where one is high by
    chance, its token is kept, so the kept tokens of high value run below their value, the
    winner's curse (on the unseen chat prompts, tokens kept at 0.95 were accepted at 0.77).
    Binning by value (histogram-binning calibration) conditions on what the selection saw,
    which a correction per draft position alone cannot: it mixes the tokens of each position
    kept at every value. Each position is binned apart, as each errs its own way: a draft's
    first token carries the request's own record and the proposer's confidence, the later ones
    the class's run past it, and the deeper a token the more its value leans on the class's
    conditional acceptance holding on. On the unseen chat prompts (our n-gram, three rounds),
    tokens valued 0.2-0.4 (corrected) were accepted at 0.40 in second place and 0.15 in fourth;
    binned first-or-later, fifth and later tokens were valued at 0.35-0.40 and accepted at 0.21,
    which drew drafts past the depth that pays. A cell's ratio of accepted over expected, shrunk
    by `prior` expected tokens toward a target, multiplies the values that fall in it. Deep
    cells see few tokens, a handful a bin: the target is the same bin's ratio one position
    earlier (cells err the way the positions before them do) times the position's drift, all
    its bins pooled (accepted over what those earlier ratios predicted), so a position where
    acceptance falls off pulls its thin cells down with it. Shrunk toward the earlier ratio
    alone, over vLLM's n-gram on the unseen chat prompts the sixth to eighth positions' kept
    tokens were valued at 28, 17 and 5 tokens and made 21, 11 and 1
    (`bench/trim_values.py`); with the drift, 21, 15 and 7 against 18, 12 and 4.

    The evidence ages by the row's own tokens (each verified token multiplies the row's sums by
    1 - 1 / window), not by engine steps: a row's correction holds about `window` of its
    latest tokens however often it drafts, where decaying per step would leave a row that
    drafts in one step in four near its prior.

    Attributes: bins, positions (positions from the last on share its cells), window, prior,
    expected and accepted ([n_rows, positions, bins])."""

    def __init__(self, n_rows: int, bins: int = 10, window: float = 1000.0,
                 prior: float = 8.0, positions: int = 8) -> None:
        self.bins = bins
        self.positions = max(int(positions), 1)
        self.window = window
        self.prior = prior
        self.expected = np.zeros((n_rows, self.positions, bins))
        self.accepted = np.zeros((n_rows, self.positions, bins))

    def _cell(self, values: np.ndarray, position: np.ndarray) -> np.ndarray:
        """(draft position, value bin) as one index into the last two axes."""
        return (np.minimum(position, self.positions - 1) * self.bins
                + equal_bins(values, self.bins))

    def partial_fit(self, rows: np.ndarray, values: np.ndarray, verified: np.ndarray,
                    accepted: np.ndarray) -> None:
        """Verified drafts: the values [n, >= longest] their tokens were kept at (before
        `correct`), how many were verified and accepted."""
        values = np.asarray(values, dtype=np.float64)
        j = np.arange(values.shape[1])[None, :]
        kept = j < np.asarray(verified, dtype=np.int64)[:, None]
        if not kept.any():
            return
        hit = kept & (j < np.asarray(accepted, dtype=np.int64)[:, None])
        rows = np.broadcast_to(np.asarray(rows, dtype=np.int64)[:, None], kept.shape)[kept]
        n_rows = self.expected.shape[0]
        age = (1.0 - 1.0 / self.window) ** np.bincount(rows, minlength=n_rows)
        self.expected *= age[:, None, None]
        self.accepted *= age[:, None, None]
        position = np.broadcast_to(j, kept.shape)[kept].astype(np.int64)
        cell = rows * self.positions * self.bins + self._cell(values[kept], position)
        size, shape = self.expected.size, self.expected.shape
        self.expected += np.bincount(cell, weights=np.fmax(values[kept], 0.0),
                                     minlength=size).reshape(shape)
        self.accepted += np.bincount(cell, weights=hit[kept].astype(np.float64),
                                     minlength=size).reshape(shape)

    def ratio(self, rows: np.ndarray) -> np.ndarray:
        """Accepted over expected, [len(rows), positions, bins], each cell shrunk by `prior`
        expected tokens toward the same bin's ratio one position earlier times the position's
        drift: how its tokens, all bins pooled, turned out against what those earlier ratios
        predicted (itself shrunk by `prior` toward no drift). The first position leans on 1."""
        rows = np.asarray(rows, dtype=np.int64)
        acc, exp = self.accepted[rows], self.expected[rows]
        out = np.empty_like(acc)
        before = np.ones(acc[:, 0].shape)
        for j in range(self.positions):
            drift = ((acc[:, j].sum(axis=1) + self.prior)
                     / ((exp[:, j] * before).sum(axis=1) + self.prior))
            toward = before * drift[:, None]
            out[:, j] = before = (acc[:, j] + self.prior * toward) / (exp[:, j] + self.prior)
        return out

    def correct(self, values: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Values [k, m] (running products, a draft per column) times their cell's ratio in
        their draft's row; still a running product (non-increasing along a draft, at most 1),
        so the trim keeps prefixes."""
        r = self.ratio(rows).reshape(len(rows), -1)  # [m, positions * bins]
        position = np.arange(values.shape[0])[:, None]
        factor = r[np.arange(values.shape[1])[None, :], self._cell(values, position)]
        return np.minimum.accumulate(np.minimum(values * factor, 1.0), axis=0)
