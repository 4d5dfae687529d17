"""A server's /metrics read back: Prometheus text -> samples, and adaptspec's series per class."""

from __future__ import annotations

from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


def parse_metrics(text: str) -> Samples:
    """Prometheus text format -> {sample name: {sorted label pairs: value}}."""
    out: Samples = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name][tuple(sorted(sample.labels.items()))] = sample.value
    return out


def per_class(metrics: Samples) -> dict[str, dict[str, float]]:
    """Per-class summary of the adaptspec_* series: draft_tokens, accepted_tokens, k_sum,
    k_count, steps_<decision>, mean_k and acceptance."""
    rows: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for name, key in (("adaptspec_draft_tokens_total", "draft_tokens"),
                      ("adaptspec_accepted_tokens_total", "accepted_tokens"),
                      ("adaptspec_chosen_k_sum", "k_sum"),
                      ("adaptspec_chosen_k_count", "k_count")):
        for labels, v in metrics.get(name, {}).items():
            rows[dict(labels)["class"]][key] += v
    for labels, v in metrics.get("adaptspec_steps_total", {}).items():
        d = dict(labels)
        rows[d["class"]]["steps_" + d["decision"]] += v
    for r in rows.values():
        r["mean_k"] = r["k_sum"] / r["k_count"] if r["k_count"] else 0.0
        r["acceptance"] = r["accepted_tokens"] / r["draft_tokens"] if r["draft_tokens"] else 0.0
    return {k: dict(v) for k, v in rows.items()}


def difference(after: Samples, before: Samples) -> Samples:
    """What each counter series moved between two readings (gauges come out as their change
    too: read them from `after`)."""
    return {name: {labels: v - before.get(name, {}).get(labels, 0.0)
                   for labels, v in series.items()} for name, series in after.items()}
