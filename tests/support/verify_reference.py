"""Reference verification for speculative decoding, batched with numpy.

This module is the engine-agnostic ground truth the engine plugins are checked against: it does
not import torch or vllm, and it favours clarity over speed (it is vectorised over the batch, and
loops only over the at most ``Kmax`` draft positions).

One verification step for one request works like this. A cheap proposer drafted ``K`` tokens
``x_0 .. x_{K-1}``; the target model scored the prefix plus those drafts in one forward pass,
which gives a target distribution ``p_j`` at each of the ``K + 1`` positions (``p_K`` is the
distribution after the last draft). Verification walks the drafts left to right, keeps a prefix of
them, and then emits exactly one token of its own from the target, so every step emits between
1 and ``K + 1`` tokens and ``K = 0`` is plain decoding.

Output convention shared by both verifiers: ``(accepted_counts, output_tokens)`` where

* ``accepted_counts`` is ``int64 [B]``: how many drafts request ``b`` kept (``0 .. num_draft[b]``);
* ``output_tokens`` is ``int64 [B, Kmax + 1]``: the emitted tokens, left-aligned and padded with
  ``-1`` (:data:`PAD`). Request ``b`` emitted ``accepted_counts[b] + 1`` tokens, namely
  ``output_tokens[b, :accepted_counts[b] + 1]``; the first ``accepted_counts[b]`` are its
  accepted drafts and the last is the target's correction (or the bonus token when every draft
  was accepted). :func:`emitted_lists` turns the pair into a list of lists.
"""

from __future__ import annotations

from typing import Literal, get_args

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = [
    "PAD",
    "RejectionRule",
    "emitted_lists",
    "sample_drafts",
    "verify_greedy",
    "verify_rejection",
]

PAD = -1
"""Padding value in ``output_tokens`` after a request's last emitted token."""

RejectionRule = Literal[
    "exact", "resample_from_p", "inverted_ratio", "shared_uniform", "stale_bonus"
]
"""Which acceptance rule :func:`verify_rejection` applies.

Only ``"exact"`` (the default) is correct. The others are DELIBERATELY WRONG, kept here so the
statistical tests can prove they have the power to catch a real bug; each one changes the
distribution of the emitted tokens (see :func:`verify_rejection` for why). Never use them to serve.
"""

_RULES: frozenset[str] = frozenset(get_args(RejectionRule))


def verify_greedy(
    draft_tokens: ArrayLike, target_argmax: ArrayLike, num_draft: ArrayLike
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Greedy (temperature 0) verification: keep drafts while they equal the target's argmax.

    Args:
        draft_tokens: int ``[B, Kmax]``, drafts left-aligned; entries at ``j >= num_draft[b]``
            are padding and ignored (any value, e.g. ``-1``).
        target_argmax: int ``[B, Kmax + 1]``, the target's argmax at each position; position
            ``j`` is the token the target would emit after the prefix plus drafts ``< j``.
            Entries at ``j > num_draft[b]`` are ignored.
        num_draft: int ``[B]``, the per-request draft length ``K`` in ``0 .. Kmax``.

    Returns:
        ``(accepted_counts, output_tokens)`` as described in the module docstring.

    Why this is lossless: greedy decoding emits ``argmax_0``, then, given that, ``argmax_1``, and
    so on. While ``x_j == argmax_j`` the target's own choice and the draft agree, so the target's
    argmax at ``j + 1`` (computed with ``x_j`` in the prefix) is exactly what greedy decoding would
    compute next. At the first mismatch the draft prefix diverges from what greedy decoding would
    have produced, so everything the target computed after it is discarded, and ``argmax_j`` itself
    (computed on a still-correct prefix) is the correction. If all ``K`` match, ``argmax_K`` is a
    free "bonus" token. Either way the emitted tokens are ``target_argmax[b, :accepted + 1]``.
    """
    drafts = np.asarray(draft_tokens)
    argmax = np.asarray(target_argmax)
    batch, kmax = _check_drafts(drafts, num_draft)
    k = np.asarray(num_draft, dtype=np.int64)
    if argmax.shape != (batch, kmax + 1):
        raise ValueError(
            f"target_argmax must have shape [B, Kmax + 1] = {(batch, kmax + 1)}, got {argmax.shape}"
        )
    positions = np.arange(kmax)
    match = (drafts == argmax[:, :kmax]) & (positions[None, :] < k[:, None])
    # Number of leading matches: the run of ones before the first zero.
    accepted = np.cumprod(match, axis=1, dtype=np.int64).sum(axis=1)
    keep = np.arange(kmax + 1)[None, :] <= accepted[:, None]
    output = np.where(keep, argmax, PAD).astype(np.int64)
    return accepted, output


def verify_rejection(
    draft_tokens: ArrayLike,
    draft_probs: ArrayLike | None,
    target_probs: ArrayLike,
    num_draft: ArrayLike,
    rng: np.random.Generator | int | None = None,
    *,
    rule: RejectionRule = "exact",
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Speculative sampling via modified rejection sampling (Leviathan et al.; Chen et al. 2023).

    Args:
        draft_tokens: int ``[B, Kmax]``, drafts left-aligned; entries at ``j >= num_draft[b]`` are
            padding and ignored. Draft ``x_j`` must have been drawn from ``q_j`` (or be any
            token at all when ``draft_probs`` is None).
        draft_probs: float ``[B, Kmax, V]``, the proposer's distribution ``q_j`` at each draft
            position, or None for one-hot drafts (n-gram / prompt-lookup proposers, as in vLLM):
            the proposer is treated as deterministic, ``q_j = onehot(x_j)``, so ``q_j(x_j) = 1``.
            Read-only broadcast views (``np.broadcast_to``) are fine.
        target_probs: float ``[B, Kmax + 1, V]``, the target's distribution ``p_j`` at each
            position (after temperature / top-k / top-p, i.e. what plain sampling would draw from).
            Rows of ``p`` and ``q`` are expected to sum to 1; they are not renormalised, because
            the acceptance ratio ``p/q`` depends on the scale of both.
        num_draft: int ``[B]``, the per-request draft length ``K`` in ``0 .. Kmax``.
        rng: a numpy Generator (or a seed for one). Uses one uniform per draft position and one
            for the single non-draft token each request emits.
        rule: ``"exact"`` (the default, and the only correct rule) or one of the DELIBERATELY
            WRONG variants below, which exist only so tests can prove they detect bugs.

    Returns:
        ``(accepted_counts, output_tokens)`` as described in the module docstring.

    Why ``"exact"`` is lossless: at position ``j`` accept ``x ~ q`` with probability
    ``min(1, p(x)/q(x))``; this keeps ``x`` with probability ``q(x) min(1, p(x)/q(x)) =
    min(p(x), q(x))``. The total rejection probability is ``beta = 1 - sum_x min(p, q) =
    sum_x max(0, p - q)``, and on rejection the token is drawn from the residual
    ``max(0, p - q) / beta``, contributing ``max(0, p(x) - q(x))``. Since
    ``min(p, q) + max(0, p - q) = p``, the emitted token at position ``j`` is distributed exactly
    as ``p_j``. Accepting makes the prefix the target saw for ``p_{j+1}`` correct, so induction
    gives the joint; if all ``K`` are accepted, the bonus token drawn from ``p_K`` completes the
    step. With one-hot drafts ``q = onehot(x)`` the same algebra holds for any fixed ``x``: keep
    ``x`` with probability ``p(x)``, else draw from ``p`` with ``x`` removed, renormalised.

    The residual is zero only when ``p <= q`` everywhere, i.e. ``p == q`` for normalised rows,
    where rejection has probability zero; it can still be reached through rounding or
    unnormalised inputs, and then the replacement is drawn from ``p`` itself (the residual's
    limit as ``q -> p`` is ill-defined, and drawing from ``p`` changes the output by at most the
    vanishing rejection probability).

    The deliberately wrong rules, and why each one changes the output distribution:

    * ``"resample_from_p"``: on rejection draw from ``p`` instead of the residual. The first token
      then has law ``min(p, q) + beta * p``, which equals ``p`` only if ``min(p, q) = (1-beta) p``,
      impossible unless ``p == q`` (wherever ``q >= p`` it would need ``p = (1-beta) p``). Tokens
      the draft over-proposes come out too often.
    * ``"inverted_ratio"``: accept with probability ``min(1, q(x)/p(x))`` (ratio upside down),
      residual as usual. Tokens the draft over-proposes (``q > p``) are always kept, so they come
      out with probability at least ``q(x) > p(x)``; with one-hot drafts every draft is kept.
    * ``"shared_uniform"``: reuse request ``b``'s first uniform at every position instead of a
      fresh one. Each single acceptance still has the right probability, but they are no longer
      independent: having accepted at ``j`` (``u < r_j``) raises the chance of accepting at
      ``j + 1`` to ``min(r_j, r_{j+1}) / r_j``, so the token at position 1 given position 0 is
      wrong (position 0 alone is still right, which is why tests must look past it).
    * ``"stale_bonus"``: an off-by-one that draws the bonus token from ``p_{K-1}`` instead of
      ``p_K``. Only the token after ``K`` accepted drafts is affected, and only when
      ``p_{K-1} != p_K``.
    """
    if rule not in _RULES:
        raise ValueError(f"rule must be one of {sorted(_RULES)}, got {rule!r}")
    gen = np.random.default_rng(rng)
    drafts = np.asarray(draft_tokens)
    batch, kmax = _check_drafts(drafts, num_draft)
    k = np.asarray(num_draft, dtype=np.int64)
    p = np.asarray(target_probs)
    if p.ndim != 3 or p.shape[:2] != (batch, kmax + 1):
        raise ValueError(
            f"target_probs must have shape [B, Kmax + 1, V] with B, Kmax = {batch}, {kmax}, "
            f"got {p.shape}"
        )
    vocab = p.shape[2]
    q = None if draft_probs is None else np.asarray(draft_probs)
    if q is not None and q.shape != (batch, kmax, vocab):
        raise ValueError(
            f"draft_probs must have shape [B, Kmax, V] = {(batch, kmax, vocab)}, got {q.shape}"
        )
    active_tokens = drafts[np.arange(kmax)[None, :] < k[:, None]]
    if active_tokens.size and (active_tokens.min() < 0 or active_tokens.max() >= vocab):
        raise ValueError(f"draft tokens must lie in [0, {vocab}) at positions j < num_draft")
    tiny = _residual_tolerance(p, q)

    u_accept = gen.random((batch, kmax))
    u_emit = gen.random(batch)  # every request emits exactly one non-draft token
    if rule == "shared_uniform":
        u_accept = np.repeat(u_accept[:, :1], kmax, axis=1)

    rows = np.arange(batch)
    output = np.full((batch, kmax + 1), PAD, dtype=np.int64)
    accepted = np.zeros(batch, dtype=np.int64)
    alive = np.ones(batch, dtype=bool)  # no rejection yet

    for j in range(kmax):
        idx = rows[alive & (j < k)]
        if idx.size == 0:
            break
        x = drafts[idx, j].astype(np.int64)
        p_x = p[idx, j, x].astype(np.float64)
        q_x = np.ones_like(p_x) if q is None else q[idx, j, x].astype(np.float64)
        u = u_accept[idx, j]
        if rule == "inverted_ratio":
            ok = u * p_x < q_x  # u < q/p
        else:
            ok = u * q_x < p_x  # u < p/q, i.e. probability min(1, p/q); no division by q = 0
        keep, rej = idx[ok], idx[~ok]
        output[keep, j] = x[ok]
        accepted[keep] += 1
        if rej.size:
            p_rows = p[rej, j, :].astype(np.float64)
            if rule == "resample_from_p":
                dist = p_rows
            else:
                if q is None:
                    q_rows = np.zeros_like(p_rows)
                    q_rows[np.arange(rej.size), x[~ok]] = 1.0
                else:
                    q_rows = q[rej, j, :].astype(np.float64)
                dist = np.maximum(p_rows - q_rows, 0.0)
                empty = dist.sum(axis=1) <= tiny
                dist[empty] = p_rows[empty]
            output[rej, j] = _sample_rows(dist, u_emit[rej])
            alive[rej] = False

    # Requests that accepted all K drafts (including K = 0) draw the bonus token from p_K.
    idx = rows[alive]
    if idx.size:
        pos = k[idx]
        src = np.maximum(pos - 1, 0) if rule == "stale_bonus" else pos
        output[idx, pos] = _sample_rows(p[idx, src, :].astype(np.float64), u_emit[idx])
    return accepted, output


def sample_drafts(
    draft_probs: ArrayLike, rng: np.random.Generator | int | None = None
) -> NDArray[np.int64]:
    """Draw ``x_j ~ q_j`` independently at every position: ``[B, Kmax, V] -> int64 [B, Kmax]``.

    This is what a stochastic draft model does when its distributions do not depend on its own
    earlier samples (the simple setting the tests use); it loops over positions, not the batch.
    """
    q = np.asarray(draft_probs)
    if q.ndim != 3:
        raise ValueError(f"draft_probs must have shape [B, Kmax, V], got {q.shape}")
    gen = np.random.default_rng(rng)
    batch, kmax, _ = q.shape
    out = np.empty((batch, kmax), dtype=np.int64)
    for j in range(kmax):
        out[:, j] = _sample_rows(q[:, j, :].astype(np.float64), gen.random(batch))
    return out


def emitted_lists(accepted_counts: ArrayLike, output_tokens: ArrayLike) -> list[list[int]]:
    """The emitted tokens of each request as a list of lists (``accepted + 1`` tokens each)."""
    acc = np.asarray(accepted_counts)
    out = np.asarray(output_tokens)
    return [out[b, : int(acc[b]) + 1].tolist() for b in range(acc.shape[0])]


def _check_drafts(drafts: np.ndarray, num_draft: ArrayLike) -> tuple[int, int]:
    if drafts.ndim != 2:
        raise ValueError(f"draft_tokens must have shape [B, Kmax], got {drafts.shape}")
    batch, kmax = drafts.shape
    k = np.asarray(num_draft)
    if k.shape != (batch,):
        raise ValueError(f"num_draft must have shape [B] = {(batch,)}, got {k.shape}")
    if batch and (k.min() < 0 or k.max() > kmax):
        raise ValueError(f"num_draft must lie in [0, Kmax={kmax}], got {k.min()}..{k.max()}")
    return batch, kmax


def _residual_tolerance(p: np.ndarray, q: np.ndarray | None) -> float:
    """A residual mass at or below this is rounding noise of ``p - q`` with ``p == q``."""
    dtypes = [p.dtype] + ([] if q is None else [q.dtype])
    dtype = np.result_type(*dtypes)
    eps = np.finfo(dtype).eps if np.issubdtype(dtype, np.floating) else np.finfo(np.float64).eps
    return 4.0 * float(eps)


def _sample_rows(probs: NDArray[np.float64], u: NDArray[np.float64]) -> NDArray[np.int64]:
    """Inverse-CDF draw of one index per row of (possibly unnormalised) ``probs``, given uniforms.

    Picks ``i`` with ``cdf[i-1] <= u * total < cdf[i]``, so zero-probability entries are never
    chosen; the clamp to the last positive entry only guards ``u * total`` rounding up to
    ``total``.
    """
    cdf = np.cumsum(probs, axis=1)
    target = u * cdf[:, -1]
    idx = (cdf <= target[:, None]).sum(axis=1)
    last_positive = probs.shape[1] - 1 - np.argmax(probs[:, ::-1] > 0, axis=1)
    return np.minimum(idx, last_positive).astype(np.int64)
