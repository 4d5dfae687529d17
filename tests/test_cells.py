"""The bench's per-class counters, read from a server's /metrics as prometheus-client parses
them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest

from adaptspec.tools.bench.cells import _spec_counters, class_counters
from adaptspec.tools.promtext import parse_metrics


def _parsed(registry: CollectorRegistry) -> dict[str, dict]:
    return parse_metrics(generate_latest(registry).decode())


def test_class_counters_say_where_the_cut_dropped_draft_tokens() -> None:
    reg = CollectorRegistry()
    cut = Counter("adaptspec_confidence_cut_tokens", "", ["class"], registry=reg)
    arrived = Counter("adaptspec_confidence_drafts", "", ["class"], registry=reg)
    trimmed = Counter("adaptspec_trimmed_tokens", "", ["class"], registry=reg)
    drafted = Counter("adaptspec_draft_tokens", "", ["class"], registry=reg)
    arrived.labels("chat").inc(10)
    cut.labels("chat").inc(3)
    trimmed.labels("chat").inc(5)
    trimmed.labels("code").inc(1)
    drafted.labels("chat").inc(40)
    got = class_counters(_parsed(reg))
    assert got["chat"] == {"drafted": 40.0, "confidence_drafts": 10.0, "confidence_cut": 3.0,
                           "trimmed": 5.0}
    assert got["code"] == {"trimmed": 1.0}


def test_per_position_counters_of_adaptspec_and_of_vllm() -> None:
    reg = CollectorRegistry()
    drafted = Counter("adaptspec_draft_tokens_per_pos", "", ["class", "position"],
                      registry=reg)
    accepted = Counter("adaptspec_accepted_tokens_per_pos", "", ["class", "position"],
                       registry=reg)
    vllm_acc = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "",
                       ["engine", "position"], registry=reg)
    drafted.labels("chat", "0").inc(10)
    drafted.labels("chat", "1").inc(6)
    accepted.labels("chat", "0").inc(7)
    vllm_acc.labels("0", "0").inc(5)
    vllm_acc.labels("0", "1").inc(2)
    m = _parsed(reg)
    assert class_counters(m)["chat"] == {"drafted_pos0": 10.0, "drafted_pos1": 6.0,
                                         "accepted_pos0": 7.0}
    spec = _spec_counters(m)
    assert spec["accepted_pos:0"] == 5.0 and spec["accepted_pos:1"] == 2.0


def test_per_proposer_counters_beside_the_class_totals() -> None:
    """A class's drafted and accepted tokens by proposer (what the simulator's hybrid is fitted
    to), beside its totals over every proposer."""
    reg = CollectorRegistry()
    drafted = Counter("adaptspec_draft_tokens", "", ["class", "proposer"], registry=reg)
    accepted = Counter("adaptspec_accepted_tokens", "", ["class", "proposer"], registry=reg)
    drafted.labels("chat", "ngram").inc(20)
    drafted.labels("chat", "suffix").inc(3)
    accepted.labels("chat", "ngram").inc(15)
    assert class_counters(_parsed(reg))["chat"] == {
        "drafted": 23.0, "accepted": 15.0, "drafted_ngram": 20.0, "drafted_suffix": 3.0,
        "accepted_ngram": 15.0}
