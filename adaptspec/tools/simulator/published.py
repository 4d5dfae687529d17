"""Published GPU measurements the simulator's ``gpu`` step-time preset is fitted to and checked
against. The numbers are copied here, with their sources, so that nothing reads a notes file at
run time.

1. vLLM PR #32374, "Add Dynamic SD" (https://github.com/vllm-project/vllm/pull/32374):
   Llama-3.1-8B target, EAGLE-LLaMA3.1-8B drafter, MT-Bench. Milliseconds per engine step,
   drafting included, with K drafts for every request of a batch of B (so S = B*K draft tokens
   and the longest draft is K). The GPU is not named; the author's other runs are on H100.
   The same PR gives the drafter's acceptance on MT-Bench by draft position.

2. arXiv 2601.11580, "Speculative Decoding: Performance or Illusion?" (MLSys 2026): the linear
   step-time predictor of its simulator for Llama-3.1-8B on one H100 (``Llama8BH100``), fitted
   with vLLM 0.10.1. A different setup (other vLLM version, a KV-cache term), used only as a
   loose second check.
"""

from __future__ import annotations

import numpy as np

# ---------------------------------------------------------------- vLLM PR #32374

PR32374_BATCHES: tuple[int, ...] = (1, 4, 16, 64, 256)
PR32374_KS: tuple[int, ...] = (0, 1, 3, 5)
# ms per engine step, rows PR32374_BATCHES, columns PR32374_KS
PR32374_STEP_MS: np.ndarray = np.array([
    [6.52, 7.37, 8.84, 10.33],
    [6.60, 7.47, 8.98, 10.40],
    [6.90, 7.85, 9.52, 11.20],
    [7.77, 9.66, 13.50, 16.83],
    [14.49, 27.14, 41.85, 57.40],
])
# P(draft positions 0..j all accepted), j = 0..4
PR32374_CUMULATIVE_ACCEPTANCE: tuple[float, ...] = (0.681, 0.391, 0.204, 0.101, 0.051)
# P(position j accepted | positions before it were), as the PR rounds it
PR32374_CONDITIONAL_ACCEPTANCE: tuple[float, ...] = (0.68, 0.58, 0.52, 0.50, 0.51)
# The best fixed K by batch that the two tables above imply (see `best_fixed_k`)
PR32374_BEST_K: dict[int, int] = {1: 3, 4: 3, 16: 3, 64: 1, 256: 0}


def expected_tokens(k: int, cumulative: tuple[float, ...] = PR32374_CUMULATIVE_ACCEPTANCE
                    ) -> float:
    """Tokens a request gains per step with K drafts: 1 + the cumulative acceptances to K."""
    return 1.0 + float(sum(cumulative[:k]))


def best_fixed_k(step_ms: dict[int, float], batch: int,
                 cumulative: tuple[float, ...] = PR32374_CUMULATIVE_ACCEPTANCE) -> int:
    """The K of `step_ms` (K -> ms a step at this batch) with the highest throughput,
    batch * expected_tokens(K) / step time."""
    return max(step_ms, key=lambda k: batch * expected_tokens(k, cumulative) / step_ms[k])


# ---------------------------------------------------------------- arXiv 2601.11580

# Llama8BH100 predictor, seconds: verify = a + b * (tokens in the batch) + c * (KV tokens),
# plus a fixed per-step cost; EAGLE drafting = a + b * (speculated tokens) + c * (KV tokens);
# n-gram drafting costs about 0.6% of the verify time.
ILLUSION_VERIFY_S = (5.886e-3, 2.101e-5, 3.926e-8)
ILLUSION_STEP_FIXED_S = 1.207e-3
ILLUSION_EAGLE_DRAFT_S = (2.135e-3, 8.41e-7, 2.38e-9)
ILLUSION_NGRAM_DRAFT_SHARE = 0.006


def illusion_step_ms(batch: int, k: int, context: float, drafter: str = "eagle") -> float:
    """2601.11580's predicted step time (ms) for `batch` requests of `context` tokens each (the
    KV tokens are batch * context), K drafts each, EAGLE or n-gram drafting (none at K = 0).
    The drafting term is taken once per step, as the paper's predictor states it."""
    kv = batch * context
    tokens = batch * (1 + k)
    a, b, c = ILLUSION_VERIFY_S
    verify = a + b * tokens + c * kv
    draft = 0.0
    if k > 0 and drafter == "eagle":
        da, db, dc = ILLUSION_EAGLE_DRAFT_S
        draft = da + db * batch * k + dc * kv
    elif k > 0:
        draft = ILLUSION_NGRAM_DRAFT_SHARE * verify
    return 1e3 * (verify + ILLUSION_STEP_FIXED_S + draft)
