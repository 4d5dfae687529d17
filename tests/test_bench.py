"""`adaptspec bench` bookkeeping without servers: per-class latency and acceptance from chunk
timings, the greedy correctness gate, ratios, and the request stream."""

from __future__ import annotations

import math

import pytest

from adaptspec.tools.bench import report, servers, workload


def _cell(requests: list[dict], wall: float = 2.0) -> dict:
    zero = {k: 0.0 for k in ("vllm:spec_decode_num_drafts_total",
                             "vllm:spec_decode_num_draft_tokens_total",
                             "vllm:spec_decode_num_accepted_tokens_total")}
    return {"wall_s": wall, "errors": [], "requests": requests, "k_hist_before": {},
            "k_hist_after": {}, "spec_before": zero, "spec_after": zero,
            "class_before": {}, "class_after": {}}


def _req(rid: str, cls: str, tokens: list[int], times: list[float], per_chunk: list[int],
         temperature: float = 0.0) -> dict:
    return {"id": rid, "cls": cls, "temperature": temperature, "tokens": tokens,
            "chunk_times": times, "chunk_tokens": per_chunk}


def test_summary_shares_a_chunk_gap_among_its_tokens() -> None:
    # first token at 100 ms, then a step of 4 tokens after 40 ms and one of 1 after 10 ms
    cell = _cell([_req("a", "code", list(range(6)), [0.1, 0.14, 0.15], [1, 4, 1])], wall=1.0)
    s = report.summarize_cell(cell, static_k=4)
    row = s["classes"]["code"]
    assert s["tok_per_s"] == pytest.approx(6.0)
    assert row["ttft_mean_ms"] == pytest.approx(100.0)
    assert row["itl_mean_ms"] == pytest.approx((4 * 10.0 + 10.0) / 5)
    assert row["itl_median_ms"] == pytest.approx(10.0)
    assert row["acceptance_length"] == pytest.approx(2.5)
    assert row["k_distribution"] == {"4": 2.0}


def test_summary_records_what_calibration_fits() -> None:
    # two requests decoding side by side for 0.2 s of a 0.5 s cell; chunk gaps are step times
    cell = _cell([_req("a", "code", list(range(5)), [0.1, 0.2, 0.3], [1, 2, 2]),
                  _req("b", "chat", list(range(3)), [0.2, 0.25, 0.3], [1, 1, 1])], wall=0.5)
    spec = {"vllm:spec_decode_num_drafts_total": 4.0,
            "vllm:spec_decode_num_draft_tokens_total": 8.0,
            "vllm:spec_decode_num_accepted_tokens_total": 2.0}
    cell["spec_after"] = spec
    s = report.summarize_cell(cell, static_k=2)
    assert s["request_steps"] == 4
    assert s["decode_tokens"] == 6
    assert s["step_ms_mean"] == pytest.approx((100 + 100 + 50 + 50) / 4)
    assert s["mean_batch"] == pytest.approx((0.2 + 0.1) / 0.5)
    assert (s["vllm_drafts"], s["vllm_draft_tokens"], s["vllm_accepted_tokens"]) == (4, 8, 2)
    # the engine steps: a prefilled alone (to 0.1 s), b prefilled while a decoded (to 0.2 s),
    # then b decoded alone (0.25 s) and both together (0.3 s)
    st = s["engine_steps"]
    assert st["steps"] == 4
    assert st["other_s"] == pytest.approx(0.2)
    assert st["decode"].keys() == {"1", "2"}
    assert st["decode"]["1"] == pytest.approx([1, 50.0, 1])
    assert st["decode"]["2"] == pytest.approx([1, 50.0, 3])


def test_summary_separates_decode_time_from_unoverlapped_prefill() -> None:
    # both sent at 0; a decodes 1.0-2.0 s, b 1.5-3.0 s: 2.0 s of decoding, 1.0 s of prefill
    # before any decode; the decode gaps 0.5 s, 0.5 s and 1.5 s (b's gap spans a's prefill)
    a = {**_req("a", "code", list(range(3)), [1.0, 1.5, 2.0], [1, 1, 1]),
         "start": 0.0, "prompt_tokens": 30}
    b = {**_req("b", "chat", list(range(2)), [1.5, 3.0], [1, 1]), "start": 0.0,
         "prompt_tokens": 10}
    s = report.summarize_cell(_cell([a, b], wall=3.0), static_k=None)
    assert s["decode_busy_s"] == pytest.approx(2.0)
    assert s["decode_batch"] == pytest.approx((1.0 + 1.5) / 2.0)
    assert s["step_ms_median"] == pytest.approx(500.0)
    assert s["prompt_tokens"] == 40
    assert s["classes"]["code"]["prompt_tokens_mean"] == 30


def test_adaptive_k_distribution_comes_from_histogram_deltas() -> None:
    cell = _cell([_req("a", "code", [1, 2], [0.1, 0.2], [1, 1])])
    cell["k_hist_before"] = {"code": {"0.5": 1.0, "1.5": 1.0, "2.5": 2.0, "+Inf": 2.0}}
    cell["k_hist_after"] = {"code": {"0.5": 4.0, "1.5": 4.0, "2.5": 9.0, "+Inf": 9.0}}
    cell["class_before"] = {"code": {"k_sum": 2.0, "k_count": 2.0, "drafted": 2, "accepted": 1}}
    cell["class_after"] = {"code": {"k_sum": 12.0, "k_count": 9.0, "drafted": 12, "accepted": 9}}
    row = report.summarize_cell(cell, static_k=None)["classes"]["code"]
    assert row["k_distribution"] == {"0": 3.0, "2": 4.0}
    assert row["mean_k"] == pytest.approx(10 / 7)
    assert row["draft_acceptance"] == pytest.approx(0.8)


def test_proposer_shares_per_class_and_their_table() -> None:
    cell = _cell([_req("a", "code", [1, 2], [0.1, 0.2], [1, 1]),
                  _req("b", "math", [1, 2], [0.1, 0.2], [1, 1])])
    cell["k_hist_after"] = {"code": {"+Inf": 1.0}, "math": {"+Inf": 1.0}}
    cell["class_before"] = {"code": {"speculate_ngram": 2.0}}
    cell["class_after"] = {"code": {"speculate_ngram": 8.0, "speculate_suffix": 2.0,
                                    "drafted_ngram": 20.0, "accepted_ngram": 15.0,
                                    "drafted_suffix": 3.0, "accepted_suffix": 1.0},
                           "math": {"speculate_draft": 5.0}}
    classes = report.summarize_cell(cell, static_k=None)["classes"]
    assert classes["code"]["proposer_share"] == {"ngram": 0.75, "suffix": 0.25}
    assert classes["math"]["proposer_share"] == {"draft": 1.0}
    assert classes["code"]["proposers"] == {
        "ngram": {"decisions": 6.0, "drafted": 20.0, "accepted": 15.0},
        "suffix": {"decisions": 2.0, "drafted": 3.0, "accepted": 1.0}}
    summary = {"none": {4: report.summarize_cell(_cell(cell["requests"]), static_k=None)},
               "adaptspec_hybrid": {4: {"classes": classes}}}
    table = report.proposer_table(summary).splitlines()
    assert table[0].startswith("adaptspec_hybrid: proposer chosen per class")
    assert table[2].split() == ["code", "ngram", "75%", "suffix", "25%"]
    assert table[3].split() == ["math", "draft", "100%"]
    # a one-proposer configuration gets no table
    summary["adaptspec_hybrid"][4]["classes"]["code"]["proposer_share"] = {"ngram": 1.0}
    assert report.proposer_table(summary) == ""


def test_the_engine_account_of_a_cell_and_its_table() -> None:
    cell = _cell([_req("a", "code", [1, 2], [0.1, 0.2], [1, 1])], wall=10.0)
    cell["spec_before"] = {**cell["spec_before"], "engine_s_decode_plain": 1.0,
                           "engine_s_idle": 50.0}
    cell["spec_after"] = {**cell["spec_after"], "engine_s_decode_plain": 7.0,
                          "engine_s_prefill": 3.0, "engine_s_between": 0.5,
                          "engine_s_idle": 50.2}
    s = report.summarize_cell(cell, static_k=None)
    assert s["engine_s"] == pytest.approx({"decode_plain": 6.0, "prefill": 3.0,
                                           "between": 0.5, "idle": 0.2})
    lines = report.account_table({"none": {4: s}, "vllm_ngram_k4": {4: report.summarize_cell(
        _cell(cell["requests"]), static_k=4)}}).splitlines()
    assert len(lines) == 3  # the header's two lines and the one server that kept an account
    row = lines[2].split()
    # serving time 9.5 s of a 10 s cell; decode_plain 6 of 9.5 s
    assert row[:4] == ["none", "4", "0.950", "63.2%"]
    assert report.account_table({"x": {4: report.summarize_cell(_cell([]), None)}}) == ""


def test_decode_steps_by_batch_size_from_the_account_series() -> None:
    cell = _cell([_req("a", "code", [1, 2], [0.1, 0.2], [1, 1])], wall=10.0)
    cell["spec_before"] = {**cell["spec_before"], "engine_decode:seconds:decode_plain:4": 1.0,
                           "engine_decode:steps:decode_plain:4": 10.0}
    cell["spec_after"] = {**cell["spec_after"], "engine_decode:seconds:decode_plain:4": 3.4,
                          "engine_decode:steps:decode_plain:4": 30.0,
                          "engine_decode:drafts:decode_plain:4": 0.0,
                          "engine_decode:seconds:decode_spec:4": 1.3,
                          "engine_decode:steps:decode_spec:4": 10.0,
                          "engine_decode:drafts:decode_spec:4": 25.0,
                          "engine_decode:seconds:decode_spec:2": 0.5,
                          "engine_decode:steps:decode_spec:2": 5.0,
                          "engine_decode:drafts:decode_spec:2": 5.0}
    dec = report.summarize_cell(cell, static_k=None)["engine_decode"]
    assert dec["decode_plain"]["4"] == pytest.approx(
        {"steps": 20.0, "ms_per_step": 120.0, "drafts_per_step": 0.0})
    assert dec["decode_spec"]["4"] == pytest.approx(
        {"steps": 10.0, "ms_per_step": 130.0, "drafts_per_step": 2.5})
    assert list(dec["decode_spec"]) == ["2", "4"]  # by batch size, as numbers
    lines = report.decode_table({"adaptspec c=4": dec}).splitlines()
    assert lines[2].split() == ["adaptspec", "c=4", "2", "-", "100.0", "5", "1.00"]
    assert lines[3].split() == ["adaptspec", "c=4", "4", "120.0", "20", "130.0", "10", "2.50"]
    assert report.decode_table({}) == ""


def test_greedy_gate_flags_only_greedy_differences() -> None:
    ref = {1: _cell([_req("g", "code", [1, 2, 3], [], []),
                     _req("s", "code", [7, 8], [], [], temperature=0.7)])}
    same = {1: _cell([_req("g", "code", [1, 2, 3], [], []),
                      _req("s", "code", [9, 9], [], [], temperature=0.7)])}
    differ = {1: _cell([_req("g", "code", [1, 5, 3], [], [])])}
    assert report.check_greedy({"none": ref, "x": same}) == []
    bad = report.check_greedy({"none": ref, "x": same, "y": differ})
    assert bad == [{"config": "y", "concurrency": 1, "id": "g", "class": "code",
                    "first_difference": 1}]


def test_ratios_compare_with_the_best_static_config() -> None:
    def summ(tps: float, lc_itl: float, lc_median: float = 50.0) -> dict:
        return {"tok_per_s": tps, "classes": {"interactive": {"itl_mean_ms": lc_itl,
                                                              "itl_median_ms": lc_median}}}

    summary = {"none": {1: summ(10, 100)}, "vllm_ngram_k2": {1: summ(12, 90)},
               "vllm_ngram_k4": {1: summ(15, 95)},
               "adaptspec_ngram": {1: summ(16.5, 101, 52.0)}}
    configs = [servers.Config("none", None), servers.Config("vllm_ngram_k2", {}),
               servers.Config("vllm_ngram_k4", {}), servers.Config("adaptspec_ngram", {}, True)]
    r = report.ratios(summary, configs)["1"]
    assert r["best_static"] == "vllm_ngram_k4"
    a = r["adaptspec_ngram"]
    assert a["over_best_static"] == pytest.approx(1.1)
    assert a["over_none"] == pytest.approx(1.65)
    assert a["latency_critical_itl_over_none"] == pytest.approx(1.01)
    assert a["latency_critical_itl_median_over_none"] == pytest.approx(1.04)
    table = report.format_table(summary, report.ratios(summary, configs))
    assert "adaptspec_ngram" in table and "LC ITL / none: 1.01 (median 1.04)" in table


def test_stream_is_seeded_covers_every_class_and_both_temperatures() -> None:
    prompts = {c: [f"{c} {i}" for i in range(5)] for c in workload.CLASSES}
    a = workload.make_stream(prompts, 32, seed=3, max_tokens=40, interactive_tokens=10)
    b = workload.make_stream(prompts, 32, seed=3, max_tokens=40, interactive_tokens=10)
    assert [r.asdict() for r in a] == [r.asdict() for r in b]
    assert {r.cls for r in a} == set(workload.CLASSES)
    for cls in workload.CLASSES:
        temps = {r.temperature for r in a if r.cls == cls}
        assert temps == {0.0, 0.7}
    assert all(r.max_tokens == (10 if r.cls == "interactive" else 40) for r in a)
    assert len({r.seed for r in a}) == len(a)
    assert not math.isnan(report._pct([3.0, 1.0, 2.0], 99))


def test_configs_cover_none_static_and_adaptive() -> None:
    names = [c.name for c in servers.make_configs("/draft", servers.FULL)]
    assert names[0] == "none"
    # plain vLLM keeps the engine's time account beside adaptspec's
    assert servers.make_configs("/draft", servers.FULL)[0].account
    assert {"vllm_ngram_k2", "vllm_ngram_k4", "vllm_ngram_k8", "vllm_draft_k2",
            "vllm_draft_k4", "adaptspec_ngram", "adaptspec_draft"} <= set(names)
    assert not any("selfdraft" in n for n in names)
    selfd = {c.name: c for c in servers.make_configs("/draft", servers.FULL, "/self")}
    assert selfd["vllm_selfdraft_k2"].spec == {"method": "draft_model", "model": "/self",
                                               "num_speculative_tokens": 2}
    assert selfd["vllm_draft_k2"].spec["model"] == "/draft"
    assert selfd["adaptspec_hybrid_selfdraft"].env == {"ADAPTSPEC_DRAFT_MODEL": "/self"}
    assert not any("eagle" in n for n in names)
    eagle = {c.name: c for c in servers.make_configs("/draft", servers.FULL, eagle="/head")}
    assert eagle["vllm_eagle_k2"].spec == {"method": "eagle", "model": "/head",
                                           "num_speculative_tokens": 2}
    assert eagle["adaptspec_eagle"].adaptive and eagle["adaptspec_eagle"].spec == {
        "method": "eagle", "model": "/head", "num_speculative_tokens": max(servers.FULL.draft_k)}


def test_the_gpu_comparison_keeps_vllms_modes_and_composes_with_adaptive_verification() -> None:
    cfgs = {c.name: c for c in servers.gpu_configs("/head", k=3)}
    assert list(cfgs) == ["none", "vllm_eagle3_k3", "vllm_eagle3_dynamic",
                          "vllm_eagle3_adaptive_verification", "adaptspec_eagle3",
                          "adaptspec_eagle3_adaptive_verification"]
    assert not any(c.sync for c in cfgs.values())  # vLLM's async scheduling stays on
    assert cfgs["adaptspec_eagle3"].spec == {"method": "eagle3", "model": "/head",
                                             "num_speculative_tokens": 3}
    both = cfgs["adaptspec_eagle3_adaptive_verification"]
    assert both.adaptive and both.spec["enable_adaptive_verification"] is True
    assert both.policy == {"cost_model": {"preset": "gpu"}}
    assert cfgs["vllm_eagle3_dynamic"].spec["num_speculative_tokens_per_batch_size"][0] == \
        [1, 8, 3]
