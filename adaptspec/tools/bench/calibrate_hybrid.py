"""The simulator's hybrid against `adaptspec bench`'s hybrid cells.

A hybrid configuration chooses per request and step which proposer drafts. The benchmark
records, per cell and class, each proposer's speculating decisions and the drafts it had
verified and accepted (report.py, `proposers`). From those, each (proposer, class) gets a
per-position acceptance alpha: the one whose expected tokens per step with the proposer's mean
draft length, (1 - alpha^(K+1)) / (1 - alpha), is the measured 1 + accepted / decisions (a
decision that found no draft counts as one that drafted nothing accepted). A class a proposer
did not draft for takes that proposer's alpha pooled over classes.

The simulator then serves the cell's class mix at each batch size the cell decoded at, with
the step time fitted to the cells without adaptspec (stepfit.fit_cost), under the hybrid
controller (simulator.Adaptive with the stream's proposers), and a cell's predicted decode
time is the tokens it decoded at each batch size over the simulated throughput there, as in
calibrate.py. As in the benchmark, the cells run one after another on one server: the
simulated controller carries what it learned from one batch size and cell to the next. Each
cell is predicted twice:

* in sample: the acceptance fitted to the cell itself;
* out of sample: the acceptance fitted to the same configuration's cells at the other
  concurrencies (none there: no out-of-sample prediction).

A hybrid with a draft model is simulated with the draft's cost as its controller had fitted
it by the cell's end (ms per draft token, per catch-up token: `draft_model_cost_ms`, from the
adaptspec_draft_model_cost_ms gauge), a request's first use catching up on its class's mean
prompt; a cell that did not record it is listed as skipped.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from adaptspec.policy import CostModel, Policy
from adaptspec.tools import simulator as sim
from adaptspec.tools.bench.stepfit import _mix_stream, _ratio_cells, alpha_from_length

# Proposers that run a model: their passes cost time (recorded as draft_model_cost_ms).
MODEL_PROPOSERS = ("draft",)
# The hybrid server's order of its proposers (adaptspec_vllm.proposer.HybridProposer): the
# controller's first proposer is its default, so the simulated one must have the same first.
SERVER_ORDER = ("ngram", "suffix", "draft")


def hybrid_configs(result: dict[str, Any]) -> dict[str, list[str]]:
    """Adaptive configurations whose cells record several proposers: {name: proposers}."""
    out: dict[str, list[str]] = {}
    for cfg in result["configs"]:
        if not cfg["adaptive"]:
            continue
        seen: set[str] = set()
        for s in result["summary"].get(cfg["name"], {}).values():
            for row in s.get("classes", {}).values():
                seen.update(row.get("proposers", {}))
        if len(seen) > 1:
            out[cfg["name"]] = sorted(seen, key=lambda p: (SERVER_ORDER.index(p)
                                                           if p in SERVER_ORDER else 99, p))
    return out


def proposer_alphas(result: dict[str, Any], config: str, concurrencies: list[str],
                    proposers: list[str]) -> dict[str, dict[str, float]] | None:
    """alpha per proposer and class from the config's cells at these concurrencies (pooled);
    None where those cells recorded no decision."""

    counts: dict[tuple[str, str], np.ndarray] = {}
    for c in concurrencies:
        for cls, row in result["summary"][config][c]["classes"].items():
            for p, v in row.get("proposers", {}).items():
                counts.setdefault((p, cls), np.zeros(3))
                counts[(p, cls)] += (v["decisions"], v["drafted"], v["accepted"])
    if not counts:
        return None

    def alpha(n: np.ndarray) -> float:
        decisions, drafted, accepted = n
        if decisions <= 0 or drafted <= 0:
            return 0.0
        k = max(1, round(drafted / decisions))
        return alpha_from_length(1.0 + accepted / decisions, k)

    out: dict[str, dict[str, float]] = {}
    for p in proposers:
        mine = {cls: n for (q, cls), n in counts.items() if q == p}
        pooled = alpha(sum(mine.values(), np.zeros(3)))
        out[p] = {cls: alpha(n) if n[0] > 0 else pooled for cls, n in mine.items()}
        out[p]["*"] = pooled
    return out


def simulate_hybrid(stream_parts: dict[str, Any], alphas: dict[str, dict[str, float]],
                    cost: CostModel, policy: Policy, conc: int, seed: int,
                    model_cost: dict[str, tuple[float, float]] | None = None,
                    prompts: dict[str, float] | None = None, controller: Any = None
                    ) -> tuple[dict[str, float], Any]:
    """Decode tokens/s of plain decoding and of the hybrid controller on one batch size's
    stream (stepfit._mix_stream's parts), and the controller after it. model_cost:
    {proposer: (ms per draft token, per catch-up token)} of the proposers that run a model;
    prompts: mean prompt tokens by class; controller: one that served before (a benchmark's
    cells run one after another on one server: what it learned carries over)."""
    names, cls, length = stream_parts["names"], stream_parts["cls"], stream_parts["length"]
    rng = np.random.default_rng([seed, conc, 1])
    width = max(policy.k_max, 1)
    props = list(alphas)  # (in the server's order: proposer_alphas keeps the one given)
    alpha = np.stack([
        np.array([alphas[p].get(names[c], alphas[p]["*"]) for c in cls])[:, None]
        * np.ones(width) for p in props])
    coins = rng.random((len(cls), int(length.max()) + width), dtype=np.float32)
    model_cost = model_cost or {}
    pass_ms = np.array([model_cost.get(p, (0.0, 0.0))[0] for p in props])
    catchup_ms = np.array([model_cost.get(p, (0.0, 0.0))[1] for p in props])
    prompt = np.array([round((prompts or {}).get(names[c], 0.0)) for c in cls], dtype=np.int64)
    stream = sim.Stream(names, cls, length, alpha[0], coins,
                        proposers=sim.Proposers(tuple(props), alpha, pass_ms, catchup_ms,
                                                prompt))
    noise = rng.lognormal(-sim.STEP_NOISE ** 2 / 2, sim.STEP_NOISE, 4096)
    n_done = len(cls) - conc
    free = cost.model_copy(update={"per_draft_position_ms": 0.0, "per_request_pass_ms": 0.0})
    plain = sim.FixedK(stream, np.zeros(len(names)), np.zeros(len(names), dtype=bool), free,
                       conc)
    hybrid = sim.Adaptive(policy, stream, conc, seed)
    if controller is not None:
        for req_id in list(controller._slot_of):  # the last stream's requests in flight
            controller.remove_request(req_id)
        hybrid.ctl = controller
    return ({"none": sim.simulate(stream, conc, n_done, free, noise, plain).tokens_per_s,
             "hybrid": sim.simulate(stream, conc, n_done, free, noise, hybrid).tokens_per_s},
            hybrid.ctl)


def hybrid_check(result: dict[str, Any], rows: list[dict[str, Any]],
                 cells: dict[tuple[str, int], dict[str, Any]], cost_at: Any, policy: Policy,
                 seed: int = 0) -> dict[str, Any]:
    """Predicted against measured ratio to plain decoding for every hybrid cell, in sample and
    out of sample (see the module docstring)."""

    checks: list[dict[str, Any]] = []
    fitted: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for config, proposers in hybrid_configs(result).items():
        concs = sorted(result["summary"][config], key=int)
        cells_of = result["summary"][config]
        if any(p in MODEL_PROPOSERS for p in proposers) and not all(
                "draft_model_cost_ms" in cells_of[c] for c in concs):
            skipped[config] = "its draft model's cost is not recorded in bench.json"
            continue
        carried: dict[bool, Any] = {True: None, False: None}  # one server per prediction
        for conc in concs:
            fit = cells_of[conc].get("draft_model_cost_ms", {})
            model_cost = {p: (fit.get("per_token", 0.0), fit.get("per_catchup_token", 0.0))
                          for p in proposers if p in MODEL_PROPOSERS}
            prompts = {cls: row.get("prompt_tokens_mean", 0.0)
                       for cls, row in cells_of[conc]["classes"].items()}
            others = [c for c in concs if c != conc]
            for in_fit, source in ((True, [conc]), (False, others)):
                alphas = proposer_alphas(result, config, source, proposers) if source else None
                if alphas is None:
                    continue
                if in_fit:
                    fitted[f"{config} c={conc}"] = {p: {c: round(a, 4) for c, a in by.items()}
                                                    for p, by in alphas.items()}
                here = [r for r in rows if r["concurrency"] == int(conc)
                        and r["config"] in ("none", config)]
                decode_s: dict[tuple[str, int], float] = {}
                for batch in sorted({r["batch"] for r in here}):
                    parts = _mix_stream(result, policy, batch, seed, conc)
                    tps, carried[in_fit] = simulate_hybrid(
                        parts, alphas, cost_at(batch), policy, batch, seed, model_cost, prompts,
                        carried[in_fit])
                    for r in here:
                        if r["batch"] == batch:
                            key = (r["config"], int(conc))
                            name = "none" if r["config"] == "none" else "hybrid"
                            decode_s[key] = decode_s.get(key, 0.0) + r["tokens"] / tps[name]
                mine = {k: v for k, v in cells.items()
                        if k in (("none", int(conc)), (config, int(conc)))}
                for cell in _ratio_cells(mine, decode_s, lambda _name, f=in_fit: f):
                    cell["acceptance_from"] = "this cell" if in_fit else "other concurrencies"
                    checks.append(cell)

    def worst(in_fit: bool) -> float | None:
        errs = [abs(c["error"]) for c in checks if c["in_fit"] == in_fit]
        return round(max(errs), 4) if errs else None

    return {"cells": checks, "alpha": fitted, "skipped": skipped,
            "worst_error_in_sample": worst(True), "worst_error_out_of_sample": worst(False)}
