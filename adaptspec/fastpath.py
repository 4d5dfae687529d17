"""The controller's per-step work as compiled kernels: the only code that learns and
decides in production, for every policy.

`feedback` puts one step's verifications into both estimators; `posterior` reads the class
posteriors off the evidence; `decide` chooses every request's K from them.
adaptspec/step_reference.py is the same maths in plain numpy, written to be read first;
tests/test_fastpath.py checks these kernels against it bit for bit on random batches and
policies. The kernels exist because a numpy call costs a microsecond or two whatever its
size, and the step has a budget of 100 us for a batch of 256 (`adaptspec bench decide`):
written in numpy it takes some sixty calls.

They run in one pass over the batch in the order the reference computes, so that every sum
rounds as it does there. numba does no bounds checking: the controller checks the arrays'
shapes and slots before calling.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba.extending import register_jitable

# Per-position acceptance is capped below 1, so the value of a draft token falls along the
# draft (a request's bins never rise with the position).
ALPHA_CAP = 0.995
# Resolution of the increment values when choosing how many draft tokens the batch gets.
BINS = 128

_jit = numba.njit(cache=True, nogil=True)

# The step-time formula (adaptspec.cost), here because numba's cache recompiles a kernel when
# its own file changes, not when a function it calls from another file does.
N_FEATURES = 7


@register_jitable
def features(batch: Any, spec_tokens: Any, max_k: Any, knee: float) -> tuple:
    """The features of a step, or of plans, with `batch` requests, `spec_tokens` draft tokens
    in all and longest draft `max_k`: numbers or arrays."""
    return (1.0, batch, spec_tokens, max_k, (spec_tokens > 0) * 1.0,
            np.maximum(spec_tokens + (batch - knee), 0.0), batch * max_k)


@register_jitable
def step_time(coef: np.ndarray, batch: Any, spec_tokens: Any, max_k: Any, knee: float) -> Any:
    """Predicted step time (ms): coef . features, summed term by term in this order. The one
    definition of the formula: numba compiles it into the controller's kernels
    (register_jitable), and numpy evaluates it over arrays of plans to the same bits."""
    x = features(batch, spec_tokens, max_k, knee)
    return (coef[0] * x[0] + coef[1] * x[1] + coef[2] * x[2] + coef[3] * x[3] + coef[4] * x[4]
            + coef[5] * x[5] + coef[6] * x[6])


@_jit
def feedback(ev: np.ndarray, n_classes: int, kk: int, decay: float, cls: np.ndarray,
             records: np.ndarray, slots: np.ndarray, drafted: np.ndarray,
             accepted: np.ndarray, req_decay: float) -> tuple:
    """One step's verifications: class evidence ev [classes, 4 kk] (succ | fail | priors)
    over its first n_classes rows ages, then position j succeeds for every verification that
    accepted more than j drafts and fails at a for one that accepted a < d (d, a clipped to
    0..kk). The first position ages by `decay` every step; position j > 0 by decay^r, r the
    share of the class's drafts verified this step that reached it (acceptance.py says why).
    A request's record (s, n) in records [2, slots] decays by req_decay if it drafted, then
    s += (a > 0) and n += (d > 0): how often its drafts started right (step_reference.decide
    says why).

    Returns (the batch's records [2, n] after the update, drafted tokens in all, the longest
    draft, at least 0) - the last two for the step-time model."""
    n = slots.shape[0]
    credit = np.zeros((n_classes, 2 * kk))  # counts, added once per cell
    sn = np.empty((2, n))
    spec = 0
    longest = 0
    for i in range(n):
        spec += drafted[i]
        longest = max(longest, drafted[i])
        d = min(max(drafted[i], 0), kk)
        a = min(max(accepted[i], 0), d)
        for j in range(a):
            credit[cls[i], j] += 1.0
        if a < d:
            credit[cls[i], kk + a] += 1.0
        s_i = records[0, slots[i]]
        n_i = records[1, slots[i]]
        if d > 0:
            s_i *= req_decay
            n_i *= req_decay
        sn[0, i] = s_i + (1.0 if a > 0 else 0.0)
        sn[1, i] = n_i + (1.0 if d > 0 else 0.0)
    for c in range(n_classes):
        reached = credit[c, 0] + credit[c, kk]  # the class's drafts verified this step
        for j in range(kk):
            age = decay
            if j > 0:
                age = decay ** ((credit[c, j] + credit[c, kk + j]) / reached) if reached > 0 \
                    else 1.0
            ev[c, j] = ev[c, j] * age + credit[c, j]
            ev[c, kk + j] = ev[c, kk + j] * age + credit[c, kk + j]
    for i in range(n):  # (all read before any is written, should a slot come twice)
        records[0, slots[i]] = sn[0, i]
        records[1, slots[i]] = sn[1, i]
    return sn, spec, longest


@_jit
def posterior(ev: np.ndarray, n_classes: int, kk: int, prior_min: float) -> np.ndarray:
    """The posterior sums [2 kk, n_classes] of the first n_classes rows of ev [classes, 4 kk]
    (AcceptanceEstimator.posterior_sums says what): per position, the prior moved in log-odds
    as far as the position before moved from its own prior, plus the evidence."""
    out = np.empty((2 * kk, n_classes))
    for c in range(n_classes):
        shift = 0.0
        for j in range(kk):
            pa, pb = ev[c, 2 * kk + j], ev[c, 3 * kk + j]
            strength, prior_logit = pa + pb, np.log(pa / pb)
            prior = strength * min(max(1.0 / (1.0 + np.exp(-(prior_logit + shift))), prior_min),
                                   1.0 - prior_min)
            a = prior + ev[c, j]
            t = strength + ev[c, j] + ev[c, kk + j]
            out[j, c], out[kk + j, c] = a, t
            shift = np.log(a / (t - a)) - prior_logit
    return out


@_jit
def decide(post: np.ndarray, cls_k_min: np.ndarray, cls_k_max: np.ndarray,
           cls_kind: np.ndarray, cls_slo_ms: np.ndarray, n0: np.ndarray, sn: np.ndarray,
           cls: np.ndarray, explore: np.ndarray, z: np.ndarray, coef: np.ndarray, knee: float,
           shape_ms: np.ndarray, slack: float, hyst_steps: int, prev_k: np.ndarray,
           votes: np.ndarray, slots: np.ndarray) -> tuple:
    """K per request for a batch of at least one (step_reference.decide documents the
    arguments); updates the hysteresis state prev_k and votes (per slot) when hyst_steps > 1.

    Returns (ks, kinds, the increments [kk, n], the threshold bin, the plan's predicted ms)."""
    kk = post.shape[0] // 2
    n = cls.shape[0]
    n_cls = post.shape[1]
    # The class table: posterior mean per position (0 where a class may not draft), its
    # spread, and the factor's terms (see step_reference.decide).
    mean = np.empty((kk, n_cls))
    sd = np.empty((kk, n_cls))
    u = np.empty(n_cls)
    v = np.empty(n_cls)
    for c in range(n_cls):
        may = 1.0 if cls_k_max[c] > 0 else 0.0
        for j in range(kk):
            m = post[j, c] / post[kk + j, c] * may
            mean[j, c] = m
            sd[j, c] = np.sqrt((1.0 - m) * m / (post[kk + j, c] + 1.0))
        u[c] = may / max(post[0, c] / post[kk, c], 1e-3)
        v[c] = n0[c] * may
    # Per request: its factor, the forced drafts and the longest draft; the batch's limits.
    f = np.empty(n)
    lo = np.empty(n, dtype=np.int64)
    hi = np.empty(n, dtype=np.int64)
    n_forced = 0
    any_critical = False
    slo = np.inf
    for i in range(n):
        c = cls[i]
        f[i] = (sn[0, i] * u[c] + v[c]) / (sn[1, i] + n0[c])
        lo[i], hi[i] = cls_k_min[c], cls_k_max[c]
        n_forced += lo[i]
        any_critical = any_critical or cls_kind[c] > 1
        slo = min(slo, cls_slo_ms[c])
    k_min_max = lo.max()
    # Increments: the running product along the draft of alpha, capped; position-major, so
    # that the loops over the batch run along contiguous rows (LLVM vectorises them). Then the
    # explored requests' increments again, from their draws.
    inc = np.empty((kk, n))
    for j in range(kk):
        for i in range(n):
            alpha = min(mean[j, cls[i]] * (f[i] if j == 0 else 1.0), ALPHA_CAP)
            inc[j, i] = inc[j - 1, i] * alpha if j > 0 else alpha
    if explore.shape[0] > 0:
        r = 0
        for i in range(n):
            if explore[i]:
                c = cls[i]
                for j in range(kk):
                    alpha = min(max(sd[j, c] * z[r, j] + mean[j, c], 0.0), ALPHA_CAP)
                    inc[j, i] = inc[j - 1, i] * alpha if j > 0 else alpha
                r += 1
    # Bins (0: a position the controller may not choose, never drafted by a plan), then, in
    # the order of the positions, then of the requests, their counts and values, and the
    # forced positions' value apart.
    q = np.empty((kk, n), dtype=np.int64)
    scale = float(BINS - 1)
    for j in range(kk):
        for i in range(n):
            b = np.int64(np.sqrt(inc[j, i]) * scale) + 1
            q[j, i] = b * ((lo[i] <= j) & (j < hi[i]))  # (no branch: the loop vectorises)
    counts = np.zeros(BINS + 1)
    values = np.zeros(BINS + 1)
    col_best = np.zeros(kk, dtype=np.int64)
    forced_gain = 0.0
    for j in range(kk):
        for i in range(n):
            b = q[j, i]
            counts[b] += 1.0
            values[b] += inc[j, i]
            col_best[j] = max(col_best[j], b)
    if n_forced > 0:
        for j in range(k_min_max):
            for i in range(n):
                if j < lo[i]:
                    forced_gain += inc[j, i]
    # The longest draft of a plan: a request's drafts above a threshold are a run from its
    # k_min on, so it is the last column whose best bin reaches the threshold.
    longest = np.zeros(BINS + 1, dtype=np.int64)  # by bin
    for j in range(kk):
        longest[col_best[j]] = j + 1
    # Plan t drafts every open position whose bin is at least BINS + 1 - t (plan 0: only the
    # forced ones).
    t_ms = np.empty(BINS + 1)
    goodput = np.empty(BINS + 1)
    spec_t = np.empty(BINS + 1)
    value_t = np.empty(BINS + 1)
    max_k_t = np.empty(BINS + 1, dtype=np.int64)
    spec = 0.0
    value = 0.0
    max_k = k_min_max
    best_free = 0
    for t in range(BINS + 1):
        threshold = BINS + 1 - t
        if t > 0:
            spec += counts[threshold]
            value += values[threshold]
            max_k = max(max_k, longest[threshold])
        spec_t[t], value_t[t], max_k_t[t] = spec, value, max_k
        t_ms[t] = (step_time(coef, n, spec + n_forced, float(max_k), knee)
                   + shape_ms[min(np.int64(spec + n_forced), shape_ms.shape[0] - 1)])
        goodput[t] = (value + (n + forced_gain)) / max(t_ms[t], 1e-9)
        if goodput[t] > goodput[best_free]:
            best_free = t
    limit = t_ms[0] * (1.0 + slack) if any_critical else np.inf
    limit = min(limit, slo)
    best = 0
    for t in range(BINS + 1):
        if (t_ms[t] <= limit or t == 0) and goodput[t] > goodput[best]:
            best = t
    # K per request at the chosen plan; hysteresis runs on the plan without the limits (a
    # latency-critical request passing through is no change of mind), and never grants more
    # than the chosen plan.
    ks = lo.copy()
    wanted = lo.copy()
    for j in range(kk):
        for i in range(n):
            ks[i] += 1 if q[j, i] >= BINS + 1 - best else 0
            wanted[i] += 1 if q[j, i] >= BINS + 1 - best_free else 0
    plan_bin, plan_ms = BINS + 1 - best, t_ms[best]
    # Under a limit, part of the next bin (step_reference.decide says why): its positions one
    # at a time by value, then position-major, while the step keeps within the limit.
    b = 0
    if limit < np.inf:
        for t in range(best + 1, BINS + 1):
            if counts[BINS + 1 - t] > 0:
                b = BINS + 1 - t
                break
    if b > 0:
        m = np.int64(counts[b])
        jj = np.empty(m, dtype=np.int64)
        ii = np.empty(m, dtype=np.int64)
        r = 0
        for j in range(kk):
            for i in range(n):
                if q[j, i] == b:
                    jj[r], ii[r] = j, i
                    r += 1
        vals = np.empty(m)
        for r in range(m):
            vals[r] = -inc[jj[r], ii[r]]
        order = np.argsort(vals, kind="mergesort")
        s = spec_t[best] + n_forced
        mk = max_k_t[best]
        v = value_t[best]
        g_best = goodput[best]
        take = 0
        for r in range(m):
            j, i = jj[order[r]], ii[order[r]]
            s += 1.0
            mk = max(mk, j + 1)
            v += inc[j, i]
            t_r = (step_time(coef, n, s, float(mk), knee)
                   + shape_ms[min(np.int64(s), shape_ms.shape[0] - 1)])
            if not t_r <= limit:
                break
            g_r = (v + (n + forced_gain)) / max(t_r, 1e-9)
            if g_r > g_best:
                g_best, take, plan_ms = g_r, r + 1, t_r
        if take > 0:
            for r in range(take):
                ks[ii[order[r]]] += 1
            plan_bin = b
    if hyst_steps > 1:
        state = np.empty((2, n), dtype=np.int64)
        for i in range(n):
            p, votes_i = prev_k[slots[i]], votes[slots[i]]
            if wanted[i] - p == 1 and votes_i + 1 < hyst_steps and p >= lo[i]:
                votes_i += 1
            else:
                p, votes_i = wanted[i], 0
            state[0, i], state[1, i] = p, votes_i
            ks[i] = min(ks[i], p)
        for i in range(n):  # (all read before any is written, should a slot come twice)
            prev_k[slots[i]], votes[slots[i]] = state[0, i], state[1, i]
    kinds = np.empty(n, dtype=np.int64)
    for i in range(n):
        kinds[i] = 0 if ks[i] > 0 else cls_kind[cls[i]]
    return ks, kinds, inc, plan_bin, plan_ms


def warm_up() -> None:
    """Compile the kernels now (seconds the first time, well under one from numba's cache)
    with the argument types the controller passes, rather than in an engine's first step."""
    global _warm
    if _warm:
        return
    i64, f64 = np.zeros(1, dtype=np.int64), np.zeros(1)
    ev, records = np.ones((1, 4)), np.zeros((2, 1))
    sn, _, _ = feedback(ev, 1, 1, 1.0, i64, records, i64, i64, i64, 0.9)
    posterior(ev, 1, 1, 1e-3)
    decide(np.ones((2, 1)), i64, i64 + 1, i64 + 1, f64 + np.inf, f64 + 1.0, sn, i64,
           np.zeros(1, dtype=bool), np.zeros((0, 1)), np.zeros(N_FEATURES), 1.0, f64, 0.0, 2,
           i64.copy(), i64.copy(), i64)
    _warm = True


_warm = False
