"""The controller's per-step maths in plain numpy, to be read first.

adaptspec/fastpath.py computes the same in compiled kernels, which are what runs in
production; tests/test_fastpath.py checks them against these functions bit for bit on random
batches and policies. So sums here run in the kernels' order (np.add.accumulate, not np.sum,
which pairs terms), and nothing in the package calls this module.

The decision: request i with K_i drafts emits 1 + sum_{j<K_i} prod_{l<=j} alpha_il tokens in
expectation. Each extra draft token is an increment prod_{l<=j} alpha_il, and these shrink
along j, so for any total S of draft tokens the best plan takes the S largest increments
across the batch. Binning the increments turns "the S largest" into "every increment in a bin
at or above a threshold", and scoring every threshold's plan by (B + its increments) / its
predicted step time gives the best plan that the latency limits allow.
"""

from __future__ import annotations

import math

import numpy as np

from adaptspec.fastpath import ALPHA_CAP, BINS, step_time


def feedback(ev: np.ndarray, kk: int, decay: float, cls: np.ndarray, records: np.ndarray,
             slots: np.ndarray, drafted: np.ndarray, accepted: np.ndarray,
             req_decay: float) -> tuple[np.ndarray, int, int]:
    """fastpath.feedback (which says what), ev being the active classes' rows."""
    d = np.clip(drafted, 0, kk)
    a = np.clip(accepted, 0, d)
    pos = np.arange(kk)
    succ = pos < a[:, None]  # a verification that accepted a drafts: positions < a succeeded
    fail = (pos == a[:, None]) & (a < d)[:, None]  # and, if a < d, position a failed
    credit = np.zeros((ev.shape[0], 2 * kk))
    np.add.at(credit, cls, np.hstack([succ, fail]))
    # Position 0 ages a step every step; position j a step's share of those verifications
    # that reached it (none where the class verified nothing).
    seen = credit[:, :kk] + credit[:, kk:]
    share = np.divide(seen, seen[:, :1], out=np.zeros_like(seen), where=seen[:, :1] > 0)
    share[:, 0] = 1.0
    # (libm's pow, the kernel's: numpy's power rounds some results differently)
    age = np.tile(np.vectorize(math.pow)(decay, share), 2)
    ev[:, : 2 * kk] = ev[:, : 2 * kk] * age + credit
    sn = records[:, slots]
    sn[:, d > 0] *= req_decay
    sn += [(a > 0) * 1.0, (d > 0) * 1.0]
    records[:, slots] = sn
    return sn, int(drafted.sum()), max(int(drafted.max(initial=0)), 0)


def posterior(ev: np.ndarray, kk: int, prior_min: float) -> np.ndarray:
    """fastpath.posterior (AcceptanceEstimator.posterior_sums says what), ev being the active
    classes' rows."""
    # (libm's log and exp, the kernel's: numpy's SIMD ones, on AVX-512 machines, round some
    # results differently in the last bit)
    log, exp = np.vectorize(math.log, otypes=[float]), np.vectorize(math.exp, otypes=[float])
    succ, fail = ev[:, :kk], ev[:, kk: 2 * kk]
    pa, pb = ev[:, 2 * kk: 3 * kk], ev[:, 3 * kk:]
    strength, prior_logit = pa + pb, log(pa / pb)
    out = np.empty((2 * kk, ev.shape[0]))
    shift = np.zeros(ev.shape[0])  # how far the position before moved from its prior
    for j in range(kk):
        # (within set_prior's bounds, so that a + b > a however far the shift went)
        prior = strength[:, j] * np.clip(1.0 / (1.0 + exp(-(prior_logit[:, j] + shift))),
                                         prior_min, 1.0 - prior_min)
        a, t = prior + succ[:, j], strength[:, j] + succ[:, j] + fail[:, j]
        out[j], out[kk + j] = a, t
        shift = log(a / (t - a)) - prior_logit[:, j]
    return out


def decide(post: np.ndarray, cls_k_min: np.ndarray, cls_k_max: np.ndarray,
           cls_kind: np.ndarray, cls_slo_ms: np.ndarray, n0: np.ndarray, sn: np.ndarray,
           cls: np.ndarray, explore: np.ndarray, z: np.ndarray, coef: np.ndarray, knee: float,
           shape_ms: np.ndarray, slack: float, hyst_steps: int, prev_k: np.ndarray,
           votes: np.ndarray, slots: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, float]:
    """K per request for the next step.

    post [2 kk, classes]: AcceptanceEstimator.posterior_sums. Per class: cls_k_min (drafts
    forced), cls_k_max (0: may not draft), cls_kind (the decision kind when not drafting: 1
    plain, 2 latency-critical), cls_slo_ms (ITL SLO, inf for none), n0 (RequestSpread.shrinkage).
    Per request: sn [2, n] its record (s, n), cls its class, slots its slot; explore: whose
    acceptance is drawn this step (empty: nobody's), z [their count, kk]: standard normals.
    coef, knee: the step-time model; shape_ms [at least 1]: what a step of this batch with s
    draft tokens in all takes beyond the formula (StepCostModel.shape_offset; the last entry
    for any s past the end); slack: latency_critical_slack. Hysteresis (hyst_steps >
    1): prev_k and votes per slot, updated in place.

    Returns (K, the decision kinds (0: speculate), the increments [kk, n], the lowest bin
    drafted (under a limit, perhaps only part of it), the plan's predicted step time in ms).
    """
    kk, n = post.shape[0] // 2, len(cls)
    # Per class: posterior mean acceptance per position and its spread (normal approximation
    # of the Beta), 0 where the class may not draft.
    may = (cls_k_max[: post.shape[1]] > 0) * 1.0
    mean = post[:kk] / post[kk: 2 * kk] * may
    sd = np.sqrt((1.0 - mean) * mean / (post[kk: 2 * kk] + 1.0))
    level = np.maximum(post[0] / post[kk], 1e-3)  # the first position's
    # A request's first position is its class's times f = own / level, own = (s + n0 level) /
    # (n + n0): how often its own drafts started right, shrunk toward its class's level. The
    # positions after it keep the class's conditional acceptance: once a draft starts right
    # the rest follows its class (an n-gram match, once confirmed, tends to run on), so a
    # request whose drafts often miss drafts less far, not geometrically less (f^j).
    f = (sn[0] * (may / level)[cls] + (n0[: may.size] * may)[cls]) / (sn[1] + n0[cls])
    alpha = mean[:, cls].copy()
    alpha[0] *= f
    drawn = explore.nonzero()[0]  # Thompson draws replace these requests' estimates
    alpha[:, drawn] = np.maximum(sd[:, cls[drawn]] * z.T + mean[:, cls[drawn]], 0.0)
    inc = np.multiply.accumulate(np.minimum(alpha, ALPHA_CAP), axis=0)

    # Bins even in sqrt(increment), fine near 0 where a memory-bound GPU still finds tokens
    # worth drafting; bin 0 holds the positions the controller may not choose.
    j = np.arange(kk)[:, None]
    k_min, k_max = cls_k_min[cls], cls_k_max[cls]
    forced = j < k_min
    q = np.where((j >= k_min) & (j < k_max), (np.sqrt(inc) * (BINS - 1)).astype(np.int64) + 1, 0)
    counts = np.bincount(q.ravel(), minlength=BINS + 1)
    values = np.bincount(q.ravel(), inc.ravel(), BINS + 1)
    forced_gain = np.add.accumulate(np.append(0.0, inc[forced]))[-1]

    # Plan t drafts the forced positions and every open one in a bin >= BINS + 1 - t.
    threshold = BINS + 1 - np.arange(BINS + 1)
    spec = np.add.accumulate(np.append(0.0, counts[:0:-1])) + k_min.sum()
    value = np.add.accumulate(np.append(0.0, values[:0:-1]))
    # The longest draft: a request's drafts above a threshold are a run from its k_min on.
    reach = q.max(axis=1) >= threshold[:, None]
    max_k = np.maximum((reach * np.arange(1, kk + 1)).max(axis=1), k_min.max())
    t_ms = (step_time(coef, n, spec, max_k.astype(float), knee)
            + shape_ms[np.minimum(spec.astype(np.int64), len(shape_ms) - 1)])
    goodput = (value + (n + forced_gain)) / np.maximum(t_ms, 1e-9)
    best_free = int(goodput.argmax())
    # A latency-critical request in the batch limits the step to plain decoding's time plus
    # the slack; an SLO limits it to the SLO. The forced minimum is always allowed.
    limit = t_ms[0] * (1.0 + slack) if (cls_kind[cls] > 1).any() else np.inf
    limit = min(limit, cls_slo_ms[cls].min())
    allowed = t_ms <= limit
    allowed[0] = True
    best = int(np.where(allowed, goodput, -np.inf).argmax())

    ks = k_min + (q >= threshold[best]).sum(axis=0)
    plan_bin, plan_ms = int(threshold[best]), float(t_ms[best])
    # Under a limit part of the next bin may fit where the whole does not: requests of one
    # class without records of their own share every bin, so beside a latency-critical
    # request the smallest plan after plain decoding drafts one token for each of them. The
    # next bin's positions go in one at a time (by value, then position-major, so each draft
    # stays a run), while the step keeps within the limit; the prefix of most goodput is
    # kept where it beats the plan's.
    lower = np.flatnonzero(counts[1: threshold[best]]) + 1  # (bin 0: never drafted)
    if np.isfinite(limit) and lower.size:
        b = lower.max()
        jj, ii = np.nonzero(q == b)
        order = np.argsort(-inc[jj, ii], kind="mergesort")
        jj, ii = jj[order], ii[order]
        s = spec[best] + np.arange(1, jj.size + 1)
        mk = np.maximum(max_k[best], np.maximum.accumulate(jj + 1)).astype(float)
        t = (step_time(coef, n, s, mk, knee)
             + shape_ms[np.minimum(s.astype(np.int64), len(shape_ms) - 1)])
        v = np.add.accumulate(np.append(value[best], inc[jj, ii]))[1:]
        g = (v + (n + forced_gain)) / np.maximum(t, 1e-9)
        g = np.where(np.logical_and.accumulate(t <= limit), g, -np.inf)
        m = int(g.argmax())
        if g[m] > goodput[best]:
            ks = ks + np.bincount(ii[: m + 1], minlength=n)
            plan_bin, plan_ms = int(b), float(t[m])
    if hyst_steps > 1:
        # K rises by one only after hyst_steps steps in a row asked for it (a jump of two is
        # a real change; decreases apply at once), judged on the plan without the limits: a
        # latency-critical request passing through is no change of mind.
        wanted = k_min + (q >= threshold[best_free]).sum(axis=0)
        p, v = prev_k[slots], votes[slots]
        # (never held below k_min: a new request's K starts from 0)
        hold = (wanted - p == 1) & (v + 1 < hyst_steps) & (p >= k_min)
        prev_k[slots] = granted = np.where(hold, p, wanted)
        votes[slots] = np.where(hold, v + 1, 0)
        ks = np.minimum(ks, granted)
    kinds = np.where(ks > 0, 0, cls_kind[cls])
    return ks, kinds, inc, plan_bin, plan_ms
