"""Step-time model of a verify pass, learned online by recursive least squares.

Features of a step with B requests, S draft tokens in all and longest draft maxK:
[1, B, S, maxK, S > 0, max(0, B + S - knee), B * maxK]. The last is a draft model's passes
over the whole batch: vLLM drafts the longest K for every request and cuts afterwards. Below the
knee the extra verify tokens are almost free (a memory-bound GPU); above it every token costs
(compute-bound, or a CPU from the first token). The policy's prior curve is the starting point
and is worth `prior_weight` steps. Predicted time is coef . features (`step_time`).

Plain decoding's step time by batch size is not a line: on two CPU cores 412 ms at 1 request,
312 at 4, 655 at 16; a GPU has CUDA-graph sizes and a memory-bound to compute-bound knee. What
the linear terms leave at each batch size is learned as a table (decayed mean residual per
batch size) and added to the intercept for a batch of that size (`coef_at`), so that the
kernels keep one formula.

Nor is the cost of a draft token a constant: the kernels run a step's M = B + S tokens as one
matrix shape, and their speed jumps between shapes (oneDNN on this CPU: 4 to 6 tokens take the
same time, 7 take 25% more; a GPU pads a batch up to the next CUDA-graph size, so tokens up to
it are free). What the model leaves at each (B, S) of a speculating step is kept as a second
table (`shape_offset`), learned like the first; the decision keeps pricing plans by the
formula, and the drafts actually proposed are then trimmed to the step shape that pays best
(`trim`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

# (the formula is defined in fastpath, beside the kernels that compile it)
from adaptspec.fastpath import N_FEATURES, features, step_time
from adaptspec.policy import CostModel

__all__ = ["N_FEATURES", "StepCostModel", "features", "step_time"]


# A batch size's residual is shrunk toward 0 as if this many steps had measured none.
OFFSET_PRIOR_STEPS = 4.0
# Batch sizes above this share the last entry of the table.
TABLE_BATCHES = 1024
# The (B, S) table of speculating steps: batch sizes and draft counts above these share the
# last row or column (it is for the shapes a server sees most, and costs a bincount a fit).
SHAPE_BATCHES = 256
SHAPE_DRAFTS = 64


class StepCostModel:
    """Predicts step time (ms) from the batch shape; `partial_fit` adds one measured step.

    The fit minimises relative error (a 5 ms step matters as much as a 500 ms one) over a
    window of recent steps with exponentially decaying weights, plus a pull toward the prior
    curve worth `prior_weight` steps, under non-negative coefficients (costs
    cannot be negative; it also keeps collinear features, such as a knee of 1 where the hinge
    equals B + S - 1, from cancelling each other). The 7x7 normal equations are re-solved
    every `refit_every` steps, so the per-step cost is one row written into a ring buffer.

    What the linear terms leave at each batch size is kept per batch size (decayed sums over
    the window of the residuals and of their weights, `offset_sum`, `offset_weight`), see
    `offset` and `fit`.

    Speculating steps also leave a residual per (B, S) after both (`shape_offset`,
    `shape_sum` and `shape_weight`, decayed like the rest), which `predict` and `trim` add;
    a shape not yet measured takes that of steps of as many rows (`rows_prior`, `rows_sum`
    and `rows_weight`).

    Attributes: coef (ms per feature), prior_coef, prior_scale, prior_weight (see `fit`), knee,
    n_updates, offset_sum, offset_weight, shape_sum, shape_weight, rows_sum, rows_weight.
    """

    def __init__(self, cfg: CostModel, window: int = 512, refit_every: int = 8) -> None:
        self.knee = float(cfg.knee_tokens)
        self.learn = cfg.learn
        self.forgetting = cfg.forgetting
        self.prior_coef = np.asarray(cfg.coefficients(), dtype=float)
        coef = self.prior_coef.copy()
        self.refit_every = refit_every
        # With a knee at or below one token the hinge is B + S - knee for every real batch,
        # a copy of other features: leave it out so the fit is identifiable.
        self._active = np.ones(N_FEATURES, dtype=bool)
        if self.knee <= 1.0:
            self._active[5] = False
            coef[5] = 0.0
        self.coef = coef
        self.prior_scale = 1.0  # measured over prior step time, as of the last fit
        self.n_updates = 0
        self._x = np.zeros((window, N_FEATURES))
        self._y = np.zeros(window)
        # Steps measured since the last fit (B, S, maxK, ms), written into _x and _y by `fit`:
        # a numpy row write per step would cost as much as the rest of the bookkeeping.
        self._pending: list[tuple[int, int, int, float]] = []
        # The prior is a penalty on each coefficient's distance from the prior curve, scaled
        # so that it weighs as much as `prior_weight` steps of a typical plan would.
        # (Pseudo-observations at extreme plans would fight real data where it never reaches.)
        x_ref = np.array(features(8.0, 16.0, 4.0, self.knee))
        y_ref = max(float(x_ref @ self.prior_coef), 1e-6)
        # A reference plan below the knee has a hinge of 0, and the prior would say nothing about
        # the cost over the knee: a few noisy steps there would set it alone, and a controller
        # that learned to stay below the knee would never measure it again. The hinge's prior
        # weighs as if the reference plan's drafts were all over the knee.
        x_ref[5] = max(float(x_ref[5]), 16.0)
        self.prior_weight = cfg.prior_weight
        self._prior_prec = np.diag(cfg.prior_weight * np.maximum(x_ref / y_ref, 1e-6) ** 2)
        self.offset_sum = np.zeros(TABLE_BATCHES + 1)
        self.offset_weight = np.zeros(TABLE_BATCHES + 1)
        self.shape_sum = np.zeros((SHAPE_BATCHES + 1, SHAPE_DRAFTS + 1))
        self.shape_weight = np.zeros((SHAPE_BATCHES + 1, SHAPE_DRAFTS + 1))
        self.rows_sum = np.zeros(TABLE_BATCHES + 1)
        self.rows_weight = np.zeros(TABLE_BATCHES + 1)

    def batch_table(self) -> np.ndarray:
        """What a step of each batch size takes beyond the linear terms (ms): the decayed mean
        of its residuals, shrunk toward 0 by OFFSET_PRIOR_STEPS steps."""
        return self.offset_sum / (self.offset_weight + OFFSET_PRIOR_STEPS)

    def offset(self, batch: int) -> float:
        """`batch_table` at one batch size."""
        b = min(max(int(batch), 0), TABLE_BATCHES)
        return float(self.offset_sum[b] / (self.offset_weight[b] + OFFSET_PRIOR_STEPS))

    def shape_offset(self, batch: int, spec_tokens: Any) -> Any:
        """What a speculating step of this shape takes beyond the formula and the batch
        table (ms): the decayed mean of its residuals, shrunk like `offset` toward what a step
        of as many rows says (`rows_prior`); 0 for a step without drafts. `spec_tokens`: a
        number or an array of them."""
        b = min(max(int(batch), 0), SHAPE_BATCHES)
        spec = np.asarray(spec_tokens).astype(np.int64)
        s = np.minimum(spec, SHAPE_DRAFTS)
        mean = ((self.shape_sum[b, s] + OFFSET_PRIOR_STEPS * self.rows_prior(batch, spec))
                / (self.shape_weight[b, s] + OFFSET_PRIOR_STEPS))
        return np.where(s > 0, mean, 0.0)

    def rows_prior(self, batch: int, spec_tokens: Any) -> Any:
        """The prior of `shape_offset`: a step of B requests and S draft tokens runs B + S
        rows through the weights, as any step of as many rows does (a plain step of B + S
        requests, or a speculating step of other requests and drafts adding up to B + S), so
        it is priced like those (`rows_sum`, `rows_weight`: what the formula leaves at each
        row count, as a plain step of that many rows would; then the longest draft's terms, a
        draft model's passes, on top), as far as steps of B + S rows have been measured; 0
        where none have (the formula alone). On two CPU cores a speculating step took within
        about 5% of a plain step of as many rows for the 0.5B and the 1.5B (on a slower day,
        a step of 1 with 6 drafts 13% less), and rows are not priced linearly there (the 1.5B:
        504 ms a plain step of 2, 310 of 4): one user drafting alone measures the rows that a
        step beside a latency-critical request would run, before any such step is drafted.
        It is a prior: measured shapes replace it. What a speculating step costs beyond its
        rows stays the formula's: its fixed cost (rejection sampling, a drafter's launch) and
        its longest draft's terms."""
        b = min(max(int(batch), 0), TABLE_BATCHES)
        s = np.asarray(spec_tokens).astype(np.int64)
        rows = np.minimum(b + s, TABLE_BATCHES)
        w = self.rows_weight[rows]
        seen = w / (w + OFFSET_PRIOR_STEPS)
        mean_rows = self.rows_sum[rows] / np.maximum(w, 1e-12)
        # rows(B + S) - formula(B, S) less its fixed and longest-draft terms: the rows table
        # less the batch table at B, and S rows against S draft tokens (the hinge is the same)
        c = self.coef
        gap = mean_rows - self.offset(b) + (c[1] - c[2]) * s
        return np.where(s > 0, seen * gap, 0.0)

    def coef_at(self, batch: int) -> np.ndarray:
        """The coefficients for a batch of this size: the intercept carries its offset."""
        coef = self.coef.copy()
        coef[0] = max(coef[0] + self.offset(batch), 0.0)
        return coef

    def predict(self, batch: int, spec_tokens: float, max_k: float) -> float:
        """Predicted step time (ms) of a plan, its shape's residual included."""
        return float(step_time(self.coef_at(batch), batch, spec_tokens, max_k, self.knee)
                     + self.shape_offset(batch, int(spec_tokens)))

    def trim(self, values: np.ndarray, keep: np.ndarray, batch: int, k_min: np.ndarray,
             slack: float | None = None, max_spec: int | None = None) -> np.ndarray:
        """The drafts to verify next step, trimmed to the step shape that pays best.

        `values` [k, m]: per draft position the expected accepted tokens of keeping it (a
        running product, so non-increasing along a draft), `keep` [m] the draft lengths so
        far, `batch` the requests in the step, `k_min` [m] the forced lengths; `slack`: a
        latency-critical request is in the batch, the step may take at most that share more
        than plain decoding. Tokens go in by value, so every draft keeps a prefix; the plan
        kept is the one of most tokens per predicted ms (n + accepted over the step time
        with the shape's residual), of at most `max_spec` draft tokens in all where given
        (beyond what is forced). Never longer than `keep`."""
        keep = np.asarray(keep, dtype=np.int64)
        m = keep.size
        forced = np.minimum(np.asarray(k_min, dtype=np.int64), keep)
        j = np.arange(values.shape[0])[:, None]
        open_ = (j >= forced[None, :]) & (j < keep[None, :])
        if m == 0 or not open_.any():
            return keep.copy()
        pos, req = np.nonzero(open_)
        val = values[pos, req]
        order = np.lexsort((pos, -val))  # by value, ties by position: prefixes
        pos, req, val = pos[order], req[order], val[order]
        base = int(forced.sum())
        longest = np.maximum.accumulate(pos + 1)
        max_k0 = int(forced.max(initial=0))
        plans = np.arange(pos.size + 1)
        spec = base + plans
        max_k = np.maximum(np.append(max_k0, longest), max_k0).astype(float)
        gain = np.append(0.0, np.cumsum(val))
        t_ms = (step_time(self.coef_at(batch), batch, spec.astype(float), max_k, self.knee)
                + self.shape_offset(batch, spec))
        goodput = (batch + gain) / np.maximum(t_ms, 1e-9)
        if max_spec is not None:
            goodput = np.where((spec <= max(max_spec, base)) | (plans == 0), goodput, -np.inf)
        if slack is not None:
            plain = self.predict(batch, 0.0, 0.0)
            goodput = np.where((t_ms <= plain * (1.0 + slack)) | (plans == 0), goodput,
                               -np.inf)
        best = int(goodput.argmax())
        out = forced + np.bincount(req[:best], minlength=m)
        return np.minimum(out, keep)

    def partial_fit(self, batch: int, spec_tokens: int, max_k: int, step_ms: float) -> None:
        if not self.learn or not math.isfinite(step_ms) or step_ms <= 0:
            return
        self._pending.append((batch, spec_tokens, max_k, step_ms))
        self.n_updates += 1
        if self.n_updates % self.refit_every == 0 or self.n_updates < self.refit_every:
            self.fit()

    def fit(self) -> StepCostModel:
        """Re-solve the coefficients from the window and the prior."""
        first = self.n_updates - len(self._pending)
        for k, (batch, spec_tokens, max_k, step_ms) in enumerate(self._pending):
            i = (first + k) % len(self._y)
            self._x[i] = features(batch, spec_tokens, max_k, self.knee)
            self._y[i] = step_ms
        self._pending.clear()
        n = min(self.n_updates, len(self._y))
        if n == 0:
            return self
        newest = (self.n_updates - 1) % len(self._y)
        age = (newest - np.arange(n)) % len(self._y)
        x, y = self._x[:n], self._y[:n]
        decay = self.forgetting**age
        w = decay / y**2
        # The prior is worth `prior_weight` steps of relative error at its own scale. Measured
        # steps slower than the prior curve weigh less each (1 / y^2), which would make a prior
        # written for faster hardware (the GPU curve on a CPU) outweigh hundreds of steps: its
        # precision shrinks with the (geometric mean) measured/prior ratio so it stays worth
        # `prior_weight` steps. A prior for slower hardware (a bigger model; the cpu preset
        # under a tiny one) is already weak, but what the data cannot tell, such as the cost
        # of a draft token while nothing is drafted, would keep its absolute value and price
        # drafting out for good: nothing would be drafted to learn better. So that prior is
        # scaled down to the measured steps: it keeps its shape. (A prior for faster hardware
        # is not scaled up: it underprices drafting, and the first drafted steps correct it.)
        ratio = float(np.exp((decay * np.log(y / np.maximum(x @ self.prior_coef, 1e-9))).sum()
                             / decay.sum()))
        self.prior_scale = min(ratio, 1.0)
        prior_prec = self._prior_prec / max(ratio, 1.0) ** 2
        # Nor is a coefficient's prior worth more than `prior_weight` of the steps that
        # measured its feature, at their own scale: the reference plan's drafts (16 at 8
        # requests) weigh far more per step than a server's real ones (2 at 4 requests on
        # this CPU), and at the reference's weight the prior held the per-token price near
        # its preset's (33 ms served where the steps said 18). Only ever weaker: where the
        # reference already weighs less, it stays.
        steps = decay @ (x != 0)
        # (a step that did not measure a feature adds 0 to its sum: its x is 0)
        info = (w @ x**2) / np.maximum(steps, 1e-12)
        d = np.arange(N_FEATURES)[steps > 0]
        prior_prec[d, d] = np.minimum(prior_prec[d, d], self.prior_weight * info[d])
        xw_t = (x * w[:, None]).T
        xtx = prior_prec + xw_t @ x
        xty_prior = prior_prec @ (self.prior_scale * self.prior_coef)
        # The linear terms and the batch-size table (what the terms leave at each batch size,
        # shrunk toward 0 by OFFSET_PRIOR_STEPS steps) by alternating fits on the window: the
        # terms are fitted to what the table does not explain, so that a plain curve that is
        # not a line does not bend the speculation terms, and the table stays the smallest
        # that explains the rest (a batch size seldom seen keeps the line).
        # One round per fit, from the last fit's table: the alternation goes on across fits.
        b = np.minimum(np.maximum(x[:, 1].astype(np.int64), 0), TABLE_BATCHES)
        table = self.batch_table()
        self.coef = _nonnegative_solve(xtx, xty_prior + xw_t @ (y - table[b]), self._active)
        resid = y - x @ self.coef  # what the terms leave, step by step
        spec_tokens = x[:, 2].astype(np.int64)
        self.offset_weight = np.bincount(b, weights=decay, minlength=TABLE_BATCHES + 1)
        self.offset_sum = np.bincount(b, weights=decay * resid, minlength=TABLE_BATCHES + 1)
        # What both leave per (B, S) of the speculating steps (the batch table from this fit).
        spec = spec_tokens > 0
        size = (SHAPE_BATCHES + 1) * (SHAPE_DRAFTS + 1)
        table = self.batch_table()
        cell = (np.minimum(b[spec], SHAPE_BATCHES) * (SHAPE_DRAFTS + 1)
                + np.minimum(spec_tokens[spec], SHAPE_DRAFTS))
        rest = resid[spec] - table[b[spec]]
        self.shape_weight = np.bincount(cell, weights=decay[spec], minlength=size
                                        ).reshape(self.shape_weight.shape)
        self.shape_sum = np.bincount(cell, weights=decay[spec] * rest, minlength=size
                                     ).reshape(self.shape_sum.shape)
        # What each step leaves by its rows (B + S), written as a plain step of that many
        # rows would leave it (S draft tokens priced as S requests): `rows_prior`.
        rows = np.minimum(b + spec_tokens, TABLE_BATCHES)
        as_rows = resid - (self.coef[1] - self.coef[2]) * x[:, 2]
        self.rows_weight = np.bincount(rows, weights=decay, minlength=TABLE_BATCHES + 1)
        self.rows_sum = np.bincount(rows, weights=decay * as_rows, minlength=TABLE_BATCHES + 1)
        return self


def _nonnegative_solve(a: np.ndarray, b: np.ndarray, active: np.ndarray) -> np.ndarray:
    """argmin_{c >= 0} of the quadratic with normal equations a c = b (active set).

    lstsq rather than solve: features that never varied leave the system rank-deficient.
    """
    free = active.copy()
    c = np.zeros(len(b))
    for _ in range(len(b)):
        c[:] = 0.0
        idx = free.nonzero()[0]
        c[idx] = np.linalg.lstsq(a[idx[:, None], idx], b[idx], rcond=1e-10)[0]  # (np.ix_ is slow)
        if (c >= 0).all():
            return c
        free &= c > 0
        if not free.any():
            break
    return np.maximum(c, 0.0)
