"""Engine steps, reconstructed from the times clients received their tokens.

vLLM streams each request's new tokens when the engine step that made them ends, so the chunks
of all running requests arrive together, a few milliseconds apart, once a step; the next step
takes hundreds of milliseconds on a CPU. Grouping a benchmark cell's chunk arrivals by those
pauses gives its steps: when each ended, how many requests it decoded, how many tokens they got,
and whether a prompt was prefilled in it (a request's first chunk). A request's inter-token gap
cannot tell a decode step from one that also prefilled another request's prompt, nor how many
requests shared it; a step can.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

# Chunks of one step arrive together, but on a busy machine the API server may stream the last
# requests' chunks ~100 ms after the first ones. Steps are at least the fastest step apart
# (hundreds of ms on a CPU, though a step of 16 requests takes three times one of 4): a pause of
# half of it (the 10th percentile of a request's gaps between chunks) starts a new step. The
# floor keeps a fast model's steps (a few ms on the tiny pair) from being split by jitter.
SPLIT_FRACTION, FASTEST_PCT, MIN_SPLIT_S = 0.5, 10.0, 0.002
# A decode step under this share of the decode steps around it is an artefact of late chunks
# (a batch that drops from 16 requests to 4 at once steps about 3x faster, and is no artefact).
LATE_FRACTION = 0.3


@dataclass(frozen=True)
class Step:
    """One engine step as the clients saw it.

    end: seconds from the cell's start, when its first chunk arrived; duration: since the
    previous step ended (the first step: since the first request was sent); decoded: requests
    that got decode tokens; tokens: decode tokens they got; prefilled: requests that got their
    first token (their prompt was prefilled in this step, or in steps that emitted nothing
    before it); clean: False where chunks came late (see engine_steps), so its duration is not
    the step's.
    """

    end: float
    duration: float
    decoded: int
    tokens: int
    prefilled: int
    clean: bool = True

    @property
    def pure_decode(self) -> bool:
        return self.prefilled == 0 and self.decoded > 0 and self.clean


def arrivals(requests: list[dict[str, Any]]) -> np.ndarray:
    """[n, 4]: arrival time in the cell's clock, tokens, first-chunk flag, request index;
    sorted by time."""
    rows = []
    for j, r in enumerate(requests):
        start = float(r.get("start", 0.0))
        for i, (t, n) in enumerate(zip(r["chunk_times"], r["chunk_tokens"], strict=True)):
            rows.append((start + t, n, i == 0, j))
    if not rows:
        return np.zeros((0, 4))
    out = np.array(rows, dtype=float)
    return out[np.argsort(out[:, 0], kind="stable")]


def engine_steps(requests: list[dict[str, Any]]) -> list[Step]:
    """The steps of one cell (requests as `adaptspec bench` records them: start, chunk_times
    from the request's start, chunk_tokens)."""
    a = arrivals(requests)
    if len(a) == 0:
        return []
    gaps = np.diff(a[:, 0])
    # A request's gaps between chunks are whole steps (or ~0: two steps' chunks read at once);
    # the short end of them is the fastest step this cell ran.
    per_request = np.array([g for r in requests for g in np.diff(r["chunk_times"])])
    per_request = per_request[per_request > MIN_SPLIT_S]
    fastest = float(np.percentile(per_request, FASTEST_PCT)) if len(per_request) else 0.0
    split = max(MIN_SPLIT_S, SPLIT_FRACTION * fastest)
    # A new step where the pause is long, or where a request gets a second chunk (a step gives
    # each request one: two steps closer together than the split would otherwise merge).
    new = np.zeros(len(a), dtype=bool)
    new[1:] = gaps > split
    seen: set[int] = set()
    for i, req in enumerate(a[:, 3].astype(int)):
        if new[i] or req in seen:
            new[i], seen = True, set()
        seen.add(req)
    t0 = min(float(r.get("start", 0.0)) for r in requests)
    steps: list[Step] = []
    for chunk in np.split(a, np.flatnonzero(new[1:]) + 1):
        end = float(chunk[0, 0])  # (the first chunk: a late one cannot move it)
        first = chunk[:, 2] > 0
        steps.append(Step(end=end, duration=end - (steps[-1].end if steps else t0),
                          decoded=int((~first).sum()), tokens=int(chunk[~first, 1].sum()),
                          prefilled=int(first.sum())))
    # A decode "step" far shorter than the decode steps around it is chunks that came late (a
    # client thread that read two steps' chunks at once, the API server behind a busy engine):
    # the steps beside it have their ends moved, so none of the three times a decode step. They
    # stay in the cell's time, as steps that are not pure decode.
    decode = [i for i, st in enumerate(steps) if i and st.prefilled == 0]
    d = [steps[i].duration for i in decode]
    late = []
    for k, i in enumerate(decode):
        around = d[max(k - 2, 0):k] + d[k + 1:k + 3]
        if around and d[k] < LATE_FRACTION * float(np.median(around)):
            late.append(i)
    blurred = {j for i in late for j in (i - 1, i, i + 1) if j < len(steps)}
    return [replace(st, clean=False) if i in blurred else st for i, st in enumerate(steps)]


def summarize(steps: list[Step]) -> dict[str, Any]:
    """What calibrate needs of a cell's steps: per batch size, the pure decode steps
    (count, mean duration in ms, decode tokens), and the time of every other step (prefills,
    with whatever decoded beside them), in seconds. A mean, not a median: a speculative step's
    time varies with the drafts it verified, and the cell's time is the sum."""
    by: dict[int, list[Step]] = {}
    other = 0.0
    for s in steps:
        if s.pure_decode:
            by.setdefault(s.decoded, []).append(s)
        else:
            other += s.duration
    return {
        "decode": {str(b): [len(v), 1e3 * float(np.mean([s.duration for s in v])),
                            sum(s.tokens for s in v)] for b, v in sorted(by.items())},
        "other_s": other,
        "steps": len(steps),
    }
