"""Bad input: always a clear error, or a fold into the default or `other` class; never a crash,
never unbounded state.

Fuzzed (hypothesis) vllm_xargs values (huge strings, unicode, any JSON shape, 10,000 distinct
class names) against AdaptiveRuntime + Metrics, malformed --speculative-config through
check_speculative_config and the CLI, snapshot contents; and the security promises: class names
never become file paths, snapshot files 0600. Bad policies: test_bad_policies.py. The running
server gets the same kinds of vllm_xargs in test_load.py.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _fuzz import FUZZ, ROOT, TRIED, json_like, scratch_file
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from adaptspec import snapshot
from adaptspec.classify import RequestInfo
from adaptspec.controller import Controller
from adaptspec.metrics import Metrics
from adaptspec.policy import OTHER_CLASS, Policy, load_policy
from adaptspec.runtime import AdaptiveRuntime
from adaptspec.serve import API_SERVER, ServeError, check_speculative_config, serve

# ------------------------------------------------------------------ vllm_xargs


def _runtime(dynamic: bool, max_classes: int = 8) -> tuple[AdaptiveRuntime, CollectorRegistry]:
    reg = CollectorRegistry()
    pol = load_policy(ROOT / "policies" / "default.yaml").model_copy(
        update={"dynamic_classes": dynamic, "max_classes": max_classes})
    return AdaptiveRuntime(pol, k_cap=4, metrics=Metrics(pol.max_classes, pol.k_max, reg)), reg


def _labels(reg: CollectorRegistry) -> set[str]:
    return set(re.findall(r'class="((?:[^"\\]|\\.)*)"', generate_latest(reg).decode()))


@FUZZ
@given(st.lists(st.dictionaries(st.sampled_from(["adaptspec_class", "priority", "x"])
                                | st.text(max_size=20), json_like, max_size=4),
                min_size=1, max_size=16), st.booleans())
def test_any_vllm_xargs_fold_into_known_classes(batch: list[dict], dynamic: bool) -> None:
    TRIED["vllm_xargs"] += len(batch)
    rt, reg = _runtime(dynamic)
    pol = rt.policy
    ids = [f"r{i}" for i in range(len(batch))]
    for r, xargs in zip(ids, batch, strict=True):
        cls = rt.admit(r, RequestInfo(extra_args=xargs))
        named = xargs.get("adaptspec_class")
        if cls not in pol.classes:  # a dynamic class: only a well-formed name the client sent
            assert dynamic and cls == named and re.fullmatch(r"[A-Za-z][A-Za-z0-9_.-]{0,63}", cls)
    for _ in range(2):
        rt.step(ids, [rt.k_for(r) for r in ids], [0] * len(ids), 0.01)
    for r in ids:
        rt.finish(r)
    assert rt.errors == 0
    assert len(rt.controller.class_names) <= pol.max_classes + 1
    assert len(_labels(reg)) <= pol.max_classes + 1


@pytest.mark.parametrize("dynamic", [True, False])
def test_ten_thousand_distinct_class_names_stay_capped(dynamic: bool) -> None:
    rt, reg = _runtime(dynamic, max_classes=16)
    pol = rt.policy
    n, batch = 10_000, 64
    names = [f"tenant-{i}" for i in range(n)]
    for start in range(0, n, batch):
        ids = [f"r{i}" for i in range(start, min(start + batch, n))]
        for r, name in zip(ids, names[start:start + batch], strict=False):
            rt.admit(r, RequestInfo(extra_args={"adaptspec_class": name}))
        for _ in range(2):
            rt.step(ids, [rt.k_for(r) for r in ids], [1] * len(ids), 0.01)
        for r in ids:
            rt.finish(r)
    TRIED["distinct class names"] += n
    labels = _labels(reg)
    assert rt.errors == 0
    assert len(labels) <= pol.max_classes + 1, len(labels)
    assert (OTHER_CLASS in labels) == dynamic
    assert len(rt.controller.class_names) <= pol.max_classes + 1
    assert len(rt.metrics._labels) <= 4 * pol.max_classes  # type: ignore[union-attr]
    assert len(rt.classifier._warned) <= 100
    assert rt.state_sizes()["requests"] == 0 and rt.state_sizes()["controller_new_requests"] == 0
    assert rt.controller.num_requests == 0


def test_huge_and_strange_class_values() -> None:
    rt, reg = _runtime(True)
    values: list[Any] = ["x" * 1_000_000, "a" * 64, "a" * 65, "ünïcødé", "类", "🙂", "a\x00b",
                         "../../etc/passwd", "/abs", "a/b", "other", "", " ", "a b", "A.b-c_d",
                         12345, -1, 1e308, float("nan"), None, True, ["code"], {"a": "b"}]
    ids = [f"r{i}" for i in range(len(values))]
    got = [rt.admit(r, RequestInfo(extra_args={"adaptspec_class": v}))
           for r, v in zip(ids, values, strict=True)]
    TRIED["strange class values"] += len(values)
    rt.step(ids, [1] * len(ids), [0] * len(ids), 0.01)
    assert [rt.k_for(r) for r in ids]  # no KeyError for dynamic classes (a bug, fixed)
    d = rt.policy.default_class
    for v, cls in zip(values, got, strict=True):
        valid = isinstance(v, str) and re.fullmatch(r"[A-Za-z][A-Za-z0-9_.-]{0,63}", v)
        assert cls == (v if valid and v != OTHER_CLASS else d), (str(v)[:20], cls)
    assert len(_labels(reg)) <= rt.policy.max_classes + 1
    assert all(len(lab) <= 64 for lab in _labels(reg))


# ------------------------------------------------------------------ --speculative-config


@FUZZ
@given(st.one_of(st.text(max_size=200),
                 st.dictionaries(st.sampled_from(["method", "model", "num_speculative_tokens",
                                                  "prompt_lookup_max", "x"]), json_like,
                                 max_size=4).map(lambda d: json.dumps(d, default=str))))
def test_speculative_config_is_parsed_or_refused_clearly(text: str) -> None:
    TRIED["--speculative-config"] += 1
    try:
        cfg = check_speculative_config(text)
    except ServeError as e:
        # (serve.py echoes a bad num_speculative_tokens in full: long, but bounded by the input)
        assert "--speculative-config" in str(e) and len(str(e)) < len(text) + 500
        return
    assert isinstance(cfg, dict)
    k = cfg.get("num_speculative_tokens")
    assert k is None or (type(k) is int and 0 <= k <= 64)


@pytest.mark.parametrize("text", [
    '{"method": "ngram",', "[1, 2]", "null", '"ngram"', "", "{'method': 'ngram'}",
    '{"num_speculative_tokens": -1}', '{"num_speculative_tokens": "4"}',
    '{"num_speculative_tokens": 1e9}', '{"num_speculative_tokens": true}',
    '{"num_speculative_tokens": NaN}', '{"num_speculative_tokens": 65}',
])
def test_cli_refuses_malformed_speculative_config(text: str, capsys: pytest.CaptureFixture
                                                  ) -> None:
    TRIED["CLI --speculative-config"] += 1
    assert serve(["m", "--dry-run", "--speculative-config", text]) == 2
    err = capsys.readouterr().err
    assert err.startswith("adaptspec serve: --speculative-config"), err


def test_cli_end_to_end_refuses_and_accepts() -> None:
    base = [sys.executable, "-m", "adaptspec.cli", "serve", "m", "--dry-run"]
    bad = subprocess.run([*base, "--speculative-config", '{"num_speculative_tokens": 99}'],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "num_speculative_tokens" in bad.stderr, bad.stderr
    good = subprocess.run([*base, "--speculative-config",
                           '{"method": "ngram", "num_speculative_tokens": 3}'],
                          capture_output=True, text=True, timeout=60)
    assert good.returncode == 0 and API_SERVER in good.stdout


def test_deeply_nested_speculative_config_is_refused_clearly() -> None:
    with pytest.raises(ServeError):
        check_speculative_config("[" * 100_000)


# ------------------------------------------------------------------ snapshot contents


@FUZZ
@given(st.one_of(json_like, st.fixed_dictionaries(
    {"format": st.just("adaptspec-state"), "version": st.just(1),
     "classes": st.dictionaries(st.sampled_from(["code", "chat", "other", "nope", "ü"]),
                                json_like | st.fixed_dictionaries({"succ": json_like,
                                                                   "fail": json_like}),
                                max_size=3),
     "cost_coef_ms": json_like})))
def test_any_snapshot_content_is_applied_whole_or_refused(state: Any) -> None:
    TRIED["snapshot contents"] += 1
    pol = load_policy(ROOT / "policies" / "default.yaml")
    ctl = Controller(pol)
    before = (ctl.estimator.succ.copy(), ctl.estimator.fail.copy(), ctl.cost.coef.copy())
    try:
        raw = json.dumps(state, allow_nan=True).encode()
    except (ValueError, OverflowError):
        return
    path = scratch_file(raw, suffix=".json")
    try:
        snapshot.load(ctl, path)
    except snapshot.SnapshotError:
        np.testing.assert_array_equal(ctl.estimator.succ, before[0])
        np.testing.assert_array_equal(ctl.estimator.fail, before[1])
        np.testing.assert_array_equal(ctl.cost.coef, before[2])
        return
    assert np.isfinite(ctl.estimator.succ).all() and (ctl.estimator.succ >= 0).all()


@pytest.mark.parametrize("raw", [
    b"[" * 100_000, b'{"format": "adaptspec-state", "version": 1, "classes": {}, "x": '
    + b"1" * 5000 + b"}", b'{"format": "adaptspec-state", "version": 1, "classes": '
    b'{"code": {"succ": 5, "fail": 5}}}', b'{"format": "adaptspec-state", "version": 1, '
    b'"classes": {}, "cost_coef_ms": "abc"}', b'{"format": "adaptspec-state", "version": 1, '
    b'"classes": {"code": {"succ": [1e999], "fail": [1]}}}', b"\xef\xbb\xbf{}", b"\x00" * 100,
])
def test_hostile_snapshots_are_refused_with_a_warning(raw: bytes, tmp_path: Path) -> None:
    """Found by the fuzz test above: these crashed the runtime's start (IndexError, ValueError,
    RecursionError escaped load()) before snapshot.py was fixed."""
    TRIED["hostile snapshots"] += 1
    path = tmp_path / "state.json"
    path.write_bytes(raw)
    pol = load_policy(ROOT / "policies" / "default.yaml").model_copy(
        update={"state_file": str(path)})
    rt = AdaptiveRuntime(pol, k_cap=4)
    assert rt.errors == 1


# ------------------------------------------------------------------ files


def test_class_names_never_become_file_paths(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    work = tmp_path / "cwd"
    work.mkdir()
    cwd = os.getcwd()
    os.chdir(work)
    try:
        pol = load_policy(ROOT / "policies" / "default.yaml").model_copy(update={
            "dynamic_classes": True, "state_file": str(state_dir / "learned.json")})
        rt = AdaptiveRuntime(pol, k_cap=4)
        names = ["..", "../escape", "/etc/passwd", "a/b", "state", "learned.json", "CON", "x" * 64,
                 "a..b", ".hidden", "tenant.json", "-rf"]
        ids = [f"r{i}" for i in range(len(names))]
        for r, n in zip(ids, names, strict=True):
            rt.admit(r, RequestInfo(extra_args={"adaptspec_class": n}))
        rt.step(ids, [1] * len(ids), [1] * len(ids), 0.01)
        assert rt.maybe_snapshot(force=True)
    finally:
        os.chdir(cwd)
    assert [p.name for p in state_dir.iterdir()] == ["learned.json"]
    assert list(work.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cwd", "state"]
    data = json.loads((state_dir / "learned.json").read_text())
    assert "a..b" in data["classes"]  # names live inside the JSON, nowhere else


def test_snapshot_is_private_whatever_the_umask(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text("{}")
    os.chmod(path, 0o666)
    old = os.umask(0)
    try:
        snapshot.save(Controller(Policy()), path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]

