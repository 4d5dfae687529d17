"""Engine-agnostic draft proposers: model-free drafts from a request's own tokens and history.

A vLLM ``custom_class`` proposer wraps these: once per engine step it calls ``propose`` for each
running request with the request's token ids so far and the K the controller chose for it. They
import neither vllm nor torch, so the controller and its tests run without an engine.

Contract shared by every proposer (``Proposer``):

* ``propose(req_id, token_ids, k)`` drafts at most ``k`` tokens to follow ``token_ids``. With
  ``k == 0`` it returns an empty draft before touching any state, because the point of adaptive K
  is that a request the controller switched off costs nothing; the tokens it skipped are indexed
  by the next call with ``k > 0``.
* ``token_ids`` is the request's full sequence (prompt + output) and only grows between calls.
  A proposer keeps its own copy and reads only the tokens it has not seen, so a caller may pass a
  row of a reused buffer; a sequence that shrank or changed its last seen token is treated as a
  new request.
* ``observe(req_id, token_ids)`` keeps the proposer's copy of a request it is not drafting for
  (a hybrid server drafts each request with one proposer at a time): cheap, no indexing, so a
  later ``propose`` has the tokens, and the suffix proposer's cross-request corpus gets every
  request's output, whoever drafted it.
* ``add_request`` / ``remove_request`` bracket a request's life. A proposer also accepts a
  ``propose`` for a request it was never told about (it then takes the first tokens it sees as
  the prompt), so the hooks are for freeing memory and for telling prompt from output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

# What callers may pass as a token sequence: a Python sequence of ints or a 1-D integer array.
TokenIds = Sequence[int] | np.ndarray


@dataclass
class Draft:
    """Draft tokens for one request, and how much the proposer trusts them.

    ``confidence`` in [0, 1] estimates the per-token acceptance rate of this draft from the
    proposer's own evidence (match length, how often the continuation was seen), comparable to
    the controller's per-position acceptance alpha. The chance that the whole draft is accepted
    is roughly ``confidence ** len(tokens)``. An empty draft has confidence 0.
    """

    tokens: list[int] = field(default_factory=list)
    confidence: float = 0.0

    def __len__(self) -> int:
        return len(self.tokens)


@runtime_checkable
class Proposer(Protocol):
    """What a draft proposer offers the engine wrapper (see the module docstring)."""

    def add_request(self, req_id: str, prompt_token_ids: TokenIds) -> None: ...

    def remove_request(self, req_id: str) -> None: ...

    def propose(self, req_id: str, token_ids: TokenIds, k: int) -> Draft: ...

    def observe(self, req_id: str, token_ids: TokenIds) -> None: ...


def as_token_list(token_ids: TokenIds, start: int = 0, stop: int | None = None) -> list[int]:
    """``token_ids[start:stop]`` as a list of Python ints (fast path for numpy arrays)."""
    part = token_ids[start:stop]
    if isinstance(part, np.ndarray):
        return part.tolist()
    return [int(t) for t in part]


# Imported last because the proposer modules import Draft and as_token_list from this package.
from adaptspec.proposers.ngram import NgramProposer  # noqa: E402
from adaptspec.proposers.suffix import SuffixProposer  # noqa: E402

__all__ = ["Draft", "NgramProposer", "Proposer", "SuffixProposer", "TokenIds", "as_token_list"]
