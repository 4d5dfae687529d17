"""Which proposer drafts for each request: the one expected to get the most tokens accepted.

A server may run several proposers at once (the hybrid: n-gram and suffix lookups, later a draft
model). The controller keeps acceptance per (class, proposer, position) and per (request,
proposer); before choosing K it picks, per request, the proposer whose draft of the class's
longest K would have the most tokens accepted in expectation,

    score(p) = sum_{j < k_max} prod_{l <= j} alpha_p,l,

alpha being the class's posterior mean for p, the first position's times the request's own
factor (as in step_reference.decide). Model-free proposers cost the same per draft token (the
verify pass prices the token, not who proposed it), so at any K the proposer with the higher
acceptance curve gives more tokens for the same step time, and the K decision that follows
prices the step for the chosen one. A proposer that runs a model (the hybrid's draft model)
also costs a forward pass per draft token, which the verify-step model does not see: its
increments count only by how much they exceed that pass's cost in tokens (the tokens the batch
would have made in that time), and the controller then drafts it only as far as an increment
still pays for its pass. Requests drawn for exploration score each proposer on a Thompson draw
(normal approximation of each Beta), so a proposer the class has not used for a while, whose
evidence has decayed back to its prior, gets tried again when the prior says it could pay.

Ties go to the first proposer configured. The maths is numpy over [k_max, n, proposers]: with
three proposers and k_max 8, a median of 135 us for a batch of 16 and 280 us for 256 (measured
beside a test run on 2 cores), more than the compiled K decision (~100 us at 256) and well
under 1% of a CPU engine step; a compiled version is the fast path to add against a GPU step.
Servers with one proposer skip it.
"""

from __future__ import annotations

import numpy as np

from adaptspec.fastpath import ALPHA_CAP


def choose_proposers(post: np.ndarray, n_cls: int, n_prop: int, cls: np.ndarray,
                     k_max: np.ndarray, sn: np.ndarray, n0: np.ndarray, explore: np.ndarray,
                     z: np.ndarray, pass_tokens: np.ndarray | None = None,
                     observations: np.ndarray | None = None, min_tried: float = 4.0
                     ) -> np.ndarray:
    """Index of the proposer to draft for each request.

    post [2 kk, rows]: AcceptanceEstimator.posterior_sums over rows p * n_cls + c (rows of
    the last proposer may stop at the classes registered so far). cls [n]: class per request;
    k_max [n]: the longest K its class allows (0: it never drafts, gets proposer 0). sn [2, n,
    n_prop]: each request's record (s, n) per proposer, n0 [rows] its shrinkage per row
    (RequestSpread.shrinkage). explore [n] bool: whose scores are drawn;
    z [explored, kk, n_prop]: standard normals for them. pass_tokens [n_prop] (None: all 0):
    what one draft token of each proposer costs beyond the verify pass, in tokens (a draft
    model's forward pass); a position counts only by how much its increment exceeds it.
    observations [rows] (None: not used): each row's evidence (decayed verified positions). An
    explored request whose class has a proposer with less than `min_tried` of it tries that
    one (the least tried, of those whose score is positive): a proposer the class has not used
    lately gets its turn, which a Thompson draw against well-measured rivals may deny it for
    long.
    """
    kk = post.shape[0] // 2
    n = cls.shape[0]
    if n_prop == 1 or n == 0:
        return np.zeros(n, dtype=np.int64)
    rows = np.arange(n_prop)[None, :] * n_cls + cls[:, None]  # [n, P]
    a, t = post[:kk, rows], post[kk: 2 * kk, rows]  # [kk, n, P]
    mean = a / t
    level = np.maximum(post[0, rows] / post[kk, rows], 1e-3)  # [n, P]
    # The request's own record shrunk toward its class's level, as a factor on the class's
    # first position (step_reference.decide).
    f = (sn[0] / level + n0[rows]) / (sn[1] + n0[rows])
    alpha = mean.copy()
    alpha[0] *= f
    drawn = np.flatnonzero(explore)
    if drawn.size:
        m = mean[:, drawn]
        sd = np.sqrt((1.0 - m) * m / (t[:, drawn] + 1.0))
        alpha[:, drawn] = np.maximum(m + sd * np.moveaxis(z, 0, 1), 0.0)
    inc = np.multiply.accumulate(np.minimum(alpha, ALPHA_CAP), axis=0)
    within = np.arange(kk)[:, None] < k_max[None, :]  # [kk, n]
    if pass_tokens is not None:
        inc = np.maximum(inc - pass_tokens[None, None, :], 0.0)
    score = (inc * within[:, :, None]).sum(axis=0)  # [n, P]
    choice = score.argmax(axis=1).astype(np.int64)
    if observations is not None and drawn.size:
        # (only proposers that could pay at all: a draft model whose pass costs more than
        # any position can gain would be given K = 0, and the request would lose its draft)
        obs = np.where(score[drawn] > 0, observations[rows[drawn]], np.inf)  # [explored, P]
        untried = obs.min(axis=1) < min_tried
        choice[drawn[untried]] = obs[untried].argmin(axis=1)
    return choice
