"""What a proposer that runs a model (the hybrid's draft model) costs, and what it may draft.

The verify-step model (cost.py) prices the target's pass; a model proposer also runs one pass
per draft token plus its catch-up (the prompt, tokens missed while idle). Its ms per pass and
per catch-up token are fitted to what the worker measured (decayed least squares); a draft
token of it is worth drafting only while its expected gain pays for its pass, and with a
latency-critical request in the batch its passes count against the policy's slack.
"""

from __future__ import annotations

import numpy as np

from adaptspec import fastpath


def fit(stats: np.ndarray, ms: float, passes: int, catchup_tokens: int) -> tuple[float, float]:
    """Add one measurement to `stats` (the decayed sums pp, pc, cc, py, cy, updated in place);
    returns (ms per pass, ms per catch-up token)."""
    p, c = float(passes), float(max(catchup_tokens, 0))
    stats *= 0.98  # about the last 50 reports
    stats += (p * p, p * c, c * c, p * ms, c * ms)
    spp, spc, scc, spy, scy = stats
    det = spp * scc - spc * spc
    a = b = -1.0
    if det > 1e-9 * spp * max(scc, 1e-12):
        a, b = (scc * spy - spc * scy) / det, (spp * scy - spc * spy) / det
    if a < 0 or b < 0:  # catch-up never varied apart from the passes, or a negative fit
        a, b = spy / spp, 0.0
    return a, b


def worth_drafting(ks: np.ndarray, inc: np.ndarray, cost_tokens: np.ndarray,
                   k_min: np.ndarray) -> np.ndarray:
    """K after a model proposer's passes are priced: the plan priced the verify pass; each of
    its draft tokens also costs a pass (`cost_tokens`, in tokens of plain decoding), so it is
    drafted only while its expected gain (its increment) pays for that (never below k_min)."""
    worth = (inc >= cost_tokens[None, :]).sum(axis=0)
    return np.where(cost_tokens > 0, np.minimum(ks, np.maximum(worth, k_min)), ks)


def within_slack(ks: np.ndarray, inc: np.ndarray, pass_ms: np.ndarray, k_min: np.ndarray,
                 coef: np.ndarray, knee: float, slack: float, plain_ms: float) -> np.ndarray:
    """With a latency-critical request in the batch, a model proposer's passes count against the
    policy's slack like the verify plan does: that request gets one token a step whoever
    drafts. The passes left in the slack go to the most valuable positions (increments only
    shrink along a draft, so each request keeps a prefix). `pass_ms`: per request, the ms of
    one pass of its proposer."""
    model = (pass_ms > 0) & (ks > 0)
    if not model.any():
        return ks
    # What the step costs with the other requests' drafts, and what each of the model's
    # tokens adds: its pass and its verification (the verify model's per-token term).
    rest = np.where(model, 0, ks)
    base = float(fastpath.step_time(coef, len(ks), float(rest.sum()),
                                    float(rest.max(initial=0)), knee))
    budget = (1.0 + slack) * plain_ms - base
    ms = pass_ms + coef[2] + coef[5] * (float(ks.sum()) + len(ks) > knee)
    cols = np.flatnonzero(model)
    pos = [(inc[j, i], i, j) for i in cols.tolist() for j in range(int(ks[i]))]
    pos.sort(key=lambda x: (-x[0], x[2]))
    keep = np.zeros_like(ks)
    for _, i, _j in pos:
        if budget < ms[i]:
            break
        budget -= ms[i]
        keep[i] += 1
    out = ks.copy()
    out[cols] = np.maximum(keep[cols], k_min[cols])
    return out
