"""bench/ngram_ceiling.py: the exact replay of the unseen chat stream under K policies."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

spec = importlib.util.spec_from_file_location(
    "ngram_ceiling", Path(__file__).resolve().parents[1] / "bench" / "ngram_ceiling.py")
assert spec and spec.loader
nc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(nc)

CURVE = (100.0, 0.0, 5.0, 4.0, 0.0, 0.0)


def lookup(context: np.ndarray, k: int) -> list[int]:
    """A lookup proposer without vLLM: what followed the last earlier occurrence of the last two
    tokens, up to k tokens."""
    c = context.tolist()
    for i in range(len(c) - 3, -1, -1):
        if c[i:i + 2] == c[-2:]:
            return c[i + 2:i + 2 + k]
    return []


def stream(n: int = 6, length: int = 24, seed: int = 0) -> list[object]:
    """Requests whose outputs repeat their prompts in places (so some drafts are accepted, some
    in part, some not at all)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prompt = rng.integers(0, 50, 12).tolist()
        text = [prompt[int(rng.integers(0, 10))] for _ in range(3)]
        while len(text) < length:
            if rng.random() < 0.5:
                i = int(rng.integers(0, 9))
                text += prompt[i:i + int(rng.integers(2, 6))]
            else:
                text.append(int(rng.integers(0, 50)))
        out.append(nc.Request(prompt, text[:length], propose=lookup))
    return out


def test_a_request_knows_each_drafts_accepted_prefix_and_match() -> None:
    r = nc.Request([1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 5], propose=lookup)
    # after [.., 6, 1] nothing matches; after [.., 1, 2] what followed the prompt's "1 2"
    assert r.drafts[1] == [] and r.accepted[1] == 0
    assert r.drafts[2] == [3, 4, 5, 6, 1, 2]
    assert r.accepted[2] == 1  # "3" then "9", not "4"
    assert nc.matched_n([1, 2, 3, 4, 5, 6, 1, 2]) == 2
    assert nc.matched_n([1, 2, 3, 1, 2, 3]) == 3
    assert nc.matched_n([1, 2, 3, 4]) == 0


@pytest.mark.parametrize("policy,expected", [
    ("0", 0), ("2", 2), ("8", 6), ("oracle", 3), ("oracle2", 2), ("first2", 2),
    ("bylen1,2,5", 2),
])
def test_draft_lengths_by_policy(policy: str, expected: int) -> None:
    assert nc.draft_len(policy, proposed=6, accepted=3, ngram=3) == expected


def test_a_draft_whose_first_token_fails_is_dropped_only_by_those_that_know() -> None:
    assert nc.draft_len("first2", proposed=6, accepted=0, ngram=4) == 0
    assert nc.draft_len("2", proposed=6, accepted=0, ngram=4) == 2


def test_plain_decoding_takes_a_step_a_token_and_the_oracle_wastes_nothing() -> None:
    reqs = stream()
    plain = nc.replay(reqs, nc.Rule("0"), CURVE, 1.0, clients=2, per_client=3)
    assert sum(s["steps"] for s in plain["slices"]) >= sum(r.length - 1 for r in reqs) / 2
    oracle = nc.replay(reqs, nc.Rule("oracle"), CURVE, 1.0, clients=2, per_client=3)
    drafted = sum(s["drafted"] for s in oracle["slices"])
    assert drafted == sum(s["accepted"] for s in oracle["slices"]) > 0
    static = nc.replay(reqs, nc.Rule("8"), CURVE, 1.0, clients=2, per_client=3)
    # every policy over the same proposer accepts at most what the oracle accepts, and the
    # oracle is faster than plain decoding and than drafting all that was proposed
    assert sum(s["accepted"] for s in static["slices"]) <= drafted
    assert oracle["wall_ms"] < plain["wall_ms"]
    assert oracle["wall_ms"] < static["wall_ms"]
    assert len(plain["slices"]) == 1  # 6 requests, 2 clients, 3 each


def test_a_slice_waits_for_its_last_request() -> None:
    """With one client, a slice is its requests one after another: its wall time is the sum of
    their prefills and steps."""
    reqs = stream(n=2)
    out = nc.replay(reqs, nc.Rule("0"), CURVE, 2.0, clients=1, per_client=2)
    steps = sum(r.length - 1 for r in reqs)
    assert out["slices"][0]["steps"] == steps
    assert out["wall_ms"] == pytest.approx(steps * 100.0 + 2.0 * sum(len(r.prompt) for r in reqs))


def test_adaptspec_drives_the_runtime_and_never_verifies_more_than_was_proposed() -> None:
    reqs = stream(n=8)
    policy = nc.Adaptspec("default", seed=0)
    made: dict[int, int] = {}
    drafts = policy.drafts

    def checked(m: dict[int, int], requests: list[object]) -> dict[int, int]:
        made.update(m)
        k = drafts(m, requests)
        for r, n in m.items():
            assert 0 <= k[r] <= len(requests[r].drafts[n])
        return k

    policy.drafts = checked
    out = nc.replay(reqs, policy, CURVE, 1.0, clients=4, per_client=2)
    oracle = nc.replay(reqs, nc.Rule("oracle"), CURVE, 1.0, clients=4, per_client=2)
    assert sum(s["drafted"] for s in out["slices"]) > 0
    assert 0 < sum(s["accepted"] for s in out["slices"]) <= sum(
        s["accepted"] for s in oracle["slices"])
    assert made and policy.rt.errors == 0
    assert not policy.rt.classes  # every request finished and was let go
