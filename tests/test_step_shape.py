"""The step-time model's (batch, draft tokens) table, and drafts trimmed to the shape that pays.

A step's time jumps between token counts (oneDNN's kernels on a CPU, CUDA-graph sizes on a
GPU), which a model linear in draft tokens cannot see: docs/unseen.md measures it."""

from __future__ import annotations

import itertools

import numpy as np

from adaptspec.cost import OFFSET_PRIOR_STEPS, StepCostModel, step_time
from adaptspec.policy import CostModel

JUMP_AT, JUMP_MS = 7, 40.0  # a step of 7 tokens or more (batch + drafts) costs this much more


def truth(b: int, s: int) -> float:
    return 80.0 + 2.0 * b + 0.5 * s + (JUMP_MS if s > 0 and b + s >= JUMP_AT else 0.0)


def learned(steps: int = 1500, seed: int = 0) -> StepCostModel:
    rng = np.random.default_rng(seed)
    m = StepCostModel(CostModel(preset="cpu", prior_weight=1.0, forgetting=0.999))
    for _ in range(steps):
        # a closed loop of 4 clients: batches of 4, and of 2 as requests finish unevenly
        b = 4 if rng.random() < 0.8 else 2
        s = 0 if rng.random() < 0.3 else int(rng.integers(1, 9))
        m.partial_fit(b, s, min(s, 4), truth(b, s) * rng.lognormal(0.0, 0.02))
    return m.fit()


def test_the_table_learns_a_jump_the_line_cannot() -> None:
    m = learned()
    for b, s in [(4, 0), (4, 1), (4, 2), (4, 3), (4, 4), (4, 6)]:
        linear = float(step_time(m.coef_at(b), b, s, min(s, 4), m.knee))
        pred = m.predict(b, s, min(s, 4))
        assert abs(pred - truth(b, s)) < 0.04 * truth(b, s), (b, s, pred, truth(b, s))
        if s and b + s in (JUMP_AT - 1, JUMP_AT):  # either side of the jump the line misses
            assert abs(linear - truth(b, s)) > 2 * abs(pred - truth(b, s))


def goodput(m: StepCostModel, values: np.ndarray, lengths: tuple[int, ...], batch: int) -> float:
    gain = sum(values[:k, i].sum() for i, k in enumerate(lengths))
    return (batch + gain) / m.predict(batch, sum(lengths), max(lengths, default=0))


def hand_model() -> StepCostModel:
    """Coefficients set by hand (plain attributes): no cost per longest draft, so that the
    best plan of S tokens is the S most valuable ones, and a jump at 7 tokens at batch 4."""
    m = StepCostModel(CostModel(preset="cpu", learn=False))
    m.coef = np.array([80.0, 2.0, 0.5, 0.0, 0.0, 0.0, 0.0])
    m.shape_sum[4, JUMP_AT - 4:] = JUMP_MS * OFFSET_PRIOR_STEPS  # weight 0: the mean is JUMP_MS
    return m


def test_trim_keeps_the_best_plan_of_all() -> None:
    rng = np.random.default_rng(3)
    m = hand_model()
    for _ in range(40):
        # 4 requests, 3 of them with drafts of up to 3 tokens; running products (non-increasing)
        values = np.zeros((8, 4))
        values[:3, :3] = np.cumprod(rng.uniform(0.3, 1.0, (3, 3)), axis=0)
        keep = np.array([3, 3, 3, 0])
        got = m.trim(values, keep, 4, np.zeros(4, dtype=np.int64))
        assert (got <= keep).all()
        best = max(goodput(m, values, p, 4)
                   for p in itertools.product(range(4), range(4), range(4), range(1)))
        assert np.isclose(goodput(m, values, tuple(got), 4), best)


def test_trim_stops_below_the_jump_when_the_tokens_past_it_do_not_pay() -> None:
    m = hand_model()
    values = np.zeros((8, 4))
    values[:, 0] = np.cumprod([0.7, 0.7, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9])  # one long draft
    keep = np.array([8, 0, 0, 0])
    got = m.trim(values, keep, 4, np.zeros(4, dtype=np.int64))
    # 2 tokens (a step of 6) gain 1.19 at 89 ms, 5.19 tokens at 58 a second; 8 gain 3.26
    # at 132 ms (past the jump), 55 a second
    assert got.tolist() == [2, 0, 0, 0]
    # without the jump the whole draft pays
    m.shape_sum[:] = 0.0
    assert m.trim(values, keep, 4, np.zeros(4, dtype=np.int64)).tolist() == [8, 0, 0, 0]


def test_trim_keeps_forced_tokens_and_a_latency_critical_limit() -> None:
    m = hand_model()
    values = np.zeros((8, 4))
    values[:4, :] = 0.9
    keep = np.array([4, 4, 4, 4])
    forced = np.array([3, 0, 0, 0])
    assert (m.trim(values, keep, 4, forced) >= forced).all()
    # with a latency-critical request in the batch, a step may take 2% more than plain: at
    # 0.5 ms a draft token over 88 ms that would be 3 tokens, but 3 make a step of 7 (the jump)
    got = m.trim(values, keep, 4, np.zeros(4, dtype=np.int64), slack=0.02)
    assert got.sum() == 2
    plain = m.predict(4, 0, 0)
    assert m.predict(4, int(got.sum()), int(got.max())) <= plain * 1.02


ROWS_MS = {1: 410.0, 2: 500.0, 3: 340.0, 4: 310.0, 5: 320.0}  # a step by its rows (1.5B, 2 cores)


def test_an_unmeasured_shape_is_priced_as_a_plain_step_of_as_many_rows() -> None:
    """A step of 2 requests with 2 drafts runs 4 rows: before any such step is measured it is
    priced as the plain steps of 4 measured, not by the line through batch sizes; a shape
    with no plain step of as many rows keeps the formula; measured shapes take over."""
    rng = np.random.default_rng(0)
    m = StepCostModel(CostModel(preset="cpu", prior_weight=1.0, forgetting=0.999))
    for _ in range(400):
        b = int(rng.integers(1, 5))
        m.partial_fit(b, 0, 0, ROWS_MS[b] * rng.lognormal(0.0, 0.02))
    m.fit()
    target = ROWS_MS[4] + m.coef[4] + m.coef[3] * 1  # and what speculating adds beyond rows
    line = float(step_time(m.coef_at(2), 2, 2, 1, m.knee))
    # as far as the 4 rows were measured (their decayed weight against the table's prior)
    unseen = OFFSET_PRIOR_STEPS / (m.rows_weight[4] + OFFSET_PRIOR_STEPS)
    assert abs(m.predict(2, 2, 1) - target) <= (unseen + 0.02) * abs(line - target)
    assert m.predict(2, 2, 1) < m.predict(2, 0, 0)  # cheaper than plain: worth drafting
    formula = float(step_time(m.coef_at(4), 4, 3, 3, m.knee))
    assert m.predict(4, 3, 3) == formula  # 7 rows: never measured
    for _ in range(60):
        m.partial_fit(2, 2, 1, 450.0)
    m.fit()
    assert abs(m.predict(2, 2, 1) - 450.0) < 0.05 * 450.0


def test_speculating_steps_of_as_many_rows_price_an_unmeasured_shape() -> None:
    """One user drafting alone (1 request, 1-4 drafts: 2-5 rows) measures what a step beside a
    latency-critical request would run (2 requests, 2 drafts: 4 rows) before any such step
    is drafted: that shape is priced from them, and cheaper than a plain step of 2 (on two
    CPU cores a plain step of 2 is dearer than one of 4 rows), where the line through the
    measured shapes would keep it dearer than plain."""
    rng = np.random.default_rng(1)
    m = StepCostModel(CostModel(preset="cpu", prior_weight=1.0, forgetting=0.999))
    extra = 5.0  # what a speculating step costs beyond its rows (rejection sampling)
    for _ in range(400):
        b = int(rng.integers(1, 3))
        s = int(rng.integers(1, 5)) if b == 1 and rng.random() < 0.7 else 0
        m.partial_fit(b, s, s, (ROWS_MS[b + s] + (extra if s else 0.0))
                      * rng.lognormal(0.0, 0.02))
    m.fit()
    assert m.shape_weight[2, 2] == 0  # never measured
    assert m.predict(2, 2, 1) < 0.8 * m.predict(2, 0, 0)
    # as far as 4 rows were measured, at the rows' time plus what a speculating step adds
    target = ROWS_MS[4] + m.coef[4] + m.coef[3] * 1
    line = float(step_time(m.coef_at(2), 2, 2, 1, m.knee))
    unseen = OFFSET_PRIOR_STEPS / (m.rows_weight[4] + OFFSET_PRIOR_STEPS)
    assert abs(m.predict(2, 2, 1) - target) <= (unseen + 0.05) * abs(line - target)
