"""The payoff guard: speculation goes on only while the engine's own step timings show it pays.

The controller predicts what a step costs from a step-time model; where that model is wrong (a
fixed cost of any step that carries a draft, a proposer slower than priced, a kernel re-planned
for a new token count) its choices can make serving slower than plain decoding. The guard
checks the choices against what they measurably did, at the level of the whole batch, because a
step with drafts can slow every request in it:

- Plain steps (nothing verified, nothing proposed) give the plain step time per batch size, as a
  running estimate (a table: on a CPU the plain step is not even monotone in the batch). When
  no batch size near the current one has a recent estimate, the next step is plain, to measure
  it: a plain step costs nothing against plain decoding.
- A step that verified or proposed drafts is charged its loss: its measured time minus the time
  plain decoding would have taken to emit the same tokens at that batch size,
  ``t - (B + accepted) / B * plain(B)``, with t at most 3 x plain(B) (beyond: a stall). A gain
  is a negative loss. With a latency-critical request in the batch, the loss is at least the
  step's time over ``(1 + slack) * plain(B)``, since that request gets one token a step
  whatever the others accept.
- Every measured step adds ``budget`` (1%) of its time to an account; losses are taken from it,
  gains paid into it, up to ``cap_steps`` (8) plain steps' worth, and it opens full.
  Speculation is allowed while the account is positive. So what speculation loses is bounded
  by 1% of the engine's time plus a few steps (the opening credit and the last run's overdraft),
  whatever the cost model believes; while speculation pays, the account stays full and nothing
  is held back.
- A step proposes the drafts that the next one verifies, so a run of speculation, once started,
  lasts at least ``min_run`` (2) decisions: otherwise a draft model's first proposing step,
  charged its passes with no gain yet, would end the run before its drafts were verified.

Steps that also prefilled are not measured (their time says little about the decodes), and
neither charge nor credit the account. Engine-agnostic: the runtime calls `allow` before each
decision and `observe` with each measured step.
"""

from __future__ import annotations

import math

# Speculating steps are charged at most this many plain steps (see observe): a draft model's K=4
# step measured 1.85x plain decoding's with the 1.5B target on a CPU.
STALL_FACTOR = 3.0


def _near(batch: int) -> range:
    """The batch sizes within a quarter of `batch` (at least one request either side)."""
    tol = max(1, batch // 4)
    return range(batch - tol, batch + tol + 1)


class PayoffGuard:
    """Batch-level gate on speculation from measured step times.

    Attributes (plain, for inspection and tests): budget (share of time speculation may lose),
    cap_steps, refresh_steps, plain_ms (batch size -> running plain step time), plain_n,
    plain_at (step index of the last plain sample per batch size), account_ms, steps,
    spec_steps, loss_ms (total charged), time_ms (total measured), forced_plain, held,
    shape_ratio, shape_n ((batch size, draft tokens verified) -> speculating steps' time over
    plain decoding's at that batch size, running mean over shape_n of them).
    """

    def __init__(self, budget: float = 0.01, cap_steps: float = 8.0, refresh_steps: int = 256,
                 memory: int = 64, min_samples: int = 2, min_run: int = 2) -> None:
        if not 0.0 <= budget < 1.0:
            raise ValueError(f"budget must be in [0, 1), got {budget}")
        self.budget = budget
        self.cap_steps = cap_steps
        self.refresh_steps = refresh_steps
        self.memory = memory
        self.min_run = min_run
        self._committed = 0  # decisions still granted to the run of speculation in progress
        self._allowed_last = False
        self.min_samples = min_samples
        self.plain_ms: dict[int, float] = {}
        self.plain_n: dict[int, int] = {}
        self.plain_at: dict[int, int] = {}
        self.account_ms = 0.0
        self.steps = 0
        self.spec_steps = 0
        self.loss_ms = 0.0
        self.time_ms = 0.0
        self.forced_plain = 0  # decisions held plain to measure the plain step
        self.held = 0  # decisions held plain because the account was spent
        self.last_hold: str | None = None  # why the last `allow` said no: measure | budget
        # Speculating steps' time over plain decoding's at the same batch size (running mean
        # per batch size: on a CPU a draft token can make a step of 2 faster than plain, where
        # it makes a step of 4 slower)
        self.shape_ratio: dict[tuple[int, int], float] = {}
        self.shape_n: dict[tuple[int, int], int] = {}
        self.min_ratio_samples = 8

    # ---------------------------------------------------------------- the plain reference

    def _fresh(self, batch: int) -> bool:
        """Is there a recent plain estimate at this batch size or one near it (within a
        quarter, at least one request)? Interpolating between near sizes is good enough, and
        a GPU engine's batch moves over hundreds of sizes."""
        return any(self.plain_n[b] >= self.min_samples
                   and self.steps - self.plain_at[b] <= self.refresh_steps
                   for b in _near(batch) if b in self.plain_n)

    def plain_estimate(self, batch: int) -> float | None:
        """Plain step time at `batch` (ms): measured there, else interpolated between the
        nearest measured batch sizes (or scaled from the nearest one); None before any."""
        if batch in self.plain_ms:
            return self.plain_ms[batch]
        if not self.plain_ms:
            return None
        below = max((b for b in self.plain_ms if b < batch), default=None)
        above = min((b for b in self.plain_ms if b > batch), default=None)
        if below is not None and above is not None:
            w = (batch - below) / (above - below)
            return (1 - w) * self.plain_ms[below] + w * self.plain_ms[above]
        near = below if below is not None else above
        # Outside the measured range: no cheaper per request than the nearest size (a batch
        # never gets cheaper by growing), no dearer than in proportion.
        return self.plain_ms[near] * (batch / near if batch > near else 1.0)

    def _add_plain(self, batch: int, ms: float) -> None:
        # The mean of the first `memory` samples, then a moving average over about as many.
        # A long memory matters: speculation is allowed while the account is positive, and an
        # estimate that happens to be high makes speculating steps look cheap, so a noisy
        # estimate would let speculation through exactly when it is overrated.
        n = self.plain_n.get(batch, 0) + 1
        old = self.plain_ms.get(batch)
        if not self.plain_ms:
            # The account opens full: a draft model's first run (its catch-up pass over the
            # context, no gain yet) would otherwise spend an empty account and hold
            # speculation for ~100 steps per plain step lost, which on a short stream is all
            # of it.
            self.account_ms = self.cap_steps * ms
        if old is None:
            self.plain_ms[batch] = ms
        else:
            # A stalled step (another process took the cores) moves the estimate a little.
            ms = min(max(ms, 0.5 * old), 2.0 * old)
            self.plain_ms[batch] = old + (ms - old) / min(n, self.memory)
        self.plain_n[batch] = n
        self.plain_at[batch] = self.steps

    # ---------------------------------------------------------------- per step

    def allow(self, batch: int) -> bool:
        """May the next step (about `batch` requests) speculate?"""
        self.last_hold = None
        if batch <= 0:
            self._allowed_last, self._committed = False, 0
            return False
        if self._committed > 0:
            # A step proposes the drafts the next one verifies: the first step of a run pays
            # for drafting (a draft model's passes) before any gain can show, so a run is not
            # cut before its first drafts are verified.
            self._committed -= 1
            return True
        if not self._fresh(batch):
            self.forced_plain += 1
            self.last_hold = "measure"
        elif self.account_ms <= 0.0:
            self.held += 1
            self.last_hold = "budget"
        if self.last_hold is not None:
            self._allowed_last = False
            return False
        if not self._allowed_last:
            self._committed = self.min_run - 1
        self._allowed_last = True
        return True

    def observe(self, batch: int, speculated: bool, accepted: int, step_ms: float | None,
                latency_critical: bool = False, slack: float = 0.0, spec_tokens: int = 1
                ) -> float | None:
        """One engine step: `speculated` if it verified or proposed drafts; `accepted` draft
        tokens in all; `step_ms` None for a step that also prefilled. Returns the loss charged
        (ms; negative: a gain), or None if the step was not charged."""
        if step_ms is None or not math.isfinite(step_ms) or step_ms <= 0 or batch <= 0:
            return None
        self.steps += 1
        self.time_ms += step_ms
        if not speculated:
            self._add_plain(batch, step_ms)
            loss = None
        else:
            self.spec_steps += 1
            plain = self.plain_estimate(batch)
            if plain is None:
                return None
            # A step over STALL_FACTOR x plain is taken as a stall (another process took the
            # cores, a pause in the engine): charged as that, not in full, or one stall would
            # hold speculation that pays for hundreds of steps.
            t = min(step_ms, STALL_FACTOR * plain)
            self._add_ratio(batch, t / plain, spec_tokens)
            loss = t - (batch + max(accepted, 0)) / batch * plain
            if latency_critical:
                loss = max(loss, t - (1.0 + slack) * plain)
            self.loss_ms += loss
            self.account_ms -= loss
        self.account_ms += self.budget * step_ms
        ref = self.plain_estimate(batch) or step_ms
        self.account_ms = min(self.account_ms, self.cap_steps * ref)
        return loss

    def _add_ratio(self, batch: int, r: float, spec_tokens: int) -> None:
        # A running mean over about `memory` speculating steps, like the plain estimates.
        key = (batch, max(int(spec_tokens), 0))
        n = self.shape_n.get(key, 0) + 1
        old = self.shape_ratio.get(key, r)
        self.shape_ratio[key] = old + (r - old) / min(n, self.memory)
        self.shape_n[key] = n

    def drafts_slow_steps(self, slack: float, batch: int, spec_tokens: int | None = None
                          ) -> bool:
        """Have speculating steps of about this batch size (within a quarter, as `_fresh`)
        measured slower than (1 + slack) x plain decoding's at their size, on average over
        enough of them to say? With `spec_tokens`, only those that verified at most that many
        draft tokens: a plan of one draft is judged by steps like it, not by the deep drafts
        of full batches (on two CPU cores a step of 5 with one draft ran as fast as a plain
        one, a step of 4 with three 1.13x). A latency-critical request gets one token a step
        whatever the others accept, so such a step is that much slower for it. Judged near
        the batch size because what a draft costs depends on it: on two CPU cores a step of 2
        requests with 2 drafts took 0.67x a plain one, a step of 4 with 2 drafts 1.2x."""
        near = _near(batch)
        most = spec_tokens if spec_tokens is not None else math.inf
        cells = [(self.shape_n[k], self.shape_ratio[k]) for k in self.shape_n
                 if k[0] in near and k[1] <= most]
        n = sum(c for c, _ in cells)
        if n < self.min_ratio_samples:
            return False
        return sum(c * r for c, r in cells) / n > 1.0 + slack

    def step(self, batch: int, speculated: bool, accepted: int, step_ms: float | None,
             latency_critical: bool, slack: float, gates: bool, spec_tokens: int = 1
             ) -> tuple[bool, str | None, float | None]:
        """One engine step seen (`observe`, `spec_tokens` the draft tokens it verified); may
        the next speculate, why not (the guard's hold reason), and the loss charged. Not
        gating, the guard only keeps its account and never holds. `slack`: what the step just
        measured was allowed, against which its loss is charged. (Beside a latency-critical
        request the plan is then judged by `drafts_slow_steps`, with its draft tokens.)"""
        loss = self.observe(batch, speculated, accepted, step_ms,
                            latency_critical=latency_critical, slack=slack,
                            spec_tokens=spec_tokens)
        allow = self.allow(batch) if gates else True
        hold = self.last_hold if gates else None
        return allow, hold, loss

    def summary(self) -> dict[str, float]:
        return {"steps": self.steps, "spec_steps": self.spec_steps, "loss_ms": self.loss_ms,
                "time_ms": self.time_ms, "account_ms": self.account_ms,
                "forced_plain": self.forced_plain, "held": self.held}
