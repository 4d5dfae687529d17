"""A request's drafting record (adaptspec/proposers/record.py): the scheduler's record of vLLM's
n-gram drafts is the record our n-gram keeps of its own."""

from __future__ import annotations

import random

import pytest

from adaptspec.proposers import NgramProposer
from adaptspec.proposers.record import DraftRecord, DraftRecords, lookup_prior


def test_a_draft_counts_every_token_that_came_out_verified_or_not() -> None:
    """A draft of six whose six tokens all followed is six hits, however few a step verified;
    one cut short by a wrong token is a miss, and one checked after a single token says only
    whether its first was right."""
    r = DraftRecord()
    r.score([5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 9, 10])
    assert (r.hits, r.misses) == (6.0, 0.0)
    r.score([1, 2, 3], [1, 9, 3])
    assert r.hits == pytest.approx(6 * 0.9 + 1) and r.misses == 1.0
    r = DraftRecord()
    r.score([1, 2, 3], [1])  # one token out yet: right so far, no miss
    assert (r.hits, r.misses) == (1.0, 0.0)


def test_the_schedulers_record_equals_the_proposers_own() -> None:
    """Fed the drafts our n-gram proposed and the sequence as it grew, `DraftRecords` gives
    each draft the confidence the proposer gave it (one match length, so one prior)."""
    rng = random.Random(3)
    base = [rng.randrange(8) for _ in range(12)]
    seq = base * 3 + [rng.randrange(8) for _ in range(30)] + base * 3 + [1, 2] * 8
    prop = NgramProposer(min_n=4, max_n=4)
    records = DraftRecords(lookup_prior(4))
    compared = 0
    i = 8
    while i < len(seq):
        d = prop.propose("r", seq[:i], 5)
        if d.tokens:
            assert records.confidence("r", seq[:i], d.tokens) == pytest.approx(d.confidence)
            compared += 1
        # as an engine step does: the draft's accepted prefix and one more token come out
        right = 0
        while right < len(d.tokens) and i + right < len(seq) and seq[i + right] == d.tokens[right]:
            right += 1
        i += right + 1
    assert compared > 10


def test_a_request_whose_drafts_come_true_is_trusted_more() -> None:
    records = DraftRecords(lookup_prior(4))
    good, bad = list(range(100)), list(range(100))
    c_good = c_bad = records.prior
    for n in range(10, 60, 3):
        c_good = records.confidence("good", good[:n], good[n : n + 3])
        c_bad = records.confidence("bad", bad[:n], [999, 998, 997])
    # (the decay bounds the record at ten drafts: a request that always misses sits at 0.16)
    assert c_good > 0.9 > records.prior > 2 * c_bad


def test_a_rewritten_sequence_starts_a_new_record_and_the_count_is_capped() -> None:
    records = DraftRecords(0.5, max_requests=3)
    seq = list(range(40))
    for n in range(5, 30, 2):
        records.confidence("r", seq[:n], [999])
    assert records.confidence("r", seq[:30], [1]) < 0.2
    # shorter than where its last draft began: not the sequence the record was of
    assert records.confidence("r", seq[:10], [1]) == 0.5
    for i in range(5):
        records.confidence(f"x{i}", seq[:5], [1])
    assert len(records) == 3
    records.remove("x4")
    records.remove("never-seen")
    assert len(records) == 2
    with pytest.raises(ValueError):
        DraftRecords(1.5)
