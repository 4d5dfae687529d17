"""Reading adaptspec_* samples from a registry by name and labels (prometheus-client parses),
so tests need not know the exposition's label order. The engine label defaults to "0", the
only engine of a test's runtime."""

from __future__ import annotations

from prometheus_client import CollectorRegistry


def value(reg: CollectorRegistry, name: str, labels: dict[str, str] | None = None,
          engine: str = "0") -> float | None:
    """The sample's value, None when the series does not exist."""
    return reg.get_sample_value(name, {"engine": engine, **(labels or {})})
