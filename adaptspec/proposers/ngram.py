"""Prompt-lookup (n-gram) drafting: continue the request the way it continued last time.

The rule is vLLM's ngram proposer (``vllm/v1/spec_decode/ngram_proposer.py``,
``_find_longest_matched_ngram_and_propose_tokens``): take the longest suffix n-gram of the
sequence (``n`` from ``max_n`` down to ``min_n``) that occurred earlier, pick its earliest
occurrence and draft the tokens that followed it (the earliest has the longest continuation,
often in the prompt; the most recent one, a few tokens back, often has one or two). Within
``max_indexed_tokens`` the drafts are vLLM's (tests/test_proposers.py checks them against
vLLM's function). What differs is the bookkeeping, because this runs in Python once per request
per engine step: instead of scanning the sequence, each request keeps one dict per ``n`` from
n-gram to the position after its earliest occurrence in the window (and the chain of its later
occurrences, which take over when the window drops it), updated only for tokens the proposer has
not seen, so a call costs O(new tokens + k), not O(sequence length).
"""

from __future__ import annotations

from collections import OrderedDict

from adaptspec.proposers.base import Draft, TokenIds, as_token_list
from adaptspec.proposers.record import DraftRecord, lookup_prior


class _NgramState:
    """One request's copy of its tokens, its n-gram tables and its drafting record.

    Positions are absolute (index in the request's full sequence). ``toks`` holds the tokens from
    position ``off``; the indexed window starts at ``win`` (n-grams starting before it have been
    dropped from the tables); ends ``< nxt`` have been indexed.
    """

    __slots__ = ("toks", "off", "win", "nxt", "tables", "later", "last", "draft", "draft_pos",
                 "record")

    def __init__(self, tokens: list[int], n_tables: int) -> None:
        self.toks = tokens
        self.off = 0
        self.win = 0
        self.nxt = 0
        # tables[i] maps the hash of an n-gram (n = min_n + i) to the end of its earliest
        # occurrence in the window, i.e. the position of the token that followed it. Hashes,
        # not tuples, as keys: a third of the memory; a lookup checks the tokens, so a
        # collision only costs a miss. later[i] chains each indexed end to the next occurrence
        # of its n-gram, last[i] maps a hash to its latest end (where the chain grows).
        self.tables: list[dict[int, int]] = [{} for _ in range(n_tables)]
        self.later: list[dict[int, int]] = [{} for _ in range(n_tables)]
        self.last: list[dict[int, int]] = [{} for _ in range(n_tables)]
        self.draft: list[int] = []  # last draft, checked against the tokens that came next
        self.draft_pos = 0  # position its first token was meant for
        self.record = DraftRecord()  # how its drafts turned out

    @property
    def seen(self) -> int:
        return self.off + len(self.toks)


class NgramProposer:
    """Prompt-lookup drafts from the request's own tokens (per-request state, bounded memory).

    ``confidence`` is the request's drafting record (adaptspec/proposers/record.py): a prior
    that grows with the match length ``n`` (longer matches repeat more reliably), updated by how
    many of this proposer's earlier drafts for the request actually appeared in the sequence.
    That check is free: the next call sees the tokens the engine really produced.
    """

    # min_n 2 by default, as the n-gram range the benchmarks give vLLM's (2 to 4): a one-token
    # match drafts after every common token, and on chat its drafts were seldom accepted and
    # lost to vLLM's proposer (issue 34); from 2 up the drafts are vLLM's.
    def __init__(
        self,
        min_n: int = 2,
        max_n: int = 4,
        max_indexed_tokens: int = 4096,
        max_requests: int = 1024,
    ) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if max_indexed_tokens < max_n + 1 or max_requests < 1:
            raise ValueError("max_indexed_tokens must exceed max_n and max_requests be >= 1")
        self.min_n = min_n
        self.max_n = max_n
        self.max_indexed_tokens = max_indexed_tokens
        self.max_requests = max_requests
        self._ns = tuple(range(min_n, max_n + 1))
        # Dropped prefix of a request's token copy tolerated before it is cut (amortises copying).
        self._slack = max(256, max_indexed_tokens // 4)
        self._requests: OrderedDict[str, _NgramState] = OrderedDict()

    # -- Proposer protocol -------------------------------------------------------------------

    def add_request(self, req_id: str, prompt_token_ids: TokenIds) -> None:
        """Start a request from its prompt; indexing waits for the first ``k > 0`` propose."""
        self._store(req_id, _NgramState(as_token_list(prompt_token_ids), len(self._ns)))

    def remove_request(self, req_id: str) -> None:
        """Free the request's state (unknown ids are ignored)."""
        self._requests.pop(req_id, None)

    def propose(self, req_id: str, token_ids: TokenIds, k: int) -> Draft:
        """Draft up to ``k`` tokens after ``token_ids``; ``k <= 0`` returns before any work."""
        if k <= 0:
            return Draft()
        st = self._sync(req_id, token_ids)
        length = st.seen
        self._check_last_draft(st, length)
        self._index(st, length)
        toks, off, tables = st.toks, st.off, st.tables
        for i in range(len(self._ns) - 1, -1, -1):
            n = self._ns[i]
            if length - n < st.win:
                continue
            suffix = toks[length - n - off :]
            end = tables[i].get(hash(tuple(suffix)))
            if end is None or toks[end - n - off : end - off] != suffix:
                continue
            tokens = toks[end - off : end - off + k]
            st.draft, st.draft_pos = tokens, length
            return Draft(tokens, st.record.confidence(lookup_prior(n)))
        st.draft = []
        return Draft()

    def observe(self, req_id: str, token_ids: TokenIds) -> None:
        """Append ``token_ids``' unseen tokens to the request's copy; no indexing, no draft."""
        self._sync(req_id, token_ids)

    # -- internals ---------------------------------------------------------------------------

    def _store(self, req_id: str, st: _NgramState) -> _NgramState:
        reqs = self._requests
        reqs[req_id] = st
        reqs.move_to_end(req_id)
        while len(reqs) > self.max_requests:
            reqs.popitem(last=False)
        return st

    def _sync(self, req_id: str, token_ids: TokenIds) -> _NgramState:
        """The request's state with ``token_ids``' unseen tokens appended (new if it changed)."""
        length = len(token_ids)
        st = self._requests.get(req_id)
        if st is not None:
            seen = st.seen
            if length < seen or (seen and token_ids[seen - 1] != st.toks[-1]):
                st = None  # shrank or rewritten: not the sequence we indexed
            else:
                self._requests.move_to_end(req_id)
                if length > seen:
                    st.toks.extend(as_token_list(token_ids, seen))
                return st
        return self._store(req_id, _NgramState(as_token_list(token_ids), len(self._ns)))

    def _check_last_draft(self, st: _NgramState, length: int) -> None:
        """Score the previous draft against the tokens that actually followed it."""
        draft, pos = st.draft, st.draft_pos
        if not draft or length <= pos:
            return
        st.draft = []
        if pos < st.off:
            return  # its tokens were already dropped; no evidence either way
        st.record.score(draft, st.toks[pos - st.off : pos - st.off + len(draft)])

    def _index(self, st: _NgramState, length: int) -> None:
        """Index n-grams ending before ``length``; keep only the last ``max_indexed_tokens``."""
        win = length - self.max_indexed_tokens
        if win > st.win:
            if win >= st.nxt:
                # Everything indexed so far falls out of the window: start the tables afresh.
                for table in (*st.tables, *st.later, *st.last):
                    table.clear()
                st.nxt = win
            else:
                self._evict(st, win)
            st.win = win
            if win - st.off > self._slack:
                del st.toks[: win - st.off]
                st.off = win
        start = st.nxt
        if start >= length:
            return
        toks, off, base = st.toks, st.off, st.win
        for n, table, later, last in zip(self._ns, st.tables, st.later, st.last, strict=True):
            for end in range(max(start, base + n), length):
                j = end - off
                key = hash(tuple(toks[j - n : j]))
                prev = last.get(key)
                if prev is None:
                    table[key] = end  # the first in the window: the earliest
                else:
                    later[prev] = end
                last[key] = end
        st.nxt = length

    def _evict(self, st: _NgramState, win: int) -> None:
        """Drop the occurrences whose n-gram starts before ``win``: the next one of the same
        n-gram becomes its earliest."""
        toks, off, old = st.toks, st.off, st.win
        for n, table, later, last in zip(self._ns, st.tables, st.later, st.last, strict=True):
            for end in range(old + n, min(win + n, st.nxt)):
                j = end - off
                key = hash(tuple(toks[j - n : j]))
                nxt = later.pop(end, None)
                if table.get(key) == end:
                    if nxt is None:
                        del table[key]
                        last.pop(key, None)
                    else:
                        table[key] = nxt
