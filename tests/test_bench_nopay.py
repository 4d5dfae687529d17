"""`adaptspec bench nopay` bookkeeping without servers: the streams, the verdict against the
faster plain configuration of each repeat, and the greedy gate."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from adaptspec.tools.bench import nopay
from adaptspec.tools.bench.servers import FULL


def _run(tok_per_s: float, lc_gap: float, tokens: list[int] | None = None) -> dict:
    req = {"id": "np-0", "tokens": tokens or [1, 2, 3]}
    return {"tok_per_s": tok_per_s, "lc_median_gap_ms": lc_gap, "requests": [req],
            "lc_requests": [{"id": "lc-0", "tokens": [9]}], "vllm_draft_tokens": 0.0,
            "vllm_accepted_tokens": 0.0, "errors": []}


def test_verdict_is_against_the_faster_plain_configuration_of_each_repeat() -> None:
    repeats = [
        {"none": _run(10.0, 200.0), "none_sync": _run(10.5, 190.0),
         "adaptspec": _run(10.4, 195.0)},
        {"none": _run(11.0, 180.0), "none_sync": _run(10.0, 200.0),
         "adaptspec": _run(10.0, 200.0)},
        {"none": _run(10.0, 200.0), "none_sync": _run(10.0, 200.0),
         "adaptspec": _run(10.0, 200.0)},
    ]
    v = nopay.judge(repeats)
    a = v["adaptspec"]
    assert a["over_plain"]["per_repeat"] == pytest.approx([10.4 / 10.5, 10.0 / 11.0, 1.0])
    assert a["over_plain"]["median"] == pytest.approx(10.4 / 10.5)
    assert a["over_plain"]["spread"] == pytest.approx(1.0 - 10.0 / 11.0)
    assert a["lc_gap_over_plain"]["per_repeat"] == pytest.approx([195 / 190, 200 / 180, 1.0])
    assert v["goal_met"] is True  # medians: throughput 0.990, LC gap 1.026
    repeats[0]["adaptspec"] = _run(10.0, 195.0)
    assert nopay.judge(repeats)["goal_met"] is False  # throughput median 0.952
    repeats[0]["adaptspec"] = _run(10.5, 230.0)
    repeats[2]["adaptspec"] = _run(10.0, 220.0)
    assert nopay.judge(repeats)["goal_met"] is False  # LC gap median 1.1
    assert "goal" in nopay.format_table(repeats, nopay.judge(repeats))


def test_greedy_gate_compares_every_repeat_with_the_first_plain_run() -> None:
    repeats = [{"none": _run(1, 1), "adaptspec": _run(1, 1)},
               {"none": _run(1, 1), "adaptspec": _run(1, 1, tokens=[1, 2, 4])}]
    assert nopay.check_greedy(repeats) == ["repeat 1 adaptspec np-0"]


def test_streams_alternate_writing_and_math_and_are_greedy() -> None:
    sources = {"code": ["def f(): pass"], "math": [f"q{i}" for i in range(5)],
               "mtbench": {"writing": ["w1", "w2"], "roleplay": ["r1"], "stem": ["s1"],
                           "humanities": ["h1"]},
               "story": "x " * 2000}
    main, lc = nopay.make_streams(sources, 6, 3, 64, 16)
    assert [r.cls for r in main] == ["writing", "math"] * 3
    assert [r.prompt for r in main if r.cls == "writing"] == ["w1", "w2", "r1"]
    assert all(r.temperature == 0.0 and r.max_tokens == 64 for r in main)
    assert [r.cls for r in lc] == ["interactive"] * 3 and lc[0].max_tokens == 16
    assert nopay.median_gap_ms([{"chunk_times": [0.1, 0.3, 0.4], "chunk_tokens": [1, 1, 2]}]) \
        == pytest.approx(50.0)  # 200 ms for one token, then 50 ms for each of two


def test_guard_configuration_turns_only_the_guard_on(tmp_path: Path) -> None:
    cfg = next(c for c in nopay.CONFIGS if c.name == "adaptspec_guard")
    path = nopay.policy_for(cfg, nopay.DEFAULT_POLICY, tmp_path)
    data, shipped = yaml.safe_load(path.read_text()), yaml.safe_load(
        nopay.DEFAULT_POLICY.read_text())
    pay = data.pop("payoff")
    assert pay.pop("enabled") is True
    shipped_pay = shipped.pop("payoff", {})
    shipped_pay.pop("enabled", None)
    assert pay == shipped_pay
    assert data == shipped
    plain = next(c for c in nopay.CONFIGS if c.name == "adaptspec")
    assert nopay.policy_for(plain, nopay.DEFAULT_POLICY, tmp_path) == nopay.DEFAULT_POLICY


def test_servers_run_in_groups_of_three_each_with_a_plain_reference() -> None:
    groups = nopay.server_groups(list(nopay.CONFIGS))
    assert [[c.name for c in g] for g in groups] == [
        ["none", "none_sync", "adaptspec"], ["none_sync", "vllm_ngram_k4", "adaptspec_guard"]]
    assert nopay.MAX_SERVERS == 3


def test_a_later_groups_configuration_is_judged_against_its_own_reference() -> None:
    ref = {"tok_per_s": 8.0, "lc_median_gap_ms": 250.0, "slice_wall_s": [4.0, 4.0]}
    rep = {"none": _run(10.0, 200.0), "none_sync": _run(10.0, 200.0),
           "vllm_ngram_k4": {**_run(8.8, 240.0), "reference": ref, "slice_wall_s": [4.0, 5.0]}}
    rep["none_sync"]["slice_wall_s"] = [3.0, 3.0]
    v = nopay.judge([rep])
    assert v["vllm_ngram_k4"]["over_plain"]["median"] == pytest.approx(1.1)
    assert v["vllm_ngram_k4"]["lc_gap_over_plain"]["median"] == pytest.approx(240 / 250)
    assert v["vllm_ngram_k4"]["slices_over_none_sync"]["median"] == pytest.approx((1 + 0.8) / 2)


def test_counters_moved_between_two_readings_flat_and_per_class() -> None:
    before = {"vllm:x_total": 2.0, "code": {"drafted": 4.0}}
    after = {"vllm:x_total": 7.0, "code": {"drafted": 10.0, "accepted": 3.0},
             "math": {"drafted": 1.0}}
    assert nopay._delta(after, before) == {"vllm:x_total": 5.0,
                                           "code": {"drafted": 6.0, "accepted": 3.0},
                                           "math": {"drafted": 1.0}}


def test_a_slice_account_is_what_the_slice_moved() -> None:
    cell = {"spec_before": {"engine_s_prefill": 1.0, "engine_steps_prefill": 2.0,
                            "vllm:spec_decode_num_draft_tokens_total": 10.0},
            "spec_after": {"engine_s_prefill": 4.5, "engine_steps_prefill": 5.0,
                           "vllm:spec_decode_num_draft_tokens_total": 30.0,
                           "vllm:spec_decode_num_accepted_tokens_total": 12.0}}
    assert nopay._slice_account(cell) == {"s_prefill": 3.5, "steps_prefill": 3.0,
                                          "drafts": 20.0, "accepted": 12.0}


def test_the_engine_net_is_its_servers_saved_less_lost_over_wall_time() -> None:
    def run(net_ms: float) -> dict:
        return {**_run(10.0, 200.0), "wall_s": 100.0, "engine_net_saved_ms": net_ms}

    repeats = [{"none": _run(10.0, 200.0), "none_sync": _run(10.0, 200.0),
                "adaptspec": run(n)} for n in (-2000.0, 500.0, 1000.0)]
    v = nopay.judge(repeats)
    assert v["adaptspec"]["engine_net_over_wall"]["per_repeat"] == \
        pytest.approx([-0.02, 0.005, 0.01])
    assert v["adaptspec"]["engine_net_over_wall"]["median"] == pytest.approx(0.005)
    assert "engine_net_over_wall" not in v["none"]
    table = nopay.format_table(repeats, v)
    assert "+0.50%" in table and "engine net" in table


def test_a_configuration_can_keep_every_class_plain(tmp_path: Path) -> None:
    """`adaptspec bench`'s zero-cost check: the idle hybrid's policy is the run's, with every
    class latency-critical (K = 0 from every proposer), and it is a valid policy."""
    from adaptspec.policy import load_policy
    from adaptspec.tools.bench.servers import BENCH_POLICY, make_configs, policy_for

    cfg = next(c for c in make_configs("DRAFT", FULL) if c.name == "adaptspec_hybrid_idle")
    assert cfg.env == {"ADAPTSPEC_DRAFT_MODEL": "DRAFT"}
    path = policy_for(cfg, BENCH_POLICY, tmp_path)
    idle, shipped = load_policy(path), load_policy(BENCH_POLICY)
    assert set(idle.classes) == set(shipped.classes)
    assert all(c.latency_critical for c in idle.classes.values())
    assert idle.k_max == shipped.k_max and idle.cost_model == shipped.cost_model
