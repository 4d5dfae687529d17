"""TEST-ONLY hooks. Inert unless their environment variable is set; never set them in production.

``ADAPTSPEC_TEST_BROKEN_SAMPLER=accept_all|lenient`` deliberately breaks vLLM's rejection
sampler in the process that samples (the worker), so the lossless-sampling test in
tests/reliability can show that it would catch a wrong acceptance rule:

* ``accept_all``: every draft token is accepted (the uniform draw is forced to 0, so
  ``p/q >= u`` always holds): the output follows the drafter, not the target.
* ``lenient``: accept with ``min(1, 2 p/q)`` instead of ``min(1, p/q)`` (the uniform draw is
  halved): a subtler bias towards the drafter.

It patches ``vllm.v1.sample.rejection_sampler.generate_uniform_probs``, which
``rejection_sample`` looks up at call time; greedy requests never use it, so greedy outputs are
unaffected. ``adaptspec_vllm.register()`` (loaded by vLLM in every process) calls
:func:`maybe_break_sampler`.
"""

from __future__ import annotations

import os
import sys

BROKEN_SAMPLER_ENV = "ADAPTSPEC_TEST_BROKEN_SAMPLER"
_SCALES = {"accept_all": 0.0, "lenient": 0.5}


def maybe_break_sampler() -> str | None:
    """Install the broken acceptance rule named by the env var; returns its name, or None."""
    mode = os.environ.get(BROKEN_SAMPLER_ENV, "").strip()
    if not mode:
        return None
    if mode not in _SCALES:
        raise ValueError(f"{BROKEN_SAMPLER_ENV}={mode!r}: expected one of {sorted(_SCALES)}")
    from vllm.logger import init_logger
    from vllm.v1.sample import rejection_sampler as rs

    if getattr(rs.generate_uniform_probs, "_adaptspec_broken", None) == mode:
        return mode
    original = getattr(rs.generate_uniform_probs, "_adaptspec_original", rs.generate_uniform_probs)
    scale = _SCALES[mode]

    def generate_uniform_probs(*args, **kwargs):  # type: ignore[no-untyped-def]
        return original(*args, **kwargs) * scale

    generate_uniform_probs._adaptspec_broken = mode  # type: ignore[attr-defined]
    generate_uniform_probs._adaptspec_original = original  # type: ignore[attr-defined]
    rs.generate_uniform_probs = generate_uniform_probs
    init_logger("vllm.adaptspec").warning(
        "adaptspec: TEST HOOK %s=%s: vLLM's rejection sampler is deliberately BROKEN in this "
        "process (outputs are not the target model's distribution)", BROKEN_SAMPLER_ENV, mode)
    return mode


def restore_sampler() -> None:
    """Undo :func:`maybe_break_sampler` (engines may run one after another in one process)."""
    if "vllm.v1.sample.rejection_sampler" not in sys.modules:
        return
    from vllm.v1.sample import rejection_sampler as rs

    original = getattr(rs.generate_uniform_probs, "_adaptspec_original", None)
    if original is not None:
        rs.generate_uniform_probs = original
