"""bench/engine_ab.py's pricing: every engine's decode steps at one reference machine state."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location(
    "engine_ab", Path(__file__).resolve().parents[1] / "bench" / "engine_ab.py")
assert spec and spec.loader
engine_ab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(engine_ab)


def _run(steps: list[list[object]]) -> dict[str, object]:
    return {"engines": {"a": {"steps": steps}}}


def test_the_table_is_the_median_decode_step_per_requests_and_rows() -> None:
    # (requests, drafts, prefill, ms, requests drafting, tokens made, drafter ms)
    ref = _run([[4, 0, False, 100.0, 0, 4, 0.0], [4, 0, False, 104.0, 0, 4, 0.0],
                [4, 0, False, 300.0, 0, 4, 0.0], [4, 2, False, 110.0, 1, 5, 0.0],
                [4, 0, True, 900.0, 0, 4, 0.0]])  # a prefill step prices nothing
    assert engine_ab.step_table([ref]) == {(4, 4): 104.0, (4, 6): 110.0}


def test_steps_are_priced_by_their_shape_or_the_nearest_rows_at_that_batch() -> None:
    table = {(4, 4): 100.0, (4, 6): 120.0, (2, 2): 80.0}
    steps = [[4, 0, False, 999.0, 0, 4, 0.0],  # its own time is not used
             [4, 2, False, 1.0, 1, 6, 0.0],
             [4, 5, False, 1.0, 1, 7, 0.0],  # 9 rows: the nearest measured, 6
             [2, 0, False, 1.0, 0, 2, 0.0],
             [3, 0, True, 1.0, 0, 3, 0.0]]  # prefill: left out
    assert engine_ab.priced(steps, table) == pytest.approx((4 + 6 + 7 + 2) / 0.42)
    assert engine_ab.priced([[3, 0, False, 1.0, 0, 3, 0.0]], table) is None  # no batch of 3
    assert engine_ab.priced([[4, 0, False, 1.0]], table) is None  # an old log: no tokens made
