"""Proposer confidences calibrated per (class, proposer) and used to cut drafts."""

from __future__ import annotations

import numpy as np
import pytest

from adaptspec.confidence import ConfidenceCalibration, OutcomeCalibration
from adaptspec.controller import Controller
from adaptspec.policy import ClassPolicy, CostModel, Policy

K = 4


def _runs(rng: np.random.Generator, rate: np.ndarray, k: int) -> np.ndarray:
    """Accepted tokens of drafts of k tokens, each token accepted at `rate` (per draft)."""
    ok = rng.random((rate.size, k)) < rate[:, None]
    return np.cumprod(ok, axis=1).sum(axis=1)


def test_a_bin_learns_the_acceptance_of_drafts_with_that_confidence() -> None:
    """Per-token acceptance c**2 for a draft of confidence c: each bin's estimate is that of
    its drafts, within its sampling error; a second row with another mapping stays apart."""
    rng = np.random.default_rng(0)
    cal = ConfidenceCalibration(2, bins=10, forgetting=1.0)
    seen = {row: [[] for _ in range(10)] for row in (0, 1)}
    for _ in range(400):
        cal.tick()
        c = rng.random(16)
        rows = np.repeat([0, 1], 8)
        rate = np.where(rows == 0, c ** 2, 1.0 - c / 2)
        cal.partial_fit(rows, c, np.full(16, K), _runs(rng, rate, K), np.full((16, K), 0.5))
        for r, ci, ri in zip(rows, c, rate, strict=True):
            seen[r][min(int(ci * 10), 9)].append(ri)
    for row in (0, 1):
        for b in range(10):
            est = float(cal.predict(np.array([row]), np.array([(b + 0.5) / 10]))[0])
            n = cal.succ[row, b] + cal.fail[row, b]
            truth = float(np.mean(seen[row][b]))
            se = np.sqrt(truth * (1 - truth) / n)
            # rates vary within a bin (by up to 0.19 for c**2): their mean is what is estimated
            assert abs(est - truth) < 3 * se + 0.03, (row, b, est, truth, n)


def test_a_bin_without_evidence_says_nothing() -> None:
    cal = ConfidenceCalibration(1, bins=10, forgetting=1.0, min_evidence=8)
    assert np.isnan(cal.predict(np.array([0]), np.array([0.5]))).all()
    one = (np.array([0]), np.array([0.55]), np.array([4]), np.array([4]), np.full((1, 4), 0.5))
    cal.partial_fit(*one)
    assert np.isnan(cal.predict(np.array([0]), np.array([0.5]))).all()  # 4 tokens < 8
    cal.partial_fit(*one)
    assert cal.predict(np.array([0]), np.array([0.5]))[0] == pytest.approx(9 / 10)
    cal.forgetting = 0.9
    for _ in range(5):  # decays away when no more drafts come
        cal.tick()
    assert np.isnan(cal.predict(np.array([0]), np.array([0.5]))).all()


def test_a_bin_is_measured_against_the_positions_its_drafts_reached() -> None:
    """A confidence that says nothing (drawn apart from acceptance), and a cut that keeps the
    drafts of the low half at one token and the high half at four, where the first position is
    the weakest (0.5, then 0.9): the low bin's trials are first positions, the high bin's
    mostly later ones. Their rates differ (about 0.5 against 0.75); measured against what the
    per-position acceptance expected of the same trials, neither bin moves from it."""
    rng = np.random.default_rng(2)
    alpha = np.array([0.5, 0.9, 0.9, 0.9])
    cal = ConfidenceCalibration(1, bins=2, forgetting=1.0)
    for _ in range(400):
        c = rng.random(16)
        d = np.where(c < 0.5, 1, K)
        ok = rng.random((16, K)) < alpha[None, :]
        acc = np.minimum(np.cumprod(ok, axis=1).sum(axis=1), d)
        cal.partial_fit(np.zeros(16, dtype=np.int64), c, d, acc, np.tile(alpha, (16, 1)))
    rows, conf = np.zeros(2, dtype=np.int64), np.array([0.25, 0.75])
    rate = cal.predict(rows, conf)
    assert rate[1] - rate[0] > 0.15, rate  # the pooled rates would tell them apart
    shift = cal.shift(rows, conf)
    n = cal.succ[0] + cal.fail[0]
    # a log-odds shift within about three standard errors of 0 (se ~ 1 / sqrt(n p (1 - p)))
    assert (np.abs(shift) < 3 / np.sqrt(n * 0.25 * 0.75)).all(), (shift, n)


def test_outcomes_undo_the_winners_curse_of_the_values_tokens_were_kept_at() -> None:
    """Every draft token is accepted at 0.7 given the one before, but each draft's estimate is
    noisy and the trim keeps a token only while its value (the running product) is at least
    0.3: tokens kept at high values are accepted below them, and each value bin mixes early
    tokens of doubtful drafts with late tokens of confident ones. Per (draft position, value
    bin), accepted over expected is learned within sampling error, and the corrected values of
    each cell match what its tokens turned into, staying running products."""
    rng = np.random.default_rng(3)
    cal = OutcomeCalibration(1, window=1e9)
    k = 6
    seen: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # values, kept, accepted
    for _ in range(400):
        est = np.clip(0.7 + 0.15 * rng.standard_normal(16), 0.05, 0.99)
        values = est[:, None] ** np.arange(1, k + 1)[None, :]  # [16, k]
        d = (values >= 0.3).sum(axis=1)
        ok = rng.random((16, k)) < 0.7
        acc = np.minimum(np.cumprod(ok, axis=1).sum(axis=1), d)
        cal.partial_fit(np.zeros(16, dtype=np.int64), values, d, acc)
        j = np.arange(k)[None, :]
        seen.append((values, j < d[:, None], j < acc[:, None]))
    rows = np.zeros(16, dtype=np.int64)
    vals = np.concatenate([v[kp] for v, kp, _ in seen])
    hits = np.concatenate([h[kp] for _, kp, h in seen])
    fixed = np.concatenate([cal.correct(v.T, rows).T[kp] for v, kp, _ in seen])
    position = np.concatenate([np.broadcast_to(np.arange(k), kp.shape)[kp]
                               for _, kp, _ in seen])
    cell = position * cal.bins + np.minimum((vals * cal.bins).astype(int), cal.bins - 1)
    ratio = cal.ratio(np.array([0]))[0].ravel()
    counts = np.bincount(cell, minlength=cal.positions * cal.bins)
    busy = np.flatnonzero(counts >= 200)
    top_later = busy[busy >= cal.bins].max()
    assert ratio[top_later] < 0.9, ratio  # the curse: the highest values ran highest
    for c in busy:
        m = cell == c
        p = hits[m].mean()
        se = np.sqrt(p * (1 - p) / m.sum())
        # (each cell's correction is one ratio: the cell's mean, not every token in it)
        assert abs(fixed[m].mean() - p) < 3 * se + 0.02, (c, fixed[m].mean(), p)
    draft = cal.correct((0.9 ** np.arange(1, k + 1))[:, None], np.array([0]))[:, 0]
    assert (np.diff(draft) <= 0).all() and draft.max() <= 1.0


def test_outcomes_are_learned_per_draft_position_and_a_thin_cell_leans_on_the_one_before(
        ) -> None:
    """A match that breaks: each draft's first two tokens are accepted at 0.8 given the one
    before, the later ones at 0.4, while the values say a constant rate (the draft's estimate,
    0.5-0.95, to the power of the position). Tokens of one value bin then turn out very
    differently by position (a second token valued 0.3-0.4 is accepted near 0.64, a fourth near
    0.10), which cells of first-or-later position would average. Each position's corrected
    values match what its tokens turned into; positions no token reached take the ratios of the
    deepest one measured."""
    rng = np.random.default_rng(5)
    cal = OutcomeCalibration(1, window=1e9, positions=8)
    k = 5
    cond = np.array([0.8, 0.8, 0.4, 0.4, 0.4])
    seen: list[tuple[np.ndarray, np.ndarray]] = []  # values, accepted (every token verified)
    for _ in range(400):
        est = rng.uniform(0.5, 0.95, 16)
        values = est[:, None] ** np.arange(1, k + 1)[None, :]  # [16, k]
        acc = np.cumprod(rng.random((16, k)) < cond, axis=1).sum(axis=1)
        cal.partial_fit(np.zeros(16, dtype=np.int64), values, np.full(16, k), acc)
        seen.append((values, np.arange(k)[None, :] < acc[:, None]))
    rows = np.zeros(16, dtype=np.int64)
    fixed = np.concatenate([cal.correct(v.T, rows).T for v, _ in seen])  # [n, k]
    hits = np.concatenate([h for _, h in seen])
    vals = np.concatenate([v for v, _ in seen])
    for j in range(k):
        p = hits[:, j].mean()
        se = np.sqrt(p * (1 - p) / hits.shape[0])
        assert abs(fixed[:, j].mean() - p) < 3 * se + 0.02, (j, fixed[:, j].mean(), p)
    in_bin = (vals >= 0.3) & (vals < 0.4)
    second, fourth = hits[:, 1][in_bin[:, 1]].mean(), hits[:, 3][in_bin[:, 3]].mean()
    assert second > 0.5 and fourth < 0.2, (second, fourth)  # the bias planted: same bin
    ratio = cal.ratio(np.array([0]))[0]
    np.testing.assert_array_equal(ratio[k:], np.broadcast_to(ratio[k - 1], ratio[k:].shape))


def test_thin_deep_cells_follow_their_position_drift_not_the_bin_before() -> None:
    """A match that breaks at the fifth token (conditional acceptance 0.8, then 0.3) while the
    values say a constant rate, and one draft in ten verified past the fourth token: each deep
    position's tokens spread over several value bins, a few expected tokens each, under the
    prior. Leaning on the same bin one position earlier alone, those cells keep the earlier
    positions' ratios and value deep tokens well above what they make (0.25-0.28 against
    0.11-0.16 at the fifth); the position's drift, pooled over its bins, carries the break, and
    each position's corrected values match what its tokens turned into."""
    rng = np.random.default_rng(7)
    cal = OutcomeCalibration(1, window=1e9, positions=8)
    k = 8
    cond = np.array([0.8] * 4 + [0.3] * 4)
    seen: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # values, kept, accepted
    for _ in range(100):
        est = rng.uniform(0.5, 0.95, 16)
        values = est[:, None] ** np.arange(1, k + 1)[None, :]  # [16, k]
        d = np.where(rng.random(16) < 0.1, k, 4)
        acc = np.minimum(np.cumprod(rng.random((16, k)) < cond, axis=1).sum(axis=1), d)
        cal.partial_fit(np.zeros(16, dtype=np.int64), values, d, acc)
        j = np.arange(k)[None, :]
        seen.append((values, j < d[:, None], j < acc[:, None]))
    rows = np.zeros(16, dtype=np.int64)
    fixed = np.concatenate([cal.correct(v.T, rows).T for v, _, _ in seen])  # [n, k]
    kept = np.concatenate([kp for _, kp, _ in seen])
    hits = np.concatenate([h for _, _, h in seen])
    assert kept[:, 4].sum() < 250  # thin: under 25 tokens a value bin on average
    for j in range(k):
        h, f = hits[kept[:, j], j], fixed[kept[:, j], j]
        p = h.mean()
        se = np.sqrt(max(p * (1 - p), 0.01) / len(h))
        assert abs(f.mean() - p) < 3 * se + 0.02, (j, f.mean(), p)


def _controller(weight: float = 0.5) -> Controller:
    cost = CostModel(base_ms=10, per_request_ms=0.1, per_draft_token_ms=0.15,
                     spec_overhead_ms=0.0, knee_tokens=1e6, over_knee_ms=0.0, learn=False)
    return Controller(Policy(
        classes={"chat": ClassPolicy(prior_acceptance=0.7, prior_strength=20)},
        default_class="chat", k_max=K, exploration=0.0, hysteresis_steps=1,
        confidence_weight=weight, cost_model=cost))


def test_calibrated_confidence_replaces_the_raw_rank_in_the_cut() -> None:
    """Drafts that say 0.9 are accepted at 0.2, drafts that say 0.3 at 0.95 (a proposer whose
    signal runs backwards on this class). Ranked raw, the confident drafts are kept longer;
    once calibrated, they are the ones cut short, and the doubtful ones keep their length."""
    rng = np.random.default_rng(1)
    ctl = _controller()
    slots = np.array([ctl.add_request(f"r{i}", "chat") for i in range(16)])
    conf = np.where(np.arange(16) % 2 == 0, 0.9, 0.3)
    rate = np.where(conf > 0.5, 0.2, 0.95)

    def one_step(drafted: np.ndarray, accepted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ks = ctl.step(slots, drafted, accepted, None)
        return ks, ctl.cut(slots, ks, conf)

    ks, cut = one_step(np.zeros(16, dtype=np.int64), np.zeros(16, dtype=np.int64))
    first, cuts, est = cut.copy(), [], np.full(2, np.nan)
    for _ in range(120):  # each step verifies the drafts the last one kept
        ks, cut = one_step(cut, np.minimum(_runs(rng, rate, K), cut))
        cuts.append(cut)
        now = ctl.confidence.predict(np.zeros(2, dtype=np.int64), np.array([0.9, 0.3]))
        est = np.where(np.isnan(now), est, now)  # each bin's last calibrated estimate
    confident, doubtful = conf > 0.5, conf < 0.5
    assert ks.max() > 0  # the class still pays to speculate
    assert first[confident].mean() >= first[doubtful].mean()  # raw: trusted as said
    # calibrated: cut where it fails, over the last steps (a bin cut to nothing is not verified,
    # its evidence ages, and it is re-tested now and then)
    late = np.array(cuts[-40:])
    assert late[:, confident].mean() < 0.5 * late[:, doubtful].mean(), late.mean(axis=0)
    assert est[0] < 0.4 < 0.85 < est[1], est


def test_an_uncalibrated_confidence_cannot_keep_drafts_off() -> None:
    """A proposer whose raw confidence undersells some drafts (0.05 said beside others' 0.95,
    every token accepted): ranked against their row's, they would be cut to nothing, never
    verified and never calibrated. The first token of each is kept and verified, the bin
    calibrates, and the drafts get their planned length back."""
    ctl = _controller(weight=1.0)
    slots = np.array([ctl.add_request(f"r{i}", "chat") for i in range(4)])
    conf = np.array([0.05, 0.05, 0.95, 0.95])
    drafted = np.zeros(4, dtype=np.int64)
    cuts = []
    for _ in range(30):
        ks = ctl.step(slots, drafted, drafted, None)  # every verified token accepted
        drafted = ctl.cut(slots, ks, conf)
        cuts.append(drafted.copy())
    assert cuts[0][:2].tolist() == [1] * 2  # uncalibrated: the first token only
    assert (cuts[-1] == ks).all() and ks.min() > 1  # calibrated: as planned
    assert ctl.confidence.predict(np.zeros(1, dtype=np.int64), np.array([0.05]))[0] > 0.85


def test_relative_is_log_odds_over_the_rows_mean_confidence() -> None:
    cal = ConfidenceCalibration(2, bins=10, forgetting=1.0)
    rows = np.zeros(3, dtype=np.int64)
    assert cal.relative(rows, np.array([0.1, 0.5, 0.9])).tolist() == [0.0] * 3  # none seen
    cal.observe(rows, np.array([0.2, 0.4, 0.6]))
    got = cal.relative(np.array([0, 0, 1]), np.array([0.4, 0.8, 0.8]))
    logit = np.log(0.8 / 0.2) - np.log(0.4 / 0.6)
    assert np.allclose(got, [0.0, logit, 0.0])  # row 1 has seen nothing


def test_a_zero_weight_turns_confidences_off() -> None:
    ctl = _controller(weight=0.0)
    slots = np.array([ctl.add_request("a", "chat")])
    ks = ctl.step(slots, np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64), None)
    assert ctl.cut(slots, ks, np.array([0.0])).tolist() == ks.tolist()
    assert np.isnan(ctl.req_conf[slots]).all()
