"""The engine-facing runtime, snapshots and metrics: no engine needed."""

from __future__ import annotations

import json
import math
import stat
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from promsamples import value

from adaptspec import snapshot
from adaptspec.classify import RequestInfo
from adaptspec.controller import Controller
from adaptspec.metrics import Metrics
from adaptspec.policy import ClassPolicy, CostModel, Payoff, Policy
from adaptspec.runtime import AdaptiveRuntime

FREE = CostModel(base_ms=10, per_request_ms=0.1, per_draft_token_ms=0.0, spec_overhead_ms=0.0,
                 knee_tokens=1e6, over_knee_ms=0.0, learn=False)


def make_policy(**kw: object) -> Policy:
    base: dict = {
        "classes": {"code": ClassPolicy(prior_acceptance=0.9),
                    "chat": ClassPolicy(prior_acceptance=0.5),
                    "interactive": ClassPolicy(latency_critical=True)},
        "default_class": "chat", "exploration": 0.0, "hysteresis_steps": 1,
        "cost_model": FREE, "fallback_k": 2,
        # These test the controller's decisions through the runtime; the payoff guard, which
        # holds speculation until plain steps are measured, has tests of its own.
        "payoff": Payoff(enabled=False),
    }
    base.update(kw)
    return Policy(**base)


def metrics_text(reg: CollectorRegistry) -> str:
    return generate_latest(reg).decode()


def test_runtime_classifies_caps_k_and_forgets_finished() -> None:
    rt = AdaptiveRuntime(make_policy(), k_cap=3)
    assert rt.admit("a", RequestInfo(extra_args={"adaptspec_class": "code"})) == "code"
    lc = RequestInfo(extra_args={"adaptspec_class": "interactive"})
    assert rt.admit("b", lc) == "interactive"
    assert rt.admit("c", RequestInfo(extra_args={"adaptspec_class": "nope"})) == "chat"
    ks = rt.step(["a", "b", "c"], [0, 0, 0], [0, 0, 0], None)
    assert ks["a"] == 3  # policy k_max 8, engine allows 3
    assert ks["b"] == 0
    rt.finish("a")
    assert "a" not in rt.classes and rt.controller.slot("a") is None
    # unknown now: planned as a new request of the default class (k_max 8, engine cap 3)
    assert rt.k_for("a") == 3 and rt.plan_for(["a"]).reason_of("a") == "new_request"


def test_a_new_request_may_propose_its_class_k_max_and_a_latency_critical_one_nothing() -> None:
    """The step that prefills a request proposes its first drafts before the controller has
    decided for it: the proposer is asked for the class's k_max (the decision of the same step
    cuts them), never for a latency-critical request; faults fall back within the class too."""
    pol = make_policy(classes={"code": ClassPolicy(prior_acceptance=0.9),
                               "short": ClassPolicy(prior_acceptance=0.9, k_max=1),
                               "chat": ClassPolicy(),
                               "interactive": ClassPolicy(latency_critical=True)})
    rt = AdaptiveRuntime(pol, k_cap=4)
    for rid, cls in (("a", "code"), ("s", "short"), ("i", "interactive")):
        rt.admit(rid, RequestInfo(extra_args={"adaptspec_class": cls}))
    plan = rt.plan_for(list("asi"))
    assert plan.k.tolist() == [4, 1, 0]
    assert [plan.reason_of(r) for r in "asi"] == ["new_request", "new_request",
                                                  "latency_critical"]
    assert [rt.controller.fallback_k(c) for c in ("code", "short", "interactive")] == [2, 1, 0]
    ks = rt.step(["a", "s", "i"], [0, 0, 0], [0, 0, 0], None)
    assert [rt.k_for(r) for r in "asi"] == [ks["a"], ks["s"], 0]


def test_runtime_faults_give_fallback_but_latency_critical_stays_plain(
        monkeypatch: pytest.MonkeyPatch) -> None:
    reg = CollectorRegistry()
    pol = make_policy()
    rt = AdaptiveRuntime(pol, k_cap=4, metrics=Metrics(pol.max_classes, pol.k_max, registry=reg))
    rt.admit("a", RequestInfo(extra_args={"adaptspec_class": "code"}))
    rt.admit("b", RequestInfo(extra_args={"adaptspec_class": "interactive"}))

    def boom(*a: object, **k: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(rt.controller, "_step", boom)
    assert rt.step(["a", "b"], [3, 0], [2, 0], 0.01) == {"a": 2, "b": 0}
    assert rt.errors == 1
    assert value(reg, "adaptspec_controller_errors_total") == 1.0
    for cls in ("code", "interactive"):
        assert value(reg, "adaptspec_steps_total",
                     {"class": cls, "decision": "fallback", "reason": "fallback",
                      "proposer": "none"}) == 1.0
    # The step's drafts were verified all the same: counted as the controller would count them
    # (the counts must keep matching vLLM's own spec-decode counters, see test_vllm_plugin.py).
    code = {"class": "code", "proposer": "ngram"}
    assert value(reg, "adaptspec_draft_tokens_total", code) == 3.0
    assert value(reg, "adaptspec_accepted_tokens_total", code) == 2.0
    for pos, acc in ((0, 1.0), (1, 1.0), (2, None)):
        where = {"class": "code", "position": str(pos)}
        assert value(reg, "adaptspec_draft_tokens_per_pos_total", where) == 1.0
        assert value(reg, "adaptspec_accepted_tokens_per_pos_total", where) == acc
    assert 'adaptspec_draft_tokens_total{class="interactive"' not in metrics_text(reg)


def test_injected_faults_every_nth_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADAPTSPEC_FAULT", "raise_every=3")
    rt = AdaptiveRuntime(make_policy(), k_cap=4)
    rt.admit("a", RequestInfo(extra_args={"adaptspec_class": "code"}))
    for _ in range(9):
        rt.step(["a"], [0], [0], None)
    assert rt.errors == 3


def test_snapshot_round_trip_is_atomic_and_private(tmp_path: Path) -> None:
    pol = make_policy()
    ctl = Controller(pol)
    slots = np.array([ctl.add_request(f"r{i}", "code") for i in range(4)])
    for _ in range(20):
        ctl.step(slots, np.full(4, 4), np.array([4, 3, 1, 0]), 0.01)
    path = tmp_path / "state.json"
    snapshot.save(ctl, path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # no temp file left behind
    fresh = Controller(pol)
    assert snapshot.load(fresh, path) == len(pol.classes) + 1  # + "other"
    code = ctl.class_index("code")
    np.testing.assert_allclose(fresh.estimator.mean()[code], ctl.estimator.mean()[code])


def test_snapshot_of_the_six_term_cost_model_still_loads(tmp_path: Path) -> None:
    pol = make_policy(cost_model=CostModel(preset="cpu"))  # learns, so it takes the snapshot's
    ctl = Controller(pol)
    path = tmp_path / "state.json"
    snapshot.save(ctl, path)
    state = json.loads(path.read_text())
    state["cost_coef_ms"] = [300.0, 40.0, 30.0, 0.0, 10.0, 0.0]  # before B * maxK existed
    path.write_text(json.dumps(state))
    fresh = Controller(pol)
    assert snapshot.load(fresh, path) == len(pol.classes) + 1
    np.testing.assert_array_equal(fresh.cost.coef, [300.0, 40.0, 30.0, 0.0, 10.0, 0.0, 0.0])
    state["cost_coef_ms"] = [1.0] * 5  # any other length is refused whole
    path.write_text(json.dumps(state))
    with pytest.raises(snapshot.SnapshotError):
        snapshot.load(Controller(pol), path)


@pytest.mark.parametrize("content", [b"", b"{not json", b'{"format": "x"}', b"\xff\xfe",
                                     b'{"format": "adaptspec-state", "version": 1, "classes": '
                                     b'{"code": {"succ": [-1], "fail": [0]}}}'])
def test_corrupt_snapshot_is_refused_and_changes_nothing(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(content)
    ctl = Controller(make_policy())
    before = ctl.estimator.succ.copy()
    with pytest.raises(snapshot.SnapshotError):
        snapshot.load(ctl, path)
    np.testing.assert_array_equal(ctl.estimator.succ, before)


def test_runtime_survives_bad_snapshot_and_unwritable_dir(tmp_path: Path) -> None:
    bad = tmp_path / "state.json"
    bad.write_text(json.dumps({"format": "adaptspec-state", "version": 99}))
    rt = AdaptiveRuntime(make_policy(state_file=str(bad)), k_cap=4)
    assert rt.errors == 1  # counted, then started from priors
    # A snapshot folder that cannot be written (a file where the folder should be: this holds
    # even for root, who ignores permission bits).
    (tmp_path / "not-a-dir").write_text("x")
    rt2 = AdaptiveRuntime(make_policy(state_file=str(tmp_path / "not-a-dir" / "s.json")), k_cap=4)
    assert rt2.errors == 1  # reading it at start failed too, and was counted
    assert rt2.maybe_snapshot(force=True) is False
    assert rt2.errors == 2


def test_metric_names_and_class_cardinality_cap() -> None:
    reg = CollectorRegistry()
    pol = make_policy(dynamic_classes=True, max_classes=4)
    m = Metrics(pol.max_classes, pol.k_max, registry=reg)
    rt = AdaptiveRuntime(pol, k_cap=4, metrics=m)
    ids = [f"r{i}" for i in range(50)]
    for i, r in enumerate(ids):
        rt.admit(r, RequestInfo(extra_args={"adaptspec_class": f"tenant{i}"}))
    for _ in range(3):
        rt.step(ids, [2] * 50, [1] * 50, 0.01)
    text = metrics_text(reg)
    for name in ("adaptspec_draft_tokens_total", "adaptspec_accepted_tokens_total",
                 "adaptspec_accepted_tokens_per_pos_total", "adaptspec_steps_total",
                 "adaptspec_chosen_k_bucket", "adaptspec_acceptance_estimate",
                 "adaptspec_controller_errors_total"):
        assert name in text, name
    classes = {line.split('class="')[1].split('"')[0]
               for line in text.splitlines() if 'class="' in line}
    assert len(classes) <= pol.max_classes + 1
    assert "other" in classes


def test_every_series_carries_the_engine_label() -> None:
    """A data-parallel server's engine cores each have a controller: their series are told
    apart by vLLM's `engine` label (the rank), unlabelled series included."""
    reg = CollectorRegistry()
    pol = make_policy()
    rt = AdaptiveRuntime(pol, k_cap=4, metrics=Metrics(pol.max_classes, pol.k_max, reg, engine=1),
                         engine=1)
    rt.admit("a", RequestInfo(extra_args={"adaptspec_class": "code"}))
    rt.step(["a"], [0], [0], 0.01)
    rt.step(["a"], [2], [1], 0.01)
    rt.metrics.record_error()
    families = [f for f in reg.collect() if f.name.startswith("adaptspec_")]
    samples = [s for f in families for s in f.samples]
    assert len(families) >= 15 and samples
    assert all(s.labels.get("engine") == "1" for s in samples), [
        s for s in samples if s.labels.get("engine") != "1"]
    assert value(reg, "adaptspec_controller_errors_total", engine="1") == 1.0
    assert value(reg, "adaptspec_draft_tokens_total", {"class": "code", "proposer": "ngram"},
                 engine="1") == 2.0
    assert value(reg, "adaptspec_controller_errors_total") is None  # no engine "0" here


def test_a_second_engine_in_one_process_gets_fresh_series() -> None:
    """A process that builds a second engine (a notebook re-creating vLLM's LLM) unregisters
    the first engine's series, so the second's count from zero instead of failing to register."""
    reg = CollectorRegistry()
    pol = make_policy()
    first = Metrics(pol.max_classes, pol.k_max, registry=reg)
    first.record_fallback(["code"], [3], [2])
    with pytest.raises(ValueError, match="Duplicated"):
        Metrics(pol.max_classes, pol.k_max, registry=reg)
    first.unregister()
    first.unregister()  # idempotent
    second = Metrics(pol.max_classes, pol.k_max, registry=reg)
    assert "adaptspec_draft_tokens_total{" not in metrics_text(reg)
    second.record_fallback(["code", "chat", "code"], [2, 1, 4], [2, 0, 1], ["ngram"] * 3)
    code, pos1 = {"class": "code", "proposer": "ngram"}, {"class": "code", "position": "1"}
    assert value(reg, "adaptspec_draft_tokens_total", code) == 6.0
    assert value(reg, "adaptspec_accepted_tokens_total", code) == 3.0
    assert value(reg, "adaptspec_draft_tokens_per_pos_total", pos1) == 2.0
    assert value(reg, "adaptspec_accepted_tokens_per_pos_total", pos1) == 1.0
    for cls, n in (("code", 2.0), ("chat", 1.0)):
        assert value(reg, "adaptspec_steps_total",
                     {"class": cls, "decision": "fallback", "proposer": "none"}) == n


def test_runtime_cut_shortens_doubtful_drafts_counts_them_and_survives_faults() -> None:
    priced = CostModel(base_ms=10, per_request_ms=0.5, per_draft_token_ms=0.8,
                       spec_overhead_ms=0.0, knee_tokens=0, over_knee_ms=0.0, learn=False)
    reg = CollectorRegistry()
    pol = make_policy(cost_model=priced, confidence_weight=1.0)
    rt = AdaptiveRuntime(pol, k_cap=8, metrics=Metrics(pol.max_classes, pol.k_max, reg))
    ids = [f"r{i}" for i in range(6)]
    for r in ids:
        rt.admit(r, RequestInfo(extra_args={"adaptspec_class": "code"}))
    ks = rt.step(ids, [0] * 6, [0] * 6, None)
    planned = [ks[r] for r in ids]
    assert min(planned) > 0
    sure = rt.cut(ids, planned, [1.0] * 6)
    assert sure == planned
    # far below the mean confidence of the row's drafts so far (0.5), and no calibration yet:
    # each keeps its first token, which is verified and calibrates
    assert rt.cut(ids, planned, [0.0] * 6) == [1] * 6
    assert value(reg, "adaptspec_confidence_cut_tokens_total",
                 {"class": "code"}) == sum(planned) - 6
    assert value(reg, "adaptspec_confidence_drafts_total", {"class": "code"}) == 12
    # drafts without a confidence (vLLM's own proposers: NaN) go through the same trim, and
    # the confidence counters leave them out
    assert value(reg, "adaptspec_trimmed_tokens_total", {"class": "code"}) == sum(planned) - 6
    assert rt.cut(ids, planned, [math.nan] * 6) == planned
    assert value(reg, "adaptspec_confidence_drafts_total", {"class": "code"}) == 12
    # a draft longer than its step pays for is trimmed without a confidence: the trim counter
    # sees it, the confidence counters do not
    longer = [k + 4 for k in planned]
    kept = rt.cut(ids, longer, [math.nan] * 6)
    assert all(k <= n for k, n in zip(kept, longer, strict=True))
    assert value(reg, "adaptspec_trimmed_tokens_total", {"class": "code"}) == (
        sum(planned) - 6 + sum(longer) - sum(kept))
    assert value(reg, "adaptspec_confidence_drafts_total", {"class": "code"}) == 12
    assert value(reg, "adaptspec_confidence_cut_tokens_total",
                 {"class": "code"}) == sum(planned) - 6
    # unknown requests keep their drafts; a failing controller keeps them all
    assert rt.cut(["nobody"], [3], [0.0]) == [3]

    def boom(*_: object) -> None:
        raise RuntimeError("cut failed")

    rt.controller.cut = boom  # type: ignore[method-assign]
    errors = rt.errors
    assert rt.cut(ids, planned, [0.0] * 6) == planned
    assert rt.errors == errors + 1


def test_the_draft_models_cost_is_counted_and_its_fit_exported() -> None:
    reg = CollectorRegistry()
    pol = make_policy()
    rt = AdaptiveRuntime(pol, k_cap=4, metrics=Metrics(pol.max_classes, pol.k_max, registry=reg),
                         proposers=("ngram", "suffix", "draft"))
    # batched: 3 forward passes drafted 6 tokens; 40 tokens of catch-up
    rt.record_draft_cost(60.0, 6, 40, forward_passes=3)
    rt.record_draft_cost(30.0, 6, 0, forward_passes=3)
    text = metrics_text(reg)
    assert value(reg, "adaptspec_draft_model_passes_total") == 6.0
    assert value(reg, "adaptspec_draft_model_catchup_tokens_total") == 40.0
    # 6 tokens at 5 ms and 40 catch-up tokens at 0.75 ms explain both steps
    assert rt.controller.pass_ms[2] == pytest.approx(5.0)
    assert rt.controller.catchup_ms[2] == pytest.approx(0.75)
    from prometheus_client.parser import text_string_to_metric_families

    cost = {s.labels["kind"]: s.value for f in text_string_to_metric_families(text)
            if f.name == "adaptspec_draft_model_cost_ms" for s in f.samples}
    assert cost == pytest.approx({"per_token": 5.0, "per_catchup_token": 0.75})
