"""The draft-model proposer on the tiny draft model: idle costs nothing, catch-up is exact."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers",
                    reason="needs the models extra: pip install 'adaptspec[models]'")

from adaptspec.proposers.draft_model import DraftModelProposer, _common_prefix  # noqa: E402

PROMPT = [5, 17, 33, 8, 91, 14, 27, 60, 5, 17, 33]


@pytest.fixture(scope="module")
def model(tiny_models: dict[str, Any]) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_models["draft"], dtype=torch.float32)


def test_common_prefix() -> None:
    assert _common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert _common_prefix([1, 2, 3, 9], [1, 2, 3, 4, 5]) == 3
    assert _common_prefix([], [1]) == 0
    assert _common_prefix([2], [1]) == 0
    assert _common_prefix(list(range(100)) + [7], list(range(100)) + [8]) == 100


def test_idle_requests_cost_no_pass(model: Any) -> None:
    p = DraftModelProposer(model)
    assert p.propose("a", PROMPT, 0).tokens == []
    p.observe("a", PROMPT + [4])
    assert p.passes == 0
    d = p.propose("a", PROMPT, 3)
    assert len(d.tokens) == 3 and 0.0 < d.confidence <= 1.0
    assert p.passes == 3  # the prompt in one pass (which gives the first draft), then two


def test_resumed_drafts_equal_drafts_made_every_step(model: Any) -> None:
    """Draft, stay idle for 5 steps, draft again: after the catch-up pass the drafts are those
    of the same request drafted every step, token for token, and of a fresh proposer that sees
    the whole sequence at once."""
    every, gappy = DraftModelProposer(model), DraftModelProposer(model)
    seq = list(PROMPT)
    compared = 0
    for step in range(32):
        k = 3
        d_every = every.propose("r", seq, k)
        idle = 2 <= step % 8 < 7  # drafts at steps 0, 1, 7, 8, 9, ...; idle 5 steps between
        d_gappy = gappy.propose("r", seq, 0 if idle else k)
        if not idle:
            assert d_gappy.tokens == d_every.tokens, step
            fresh = DraftModelProposer(model).propose("r", seq, k)
            assert fresh.tokens == d_every.tokens, step
            compared += 1
        # The "target" accepts 0, 1 or 2 of the drafts, then emits a token of its own that
        # differs from the next draft: the cache must roll back the rejected ones.
        accepted = step % 3
        own = (d_every.tokens[accepted] + 1) % 200 + 4
        seq = seq + d_every.tokens[:accepted] + [own]
    assert compared >= 10
    assert gappy.passes < every.passes  # idle steps ran nothing
    assert gappy.catchup_tokens > every.catchup_tokens  # and resuming fed what was missed


def test_requests_are_independent_and_freed(model: Any) -> None:
    p = DraftModelProposer(model, max_requests=2)
    a = p.propose("a", PROMPT, 2).tokens
    p.propose("b", PROMPT[:5], 2)
    assert p.propose("a", PROMPT, 2).tokens == a
    p.propose("c", PROMPT[:7], 2)  # over max_requests: the least recently used (b) goes
    assert set(p._requests) == {"a", "c"}
    p.remove_request("a")
    assert set(p._requests) == {"c"}


def test_batched_drafts_equal_the_readable_version(model: Any) -> None:
    """propose_batch over requests of different lengths, K, idle gaps and rejections gives
    each request what propose gives it alone, step after step (its cache cut back out of the
    batch's stays exact), with one pass per draft position for the batch."""
    import random

    rng = random.Random(0)
    batched, single = DraftModelProposer(model), DraftModelProposer(model)
    seqs = {f"r{i}": [rng.randrange(4, 200) for _ in range(n)]
            for i, n in enumerate((1, 2, 9, 23, 40))}
    compared = 0
    for step in range(10):
        asks = [(r, list(s), 0 if (step + i) % 4 == 3 else 1 + (step + i) % 4)
                for i, (r, s) in enumerate(seqs.items())]
        # a request whose cache misses more than the one new token catches up first, alone
        catchups = sum(1 for r, s, k in asks if k and len(s) - min(
            _common_prefix(batched._requests[r].seq if r in batched._requests else [], s),
            len(s) - 1) > 1)
        passes = batched.passes
        got = batched.propose_batch(asks)
        want = [single.propose(r, s, k) for r, s, k in asks]
        assert [d.tokens for d in got] == [d.tokens for d in want], step
        for g, w in zip(got, want, strict=True):
            assert g.confidence == pytest.approx(w.confidence, rel=1e-4)
        # then the draft passes run once for the batch
        assert batched.passes - passes == max(k for _, _, k in asks) + catchups
        compared += sum(1 for _, _, k in asks if k)
        for (r, _, k), d in zip(asks, want, strict=True):
            accepted = rng.randrange(0, k + 1) if k else 0
            seqs[r] += d.tokens[:accepted] + [rng.randrange(4, 200)]
    assert compared > 30
    assert batched.draft_tokens == single.draft_tokens
    assert batched.passes < single.passes
