"""The controller tests' policy and helpers (tests/test_controller*.py)."""

from __future__ import annotations

import numpy as np

from adaptspec.acceptance import AcceptanceEstimator, RequestAcceptance, learn
from adaptspec.cost import StepCostModel
from adaptspec.policy import ClassPolicy, CostModel, Policy

FREE_TOKENS = CostModel(base_ms=10, per_request_ms=0.1, per_draft_token_ms=0.0,
                        spec_overhead_ms=0.0, knee_tokens=1e6, over_knee_ms=0.0, learn=False)
COSTLY_TOKENS = CostModel(base_ms=10, per_request_ms=5, per_draft_token_ms=5,
                          spec_overhead_ms=1.0, knee_tokens=0, over_knee_ms=0.0, learn=False)


def policy(**kw: object) -> Policy:
    base: dict = {
        "classes": {
            "code": ClassPolicy(prior_acceptance=0.9, prior_strength=50),
            "creative": ClassPolicy(prior_acceptance=0.3, prior_strength=50),
            "interactive": ClassPolicy(latency_critical=True),
        },
        "default_class": "code",
        "exploration": 0.0,
        "hysteresis_steps": 1,
        "cost_model": FREE_TOKENS,
    }
    base.update(kw)
    return Policy(**base)


def predict(model: StepCostModel, batch: int, spec_tokens: int, max_k: int) -> float:
    """The model's step time (ms) for one plan."""
    return model.predict(batch, float(spec_tokens), float(max_k))


def run_chain(alpha: np.ndarray, k: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Accepted counts of drafts whose position j is accepted with prob alpha[j] (conditional)."""
    acc = np.zeros(len(k), dtype=np.int64)
    alive = np.ones(len(k), dtype=bool)
    for j in range(int(k.max(initial=0))):
        alive &= (j < k) & (rng.random(len(k)) < alpha[min(j, len(alpha) - 1)])
        acc += alive
    return acc


def fit(est: AcceptanceEstimator, cls: object, drafted: object, accepted: object) -> None:
    """One step's verifications into a class estimator (with records of their own)."""
    cls, drafted, accepted = (np.asarray(x, dtype=np.int64) for x in (cls, drafted, accepted))
    learn(est, RequestAcceptance(len(cls)), cls, np.arange(len(cls)), drafted, accepted)
