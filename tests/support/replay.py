"""A recorded-steps replay of the runtime: the same synthetic engine run, step by step, through
any version of AdaptiveRuntime (admit / step / finish / proposer_for), so the decisions of one
version can be compared with another's (tests/test_plan.py, tests/data/replay_*.json).

The engine is seeded and made of plain numpy: requests of several classes (latency-critical and
dynamic ones included) arrive and finish; each verifies what the runtime granted it at the
step before (a new request what its class may draft: it proposes in the step that prefills it),
accepting a geometric run of its class's acceptance; each step's time follows a linear cost.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from adaptspec.classify import RequestInfo
from adaptspec.policy import Policy

CLASSES = ("code", "chat", "summarization", "creative", "interactive", "tenant_a", "tenant_b")
ALPHA = {"code": 0.85, "chat": 0.5, "summarization": 0.7, "creative": 0.3, "interactive": 0.6,
         "tenant_a": 0.9, "tenant_b": 0.2}


def replay_policy() -> Policy:
    from adaptspec.policy import load_policy

    return load_policy("default").model_copy(update={"dynamic_classes": True})


def drive(rt: Any, policy: Policy, steps: int = 300, seed: int = 0,
          n_proposers: int = 1) -> list[list[list[int]]]:
    """Run the synthetic engine for `steps` steps; per step, per scheduled request (in arrival
    order): [K granted, proposer chosen]."""
    rng = np.random.default_rng(seed)
    live: dict[str, list[Any]] = {}  # req -> [class, K to verify next, tokens left, source]
    out: list[list[list[int]]] = []
    n = 0
    for _ in range(steps):
        for _ in range(int(rng.poisson(0.8))):
            cls = CLASSES[int(rng.integers(len(CLASSES)))]
            req = f"r{n}"
            n += 1
            rt.admit(req, RequestInfo(extra_args={"adaptspec_class": cls}))
            settings = cls if cls in policy.classes else policy.default_class
            k0 = min(policy.class_k_max(settings), rt.k_cap)
            live[req] = [cls, k0, int(rng.integers(5, 60)), rt.proposer_for(req)]
        if not live:
            continue
        ids = list(live)
        drafted = [live[r][1] for r in ids]
        accepted = []
        for r, d in zip(ids, drafted, strict=True):
            # acceptance differs by proposer, so a hybrid's choice has something to learn
            a = ALPHA[live[r][0]] * (1.0 - 0.3 * live[r][3])
            run = 0
            while run < d and rng.random() < a:
                run += 1
            accepted.append(run)
        step_s = (10.0 + 0.2 * len(ids) + 0.4 * sum(drafted)) * rng.uniform(0.95, 1.05) / 1e3
        sources = [live[r][3] for r in ids] if n_proposers > 1 else None
        ks = rt.step(ids, drafted, accepted, step_s, sources)
        row = []
        for r in ids:
            k, p = int(ks[r]), int(rt.proposer_for(r))
            row.append([k, p])
            live[r][1], live[r][3] = k, p
            live[r][2] -= 1
            if live[r][2] <= 0:
                del live[r]
                rt.finish(r)
        out.append(row)
    return out
