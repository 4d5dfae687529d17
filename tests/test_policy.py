"""Policy loading and validation: good files load, bad ones fail with a message a person can
act on."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from adaptspec.classify import Classifier, RequestInfo
from adaptspec.policy import COST_PRESETS, Policy, PolicyError, load_policy, policy_from_dict

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["default", "latency-first", "throughput-first"])
def test_shipped_policies_load(name: str) -> None:
    p = load_policy(ROOT / "policies" / f"{name}.yaml")
    assert p.default_class in p.classes
    assert any(c.latency_critical for c in p.classes.values())


def test_default_policy_has_required_classes() -> None:
    p = load_policy(ROOT / "policies" / "default.yaml")
    assert {"code", "chat", "creative", "interactive"} <= set(p.classes)
    assert p.classes["interactive"].latency_critical
    assert p.class_k_max("interactive") == 0


def _write(tmp_path: Path, text: str) -> Path:
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    return f


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("k_max: 8\nclasses: {code: {k_max: 12}}\ndefault_class: code\n",
         ["bad.yaml", "classes", "k_max", "12"]),
        ("classes: {code: {prior_acceptance: 1.5}}\ndefault_class: code\n",
         ["bad.yaml", "classes.code.prior_acceptance", "1.5", "between 0 and 1"]),
        ("classes: {code: {}}\ndefault_class: chat\n",
         ["default_class", "'chat'", "code"]),
        ("classes: {code: {}}\ndefault_class: code\nexplorashun: 0.1\n",
         ["explorashun", "unknown field"]),
        ("classes: {code: {}}\ndefault_class: code\nrules: [{class: nope, match: {}}]\n",
         ["rules[0]", "'nope'"]),
        ("classes: {code: {}}\ndefault_class: code\nrules: [{class: code, match: "
         "{prompt_regex: '(('}}]\n", ["prompt_regex", "regular expression"]),
        ("classes: {code: {latency_critical: true, k_min: 2}}\ndefault_class: code\n",
         ["latency_critical", "k_min"]),
        ("classes: {other: {}}\ndefault_class: other\n", ["reserved"]),
        ("exploration: 2\n", ["exploration", "0.5", "2"]),
        ("latency_critical_slack: 0.05\nlatency_critical_burst: 0.02\n",
         ["latency_critical_burst (0.02) is below latency_critical_slack (0.05)"]),
        ("- just\n- a list\n", ["mapping"]),
        ("classes: {code: [\n", ["not valid YAML"]),
    ],
)
def test_bad_policies_name_file_field_and_value(
        tmp_path: Path, text: str, needles: list[str]) -> None:
    with pytest.raises(PolicyError) as exc:
        load_policy(_write(tmp_path, text))
    msg = str(exc.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"


def test_yaml_never_executes_code(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    f = _write(tmp_path, f"!!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(PolicyError):
        load_policy(f)
    assert not marker.exists()


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="cannot read"):
        load_policy(tmp_path / "nope.yaml")


def test_python_policy_from_module_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mypol.py").write_text(
        "from adaptspec.policy import Policy, ClassPolicy\n"
        "POLICY = Policy(classes={'a': ClassPolicy(), 'b': ClassPolicy(latency_critical=True)},"
        " default_class='a')\n"
        "AS_DICT = {'classes': {'x': {}}, 'default_class': 'x'}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert set(load_policy("mypol:POLICY").classes) == {"a", "b"}
    assert set(load_policy("mypol:AS_DICT").classes) == {"x"}
    with pytest.raises(PolicyError, match="no attribute"):
        load_policy("mypol:MISSING")
    with pytest.raises(PolicyError, match="not a policy file"):
        load_policy("not a path or module")


def test_cost_presets_apply_and_can_be_overridden() -> None:
    p = policy_from_dict({"cost_model": {"preset": "gpu", "knee_tokens": 99}})
    assert p.cost_model.base_ms == COST_PRESETS["gpu"]["base_ms"]
    assert p.cost_model.knee_tokens == 99


def test_classifier_order_and_fallbacks() -> None:
    p = load_policy(ROOT / "policies" / "default.yaml")
    c = Classifier(p)
    assert c.classify(RequestInfo(extra_args={"adaptspec_class": "creative"})) == "creative"
    # an unknown name falls through to the rules, then the default
    assert c.classify(RequestInfo(extra_args={"adaptspec_class": "zzz"})) == "chat"
    assert c.classify(RequestInfo(priority=-5)) == "interactive"
    assert c.classify(RequestInfo(headers={"X-Adaptspec-Latency": "critical"})) == "interactive"
    assert c.classify(RequestInfo(prompt="def f(x):\n    return x")) == "code"
    assert c.classify(RequestInfo(prompt="Summarize this text")) == "summarization"
    assert c.classify(RequestInfo(prompt="Tell me a story")) == "chat"


def test_dynamic_classes_allowed_names_only() -> None:
    p = policy_from_dict({"dynamic_classes": True})
    c = Classifier(p)
    assert c.classify(RequestInfo(extra_args={"adaptspec_class": "tenant-7"})) == "tenant-7"
    assert c.classify(RequestInfo(extra_args={"adaptspec_class": "../etc/passwd"})) == "default"
    assert c.classify(RequestInfo(extra_args={"adaptspec_class": "other"})) == "default"


_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
    st.text(max_size=20),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=12), inner, max_size=4)),
    max_leaves=12,
)
_fields = st.sampled_from(sorted(Policy.model_fields) + ["classes", "rules", "bogus"])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_fields, _values, max_size=6))
def test_fuzzed_policies_load_or_fail_cleanly(data: dict) -> None:
    try:
        p = policy_from_dict(data, "fuzz.yaml")
    except PolicyError as e:
        assert str(e).startswith("fuzz.yaml: ")
    else:
        assert p.default_class in p.classes


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_fuzzed_yaml_text_loads_or_fails_cleanly(text: str) -> None:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return
    try:
        policy_from_dict(data, "fuzz.yaml")
    except PolicyError:
        pass


@pytest.mark.parametrize("field", ["state_file", "warm_start"])
def test_a_state_path_no_file_system_can_hold_is_refused_at_start(field: str,
                                                                  tmp_path: Path) -> None:
    """Found by the long fuzzing run: a 300-character state_file validated, and every snapshot
    read and write then failed (ENAMETOOLONG), counted as controller faults."""
    for bad in ("x" * 300, f"/var/lib/{'y' * 260}.json", "a\0b", "/" + "d/" * 2100):
        with pytest.raises(ValidationError, match=f"{field} must be a file path"):
            Policy(**{field: bad})
    # a state file's name leaves room for an engine's index and the atomic write's temp name
    assert Policy(warm_start="w" * 250).warm_start == "w" * 250
    with pytest.raises(ValidationError, match="at most 223 bytes"):
        Policy(state_file="s" * 250)
    ok = str(tmp_path / ("s" * 223))
    assert Policy(state_file=ok).state_file == ok
    assert Policy(state_file="").state_file is None  # empty: no state file, as before


def test_the_benchmarks_fixed_k2_policy_plans_k2_for_every_class_that_drafts(
        tmp_path: Path) -> None:
    """`bench unseen`'s adaptspec_k2: adaptspec's machinery at vLLM's static K=2 (the A/B that
    separates what the machinery costs from what the decisions do): K = 2 whatever is accepted
    or how sure the proposer is, 0 for the latency-critical class."""
    import numpy as np

    from adaptspec.classify import RequestInfo
    from adaptspec.runtime import AdaptiveRuntime
    from adaptspec.tools.bench.unseen import fixed_k2_policy

    rt = AdaptiveRuntime(load_policy(fixed_k2_policy(tmp_path)), k_cap=8)
    classes = ["code", "chat", "creative", "summarization", "interactive"]
    ids = [f"r{i}" for i in range(len(classes))]
    for r, c in zip(ids, classes, strict=True):
        rt.admit(r, RequestInfo(extra_args={"adaptspec_class": c}))
    want = {r: 0 if c == "interactive" else 2 for r, c in zip(ids, classes, strict=True)}
    rng = np.random.default_rng(0)
    ks = {r: rt.k_for(r) for r in ids}
    for _ in range(50):
        drafted = [ks[r] for r in ids]
        accepted = [int(rng.integers(0, d + 1)) for d in drafted]  # anything from 0 to all
        ks = rt.step(ids, drafted, accepted, float(rng.uniform(0.05, 0.5)))
        assert ks == want
        drafting = [r for r in ids if ks[r]]
        assert rt.cut(drafting, [2] * len(drafting), [0.01] * len(drafting)) == \
            [2] * len(drafting)
    assert rt.errors == 0  # (a fault in `cut` would keep drafts as they are, and say so here)
