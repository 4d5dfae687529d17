"""Shared pytest fixtures."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

# The test-only hooks (tests/support/adaptspec_testhooks: fault injection, a broken sampler):
# importable here, and a vLLM plugin in every process a test starts, through PYTHONPATH.
SUPPORT = str(Path(__file__).resolve().parent / "support")
PYTHONPATH_WITHOUT_HOOKS = os.environ.get("PYTHONPATH", "")
if SUPPORT not in sys.path:
    sys.path.insert(0, SUPPORT)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [SUPPORT, PYTHONPATH_WITHOUT_HOOKS]))
import adaptspec_testhooks  # noqa: E402

adaptspec_testhooks.install_faults()


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, Any]:
    """The tiny Llama target/draft pair (float32), built once and cached.

    Built by :func:`adaptspec.tools.models.build_tiny` with its default parameters into
    ``$ADAPTSPEC_MODELS_DIR/tiny`` (default ``~/.cache/adaptspec/models/tiny``): ~20 s the first
    time on 2 cores, instant afterwards. Returns the manifest plus ``dir``, ``target`` and
    ``draft`` (folder paths as strings; pass them to vLLM or transformers as ``model=``).
    """
    for mod in ("torch", "transformers", "tokenizers", "safetensors"):
        pytest.importorskip(mod, reason="needs the models extra: pip install 'adaptspec[models]'")
    from adaptspec.tools.models import build_tiny

    return build_tiny(progress=lambda msg: print(msg, flush=True))
