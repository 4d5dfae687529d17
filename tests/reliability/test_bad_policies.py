"""Bad policies: always a clear error or a policy that runs; never executed code.

Fuzzed (hypothesis) YAML and Python policies and policy specs, mutations of the default policy;
the security promises: no code from YAML, Python policies only from an explicit module path; a
YAML alias bomb fails fast. The other bad input (vllm_xargs, --speculative-config, snapshots,
files): test_bad_input.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from _fuzz import FUZZ, ROOT, SCRATCH, TRIED, json_like, scratch_file
from hypothesis import assume, given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from adaptspec.classify import RequestInfo
from adaptspec.metrics import Metrics
from adaptspec.policy import Policy, PolicyError, load_policy, policy_from_dict
from adaptspec.runtime import AdaptiveRuntime

BASE_POLICY = yaml.safe_load((ROOT / "policies" / "default.yaml").read_text())


def _usable(pol: Policy) -> None:
    """A policy that validates must run: build the runtime and step it a few times."""
    if pol.max_requests * (pol.k_max + 1) > 5_000_000:
        return  # (valid, just too big to allocate in a unit test)
    rt = AdaptiveRuntime(pol, k_cap=pol.k_max, metrics=Metrics(pol.max_classes, pol.k_max,
                                                               registry=CollectorRegistry()))
    ids = [f"r{i}" for i in range(4)]
    for i, r in enumerate(ids):
        rt.admit(r, RequestInfo(extra_args={pol.class_key: list(pol.classes)[i % len(pol.classes)]},
                                priority=i - 2, prompt="def f(x):\n ```"))
    for _ in range(3):
        ks = rt.step(ids, [rt.k_for(r) for r in ids], [0, 1, 0, 1], 0.02)
        assert all(0 <= k <= pol.k_max for k in ks.values())
    for r in ids:
        rt.finish(r)
    assert rt.errors == 0, "a policy that validated made the controller fail"


# ------------------------------------------------------------------ policies


@FUZZ
@given(st.text(max_size=400))
def test_any_yaml_text_gives_a_policy_or_a_clear_error(text: str) -> None:
    TRIED["yaml text"] += 1
    path = scratch_file(text)
    try:
        pol = load_policy(path)
    except PolicyError as e:
        assert str(path) in str(e)
        return
    _usable(pol)


def _mutations() -> st.SearchStrategy[list[tuple[tuple[str, ...], Any]]]:
    paths = [(k,) for k in (*Policy.model_fields, "unknown_key")] + [
        ("classes", "code", k) for k in ("latency_critical", "k_min", "k_max", "prior_acceptance",
                                         "prior_strength", "itl_slo_ms", "typo")
    ] + [("cost_model", k) for k in ("preset", "base_ms", "knee_tokens", "forgetting", "learn")
         ] + [("rules", 0, "match", k) for k in ("priority_max", "prompt_regex", "extra_args",
                                                 "model")] + [("classes", "ünï/../x",)]
    return st.lists(st.tuples(st.sampled_from(paths), json_like), min_size=1, max_size=3)


def _set(d: Any, path: tuple, value: Any) -> None:
    for p in path[:-1]:
        d = d[p]
    d[path[-1]] = value


@FUZZ
@given(_mutations())
def test_mutated_policies_give_a_usable_policy_or_a_clear_error(muts: list) -> None:
    TRIED["yaml policy mutations"] += 1
    data = json.loads(json.dumps(BASE_POLICY))
    for path, value in muts:
        try:
            _set(data, path, value)
        except (KeyError, IndexError, TypeError):
            pass
    try:
        text = yaml.safe_dump(data, allow_unicode=True)
    except (yaml.YAMLError, ValueError, OverflowError):
        return
    path = scratch_file(text)
    try:
        pol = load_policy(path)
    except PolicyError as e:
        msg = str(e)
        assert str(path) in msg and "invalid policy" in msg or "not valid YAML" in msg, msg
        assert len(msg) < 20_000  # values are shown shortened
        return
    _usable(pol)


@FUZZ
@given(json_like)
def test_python_policy_objects_give_a_policy_or_a_clear_error(obj: Any) -> None:
    """What `package.module:NAME` may point at: anything at all."""
    TRIED["python policy objects"] += 1
    try:
        pol = policy_from_dict(obj, "mod:POLICY")
    except PolicyError as e:
        assert "mod:POLICY" in str(e)
        return
    _usable(pol)


@FUZZ
@given(st.text(max_size=60))
def test_any_policy_spec_string_is_a_file_a_module_or_a_clear_error(text: str) -> None:
    TRIED["policy spec strings"] += 1
    m = re.match(r"^([A-Za-z_][\w.]*):[A-Za-z_]\w*$", text)
    if m:  # only names that cannot import anything real (no side effects from stdlib modules)
        top = m.group(1).split(".")[0]
        assume(top not in sys.stdlib_module_names and top not in sys.modules)
        try:
            assume(importlib.util.find_spec(top) is None)
        except (ValueError, ImportError):
            pass
    cwd = os.getcwd()
    os.chdir(SCRATCH)  # relative paths resolve in an empty folder
    try:
        load_policy(text)
    except PolicyError:
        pass
    finally:
        os.chdir(cwd)


def test_python_policy_loads_from_an_explicit_module_path(monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
    (tmp_path / "relpol_mod.py").write_text(
        "from adaptspec.policy import Policy\n"
        "P = Policy(k_max=3)\nD = {'k_max': 2, 'classes': {'code': {}}, 'default_class': 'code'}\n"
        "NOT = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_policy("relpol_mod:P").k_max == 3
    assert load_policy("relpol_mod:D").k_max == 2
    with pytest.raises(PolicyError, match="must be a mapping"):
        load_policy("relpol_mod:NOT")
    with pytest.raises(PolicyError, match="no attribute"):
        load_policy("relpol_mod:MISSING")
    with pytest.raises(PolicyError, match="cannot import"):
        load_policy("relpol_nonexistent_zz:P")


def test_yaml_never_imports_or_executes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    marker = tmp_path / "executed"
    (tmp_path / "relpol_sentinel.py").write_text(
        f"open({str(marker)!r}, 'w').write('imported')\nP = {{}}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    payloads = [
        f'!!python/object/apply:os.system ["touch {marker}"]',
        f"k_max: !!python/object/apply:os.system ['touch {marker}']",
        "!!python/name:os.system",
        "!!python/module:os",
        f"!!python/object/new:subprocess.Popen [[touch, '{marker}']]",
        "relpol_sentinel:P",  # a module path inside a YAML file is just a string
        "policy: relpol_sentinel:P",
        "classes: {code: {}}\ndefault_class: code\nstate_file: !!python/object:os.environ {}\n",
    ]
    for text in payloads:
        TRIED["yaml code-execution payloads"] += 1
        path = scratch_file(text)
        with pytest.raises(PolicyError) as err:
            load_policy(path)
        assert str(path) in str(err.value)
        assert not marker.exists(), text
    assert "relpol_sentinel" not in sys.modules
    # a file named like a module path is read as a file, not imported
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        Path("relpol_sentinel:P").write_text("k_max: 3\n")
        assert load_policy("relpol_sentinel:P").k_max == 3
    finally:
        os.chdir(cwd)
    assert not marker.exists()


def test_policy_module_failing_at_import_is_a_clear_error(monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
    (tmp_path / "relpol_boom.py").write_text("raise RuntimeError('boom at import')\n")
    (tmp_path / "relpol_syntax.py").write_text("x = (\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec in ("relpol_boom:P", "relpol_syntax:P"):
        with pytest.raises(PolicyError, match=spec.split(":")[0]):
            load_policy(spec)


def test_unhashable_cost_preset_is_a_clear_error() -> None:
    path = scratch_file("cost_model: {preset: [cpu]}\n")
    with pytest.raises(PolicyError, match="preset"):
        load_policy(path)


def test_yaml_alias_bomb_fails_fast() -> None:
    levels = 9
    lines = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(levels):
        prev, cur = chr(97 + i), chr(98 + i)
        lines.append(f"{cur}: &{cur} [{', '.join([f'*{prev}'] * 10)}]")
    lines.append(f"classes: *{chr(97 + levels)}")
    path = scratch_file("\n".join(lines) + "\n")
    code = ("import sys\nfrom adaptspec.policy import load_policy, PolicyError\n"
            "try:\n    load_policy(sys.argv[1])\n"
            "except PolicyError as e:\n    print(str(e)[:200])\n")
    try:
        proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                              text=True, timeout=5)
    except subprocess.TimeoutExpired:
        raise AssertionError("loading a 10**10-element alias bomb did not fail fast") from None
    assert "invalid policy" in proc.stdout
