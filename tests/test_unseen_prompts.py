"""The unseen chat prompt set: its shape (counts, kinds, lengths), its diversity, that it holds
no code, and that it ships as package data of `adaptspec.tools.bench.prompts`."""

from __future__ import annotations

import importlib.resources
import json
import re
from collections import Counter
from typing import Any

import pytest

from adaptspec.tools.bench.prompts import UNSEEN_CHAT, load_unseen_chat

KINDS = ("writing", "explain", "math", "analysis")
WORDS = {"short": (40, 150), "long": (450, 650), "interactive": (5, 20)}


def _texts(data: dict[str, Any]) -> dict[str, list[str]]:
    return {
        "short": [e["prompt"] for e in data["short"]],
        "long": [e["prompt"] for e in data["long"]],
        "interactive": list(data["interactive"]),
    }


@pytest.fixture(scope="module")
def data() -> dict[str, Any]:
    return load_unseen_chat()


def test_the_counts_and_the_source(data: dict[str, Any]) -> None:
    assert (len(data["short"]), len(data["long"]), len(data["interactive"])) == (32, 16, 12)
    assert data["source"] == (
        "written for adaptspec (CC0-1.0); no prompt was used to tune anything"
    )


def test_the_short_kinds_alternate_eight_of_each(data: dict[str, Any]) -> None:
    kinds = [e["kind"] for e in data["short"]]
    assert Counter(kinds) == {k: 8 for k in KINDS}
    assert kinds == list(KINDS) * 8
    assert all(set(e) == {"kind", "prompt"} for e in data["short"] + data["long"])
    assert {e["kind"] for e in data["long"]} <= set(KINDS)
    assert all(isinstance(p, str) for p in data["interactive"])


@pytest.mark.parametrize("name", sorted(WORDS))
def test_every_prompt_is_within_its_word_range(data: dict[str, Any], name: str) -> None:
    lo, hi = WORDS[name]
    counts = [len(p.split()) for p in _texts(data)[name]]
    assert all(lo <= n <= hi for n in counts), (name, counts)


def test_no_two_prompts_share_their_first_eight_words(data: dict[str, Any]) -> None:
    heads = [" ".join(p.lower().split()[:8]) for texts in _texts(data).values() for p in texts]
    repeated = [h for h, n in Counter(heads).items() if n > 1]
    assert not repeated


def test_no_prompt_holds_code(data: dict[str, Any]) -> None:
    for texts in _texts(data).values():
        for p in texts:
            assert "```" not in p, p[:60]
            assert not re.search(r"\bdef ", p), p[:60]


def test_the_set_is_package_data() -> None:
    # The editable install maps `adaptspec` to its source folder, so importlib.resources
    # finds the subpackage there; the pyproject check below is what a wheel relies on.
    found = importlib.resources.files("adaptspec.tools.bench.prompts") / "unseen_chat.json"
    assert found.is_file()
    assert json.loads(found.read_text(encoding="utf-8")) == json.loads(
        UNSEEN_CHAT.read_text(encoding="utf-8")
    )
    tomllib = pytest.importorskip("tomllib")
    pyproject = UNSEEN_CHAT.parents[4] / "pyproject.toml"
    if not pyproject.is_file():
        pytest.skip("not a source checkout")
    setuptools = tomllib.loads(pyproject.read_text(encoding="utf-8"))["tool"]["setuptools"]
    assert "adaptspec.tools.bench.prompts" in setuptools["packages"]
    assert setuptools["package-data"]["adaptspec.tools.bench.prompts"] == ["*.json"]
