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

``propose`` is the readable version: one request at a time, batch 1. ``propose_batch`` is the
production path for a step's requests: each request's catch-up runs on its own cache (a
prefill, which costs what its tokens cost batched or not), then the k draft passes run once
for the whole batch over the request caches left-padded to one length, and each request's
cache is cut back out. tests/test_draft_model.py checks it against ``propose``. ``passes``
(forward passes), ``draft_tokens`` (tokens drafted) and ``catchup_tokens`` count the work.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from adaptspec.proposers.base import Draft, TokenIds, as_token_list


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
        self.draft_tokens = 0
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
        feed = _sync(st, as_token_list(token_ids))
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
        self.draft_tokens += len(out)
        return Draft(out, _confidence(log_p, len(out)))

    def propose_batch(self, requests: Sequence[tuple[str, TokenIds, int]]) -> list[Draft]:
        """Drafts for several requests (req_id, token_ids, k): what ``propose`` gives each,
        with one forward pass per draft position for all of them (see the module docstring)."""
        torch = self._torch
        out = [Draft() for _ in requests]
        rows = [(i, self._state(r), as_token_list(t), k)
                for i, (r, t, k) in enumerate(requests) if k > 0]
        if not rows:
            return out
        lasts = []
        with torch.inference_mode():
            for _, st, toks, _ in rows:
                feed = _sync(st, toks)
                if len(feed) > 1:  # catch-up: all but the last token, which drafts with the rest
                    self.model(input_ids=torch.tensor([feed[:-1]]), past_key_values=st.cache,
                               use_cache=True)
                    self.passes += 1
                    self.catchup_tokens += len(feed) - 1
                    st.seq.extend(feed[:-1])
                lasts.append(feed[-1])
            lengths = [len(st.seq) for _, st, _, _ in rows]
            ks = [k for _, _, _, k in rows]
            width = max(lengths)
            cache = _left_padded([st.cache for _, st, _, _ in rows], lengths, width)
            mask = torch.tensor([[0] * (width - n) + [1] * (n + 1) for n in lengths])
            pos = torch.tensor(lengths)[:, None]
            ids = torch.tensor(lasts)[:, None]
            drafted: list[list[int]] = [[] for _ in rows]
            log_p = [0.0] * len(rows)
            for j in range(max(ks)):
                logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                                    past_key_values=cache, use_cache=True).logits[:, -1]
                self.passes += 1
                probs = torch.softmax(logits.float(), dim=-1)
                tok = torch.argmax(probs, dim=-1)
                chosen = torch.log(probs.gather(1, tok[:, None]).clamp_min(1e-12))[:, 0]
                for r, (t, lp) in enumerate(zip(tok.tolist(), chosen.tolist(), strict=True)):
                    if j < ks[r]:
                        drafted[r].append(t)
                        log_p[r] += lp
                ids, pos = tok[:, None], pos + 1
                mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=mask.dtype)], dim=1)
        # Each request keeps its tokens and its drafts but the last (never fed), as `propose`.
        for r, (i, st, _, k) in enumerate(rows):
            st.cache = _row_cache(cache, r, width - lengths[r], width + k)
            st.seq.extend([lasts[r], *drafted[r][:-1]])
            out[i] = Draft(drafted[r], _confidence(log_p[r], k))
            self.draft_tokens += k
        return out

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


def _sync(st: _DraftState, toks: list[int]) -> list[int]:
    """Cut a request's cache back to what it shares with its tokens now; returns the tokens to
    feed (at least the last one: its logits give the first draft)."""
    common = _common_prefix(st.seq, toks)
    if common == len(toks):
        common -= 1
    if common < len(st.seq):
        st.cache.crop(common - len(st.seq))
        del st.seq[common:]
    return toks[common:]


def _confidence(log_p: float, n: int) -> float:
    """The geometric mean of the draft's own probabilities of its n tokens."""
    return min(1.0, max(0.0, math.exp(log_p / n)))


def _left_padded(caches: list[Any], lengths: list[int], width: int) -> Any:
    """One DynamicCache for the batch: each request's keys and values, zeros on the left up to
    `width` positions (masked by the attention mask)."""
    import torch
    from transformers import DynamicCache

    if width == 0:
        return DynamicCache()
    longest = caches[lengths.index(width)]  # (it has every layer; an empty cache has none)
    layers = []
    for li, ref in enumerate(longest.layers):
        kv = []
        for part in ("keys", "values"):
            heads, dim = getattr(ref, part).shape[1], getattr(ref, part).shape[3]
            rows = []
            for c, n in zip(caches, lengths, strict=True):
                pad = ref.keys.new_zeros((1, heads, width - n, dim))
                rows.append(torch.cat([pad, getattr(c.layers[li], part)], dim=2) if n else pad)
            kv.append(torch.cat(rows, dim=0))
        layers.append(tuple(kv))
    return DynamicCache(ddp_cache_data=layers)


def _row_cache(cache: Any, row: int, start: int, stop: int) -> Any:
    """Request `row`'s own cache, positions start..stop of the batch's."""
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=[
        (layer.keys[row:row + 1, :, start:stop].contiguous(),
         layer.values[row:row + 1, :, start:stop].contiguous()) for layer in cache.layers])


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
