"""bench.calibrate: the step-time fit recovers a known cost curve, acceptance is inverted
from tokens per step, and the simulator check predicts what a synthetic engine produced."""

from __future__ import annotations

import numpy as np
import pytest

from adaptspec.policy import Policy, policy_from_dict
from adaptspec.tools.bench import calibrate, stepfit

TRUE = {"per_draft_token_ms": 3.0, "spec_overhead_ms": 5.0, "per_draft_position_ms": 20.0,
        "per_request_pass_ms": 2.0}
# Plain decoding's step time by batch size, not monotone (as on two CPU cores: 4 requests step
# faster than 1); the calibration must recover it, not a line through it.
PLAIN = {1: 60.0, 4: 52.0, 16: 136.0}
CLASSES = {"code": 0.85, "chat": 0.5, "interactive": 0.6}


def _expected_tokens(alpha: float, k: int) -> float:
    return sum(alpha ** i for i in range(k + 1))


def _cell(cfg: dict, conc: int, k_by_class: dict[str, int], rate: float = 1.0,
          prefill_s: float = 0.0) -> dict:
    """A summary cell as `adaptspec bench` writes it, from the true curve and acceptance: every
    decode step at a batch of `conc`, and prefill_s in steps that prefilled. An n-gram proposer
    has a draft at a share `rate` of request-steps."""
    family = stepfit._family(cfg)
    rate = rate if family == "ngram" else 1.0
    reqs = {"code": 2 * conc, "chat": 2 * conc, "interactive": conc}
    total = sum(reqs.values())
    # request-steps per class from the tokens each class needs
    length = {cls: (16 if cls == "interactive" else 32) for cls in reqs}
    tps_class = {cls: 1 + rate * (_expected_tokens(CLASSES[cls], k_by_class[cls]) - 1)
                 for cls in reqs}
    steps_class = {cls: reqs[cls] * (length[cls] - 1) / tps_class[cls] for cls in reqs}
    request_steps = sum(steps_class.values())
    draft_tokens = rate * sum(steps_class[c] * k_by_class[c] for c in reqs)
    drafts = rate * sum(steps_class[c] for c in reqs if k_by_class[c])
    batch = conc
    engine_steps = request_steps / batch
    spec = draft_tokens / engine_steps
    max_k = max(k_by_class.values())
    k_dist = {str(k_by_class[c]): steps_class[c] for c in reqs}
    if cfg["adaptive"]:  # requests of mixed K: the longest draft of a step, in expectation
        passes: dict[str, float] = {}  # (a draft model passes at least once)
        for k, n in k_dist.items():
            key = str(max(int(k), 1)) if family == "draft_model" else k
            passes[key] = passes.get(key, 0.0) + n
        max_k = stepfit._expected_max(passes, batch)
    step = (PLAIN[batch] + TRUE["per_draft_token_ms"] * spec
            + TRUE["spec_overhead_ms"] * (spec > 0 or family == "draft_model")
            + (TRUE["per_draft_position_ms"] * max(max_k, 1)
               + TRUE["per_request_pass_ms"] * (spec + batch * max(max_k, 1))
               if family == "draft_model" else 0.0))
    wall = engine_steps * step / 1e3 + prefill_s
    tokens = sum(reqs[c] * length[c] for c in reqs)
    classes = {cls: {"requests": reqs[cls], "acceptance_length": tps_class[cls]}
               for cls in reqs}
    if cfg["adaptive"]:
        for cls in reqs:
            classes[cls]["k_distribution"] = {str(k_by_class[cls]): steps_class[cls]}
        assert sum(len(c["k_distribution"]) for c in classes.values()) == len(k_dist)
    return {"tok_per_s": tokens / wall, "request_steps": request_steps, "wall_s": wall,
            "output_tokens": tokens, "decode_tokens": tokens - total,
            "vllm_draft_tokens": draft_tokens, "vllm_drafts": drafts, "classes": classes,
            "engine_steps": {"decode": {str(batch): [engine_steps, step, tokens - total]},
                             "other_s": prefill_s, "steps": engine_steps + total}}


def _result(rate: float = 1.0, prefill_s: float = 0.0) -> dict:
    configs = [{"name": "none", "spec": None, "adaptive": False}]
    configs += [{"name": f"vllm_draft_k{k}", "adaptive": False,
                 "spec": {"method": "draft_model", "num_speculative_tokens": k}} for k in (2, 4)]
    configs += [{"name": f"vllm_ngram_k{k}", "adaptive": False,
                 "spec": {"method": "ngram", "num_speculative_tokens": k}} for k in (2, 4, 8)]
    configs += [{"name": "adaptspec_draft", "adaptive": True,
                 "spec": {"method": "draft_model", "num_speculative_tokens": 4}},
                {"name": "adaptspec_ngram", "adaptive": True,
                 "spec": {"method": "ngram", "num_speculative_tokens": 8}}]
    summary = {}
    for cfg in configs:
        summary[cfg["name"]] = {}
        for conc in (1, 4, 16):
            if cfg["spec"] is None:
                ks = dict.fromkeys(CLASSES, 0)
            elif cfg["adaptive"]:
                ks = {"code": 3, "chat": 1, "interactive": 0}
            else:
                ks = dict.fromkeys(CLASSES, cfg["spec"]["num_speculative_tokens"])
            summary[cfg["name"]][str(conc)] = _cell(cfg, conc, ks, rate, prefill_s * conc)
    return {"configs": configs, "summary": summary, "policy": None,
            "sizes": {"max_tokens": 32, "interactive_tokens": 16}}


def test_step_time_fit_recovers_the_true_curve() -> None:
    rows, cells = stepfit.observations(_result())
    fitted = stepfit.fit_cost(rows)
    for key, value in TRUE.items():
        assert fitted[key] == pytest.approx(value, rel=1e-3, abs=1e-3), key
    for batch, ms in PLAIN.items():
        assert stepfit.plain_step_ms(fitted, batch) == pytest.approx(ms, rel=1e-3), batch
    # between measured batch sizes: linear
    assert stepfit.plain_step_ms(fitted, 10) == pytest.approx((52.0 + 136.0) / 2, rel=1e-3)
    check = stepfit.step_time_check(rows, cells, fitted)
    assert check and max(abs(c["error"]) for c in check) < 1e-3
    # the adaptive cells were not in the fit, and still predicted
    assert any(c["config"] == "adaptspec_draft" and not c["in_fit"] for c in check)


def test_fit_ignores_adaptive_cells() -> None:
    rows, _ = stepfit.observations(_result())
    for r in rows:
        if r["adaptive"]:
            r["step_ms"] *= 10  # a wild adaptive measurement must not move the fit
    fitted = stepfit.fit_cost(rows)
    assert stepfit.plain_step_ms(fitted, 4) == pytest.approx(PLAIN[4], rel=1e-3)
    assert fitted["per_draft_position_ms"] == pytest.approx(20.0, rel=1e-3)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.7, 0.95])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_alpha_from_length_inverts_expected_tokens(alpha: float, k: int) -> None:
    assert stepfit.alpha_from_length(_expected_tokens(alpha, k), k) == pytest.approx(
        alpha, abs=1e-4)


def test_expected_max_of_k() -> None:
    assert stepfit._expected_max({"3": 5.0}, 4) == pytest.approx(3.0)
    # half the requests K=0, half K=2: P(max >= 1) = P(max >= 2) = 1 - 0.5^B
    assert stepfit._expected_max({"0": 1.0, "2": 1.0}, 2) == pytest.approx(2 * 0.75)
    assert stepfit._expected_max({}, 8) == 0.0


def test_simulator_check_predicts_a_synthetic_engine() -> None:
    policy = policy_from_dict({"default_class": "chat", "k_max": 4, "classes": {
        "code": {}, "chat": {}, "interactive": {"latency_critical": True}}})
    cal = calibrate.calibrate(_result(), policy)
    assert cal["acceptance"]["draft_model"]["alpha"]["code"] == pytest.approx(0.85, abs=1e-3)
    statics = [c for c in cal["simulator_check"]
               if c["config"].startswith("vllm_draft") and not c["in_fit"]]
    assert statics  # K=2 predicted from acceptance fitted on K=4
    # The synthetic engine follows the simulator's own model (acceptance per position, the
    # step-time formula), so the simulator's static-K predictions land close.
    assert max(abs(c["error"]) for c in statics) < 0.1, statics
    assert set(cal["gpu_preset"]) == {"draft_model", "ngram"}
    gpu = cal["gpu_preset"]["draft_model"]
    assert set(gpu["adaptive_over_none"]) == {str(n) for n in stepfit.GPU_LOADS}
    assert all(np.isfinite(v) and v > 0 for v in gpu["adaptive_over_none"].values())
    # The oracle: K 0..(the family's largest) per class in hindsight, latency-critical classes
    # at 0, and plain decoding is one of its candidates, so it is never below it.
    for fam, g in cal["gpu_preset"].items():
        tps = g["tokens_per_s"]
        k_top = max(c["spec"]["num_speculative_tokens"] for c in _result()["configs"]
                    if c["spec"] and stepfit._family(c) == fam)
        for n in map(str, stepfit.GPU_LOADS):
            assert tps["oracle"][n] >= tps["none"][n], (fam, n)
            assert g["oracle_k"][n]["interactive"] == 0
            assert all(0 <= k <= k_top for k in g["oracle_k"][n].values())
            assert g["adaptive_over_oracle"][n] == pytest.approx(
                tps["adaptive"][n] / tps["oracle"][n], rel=1e-3)
    report = calibrate.format_report(cal)
    assert "adaptive / oracle" in report and "oracle / best static" in report


def test_simulator_check_accounts_for_missing_drafts_and_prefill() -> None:
    # vLLM's n-gram drafts at 40% of request-steps, and every cell spends time prefilling:
    # without both, the static n-gram cells would look far slower than the engine's.
    policy = policy_from_dict({"default_class": "chat", "k_max": 8, "classes": {
        "code": {}, "chat": {}, "interactive": {"latency_critical": True}}})
    cal = calibrate.calibrate(_result(rate=0.4, prefill_s=2.0), policy)
    ngram = cal["acceptance"]["ngram"]
    assert ngram["draft_rate"] == pytest.approx(0.4, abs=1e-3)
    assert ngram["alpha"]["code"] == pytest.approx(0.85, abs=1e-3)
    statics = [c for c in cal["simulator_check"] if c["config"].startswith("vllm_ngram")]
    assert max(abs(c["error"]) for c in statics) < 0.1, statics
    assert max(abs(c["error"]) for c in cal["step_time_check"] if c["in_fit"]) < 1e-3
    # the same engine judged without the draft rate: drafts cost every step, predictions miss
    no_rate = _result(rate=0.4, prefill_s=2.0)
    for by_c in no_rate["summary"].values():
        for cell in by_c.values():
            cell.pop("vllm_drafts")
    worse = calibrate.calibrate(no_rate, policy)["simulator_check"]
    assert max(abs(c["error"]) for c in worse if c["config"].startswith("vllm_ngram")) > 0.1


def test_calibration_needs_static_cells() -> None:
    with pytest.raises(ValueError, match="at least one static"):
        stepfit.fit_cost([])
    assert isinstance(Policy(), Policy)


def test_adaptive_k_is_counted_as_vllm_drafts_it() -> None:
    """The controller's K above the configured num_speculative_tokens is drafted at that many
    (the scheduler's budget), and a draft model passes at least once: K = 0 counts as 1."""
    result = _result()
    cell = result["summary"]["adaptspec_draft"]["4"]
    classes = cell["classes"]
    classes["code"]["k_distribution"] = {"7": 3.0, ">8": 2.0}
    classes["chat"]["k_distribution"] = {"0": 5.0}
    classes["interactive"]["k_distribution"] = {}
    row = next(r for r in stepfit.observations(result)[0]
               if r["config"] == "adaptspec_draft" and r["concurrency"] == 4)
    assert row["max_k"] == pytest.approx(stepfit._expected_max({"4": 5.0, "1": 5.0}, 4.0))
    # an n-gram proposer drafts nothing at K = 0
    classes = result["summary"]["adaptspec_ngram"]["4"]["classes"]
    classes["code"]["k_distribution"] = {"0": 5.0}
    classes["chat"]["k_distribution"] = {">8": 5.0}
    classes["interactive"]["k_distribution"] = {}
    row = next(r for r in stepfit.observations(result)[0]
               if r["config"] == "adaptspec_ngram" and r["concurrency"] == 4)
    assert row["max_k"] == pytest.approx(stepfit._expected_max({"0": 5.0, "8": 5.0}, 4.0))
    assert 0.0 < row["max_k"] < 8.0


def test_steps_come_from_raw_requests_when_the_summary_lacks_them() -> None:
    """A bench.json written with --raw before summaries carried engine steps still calibrates;
    one without either says to run the benchmark again."""
    result = _result()
    summary = result["summary"]["none"]["4"]
    summary.pop("engine_steps")
    reqs = [{"start": 0.0, "chunk_times": [0.5, 0.6, 0.7], "chunk_tokens": [1, 1, 1]},
            {"start": 0.0, "chunk_times": [0.5, 0.6, 0.7], "chunk_tokens": [1, 1, 1]}]
    result["raw"] = {"none": {"4": {"requests": reqs}}}
    got = stepfit.cell_steps(result, "none", "4")
    assert got["decode"] == {"2": [2, pytest.approx(100.0), 4]}
    assert got["other_s"] == pytest.approx(0.5)
    result.pop("raw")
    with pytest.raises(ValueError, match="run `adaptspec bench` again"):
        stepfit.observations(result)


def test_cells_the_chunk_times_did_not_resolve_are_reported() -> None:
    policy = policy_from_dict({"default_class": "chat", "k_max": 4, "classes": {
        "code": {}, "chat": {}, "interactive": {"latency_critical": True}}})
    result = _result()
    assert calibrate.calibrate(result, policy)["unresolved_cells"] == {}
    # most of a cell's tokens came in steps that were not clean decode steps
    n, ms, tokens = result["summary"]["vllm_ngram_k4"]["4"]["engine_steps"]["decode"]["4"]
    result["summary"]["vllm_ngram_k4"]["4"]["engine_steps"]["decode"]["4"] = [
        n * 0.2, ms, tokens * 0.2]
    cal = calibrate.calibrate(result, policy)
    assert list(cal["unresolved_cells"]) == ["vllm_ngram_k4 c=4"]
    assert cal["unresolved_cells"]["vllm_ngram_k4 c=4"] < stepfit.MIN_COVERAGE
    assert "NOT MEANINGFUL" in calibrate.format_report(cal)


def test_class_mix_of_one_concurrency() -> None:
    """Each concurrency's stream is simulated with its own class mix (4 requests at c=1 are
    not the benchmark's mix)."""
    result = _result()
    result["summary"]["none"]["1"]["classes"] = {"code": {"requests": 3}, "chat": {"requests": 1}}
    assert stepfit._class_mix(result, "1") == {"chat": 0.25, "code": 0.75}
    whole = stepfit._class_mix(result)
    assert set(whole) == {"code", "chat", "interactive"}
    assert whole["code"] == pytest.approx((3 + 8 + 32) / (4 + 20 + 80))
