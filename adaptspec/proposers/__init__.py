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

from adaptspec.proposers.base import Draft, Proposer, TokenIds, as_token_list
from adaptspec.proposers.ngram import NgramProposer
from adaptspec.proposers.suffix import SuffixProposer

__all__ = ["Draft", "NgramProposer", "Proposer", "SuffixProposer", "TokenIds", "as_token_list"]
