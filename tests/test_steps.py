"""bench.steps: engine steps rebuilt from the chunk times clients saw, against a synthetic
engine whose steps are known (batch, tokens, prefills, durations), with arrival jitter."""

from __future__ import annotations

import numpy as np
import pytest

from adaptspec.tools.bench import steps


def _engine(step_s: float, prefill_s: float, jitter_s: float, seed: int = 0
            ) -> tuple[list[dict], list[tuple[float, int, int, int]]]:
    """Closed-loop clients on a toy engine: 3 slots, 7 requests of 5 decode steps each. A step
    prefills every waiting request (prefill_s each) and decodes the running ones (step_s, each
    getting 1-3 tokens). Returns the requests as `adaptspec bench` records them and the true
    steps (end, decoded, tokens, prefilled)."""
    rng = np.random.default_rng(seed)
    n_req, slots, length = 7, 3, 5
    reqs = [{"start": 0.0, "chunk_times": [], "chunk_tokens": []} for _ in range(n_req)]
    left = {i: length for i in range(slots)}  # running: decode steps left (-1: waiting)
    waiting = list(range(slots))
    nxt, t, truth = slots, 0.0, []
    while left:
        decoding = [i for i in left if i not in waiting]
        t += step_s + prefill_s * len(waiting)
        tokens = 0
        for i in decoding:
            n = int(rng.integers(1, 4))
            tokens += n
            reqs[i]["chunk_times"].append(t + rng.uniform(0, jitter_s) - reqs[i]["start"])
            reqs[i]["chunk_tokens"].append(n)
            left[i] -= 1
        for i in waiting:
            reqs[i]["chunk_times"].append(t + rng.uniform(0, jitter_s) - reqs[i]["start"])
            reqs[i]["chunk_tokens"].append(1)
        truth.append((t, len(decoding), tokens, len(waiting)))
        waiting = []
        for i in [i for i, n in left.items() if n == 0]:
            del left[i]
            if nxt < n_req:  # the client sends its next request right away
                reqs[nxt]["start"] = t + jitter_s
                left[nxt] = length
                waiting.append(nxt)
                nxt += 1
    return reqs, truth


@pytest.mark.parametrize(("step_s", "prefill_s", "jitter_s"),
                         [(0.3, 2.0, 0.005), (0.005, 0.03, 0.0005)])
def test_steps_match_the_engine(step_s: float, prefill_s: float, jitter_s: float) -> None:
    reqs, truth = _engine(step_s, prefill_s, jitter_s)
    got = steps.engine_steps(reqs)
    assert [(s.decoded, s.tokens, s.prefilled) for s in got] == [x[1:] for x in truth]
    ends = np.array([x[0] for x in truth])
    durations = np.diff(ends, prepend=0.0)
    assert np.allclose([s.duration for s in got], durations, atol=2 * jitter_s)
    # a step that prefilled is not a decode step, whatever it also decoded
    assert [s.pure_decode for s in got] == [x[3] == 0 and x[1] > 0 for x in truth]


def test_summary_by_batch_and_other_time() -> None:
    reqs, truth = _engine(0.3, 2.0, 0.002, seed=1)
    s = steps.summarize(steps.engine_steps(reqs))
    durations = np.diff([x[0] for x in truth], prepend=0.0)
    pure = {}
    for (_, decoded, tokens, prefilled), d in zip(truth, durations, strict=True):
        if prefilled == 0 and decoded:
            n, total, toks = pure.get(decoded, (0, 0.0, 0))
            pure[decoded] = (n + 1, total + d, toks + tokens)
    assert set(s["decode"]) == {str(b) for b in pure}
    for b, (n, total, toks) in pure.items():
        got_n, got_ms, got_tokens = s["decode"][str(b)]
        assert (got_n, got_tokens) == (n, toks)
        assert got_ms == pytest.approx(1e3 * total / n, abs=5.0)
    prefill_time = sum(d for x, d in zip(truth, durations, strict=True)
                       if x[3] or not x[1])
    assert s["other_s"] == pytest.approx(prefill_time, abs=0.02)
    assert s["steps"] == len(truth)


def test_no_chunks_no_steps() -> None:
    assert steps.engine_steps([{"start": 0.0, "chunk_times": [], "chunk_tokens": []}]) == []
    assert steps.summarize([]) == {"decode": {}, "other_s": 0.0, "steps": 0}


def test_a_request_never_gets_two_chunks_in_one_step() -> None:
    # two requests in a fast engine whose steps (1 ms) are closer than the split floor: the
    # pause alone cannot separate them, the second chunk of a request does
    reqs = [{"start": 0.0, "chunk_times": [0.010, 0.011, 0.012], "chunk_tokens": [1, 2, 1]},
            {"start": 0.0, "chunk_times": [0.010, 0.011, 0.012], "chunk_tokens": [1, 1, 1]}]
    got = steps.engine_steps(reqs)
    assert [(s.decoded, s.tokens, s.prefilled) for s in got] == [(0, 0, 2), (2, 3, 0), (2, 2, 0)]
    assert [s.duration for s in got] == pytest.approx([0.010, 0.001, 0.001])


def test_late_chunks_do_not_time_a_decode_step() -> None:
    # three requests decoding at 300 ms a step. A chunk 120 ms late joins its step, which ends
    # when its first chunk came; a client that read two steps' chunks at once (the third, at
    # 1.2 s) leaves a step of no time: it and the steps beside it time no decode step.
    times = [[0.3, 0.6, 0.9, 1.2, 1.5, 1.8]] * 2 + [[0.3, 0.72, 0.9, 1.2, 1.2, 1.8]]
    reqs = [{"start": 0.0, "chunk_times": t, "chunk_tokens": [1] * 6} for t in times]
    got = steps.engine_steps(reqs)
    assert [s.decoded for s in got] == [0, 3, 3, 3, 1, 2, 3]
    assert [s.duration for s in got] == pytest.approx([0.3, 0.3, 0.3, 0.3, 0.0, 0.3, 0.3])
    assert [s.pure_decode for s in got] == [False, True, True, False, False, False, True]
    s = steps.summarize(got)
    assert s["decode"] == {"3": [3, pytest.approx(300.0), 9]}
    assert s["other_s"] == pytest.approx(0.3 + 0.3 + 0.0 + 0.3)


def test_a_batch_that_shrinks_at_once_steps_faster_and_is_kept() -> None:
    # four requests at 1 s a step; three finish at 3 s, and the last steps at 300 ms alone
    long = [1.0, 2.0, 3.0]
    reqs = [{"start": 0.0, "chunk_times": long, "chunk_tokens": [1] * 3} for _ in range(3)]
    reqs.append({"start": 0.0, "chunk_times": [*long, 3.3, 3.6, 3.9],
                 "chunk_tokens": [1] * 6})
    got = steps.engine_steps(reqs)
    assert [s.decoded for s in got] == [0, 4, 4, 1, 1, 1]
    assert all(s.clean for s in got)
    assert steps.summarize(got)["decode"]["1"] == [3, pytest.approx(300.0), 3]
