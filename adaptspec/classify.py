"""Map a request to its class: the explicit extra arg first, then the policy's rules in order."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from adaptspec.policy import _NAME, OTHER_CLASS, Policy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestInfo:
    """What an engine knows about a request when it arrives."""

    extra_args: Mapping[str, Any] | None = None
    headers: Mapping[str, str] | None = None
    priority: int = 0
    model: str | None = None
    prompt: str | None = None


@dataclass
class Classifier:
    policy: Policy
    _regex: list[re.Pattern[str] | None] = field(init=False)
    _warned: set[str] = field(init=False, default_factory=set)

    def __post_init__(self) -> None:
        self._regex = [
            re.compile(r.match.prompt_regex) if r.match.prompt_regex else None
            for r in self.policy.rules
        ]

    def classify(self, info: RequestInfo) -> str:
        p = self.policy
        named = (info.extra_args or {}).get(p.class_key)
        if isinstance(named, str):
            if named in p.classes:
                return named
            if p.dynamic_classes and named != OTHER_CLASS and re.match(_NAME, named):
                return named
            self._warn_once(named)
        for rule, rx in zip(p.rules, self._regex, strict=True):
            if self._matches(rule.match, rx, info):
                return rule.class_
        return p.default_class

    def _warn_once(self, name: str) -> None:
        # Bounded so a client sending random names cannot grow this set without limit.
        if len(self._warned) < 100 and name not in self._warned:
            self._warned.add(name)
            log.warning(
                "adaptspec: request names unknown class %r; using default class %r",
                name[:64], self.policy.default_class,
            )

    @staticmethod
    def _matches(m: Any, rx: re.Pattern[str] | None, info: RequestInfo) -> bool:
        if m.extra_args:
            args = info.extra_args or {}
            if any(str(args.get(k)) != v for k, v in m.extra_args.items()):
                return False
        if m.headers:
            headers = {k.lower(): v for k, v in (info.headers or {}).items()}
            if any(headers.get(k.lower()) != v for k, v in m.headers.items()):
                return False
        if m.priority_min is not None and info.priority < m.priority_min:
            return False
        if m.priority_max is not None and info.priority > m.priority_max:
            return False
        if m.model is not None and info.model != m.model:
            return False
        prompt = info.prompt or ""
        if m.prompt_contains and not any(s in prompt for s in m.prompt_contains):
            return False
        if rx is not None and not rx.search(prompt):
            return False
        return True
