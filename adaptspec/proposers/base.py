"""The proposers' shared types: a draft, the proposer protocol, token sequences (the contract
every proposer keeps is in adaptspec.proposers's docstring)."""

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
    """What a draft proposer offers the engine wrapper (see adaptspec.proposers)."""

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
