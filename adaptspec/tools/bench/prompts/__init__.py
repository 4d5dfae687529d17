"""Prompt sets the repository holds for benchmark cells.

`unseen_chat.json` is the "unseen chat" cell: chat prompts written for adaptspec (CC0-1.0) that
no policy, threshold or fit was ever tuned on, so a result on them measures how the controller
generalises rather than how well it was fitted. The set is kept diverse (no two prompts share a
topic or a template) and low in repetition (no prompt invites copying long spans of itself into
the answer), so prompt-lookup drafting finds few free matches in it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

UNSEEN_CHAT: Path = Path(__file__).with_name("unseen_chat.json")


def load_unseen_chat() -> dict[str, Any]:
    """The unseen chat set: "source" (its provenance), "short" and "long" ({"kind",
    "prompt"} dicts), "interactive" (strings)."""
    return json.loads(UNSEEN_CHAT.read_text(encoding="utf-8"))
