"""Learned state across engines: a file per data-parallel engine, merged snapshots, warm
starts (issue "Beyond one engine process")."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from adaptspec import snapshot
from adaptspec.cli import main
from adaptspec.controller import Controller
from adaptspec.policy import ClassPolicy, CostModel, Payoff, Policy
from adaptspec.runtime import AdaptiveRuntime


def make_policy(**kw: object) -> Policy:
    base: dict = {"classes": {"code": ClassPolicy(), "chat": ClassPolicy()},
                  "default_class": "chat", "exploration": 0.0,
                  "cost_model": CostModel(preset="cpu"), "payoff": Payoff(enabled=False)}
    base.update(kw)
    return Policy(**base)


def trained(policy: Policy, cls: str, accepted: int, steps: int) -> Controller:
    ctl = Controller(policy)
    slots = np.array([ctl.add_request(f"{cls}{i}", cls) for i in range(2)])
    for _ in range(steps):
        ctl.step(slots, np.full(2, 4), np.full(2, accepted), 0.3)
    return ctl


def test_each_data_parallel_engine_writes_its_own_file(tmp_path: Path) -> None:
    pol = make_policy(state_file=str(tmp_path / "state.json"))
    assert snapshot.engine_path(pol.state_file, 0) == pol.state_file
    runtimes = [AdaptiveRuntime(pol, k_cap=4, engine=e) for e in (0, 1, 2)]
    for rt in runtimes:
        assert rt.maybe_snapshot(force=True)
    # engine 0 keeps the name (a one-engine server restarted with more keeps its state there)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.engine1.json",
                                                          "state.engine2.json", "state.json"]
    # each engine reads back its own
    rt = AdaptiveRuntime(pol, k_cap=4, engine=1)
    assert rt.state_file == str(tmp_path / "state.engine1.json")


def test_merged_evidence_is_the_sum_and_coefficients_the_weighted_mean(tmp_path: Path) -> None:
    pol = make_policy()
    a, b = trained(pol, "code", 4, 30), trained(pol, "chat", 0, 10)
    merged = snapshot.merge([snapshot.state_dict(a), snapshot.state_dict(b)])
    fresh = Controller(pol)
    snapshot.load_state_dict(fresh, merged)
    for name in ("code", "chat"):
        i = fresh.class_index(name)
        np.testing.assert_allclose(fresh.estimator.succ[i],
                                   a.estimator.succ[i] + b.estimator.succ[i])
        np.testing.assert_allclose(fresh.estimator.fail[i],
                                   a.estimator.fail[i] + b.estimator.fail[i])
    assert merged["steps"] == a.steps + b.steps
    weighted = (a.cost.coef * a.steps + b.cost.coef * b.steps) / (a.steps + b.steps)
    np.testing.assert_allclose(merged["cost_coef_ms"], weighted)
    # the merged controller learned what each engine learned: code accepts, chat does not
    code, chat = fresh.class_index("code"), fresh.class_index("chat")
    assert fresh.estimator.mean()[code][0] > 0.9 > 0.5 > fresh.estimator.mean()[chat][0]


def test_a_new_replica_starts_warm_and_never_writes_the_warm_file(tmp_path: Path) -> None:
    warm = tmp_path / "warm.json"
    snapshot.save(trained(make_policy(), "code", 4, 30), warm)
    before = warm.read_bytes()
    own = tmp_path / "own.json"
    pol = make_policy(state_file=str(own), warm_start=str(warm))
    rt = AdaptiveRuntime(pol, k_cap=4)
    code = rt.controller.class_index("code")
    assert rt.controller.estimator.mean()[code][0] > 0.9
    assert rt.maybe_snapshot(force=True)
    assert own.exists() and warm.read_bytes() == before
    # once it has a state of its own, that is what it restores
    rt.controller.estimator.succ[code] = 0.0
    rt.controller.estimator.fail[code] = 50.0
    rt.maybe_snapshot(force=True)
    again = AdaptiveRuntime(pol, k_cap=4)
    assert again.controller.estimator.mean()[code][0] < 0.1


@pytest.mark.parametrize("bad", [{"format": "x"}, {"format": "adaptspec-state", "version": 1,
                                                   "classes": {"code": {"succ": [-1.0],
                                                                        "fail": [0.0]}}}])
def test_merge_refuses_what_is_not_a_snapshot(bad: dict) -> None:
    with pytest.raises(snapshot.SnapshotError):
        snapshot.merge([bad])


def test_state_merge_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pol = make_policy()
    files = []
    for i, cls in enumerate(("code", "chat")):
        files.append(tmp_path / f"s{i}.json")
        snapshot.save(trained(pol, cls, 3, 5), files[-1])
    out = tmp_path / "merged.json"
    assert main(["state", "merge", *map(str, files), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["steps"] == 10
    assert snapshot.load(Controller(pol), out) == 3  # code, chat, other
    (tmp_path / "bad.json").write_text("{not json")
    assert main(["state", "merge", str(tmp_path / "bad.json"), "--out", str(out)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_a_restart_restores_dynamic_classes_while_there_is_room(tmp_path: Path) -> None:
    """Tenants learned as dynamic classes survive a restart (up to max_classes; restoring never
    evicts): before, a restarted engine kept only the classes its policy names."""
    pol = make_policy(dynamic_classes=True, max_classes=4)  # code, chat + 2 tenants (+ other)
    ctl = trained(pol, "tenant-a", 4, 20)
    slots = np.array([ctl.add_request(f"b{i}", "tenant-b") for i in range(2)])
    for _ in range(5):
        ctl.step(slots, np.full(2, 4), np.full(2, 0), 0.3)
    state = snapshot.state_dict(ctl)
    assert {"tenant-a", "tenant-b"} <= set(state["classes"])
    again = Controller(pol)
    assert snapshot.load_state_dict(again, state) == len(state["classes"])
    for name in ("tenant-a", "tenant-b", "code"):
        assert np.allclose(again.estimator.mean()[again.class_index(name)],
                           ctl.estimator.mean()[ctl.class_index(name)])
    # a policy without dynamic classes restores only the classes it names
    static = Controller(make_policy())
    assert snapshot.load_state_dict(static, state) == 3  # code, chat, other
    assert "tenant-a" not in static.class_names
    # no room: the first ones fit, the rest are skipped, nothing evicted
    tight = Controller(make_policy(dynamic_classes=True, max_classes=3))
    assert snapshot.load_state_dict(tight, state) == 4
    assert len(tight.class_names) == 4 and "tenant-a" in tight.class_names
