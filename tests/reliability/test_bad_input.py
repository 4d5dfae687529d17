"""Bad input: always a clear error, or a fold into the default or `other` class; never a crash,
never executed code, never unbounded state.

Fuzzed (hypothesis) YAML and Python policies, vllm_xargs values (huge strings, unicode, any JSON
shape, 10,000 distinct class names) against AdaptiveRuntime + Metrics, malformed
--speculative-config through check_speculative_config and the CLI, snapshot contents; and the
security promises: no code from YAML, Python policies only from an explicit module path, class
names never become file paths, snapshot files 0600. The running server gets the same kinds of
vllm_xargs in test_load.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import stat
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from _rel import LONG
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from adaptspec import snapshot
from adaptspec.classify import RequestInfo
from adaptspec.controller import Controller
from adaptspec.metrics import Metrics
from adaptspec.policy import OTHER_CLASS, Policy, PolicyError, load_policy, policy_from_dict
from adaptspec.runtime import AdaptiveRuntime
from adaptspec.serve import ServeError, check_speculative_config, serve

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = 1500 if LONG else 120
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=not LONG,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TRIED: Counter[str] = Counter()
SCRATCH = Path(tempfile.mkdtemp(prefix="adaptspec-fuzz-"))

BASE_POLICY = yaml.safe_load((ROOT / "policies" / "default.yaml").read_text())

weird_scalars = st.one_of(
    st.none(), st.booleans(),
    st.sampled_from([-1, 0, 1, 2, 63, 64, 65, 10**6, 10**9, 2**63, -(2**63), 10**400]),
    st.integers(), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 1.0, 0.5, 1e-300, 1e308, -0.0]),
    st.text(max_size=40), st.sampled_from(["", "x" * 10_000, "ünïcødé-类-🙂", "../../etc/passwd",
                                           "other", "default", "\x00", "a\nb: c"]),
)
json_like = st.recursive(weird_scalars, lambda c: st.lists(c, max_size=4)
                         | st.dictionaries(st.text(max_size=12), c, max_size=4), max_leaves=12)


@pytest.fixture(scope="module", autouse=True)
def _report() -> Iterator[None]:
    yield
    total = sum(TRIED.values())
    print(f"\nbad input: {total} inputs tried: " + ", ".join(f"{k} {v}" for k, v in
                                                             sorted(TRIED.items())))


def _write(text: str | bytes, suffix: str = ".yaml") -> Path:
    fd, name = tempfile.mkstemp(suffix=suffix, dir=SCRATCH)
    with os.fdopen(fd, "wb") as f:
        f.write(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text)
    return Path(name)


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
    path = _write(text)
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
    path = _write(text)
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
        path = _write(text)
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
    path = _write("cost_model: {preset: [cpu]}\n")
    with pytest.raises(PolicyError, match="preset"):
        load_policy(path)


def test_yaml_alias_bomb_fails_fast() -> None:
    levels = 9
    lines = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(levels):
        prev, cur = chr(97 + i), chr(98 + i)
        lines.append(f"{cur}: &{cur} [{', '.join([f'*{prev}'] * 10)}]")
    lines.append(f"classes: *{chr(97 + levels)}")
    path = _write("\n".join(lines) + "\n")
    code = ("import sys\nfrom adaptspec.policy import load_policy, PolicyError\n"
            "try:\n    load_policy(sys.argv[1])\n"
            "except PolicyError as e:\n    print(str(e)[:200])\n")
    try:
        proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                              text=True, timeout=5)
    except subprocess.TimeoutExpired:
        raise AssertionError("loading a 10**10-element alias bomb did not fail fast") from None
    assert "invalid policy" in proc.stdout


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
    assert rt.state_sizes()["requests"] == 0 and rt.state_sizes()["k_entries"] == 0
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
    assert good.returncode == 0 and "vllm.entrypoints.openai.api_server" in good.stdout


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
    path = _write(raw, suffix=".json")
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

