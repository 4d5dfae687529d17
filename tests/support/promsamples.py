"""Reading adaptspec_* samples from a registry by name and labels (prometheus-client parses),
so tests need not know the exposition's label order. The engine label defaults to "0", the
only engine of a test's runtime."""

from __future__ import annotations

from prometheus_client import CollectorRegistry


def value(reg: CollectorRegistry, name: str, labels: dict[str, str] | None = None,
          engine: str = "0") -> float | None:
    """The sum of the samples `name` whose labels include these (a series' other labels, such
    as adaptspec_steps' reason, summed over); None when no series matches."""
    want = {"engine": engine, **(labels or {})}
    found = [s.value for m in reg.collect() for s in m.samples
             if s.name == name and all(s.labels.get(k) == v for k, v in want.items())]
    return sum(found) if found else None
