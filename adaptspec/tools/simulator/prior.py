"""A cost prior dearer than the engine: does the controller still find the K that pays?

The ``gpu`` preset (fitted to vLLM PR #32374, see published.py) prices drafting at large batch
from one table. At batch 128 it predicts a slowdown where EAGLE with K=3 measured 1.14-1.29x on
an H100 table it was not fitted on; at 256 it predicts a slowdown for every K. A controller
whose prior is that preset plans every step plain there, and a plain step never measures what a
draft costs: without the cost probe (``CostModel.probe_every``, learner.py) the prior would keep
speculation off for good.

Here the controller's prior is the preset and the engine's true curve is the preset with its
large-batch cost lowered (`cheaper_at_scale`): the over-knee term, so that a step of `batch`
requests with K drafts each is `cheaper` (20-30%) faster. Acceptance by draft position is
PR #32374's EAGLE drafter's (conditional 0.68 / 0.58 / 0.52 / 0.50 / 0.51). `settle` runs one
closed loop (engine.simulate, same stream and noise for every policy) and reports what the
controller did and when: the step of the first probe, the first step it drafted by its own
decision (the K that pays found), and its throughput against the truth's best static K.
SIMULATED: no GPU was measured.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from adaptspec.policy import CostModel, Policy
from adaptspec.tools.simulator.engine import Adaptive, FixedK, controller_policy, simulate, step_ms
from adaptspec.tools.simulator.published import PR32374_CONDITIONAL_ACCEPTANCE
from adaptspec.tools.simulator.stream import STEP_NOISE, ClassSpec, make_stream

EAGLE = (ClassSpec("chat", 1.0, PR32374_CONDITIONAL_ACCEPTANCE[0],
                   PR32374_CONDITIONAL_ACCEPTANCE[0], PR32374_CONDITIONAL_ACCEPTANCE),)
STATIC_KS = (0, 1, 2, 3, 4, 5)


def cheaper_at_scale(prior: CostModel, cheaper: float, batch: int = 128, k: int = 3
                     ) -> CostModel:
    """The prior with its over-knee cost lowered so that a step of `batch` requests drafting
    `k` each takes `cheaper` (a share) less time; plain steps below the knee are unchanged."""
    full = float(step_ms(prior, batch, batch * k, k))
    hinge = max(0.0, batch * (1 + k) - prior.knee_tokens)
    over = prior.over_knee_ms - cheaper * full / hinge if hinge else -1.0
    if over < 0:
        raise ValueError(f"the over-knee term cannot make that step {cheaper:.0%} cheaper")
    return prior.model_copy(update={"over_knee_ms": over, "preset": "custom"})


class _Recorder:
    """Adaptive, recording per step the K chosen and whether the step was a cost probe."""

    def __init__(self, inner: Adaptive) -> None:
        self.inner, self.ks, self.probe = inner, [], []

    def admit(self, positions: np.ndarray, reqs: np.ndarray) -> None:
        self.inner.admit(positions, reqs)

    def retire(self, reqs: np.ndarray) -> None:
        self.inner.retire(reqs)

    def choose(self, reqs: np.ndarray, drafted: np.ndarray, accepted: np.ndarray,
               last_ms: float | None) -> np.ndarray:
        before = self.inner.ctl.probes
        ks = np.asarray(self.inner.choose(reqs, drafted, accepted, last_ms))
        self.ks.append(int(ks.sum()))
        self.probe.append(self.inner.ctl.probes > before)
        return ks


def settle(policy: Policy, cheaper: float, concurrency: int, *, seed: int = 0,
           requests_per_slot: int = 3, preset: str = "gpu") -> dict[str, Any]:
    """One closed loop at `concurrency`: the controller's prior is `preset`, the engine's truth
    `cheaper_at_scale(preset, cheaper)`. Keys: best_static_k and static_over_none (K -> ratio)
    under the truth, prior_best_static_k (what the prior alone would rank first), adaptive_over
    _none, adaptive_over_best_static, steps, first_probe, found_at (the first step drafted by
    the controller's own decision, None if never), probes_before_found, probes."""
    prior = CostModel(preset=preset)
    truth = cheaper_at_scale(prior, cheaper)
    rng = np.random.default_rng([seed, concurrency])
    n_done = requests_per_slot * concurrency
    stream = make_stream(EAGLE, n_done + 2 * concurrency, concurrency, max(STATIC_KS), rng)
    noise = rng.lognormal(-STEP_NOISE**2 / 2, STEP_NOISE, 65536)
    none = np.zeros(1, dtype=bool)

    def static(cost: CostModel) -> dict[int, float]:
        return {k: simulate(stream, concurrency, n_done, cost, noise,
                            FixedK(stream, np.array([k]), none, cost, concurrency)).tokens_per_s
                for k in STATIC_KS}

    tps, prior_tps = static(truth), static(prior)
    best = max(tps, key=lambda k: tps[k])
    rec = _Recorder(Adaptive(controller_policy(policy, preset, "engine"), stream, concurrency,
                             seed))
    run = simulate(stream, concurrency, n_done, truth, noise, rec)
    drafted = np.asarray(rec.ks) > 0
    probe = np.asarray(rec.probe)
    own = np.flatnonzero(drafted & ~probe)
    found = int(own[0]) if own.size else None
    probes = np.flatnonzero(probe & drafted)
    return {
        "concurrency": concurrency, "cheaper": cheaper, "seed": seed,
        "static_over_none": {k: round(v / tps[0], 4) for k, v in tps.items()},
        "best_static_k": best,
        "prior_best_static_k": max(prior_tps, key=lambda k: prior_tps[k]),
        "adaptive_over_none": round(run.tokens_per_s / tps[0], 4),
        "adaptive_over_best_static": round(run.tokens_per_s / tps[best], 4),
        "steps": run.steps,
        "first_probe": int(probes[0]) if probes.size else None,
        "found_at": found,
        "probes_before_found": int((probes < (found if found is not None else run.steps)).sum()),
        "probes": int(probes.size),
    }


def sweep(policy: Policy, cheapers: tuple[float, ...] = (0.0, 0.2, 0.3),
          loads: tuple[int, ...] = (64, 128, 256, 512), seeds: int = 10) -> list[dict[str, Any]]:
    """`settle` over cheaper x load x seeds 0..seeds-1."""
    return [settle(policy, c, n, seed=s) for c in cheapers for n in loads for s in range(seeds)]


def format_sweep(rows: list[dict[str, Any]]) -> str:
    """Per (cheaper, load): the truth's best static K and its gain, what the prior ranks first,
    adaptive over plain and over the best static (median and worst over seeds), and the steps
    to the first learned draft (median, worst) with the probes it took."""
    lines = [f"{'cheaper':>7} {'load':>5} {'best K':>6} {'xplain':>7} {'prior K':>7} "
             f"{'adaptive xplain':>15} {'x best static (worst)':>21} "
             f"{'found at step (worst)':>21} {'probes':>6}"]
    keys = sorted({(r["cheaper"], r["concurrency"]) for r in rows})
    for c, n in keys:
        rs = [r for r in rows if r["cheaper"] == c and r["concurrency"] == n]
        best = rs[0]["best_static_k"]
        gain = np.median([r["static_over_none"][r["best_static_k"]] for r in rs])
        over = [r["adaptive_over_best_static"] for r in rs]
        found = [r["found_at"] for r in rs]
        f = ("never" if all(x is None for x in found) else
             f"{np.median([x for x in found if x is not None]):.0f} "
             f"({'never' if None in found else max(found)})")
        lines.append(
            f"{c:>7.0%} {n:>5} {best:>6} {gain:>7.3f} {rs[0]['prior_best_static_k']:>7} "
            f"{np.median([r['adaptive_over_none'] for r in rs]):>15.3f} "
            f"{np.median(over):>13.3f} ({min(over):.3f}) {f:>21} "
            f"{max(r['probes_before_found'] for r in rs):>6}")
    return "\n".join(lines)
