"""Draft-model drafting with a KV cache per request that runs only when asked: idle costs nothing.

vLLM's own draft-model path runs the draft's first pass over the whole batch every step, even for
requests at K = 0 (that keeps the draft's KV cache in step with the target's). Here the draft
model is owned by the proposer, with its own cache per request, and a step runs draft passes
only for the requests the controller chose it for:

* ``propose(req_id, token_ids, k)`` with ``k == 0`` (or ``observe``) does nothing at all;
* with ``k > 0`` it keeps the longest common prefix of what the request's cache holds and the
  request's tokens now (drafts the target rejected, and tokens generated while the draft was
  idle, differ), crops the cache there (``DynamicCache.crop``), runs **one catch-up pass over
  every token the cache is missing**, then drafts k tokens greedily, one pass each.

Skipping passes without the catch-up would leave the draft predicting from a stale context and
silently destroy acceptance afterwards (vLLM #53426; TRT-LLM hit the same). The catch-up is what
makes the resumed request's drafts exactly those of a request drafted every step
(tests/test_draft_model.py checks it token for token).

Drafts are greedy token ids without their probabilities, like the n-gram proposers': vLLM's
rejection sampler then treats them as deterministic drafts (q one-hot), which keeps sampling
lossless. ``confidence`` is the geometric mean of the draft's own probabilities of its tokens.

This is the readable version: one request at a time, batch 1. Requests are not batched
together yet (a padded batch with per-request cache lengths is the fast path to add, against
a measured budget). ``passes`` and ``catchup_tokens`` count the work done, for metrics.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from adaptspec.proposers import Draft, TokenIds, as_token_list


class _DraftState:
    __slots__ = ("cache", "seq")

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.seq: list[int] = []  # the tokens whose keys and values the cache holds


class DraftModelProposer:
    """Greedy drafts from a small causal LM that shares the target's tokenizer.

    `model`: a Hugging Face causal LM (``AutoModelForCausalLM``), or a folder to load one from
    (float32 on the CPU by default). Attributes: model, max_requests, passes (forward passes
    run), catchup_tokens (tokens fed beyond the one new token of a request drafted every step).
    """

    def __init__(self, model: Any, dtype: str = "float32", max_requests: int = 256) -> None:
        import torch

        if isinstance(model, str):
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))
        self.model = model.eval()
        self.max_requests = max_requests
        self.passes = 0
        self.catchup_tokens = 0
        self._torch = torch
        self._requests: OrderedDict[str, _DraftState] = OrderedDict()

    # -- Proposer protocol -------------------------------------------------------------------

    def add_request(self, req_id: str, prompt_token_ids: TokenIds) -> None:
        """Nothing to do until the first draft: the prompt is fed then, as part of catch-up."""

    def remove_request(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def observe(self, req_id: str, token_ids: TokenIds) -> None:
        """Idle: no pass. The tokens are fed by the next ``propose`` with k > 0."""

    def propose(self, req_id: str, token_ids: TokenIds, k: int) -> Draft:
        if k <= 0:
            return Draft()
        torch = self._torch
        st = self._state(req_id)
        toks = as_token_list(token_ids)
        common = _common_prefix(st.seq, toks)
        if common == len(toks):
            common -= 1  # the last token is fed again: its logits give the first draft
        if common < len(st.seq):
            st.cache.crop(common - len(st.seq))
            del st.seq[common:]
        feed = toks[common:]
        # One new token per step is the steady state; more is catch-up after idle steps, a
        # rejected draft's replacement or the prompt.
        self.catchup_tokens += max(len(feed) - 1, 0)
        out: list[int] = []
        log_p = 0.0
        with torch.inference_mode():
            for _ in range(k):
                logits = self.model(input_ids=torch.tensor([feed]), past_key_values=st.cache,
                                    use_cache=True).logits[0, -1]
                self.passes += 1
                st.seq.extend(feed)
                probs = torch.softmax(logits.float(), dim=-1)
                tok = int(torch.argmax(probs))
                out.append(tok)
                log_p += float(torch.log(probs[tok].clamp_min(1e-12)))
                feed = [tok]
        conf = min(1.0, max(0.0, float(torch.exp(torch.tensor(log_p / len(out))))))
        return Draft(out, conf)

    # -- internals ---------------------------------------------------------------------------

    def _state(self, req_id: str) -> _DraftState:
        reqs = self._requests
        st = reqs.get(req_id)
        if st is None:
            from transformers import DynamicCache

            st = reqs[req_id] = _DraftState(DynamicCache())
            while len(reqs) > self.max_requests:
                reqs.popitem(last=False)
        reqs.move_to_end(req_id)
        return st


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case: one list extends the other
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
