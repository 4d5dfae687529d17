"""``--layers auto``: what a self-draft of N layers costs and which N pays best.

* :func:`decode_step_seconds` times batch-1 decoding with a KV cache (transformers, float32,
  this machine's CPU) for the target and for its first N layers, interleaved, medians.
* :func:`expected_speedup` is greedy speculative decoding's expected tokens per target pass
  ``(1 - a^(K+1)) / (1 - a)`` over the cost of a round, ``1 + K c``.
* :func:`choose_layers` is ``--layers auto``: the N with the largest expected speedup.

The builder (selfdraft.py) and the Qwen measurement (adaptspec.tools.bench.selfdraft_measure)
both use these; this module uses neither.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

COST_PROMPT = 32  # tokens fed before the timed decode steps
COST_STEPS = 12
COST_REPEATS = 3


def default_candidates(layers: int) -> list[int]:
    """A handful of N spread over 1..L-1 (1/8 to 3/4 of the target's depth)."""
    return sorted({max(1, min(layers - 1, round(layers * f)))
                   for f in (1 / 8, 1 / 4, 3 / 8, 1 / 2, 5 / 8, 3 / 4)})


def expected_speedup(a: float, c: float, k: int = 2) -> float:
    """Expected batch-1 speedup of greedy speculation with per-token agreement ``a``, ``k``
    draft tokens per round and a draft pass costing ``c`` target passes."""
    tokens = k + 1 if a >= 1 - 1e-9 else (1 - a ** (k + 1)) / (1 - a)
    return tokens / (1 + k * c)


@contextlib.contextmanager
def truncated(model: Any, layers: int | None) -> Iterator[Any]:
    """The model with only its first ``layers`` decoder layers (None: all), restored after."""
    import torch

    if layers is None:
        yield model
        return
    full, n = model.model.layers, model.config.num_hidden_layers
    model.model.layers = torch.nn.ModuleList(list(full)[:layers])
    model.config.num_hidden_layers = layers
    try:
        yield model
    finally:
        model.model.layers, model.config.num_hidden_layers = full, n


def _decode_steps(model: Any, prompt: Any, steps: int) -> list[float]:
    import torch
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache()
    out: list[float] = []
    with torch.no_grad():
        res = model(input_ids=prompt, past_key_values=cache, use_cache=True)
        nxt = res.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            t0 = time.perf_counter()
            res = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            nxt = res.logits[:, -1:].argmax(-1)
            out.append(time.perf_counter() - t0)
    return out


def decode_step_seconds(models: dict[str, tuple[Any, int | None]], prompt: Any,
                        steps: int = COST_STEPS, repeats: int = COST_REPEATS) -> dict[str, float]:
    """Median seconds per batch-1 decode step (KV cache) of each ``name: (model, layers)``:
    per repeat the median step, then the median over repeats; the models take turns within
    each repeat so that a busy machine slows them alike."""
    per: dict[str, list[float]] = {name: [] for name in models}
    for model, layers in models.values():  # warm-up
        with truncated(model, layers):
            _decode_steps(model, prompt, 2)
    for _ in range(repeats):
        for name, (model, layers) in models.items():
            with truncated(model, layers):
                per[name].append(statistics.median(_decode_steps(model, prompt, steps)))
    return {name: statistics.median(v) for name, v in per.items()}


def choose_layers(model: Any, per_n: dict[int, dict[str, Any]], k: int,
                  progress: Callable[[str], Any]) -> tuple[int, dict[str, Any]]:
    """Time each candidate N against the target and pick the best expected speedup; ``per_n``
    rows gain ``cost_ratio`` and ``expected_speedup`` (from the validation agreement)."""
    import torch

    prompt = torch.arange(COST_PROMPT).unsqueeze(0) % model.config.vocab_size + 3
    cands = {"target": (model, None), **{str(n): (model, n) for n in per_n}}
    secs = decode_step_seconds(cands, prompt)
    for n, row in per_n.items():
        row["cost_ratio"] = round(secs[str(n)] / secs["target"], 4)
        row["expected_speedup"] = round(expected_speedup(
            row["validation_agreement_with_adapter"], row["cost_ratio"], k), 4)
        progress(f"  N={n}: cost {row['cost_ratio']} of a target pass, expected speedup "
                 f"{row['expected_speedup']} at K={k}")
    best = max(per_n, key=lambda n: (per_n[n]["expected_speedup"], -n))
    return best, {"k": k, "target_step_ms": round(secs["target"] * 1e3, 2),
                  "timing": {"prompt_tokens": COST_PROMPT, "steps": COST_STEPS,
                             "repeats": COST_REPEATS, "threads": torch.get_num_threads(),
                             "load_average": [round(x, 2) for x in os.getloadavg()]},
                  "candidates": {str(n): row for n, row in sorted(per_n.items())},
                  "chosen": best}
