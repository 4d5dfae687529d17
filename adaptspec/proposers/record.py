"""A request's drafting record: how much of each draft as proposed the request then produced.

A lookup draft's worth is mostly the request's own: text that repeats (code, a list, a quoted
passage) keeps matching, and free prose rarely does. Each draft is scored against the tokens
that actually followed it, whether or not the step verified them all: a draft cut to two tokens
whose next six also came out says the request's drafts run longer than the verified record
shows, and a draft not verified at all still says how it would have done. The record is decayed
per draft (RECORD_DECAY), so it follows a request whose text changes, and its confidence is a
Beta-style posterior mean of the per-token acceptance rate, pulled toward the proposer's prior
for the match (PRIOR_WEIGHT draft tokens' worth).

`NgramProposer` keeps one per request. `DraftRecords` keeps them for a proposer that gives no
confidence of its own (vLLM's n-gram): the scheduler sees each draft as proposed, before any
cut, and the request's tokens after it, which is all a record needs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

#: Per-draft decay of the record, so it follows a request's changing text.
RECORD_DECAY = 0.9
#: Weight of the proposer's prior, in draft tokens' worth of evidence.
PRIOR_WEIGHT = 4.0


def lookup_prior(match: int) -> float:
    """A lookup draft's per-token acceptance before any record: longer matches repeat more
    reliably (2 tokens 0.4, 4 tokens 0.57)."""
    return match / (match + 3.0)


class DraftRecord:
    """Decayed counts of a request's draft tokens that came out right (`hits`) and of drafts
    that a wrong token cut short (`misses`)."""

    __slots__ = ("hits", "misses")

    def __init__(self) -> None:
        self.hits = 0.0
        self.misses = 0.0

    def score(self, draft: Sequence[int], actual: Sequence[int]) -> None:
        """Score a draft against the tokens that followed it (as many as there are yet: a
        draft checked after one token says only whether its first was right)."""
        right = 0
        for got, want in zip(actual, draft, strict=False):
            if got != want:
                break
            right += 1
        self.hits = self.hits * RECORD_DECAY + right
        self.misses = self.misses * RECORD_DECAY + (1 if right < min(len(actual), len(draft))
                                                     else 0)

    def confidence(self, prior: float) -> float:
        """Posterior mean of the per-token acceptance rate, in [0, 1]."""
        w = PRIOR_WEIGHT
        conf = (self.hits + w * prior) / (self.hits + self.misses + w)
        return min(1.0, max(0.0, conf))


class DraftRecords:
    """Per request, its record and its last draft (tokens and the position of the first), for
    drafts that come without a confidence; at most `max_requests` requests (least recently
    drafted dropped first: a dropped request starts a new record)."""

    def __init__(self, prior: float, max_requests: int = 4096) -> None:
        if not 0.0 <= prior <= 1.0 or max_requests < 1:
            raise ValueError("need 0 <= prior <= 1 and max_requests >= 1")
        self.prior = prior
        self.max_requests = max_requests
        self._requests: OrderedDict[str, tuple[DraftRecord, list[int], int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._requests)

    def confidence(self, req_id: str, tokens: Sequence[int], draft: Sequence[int]) -> float:
        """The request's last draft scored against `tokens` (its whole sequence so far), this
        `draft` (to follow `tokens`) kept to be scored next time; returns the confidence in
        it. A sequence shorter than where the last draft began is a request rewritten
        (preempted and recomputed keeps its tokens; this does not): a new record."""
        reqs = self._requests
        entry = reqs.get(req_id)
        n = len(tokens)
        if entry is None or n < entry[2]:
            record = DraftRecord()
        else:
            record, last, pos = entry
            if last and n > pos:
                record.score(last, tokens[pos : pos + len(last)])
            reqs.move_to_end(req_id)
        reqs[req_id] = (record, list(draft), n)
        while len(reqs) > self.max_requests:
            reqs.popitem(last=False)
        return record.confidence(self.prior)

    def remove(self, req_id: str) -> None:
        """Forget a request (unknown ids are ignored)."""
        self._requests.pop(req_id, None)
