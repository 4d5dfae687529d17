"""Prompt sets the repository holds for benchmark cells.

`unseen_chat.json` is the "unseen chat" cell: chat prompts written for adaptspec (CC0-1.0) that
no policy, threshold or fit was ever tuned on, so a result on them measures how the controller
generalises rather than how well it was fitted. The set is kept diverse (no two prompts share a
topic or a template) and low in repetition (no prompt invites copying long spans of itself into
the answer), so prompt-lookup drafting finds few free matches in it.

`trace.json` is `adaptspec bench trace`'s: code (completions, and edits that rewrite a given
function), roleplay, math, writing and short interactive questions, taken from the full
benchmark's pinned sources (named in its "source").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

UNSEEN_CHAT: Path = Path(__file__).with_name("unseen_chat.json")
TRACE: Path = Path(__file__).with_name("trace.json")


def load_unseen_chat() -> dict[str, Any]:
    """The unseen chat set: "source" (its provenance), "short" and "long" ({"kind",
    "prompt"} dicts), "interactive" (strings)."""
    return json.loads(UNSEEN_CHAT.read_text(encoding="utf-8"))


def load_trace() -> dict[str, Any]:
    """The trace set: "source", per kind ("code", "roleplay", "math", "writing") a list of
    {"kind", "prompt"} dicts, and "interactive" (strings)."""
    return json.loads(TRACE.read_text(encoding="utf-8"))
