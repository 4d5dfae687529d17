"""Tests for verify_reference: greedy by hand, rejection sampling by chi-square goodness of fit.

The statistical setup keeps the target distribution at each position fixed (``p_j`` does not
depend on the prefix) and draws the drafts independently from fixed ``q_j``. Then plain sampling
from the target emits independent tokens ``y_j ~ p_j``, and speculative decoding is lossless iff

* the first emitted token is distributed as ``p_0``, and
* for every position ``i >= 1`` the token at ``i``, among the samples that emitted it (i.e. that
  accepted drafts ``0 .. i-1``), is distributed as ``p_i`` independently of the token at ``i-1``.
  This is the joint ``p_0(y_0) p_1(y_1 | y_0)`` restricted to where it is defined; the table of
  (token ``i-1``, token ``i``) counts is tested against row totals times ``p_i``.

Every test uses fixed seeds, so it is deterministic. The correct rule must give p > 1e-3 on every
case and position; each deliberately wrong rule must give p < 1e-6 somewhere.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare
from verify_reference import (
    PAD,
    emitted_lists,
    sample_drafts,
    verify_greedy,
    verify_rejection,
)

N = 100_000
CASES = [(k, 5 + k % 4, 1000 + k) for k in range(1, 9)]  # (K, V, seed): V = 5..8
CASE_IDS = [f"K{k}-V{v}" for k, v, _ in CASES]
BROKEN = ["resample_from_p", "inverted_ratio", "shared_uniform", "stale_bonus"]


# --------------------------------------------------------------------------- greedy, by hand


def test_greedy_all_accepted_plus_bonus():
    acc, out = verify_greedy([[3, 1, 4]], [[3, 1, 4, 9]], [3])
    assert acc.tolist() == [3]
    assert out.tolist() == [[3, 1, 4, 9]]


def test_greedy_first_rejected():
    acc, out = verify_greedy([[3, 1, 4]], [[7, 1, 4, 9]], [3])
    assert acc.tolist() == [0]
    assert out.tolist() == [[7, PAD, PAD, PAD]]


def test_greedy_middle_rejected_ignores_later_matches():
    acc, out = verify_greedy([[3, 1, 4]], [[3, 5, 4, 9]], [3])
    assert acc.tolist() == [1]
    assert out.tolist() == [[3, 5, PAD, PAD]]


def test_greedy_k0_is_plain_decoding():
    acc, out = verify_greedy(np.zeros((1, 0), dtype=int), [[6]], [0])
    assert acc.tolist() == [0]
    assert out.tolist() == [[6]]


def test_greedy_mixed_batch_with_padding():
    drafts = [
        [3, 1, 4, 1],  # K=4, all accepted -> bonus 5
        [3, 1, -1, -1],  # K=2, second rejected -> correction 2
        [-1, -1, -1, -1],  # K=0 -> plain decoding
        [8, 8, 8, -1],  # K=3, all accepted; padded position would "match" but is ignored
        [0, -1, -1, -1],  # K=1, first rejected
    ]
    argmax = [
        [3, 1, 4, 1, 5],
        [3, 2, 0, 0, 0],
        [7, 0, 0, 0, 0],
        [8, 8, 8, 2, 0],
        [9, 9, 9, 9, 9],
    ]
    acc, out = verify_greedy(drafts, argmax, [4, 2, 0, 3, 1])
    assert acc.tolist() == [4, 1, 0, 3, 0]
    assert emitted_lists(acc, out) == [[3, 1, 4, 1, 5], [3, 2], [7], [8, 8, 8, 2], [9]]
    assert out[1].tolist() == [3, 2, PAD, PAD, PAD]


def test_greedy_rejects_bad_shapes():
    with pytest.raises(ValueError, match="num_draft"):
        verify_greedy([[1, 2]], [[1, 2, 3]], [3])
    with pytest.raises(ValueError, match="target_argmax"):
        verify_greedy([[1, 2]], [[1, 2]], [2])


# --------------------------------------------------------------- rejection, deterministic cases


def test_rejection_with_onehot_target_equals_greedy():
    """With a one-hot p (temperature 0) rejection sampling must reproduce greedy exactly."""
    rng = np.random.default_rng(7)
    b, kmax, v = 2000, 5, 6
    argmax = rng.integers(0, v, size=(b, kmax + 1))
    # Drafts agree with the argmax often enough to exercise every acceptance length.
    drafts = np.where(rng.random((b, kmax)) < 0.8, argmax[:, :kmax], rng.integers(0, v, (b, kmax)))
    k = rng.integers(0, kmax + 1, size=b)
    p = np.eye(v)[argmax]
    q = rng.dirichlet(np.ones(v), size=(b, kmax))
    want = verify_greedy(drafts, argmax, k)
    for draft_probs in (None, q):
        got = verify_rejection(drafts, draft_probs, p, k, rng)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


def test_rejection_zero_residual_falls_back_to_p():
    """p <= q everywhere (only possible unnormalised) leaves no residual: draw from p instead."""
    v, b = 4, 20_000
    q = np.full((b, 1, v), 0.25)
    p = np.broadcast_to(np.array([0.2, 0.1, 0.05, 0.0]), (b, 2, v))  # sums to 0.35
    drafts = np.zeros((b, 1), dtype=int)
    acc, out = verify_rejection(drafts, q, p, np.ones(b, dtype=int), 3)
    rejected = acc == 0
    assert 0.1 < rejected.mean() < 0.3  # accept with probability 0.2 / 0.25
    first = out[rejected, 0]
    assert set(np.unique(first)) <= {0, 1, 2}  # never the zero-probability token
    freq = np.bincount(first, minlength=v) / first.size
    np.testing.assert_allclose(freq[:3], np.array([0.2, 0.1, 0.05]) / 0.35, atol=0.02)


def test_rejection_p_equals_q_always_accepts():
    rng = np.random.default_rng(11)
    v, k, b = 6, 4, 5000
    p = rng.dirichlet(np.ones(v), size=(b, k + 1))
    q = p[:, :k].copy()
    drafts = sample_drafts(q, rng)
    acc, out = verify_rejection(drafts, q, p, np.full(b, k), rng)
    assert (acc == k).all()
    np.testing.assert_array_equal(out[:, :k], drafts)


def test_rejection_validates_inputs():
    p = np.full((1, 3, 4), 0.25)
    with pytest.raises(ValueError, match="rule"):
        verify_rejection([[0, 1]], None, p, [2], 0, rule="nope")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="draft tokens"):
        verify_rejection([[0, 4]], None, p, [2], 0)
    with pytest.raises(ValueError, match="draft_probs"):
        verify_rejection([[0, 1]], np.full((1, 2, 5), 0.2), p, [2], 0)
    # Padding beyond num_draft may hold anything.
    acc, out = verify_rejection([[0, -1]], None, p, [1], 0)
    assert out.shape == (1, 3) and 0 <= acc[0] <= 1


# ------------------------------------------------------------------- statistical losslessness


def _mix(rng: np.random.Generator, n: int, v: int) -> np.ndarray:
    """Random distributions with every entry >= 0.2 / V, so expected chi-square cells stay large."""
    return 0.8 * rng.dirichlet(np.ones(v), size=n) + 0.2 / v


def _case(k: int, v: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return _mix(rng, k + 1, v), _mix(rng, k, v)  # p: [K+1, V], q: [K, V]


def position_pvalues(acc: np.ndarray, out: np.ndarray, p: np.ndarray) -> list[float]:
    """Chi-square p-value of the emitted token at each position, as in the module docstring.

    Position 0 is tested against ``p_0``. Position ``i >= 1`` uses the samples that emitted it and
    tests the (token ``i-1``, token ``i``) table against ``row total * p_i`` (rows with an expected
    cell below 5 are dropped; ``ddof`` accounts for the row totals being fixed).
    """
    v = p.shape[1]
    pvals = [chisquare(np.bincount(out[:, 0], minlength=v), out.shape[0] * p[0]).pvalue]
    for i in range(1, out.shape[1]):
        reach = acc >= i
        table = np.bincount(out[reach, i - 1] * v + out[reach, i], minlength=v * v).reshape(v, v)
        rows = table.sum(axis=1)
        keep = rows * p[i].min() >= 5
        if not keep.any():
            continue
        expected = rows[keep, None] * p[i][None, :]
        pvals.append(chisquare(table[keep].ravel(), expected.ravel(), ddof=keep.sum() - 1).pvalue)
    return [float(x) for x in pvals]


def run_case(k: int, v: int, seed: int, rule: str = "exact", one_hot: bool = False) -> list[float]:
    p, q = _case(k, v, seed)
    rng = np.random.default_rng(seed + 1)
    big_p = np.broadcast_to(p, (N, k + 1, v))
    big_q = np.broadcast_to(q, (N, k, v))
    drafts = sample_drafts(big_q, rng)
    acc, out = verify_rejection(
        drafts, None if one_hot else big_q, big_p, np.full(N, k), rng, rule=rule
    )
    assert ((acc >= 0) & (acc <= k)).all()
    return position_pvalues(acc, out, p)


@pytest.mark.parametrize(("k", "v", "seed"), CASES, ids=CASE_IDS)
def test_rejection_sampling_is_lossless(k, v, seed):
    pvals = run_case(k, v, seed)
    assert len(pvals) >= 2
    assert min(pvals) > 1e-3, pvals


@pytest.mark.parametrize(("k", "v", "seed"), CASES, ids=CASE_IDS)
def test_onehot_drafts_are_lossless(k, v, seed):
    """draft_probs=None: the proposer is deterministic given its drafts, however they came about."""
    pvals = run_case(k, v, seed, one_hot=True)
    assert min(pvals) > 1e-3, pvals


def test_onehot_adversarial_drafts_are_lossless():
    """Always drafting each position's least likely token must not bias the output either."""
    k, v = 3, 6
    p, _ = _case(k, v, 77)
    drafts = np.broadcast_to(p[:k].argmin(axis=1), (N, k))
    acc, out = verify_rejection(
        drafts, None, np.broadcast_to(p, (N, k + 1, v)), np.full(N, k), np.random.default_rng(78)
    )
    pvals = position_pvalues(acc, out, p)
    assert len(pvals) >= 2  # deep positions are reached too rarely to test
    assert min(pvals) > 1e-3, pvals


def test_mixed_draft_lengths_in_one_batch_are_lossless():
    kmax, v = 4, 7
    p, q = _case(kmax, v, 99)
    rng = np.random.default_rng(100)
    big_q = np.broadcast_to(q, (N, kmax, v))
    drafts = sample_drafts(big_q, rng)
    k = rng.integers(0, kmax + 1, size=N)
    drafts[np.arange(kmax)[None, :] >= k[:, None]] = PAD
    acc, out = verify_rejection(drafts, big_q, np.broadcast_to(p, (N, kmax + 1, v)), k, rng)
    assert (acc <= k).all()
    assert ((out >= 0).sum(axis=1) == acc + 1).all()
    pvals = position_pvalues(acc, out, p)
    assert min(pvals) > 1e-3, pvals


@pytest.mark.parametrize("rule", BROKEN)
def test_broken_rules_are_caught(rule):
    """Power: the same test must reject each deliberately wrong rule decisively on some case."""
    worst = min(min(run_case(k, v, seed, rule=rule)) for k, v, seed in CASES)
    assert worst < 1e-6, (rule, worst)
