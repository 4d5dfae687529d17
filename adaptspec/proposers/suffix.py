"""Suffix-decoding style drafts: continue the longest matching context, across requests.

SuffixDecoding (and ArcticInference's implementation) keeps a suffix tree over recent finished
outputs plus one per live request over its prompt and output, matches the longest suffix of the
current sequence and follows the most frequent continuation. A pointer-based suffix tree costs
hundreds of bytes per token per depth level in Python, so this module answers the same queries
from a flat token list with LZ77-style hash chains instead (``_ChainIndex``):

* for a few context orders ``n`` (``min_match`` doubling, e.g. 1, 2, 4, 8) a dict maps the hash
  of an n-gram to the position after its latest occurrence, and an array links each position to
  the previous occurrence of the same n-gram: one dict entry and one machine word per token per
  order, and eviction is exact;
* a query walks the chain of the highest order whose suffix n-gram occurred, measures each
  candidate's true match length by comparing tokens backwards (up to ``max_match``), keeps the
  candidates with the longest match and votes token by token for the most frequent continuation,
  dropping candidates that disagree. That is the greedy most-frequent path of the suffix tree node
  of the longest match, restricted to its ``chain_limit`` most recent occurrences.

The global corpus holds the outputs of finished requests (``remove_request`` moves them there;
that is how one request's output drafts another's), oldest whole outputs evicted first once it
holds more than ``max_global_tokens``.
"""

from __future__ import annotations

import math
from array import array
from collections import OrderedDict, deque

from adaptspec.proposers.base import Draft, TokenIds, as_token_list

# Separates sequences in the global token list: never a real token id, so no context spans two
# sequences and no continuation runs from one into the next.
_SEP = -1


class _ChainIndex:
    """Hash-chain index of n-gram contexts over one append-only token list.

    Positions are absolute. ``toks`` holds tokens from position ``off``; positions before ``base``
    are evicted; ends (positions of the token after a context) ``< nxt`` are indexed, and
    ``prevs[i][end - off]`` is the previous end with the same order-``orders[i]`` context hash.
    """

    __slots__ = ("orders", "toks", "off", "base", "nxt", "heads", "prevs")

    def __init__(self, orders: tuple[int, ...], tokens: list[int] | None = None) -> None:
        self.orders = orders
        self.toks: list[int] = tokens if tokens is not None else []
        self.off = 0
        self.base = 0
        self.nxt = 0
        self.heads: list[dict[int, int]] = [{} for _ in orders]
        self.prevs: list[array[int]] = [array("q") for _ in orders]

    @property
    def end(self) -> int:
        """One past the last token held (the length of the sequence so far)."""
        return self.off + len(self.toks)

    def index_pending(self) -> None:
        """Index every end that has a following token and has not been indexed yet."""
        toks, off, start, stop = self.toks, self.off, self.nxt, self.end
        if start >= stop:
            return
        for n, head, prev in zip(self.orders, self.heads, self.prevs, strict=True):
            first = self.base + n
            for end in range(start, stop):
                j = end - off
                if end < first or toks[j] < 0:
                    prev.append(-1)
                    continue
                h = hash(tuple(toks[j - n : j]))
                prev.append(head.get(h, -1))
                head[h] = end
        self.nxt = stop

    def evict_to(self, new_base: int) -> None:
        """Forget positions before ``new_base``: drop their heads, cut the lists when worthwhile."""
        old = self.base
        if new_base <= old:
            return
        toks, off, nxt = self.toks, self.off, self.nxt
        for n, head in zip(self.orders, self.heads, strict=True):
            for end in range(old + n, min(new_base + n, nxt)):
                j = end - off
                h = hash(tuple(toks[j - n : j]))
                if head.get(h) == end:  # no later occurrence: the whole chain is gone
                    del head[h]
        self.base = new_base
        if nxt < new_base:  # skipped without indexing (a long jump): keep prevs aligned
            pad = array("q", [-1]) * (new_base - nxt)
            for prev in self.prevs:
                prev.extend(pad)
            self.nxt = new_base
        cut = new_base - off
        if cut > 1024 and cut > len(toks) - cut:
            del toks[:cut]
            for prev in self.prevs:
                del prev[:cut]
            self.off = new_base

    def candidates(
        self, tail: list[int], keys: list[int | None], limit: int, out: list[tuple[int, list, int]]
    ) -> int:
        """Append the occurrences of ``tail``'s longest matching suffix to ``out``.

        ``keys[i]`` is the hash of ``tail``'s last ``orders[i]`` tokens (None if too short). Walks
        up to ``limit`` occurrences from the highest order that has one, most recent first, and
        appends ``(match_length, toks, index_of_next_token)`` for each that matches at least as
        long as the best so far (the caller keeps the overall longest); returns the best length
        (0 if none). Every occurrence in the order-``n`` chain is taken to match ``n`` tokens (the
        64-bit hashes of distinct n-grams practically never collide), a candidate shorter than the
        best so far is rejected with one slice comparison, and only new records pay for the
        token-by-token extension.
        """
        toks, off = self.toks, self.off
        lt = len(tail)
        for i in range(len(self.orders) - 1, -1, -1):
            h = keys[i]
            if h is None:
                continue
            n = self.orders[i]
            end = self.heads[i].get(h, -1)
            first = self.base + n
            lowest = self.base - off  # list index of the oldest live token
            prev = self.prevs[i]
            best = 0
            for _ in range(limit):
                if end < first:
                    break
                j = end - off
                end = prev[j]
                top = j - lowest  # how far back this occurrence can match
                if top > lt:
                    top = lt
                if best > n:  # only a candidate at least as long as the best matters
                    if best > top or toks[j - best : j - n] != tail[lt - best : lt - n]:
                        continue
                    m = best
                else:
                    m = n  # the chain holds this n-gram (its 64-bit hash, taken on trust)
                if m < top and toks[j - 1 - m] == tail[lt - 1 - m]:
                    if toks[j - top : j] == tail[lt - top :]:
                        m = top
                    else:
                        m += 1
                        while toks[j - 1 - m] == tail[lt - 1 - m]:
                            m += 1
                if m > best:
                    best = m
                out.append((m, toks, j))
            if best:
                return best
        return 0


class _SuffixRequest:
    """A live request: its own index (prompt + output) and where its output starts."""

    __slots__ = ("index", "prompt_len")

    def __init__(self, index: _ChainIndex) -> None:
        self.index = index
        self.prompt_len = index.end


class SuffixProposer:
    """Drafts from the longest context match in the request itself and in recent finished outputs.

    ``confidence`` is the geometric mean over the draft of a smoothed per-token vote share,
    ``(count(token) + 2 * prior) / (count(all) + 2)``: the share of matching occurrences that
    continued with the drafted token, pulled towards a prior ``m / (m + 3)`` that grows with the
    match length ``m``, so one long match is trusted more than one short one, and many
    occurrences that agree more than either.
    """

    PRIOR_WEIGHT = 2.0

    def __init__(
        self,
        max_match: int = 16,
        min_match: int = 1,
        chain_limit: int = 16,
        max_global_tokens: int = 1 << 16,
        max_request_tokens: int = 8192,
        max_requests: int = 1024,
    ) -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        if chain_limit < 1 or max_requests < 1:
            raise ValueError("chain_limit and max_requests must be >= 1")
        if max_request_tokens <= max_match or max_global_tokens <= max_match:
            raise ValueError("token caps must exceed max_match")
        self.max_match = max_match
        self.chain_limit = chain_limit
        self.max_global_tokens = max_global_tokens
        self.max_request_tokens = max_request_tokens
        self.max_requests = max_requests
        orders = [min_match]
        while orders[-1] * 2 <= max_match // 2:
            orders.append(orders[-1] * 2)
        self.orders = tuple(orders)
        self._global = _ChainIndex(self.orders)
        self._spans: deque[tuple[int, int]] = deque()  # (start, stop) of each global sequence
        self._global_tokens = 0
        self._requests: OrderedDict[str, _SuffixRequest] = OrderedDict()

    # -- Proposer protocol -------------------------------------------------------------------

    def add_request(self, req_id: str, prompt_token_ids: TokenIds) -> None:
        """Start a request from its prompt; indexing waits for the first ``k > 0`` propose."""
        self._store(req_id, as_token_list(prompt_token_ids))

    def remove_request(self, req_id: str) -> None:
        """Move the request's output into the global corpus and free its state."""
        req = self._requests.pop(req_id, None)
        if req is None:
            return
        idx = req.index
        start = max(req.prompt_len, idx.off)
        if idx.end > start:
            self._add_global(idx.toks[start - idx.off :])

    def propose(self, req_id: str, token_ids: TokenIds, k: int) -> Draft:
        """Draft up to ``k`` tokens after ``token_ids``; ``k <= 0`` returns before any work."""
        if k <= 0:
            return Draft()
        idx = self._sync(req_id, token_ids)
        length = idx.end
        idx.evict_to(length - self.max_request_tokens)
        idx.index_pending()
        toks = idx.toks
        tail = toks[max(0, len(toks) - self.max_match) :]
        lt = len(tail)
        keys = [hash(tuple(tail[lt - n :])) if n <= lt else None for n in self.orders]
        cands: list[tuple[int, list, int]] = []
        best = idx.candidates(tail, keys, self.chain_limit, cands)
        if self._global_tokens:
            best = max(best, self._global.candidates(tail, keys, self.chain_limit, cands))
        if not best:
            return Draft()
        return self._vote([(t, j) for m, t, j in cands if m == best], best, k)

    def observe(self, req_id: str, token_ids: TokenIds) -> None:
        """Append ``token_ids``' unseen tokens to the request's copy; no indexing, no draft."""
        self._sync(req_id, token_ids)

    # -- internals ---------------------------------------------------------------------------

    def _vote(self, cands: list[tuple[list[int], int]], match: int, k: int) -> Draft:
        """Follow the most frequent continuation of ``cands`` (ties: the most recent)."""
        conts = []
        for toks, j in cands:
            cont = toks[j : j + k]
            if _SEP in cont:
                cont = cont[: cont.index(_SEP)]
            if cont:
                conts.append(cont)
        if not conts:
            return Draft()
        w = self.PRIOR_WEIGHT
        wp = w * match / (match + 3.0)
        lone = math.log((1.0 + wp) / (1.0 + w))  # one occurrence left: its share is 1 of 1
        tokens: list[int] = []
        log_conf = 0.0
        step = 0
        while conts:
            if len(conts) == 1:
                rest = conts[0][step:]
                tokens.extend(rest)
                log_conf += lone * len(rest)
                break
            column = [cont[step] for cont in conts]
            tok = max(dict.fromkeys(column), key=column.count)  # first maximum: most recent
            count = column.count(tok)
            log_conf += math.log((count + wp) / (len(column) + w))
            tokens.append(tok)
            step += 1
            conts = [cont for cont in conts if cont[step - 1] == tok and len(cont) > step]
        return Draft(tokens, min(1.0, math.exp(log_conf / len(tokens))))

    def _store(self, req_id: str, tokens: list[int]) -> _ChainIndex:
        idx = _ChainIndex(self.orders, tokens)
        reqs = self._requests
        reqs[req_id] = _SuffixRequest(idx)
        reqs.move_to_end(req_id)
        while len(reqs) > self.max_requests:
            reqs.popitem(last=False)  # dropped under pressure, not finished: not kept globally
        return idx

    def _sync(self, req_id: str, token_ids: TokenIds) -> _ChainIndex:
        """The request's index with ``token_ids``' unseen tokens appended (new if it changed)."""
        length = len(token_ids)
        req = self._requests.get(req_id)
        if req is not None:
            idx = req.index
            seen = idx.end
            if length >= seen and not (seen and token_ids[seen - 1] != idx.toks[-1]):
                self._requests.move_to_end(req_id)
                if length > seen:
                    idx.toks.extend(as_token_list(token_ids, seen))
                return idx
        return self._store(req_id, as_token_list(token_ids))

    def _add_global(self, tokens: list[int]) -> None:
        """Append one finished output to the global corpus, evicting the oldest ones over cap."""
        cap = self.max_global_tokens
        if len(tokens) > cap:
            tokens = tokens[-cap:]
        g = self._global
        start = g.end
        g.toks.extend(tokens)
        g.toks.append(_SEP)
        g.index_pending()
        self._spans.append((start, g.end))
        self._global_tokens += len(tokens)
        while self._global_tokens > cap:
            s, e = self._spans.popleft()
            self._global_tokens -= e - s - 1
            g.evict_to(e)
