"""`adaptspec bench trace`: the trace, and what its report computes (no server)."""

from __future__ import annotations

from typing import Any

import pytest

from adaptspec.tools.bench.prompts import load_trace
from adaptspec.tools.bench.trace import (
    PHASES,
    Phase,
    check_greedy,
    format_table,
    judge,
    lc_stream,
    make_trace,
    summarize,
    timeline,
)


def test_the_trace_shifts_load_and_mix_and_repeats_no_prompt() -> None:
    data = load_trace()
    assert "HumanEval" in data["source"] and "MT-Bench" in data["source"]
    trace = make_trace(data, PHASES, 32)
    assert [p.concurrency for p in PHASES] == [1, 4, 16, 4, 1]
    kinds = [{r.cls for r in reqs} for reqs in trace]
    assert kinds == [{"code"}, {"code"}, {"roleplay", "math"}, {"math", "roleplay"}, {"writing"}]
    ids = [r.id for reqs in trace for r in reqs]
    assert len(ids) == len(set(ids)) == sum(p.requests for p in PHASES)
    for kind in ("code", "math", "writing"):  # enough prompts that none repeats
        prompts = [r.prompt for reqs in trace for r in reqs if r.cls == kind]
        assert len(prompts) == len(set(prompts)), kind
    assert all(r.temperature == 0.0 and r.max_tokens == 32 for reqs in trace for r in reqs)
    lc = lc_stream(data, 30, 16)
    assert {r.cls for r in lc} == {"interactive"} and len({r.id for r in lc}) == 30


def _req(rid: str, cls: str, start: float, times: list[float], tokens: list[int] | None = None,
         chunks: list[int] | None = None) -> dict[str, Any]:
    chunks = chunks or [1] * len(times)
    return {"id": rid, "cls": cls, "start": start, "chunk_times": times, "chunk_tokens": chunks,
            "tokens": tokens if tokens is not None else list(range(sum(chunks))),
            "error": None}


def _run(phase_walls: list[float], lc_gap: float, drafted: float = 0.0,
         samples: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A configuration's trace: 2 phases of 10 tokens each in the given walls, and LC requests
    whose chunks come lc_gap s apart."""
    phases, t = [], 0.0
    for j, w in enumerate(phase_walls):
        phases.append({"name": f"p{j}", "concurrency": 1, "start_s": t, "wall_s": w,
                       "tokens": 10,
                       "requests": [_req(f"t{j}-0", "code", t, [0.1 * (i + 1) for i in range(10)])],
                       "errors": [], "spec": {"vllm:spec_decode_num_draft_tokens_total": drafted,
                                              "vllm:spec_decode_num_accepted_tokens_total":
                                              drafted / 2}})
        t += w
    lc = [_req(f"lc-{i}", "interactive", 8.0 * i, [0.5 + lc_gap * k for k in range(5)])
          for i in range(3)]
    return {"phases": phases, "lc_requests": lc, "samples": samples or [], "classes": {},
            "classes_before": {}}


def test_summary_of_one_trace() -> None:
    s = summarize(_run([10.0, 5.0], 0.2, drafted=6))
    assert s["tok_per_s"] == pytest.approx(20 / 15)
    assert s["phase_tok_per_s"] == pytest.approx([1.0, 2.0])
    assert s["lc_gap_p50_ms"] == pytest.approx(200.0) and s["lc_requests"] == 3
    assert s["ttft_ms"]["code"]["p50"] == pytest.approx(100.0)
    assert s["ttft_ms"]["interactive"]["p50"] == pytest.approx(500.0)
    assert (s["drafted"], s["accepted"]) == (12, 6)
    assert s["lc_busy_share"] == pytest.approx(3 * 1.3 / 15)  # 3 LC requests of 1.3 s each


def test_verdict_is_paired_per_repeat_and_checks_the_goals() -> None:
    phases = (Phase("a", 1, ("code",), 1), Phase("b", 4, ("code",), 1))
    repeats = [
        {"none": _run([10, 10], 0.2), "vllm_ngram_k2": _run([8, 11], 0.3),
         "adaptspec_ours": _run([8, 9], 0.2)},
        {"none": _run([20, 20], 0.2), "vllm_ngram_k2": _run([16, 22], 0.3),
         "adaptspec_ours": _run([16, 18], 0.21)},
    ]
    v = judge(repeats, phases)
    # the same ratios in both repeats, though the second ran twice as slow
    assert v["adaptspec_ours"]["trace"]["per_repeat"] == pytest.approx([20 / 17, 20 / 17])
    assert v["adaptspec_ours"]["trace"]["spread"] == pytest.approx(0.0)
    assert v["vllm_ngram_k2"]["phase1"]["median"] == pytest.approx(10 / 11)
    g = v["goals"]
    # plain is a static configuration too; here the static K beat it
    assert (g["best_static"], g["best_adaptspec"]) == ("vllm_ngram_k2", "adaptspec_ours")
    assert g["over_best_static"] == pytest.approx((20 / 17) / (20 / 19))
    assert g["min_phase_over_plain"]["adaptspec_ours"] == pytest.approx(10 / 9)
    assert g["lc_p50_over_plain"]["adaptspec_ours"] == pytest.approx(1.025)
    table = format_table(v, repeats, phases)
    assert "adaptspec_ours" in table and "goal >= 1.10" in table


def test_greedy_gate_compares_by_request_id() -> None:
    plain, same = _run([1, 1], 0.2), _run([1, 1], 0.2)
    other = _run([1, 1], 0.2)
    other["phases"][1]["requests"][0]["tokens"] = [9, 9]
    other["lc_requests"].append(_req("lc-99", "interactive", 30, [0.1]))  # plain never sent it
    bad = check_greedy([{"none": plain, "a": same, "b": other}])
    assert bad == ["repeat 0 b t1-0"]


def test_timeline_bins_tokens_and_reads_k_and_the_draft_share() -> None:
    samples = [
        {"t": 2.0, "code": {"k_sum": 4.0, "k_count": 2.0, "speculate_ngram": 2.0}},
        {"t": 4.0, "code": {"k_sum": 10.0, "k_count": 4.0, "speculate_ngram": 3.0,
                            "speculate_draft": 1.0}},
        {"t": 6.0, "code": {"k_sum": 10.0, "k_count": 4.0, "speculate_ngram": 3.0,
                            "speculate_draft": 1.0}},  # nothing decided: no point
    ]
    tl = timeline(_run([10.0, 10.0], 0.2, samples=samples), bin_s=10.0)
    # phase 0's 10 tokens and two LC requests' 5 each (sent at 0 and 8 s) in the first 10 s;
    # phase 1's 10 and the third LC request's 5 (sent at 16 s) in the next
    assert tl["tok_per_s"] == pytest.approx([2.0, 1.5])
    assert tl["k_t"] == [2.0, 4.0]
    assert tl["mean_k"] == pytest.approx([2.0, 3.0])
    assert tl["draft_share"] == pytest.approx([0.0, 0.5])


# ---------------------------------------------------------------- bench queues (issue 33)

def test_queues_cell_compares_three_dp2_servers_on_one_stream() -> None:
    from adaptspec.tools.bench import queues

    names = [c.name for c in queues.CONFIGS]
    assert names == ["none", "adaptspec_shared", "adaptspec_separate"]
    assert all(c.args == ("--data-parallel-size", "2") for c in queues.CONFIGS)
    assert [c.policy.get("latency_critical_engines") for c in queues.CONFIGS] == [None, None, [0]]
    assert queues.CONFIGS[1].spec == queues.CONFIGS[2].spec  # only the split differs


def test_queues_verdict_pairs_each_repeat_with_plain() -> None:
    from adaptspec.tools.bench.queues import format_table, judge
    from adaptspec.tools.bench.trace import Phase

    # one phase of 10 tokens: plain 10 s; shared 12.5 s with LC gaps 0.2 s; separate 8 s, 0.21 s
    repeats = [{"none": _run([10.0], 0.2), "adaptspec_shared": _run([12.5], 0.2, drafted=4),
                "adaptspec_separate": _run([8.0], 0.21, drafted=8)},
               {"none": _run([20.0], 0.2), "adaptspec_shared": _run([25.0], 0.2),
                "adaptspec_separate": _run([16.0], 0.21)}]
    v = judge(repeats, Phase("p", 4, ("code",), 1))
    assert v["adaptspec_separate"]["others_tok_s"]["per_repeat"] == pytest.approx([1.25, 1.25])
    assert v["adaptspec_shared"]["others_tok_s"]["median"] == pytest.approx(0.8)
    assert v["adaptspec_separate"]["lc_gap_p50_ms"]["median"] == pytest.approx(1.05)
    table = format_table(v, repeats)
    assert "separate over shared, other classes: 1.562 (goal > 1)" in table
    assert "8/4" in table  # drafts/accepted of the first repeat


def test_repeats_rotate_the_order_and_errors_are_collected() -> None:
    from adaptspec.tools.bench.servers import Config
    from adaptspec.tools.bench.trace import request_errors, run_repeats

    configs = [Config(n, None) for n in ("a", "b", "c")]
    ran: list[tuple[str, int]] = []

    def one(cfg: Config, i: int) -> dict[str, Any]:
        ran.append((cfg.name, i))
        run = _run([1.0], 0.1)
        if (cfg.name, i) == ("b", 1):
            run["phases"][0]["errors"] = ["t0-0: boom"]
            run["lc_requests"][0]["error"] = "timeout"
        return run

    reps = run_repeats(configs, 2, one)
    assert ran == [("a", 0), ("b", 0), ("c", 0), ("b", 1), ("c", 1), ("a", 1)]
    assert [list(r) for r in reps] == [["a", "b", "c"]] * 2
    assert request_errors(reps) == ["t0-0: boom", "lc-0: timeout"]
