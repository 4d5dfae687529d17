"""Separate queues: which data-parallel engine takes a request.

With `latency_critical_engines` set, a server with several data-parallel engines sends the
latency-critical classes' requests to those engines, which never draft, and every other request
to the rest, which speculate without a latency-critical request in their batches to slow down.
The request is classified where it is routed (the API server), by the same rules the engines
use (adaptspec.classify), so no client needs to know engine numbers.

Without the option, or with one engine, nothing here runs: every engine takes every class and
the latency-critical slack rules shared batches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from adaptspec.classify import Classifier, RequestInfo
from adaptspec.policy import Policy, PolicyError


@dataclass(frozen=True)
class EngineSplit:
    """Engine indices by the traffic they take."""

    critical: tuple[int, ...]
    others: tuple[int, ...]


def split_engines(policy: Policy, engines: int) -> EngineSplit | None:
    """The split for a server of `engines` data-parallel engines; None without the option.
    Raises PolicyError for a split that cannot serve: an index out of range, or no engine
    left for the other classes (which includes a server without data parallelism)."""
    critical = tuple(sorted(policy.latency_critical_engines))
    if not critical:
        return None
    if engines < 2:
        raise PolicyError(
            f"latency_critical_engines {list(critical)} needs data parallelism "
            "(--data-parallel-size 2 or more): with one engine every request shares it. "
            "Drop the option to keep latency-critical requests in shared batches.")
    out = [e for e in critical if e >= engines]
    if out:
        raise PolicyError(
            f"latency_critical_engines names engine {out[0]}, but this server has {engines} "
            f"data-parallel engines (0 to {engines - 1})")
    others = tuple(e for e in range(engines) if e not in critical)
    if not others:
        raise PolicyError(
            f"latency_critical_engines names all {engines} engines: the other classes would "
            "have none. Leave at least one out.")
    return EngineSplit(critical, others)


def least_loaded(candidates: Sequence[int], load: Mapping[int, float] | Sequence[float],
                 start: int = 0) -> int:
    """The candidate with the smallest load; ties go to the first from `start` (an offset into
    `candidates`, rotated by the caller so that equal engines take turns)."""
    n = len(candidates)
    best, best_load = candidates[start % n], float("inf")
    for i in range(n):
        e = candidates[(start + i) % n]
        if load[e] < best_load:
            best, best_load = e, load[e]
    return best


class Router:
    """Picks the engines a request may go to. Attributes: split, classifier, model, policy."""

    def __init__(self, policy: Policy, engines: int, model: str | None = None) -> None:
        self.split = split_engines(policy, engines)
        self.classifier = Classifier(policy)
        self.model = model
        self.policy = policy

    def candidates(self, extra_args: Mapping[str, Any] | None,
                   priority: int = 0) -> tuple[int, ...] | None:
        """The engines this request may go to; None when there is no split."""
        if self.split is None:
            return None
        cls = self.classifier.classify(
            RequestInfo(extra_args=extra_args, priority=priority, model=self.model))
        # (a class made on the fly has the default class's settings)
        settings = self.policy.classes.get(cls) or self.policy.classes[self.policy.default_class]
        return self.split.critical if settings.latency_critical else self.split.others
