"""Prompts from the standard library's source, what the tiny pair was trained on (tests only)."""

from __future__ import annotations

import sysconfig
from pathlib import Path


def code_prompts(tokenizer_json: str | Path, n: int, length: int = 48, skip: int = 0,
                 recursive: bool = False) -> list[list[int]]:
    """Prompts of `length` token ids from stdlib source (what the tiny pair was trained on):
    the top-level modules, or with `recursive` every module below (for more than ~200)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    src = Path(sysconfig.get_paths()["stdlib"])
    out: list[list[int]] = []
    files = (sorted(f for f in src.rglob("*.py") if "site-packages" not in f.parts)
             if recursive else sorted(src.glob("*.py")))
    for p in files[skip:]:
        ids = tok.encode(p.read_text(errors="ignore")[:4000]).ids
        if len(ids) >= 150 + length:
            out.append(ids[150:150 + length])
        if len(out) == n:
            break
    return out
