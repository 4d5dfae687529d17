"""Fit the simulator's step-time preset to `adaptspec bench` measurements, and check it.

The benchmark recorded when every client received every chunk of tokens; adaptspec.tools.bench.steps
rebuilds the engine steps from that: per cell (configuration, concurrency), its pure decode
steps by batch size (how many, their mean time, the tokens they gave) and the time of the other
steps, which prefilled prompts (most of the wall time at 16 clients: 15 prompts prefill in one
step of ~48 s on two cores). Two checks follow; both predict a cell's wall time as its decode
steps at their measured batch sizes, at the predicted step time, plus the time of the other
steps measured on its family's reference cell (none, or the family's static run with the
largest K), and compare the ratio of output tokens/s to no speculation with the measured one:

1. Step time. Plain decoding's step time per batch size (a table: on two CPU cores it is not
   monotone, 4 requests step faster than 2) plus the speculation terms of
   :class:`adaptspec.policy.CostModel` (per draft token, a proposer's fixed cost; per pass of a
   draft model, at least one a step, and per request and pass; a hinge above a knee of verified
   tokens where it fits markedly better) are fitted by non-negative least squares in relative
   error to the decode steps of the cells WITHOUT adaptspec (none and static K). With each
   cell's measured drafts per request-step, it predicts every cell's decode time; the adaptspec
   cells are predictions out of sample.
2. Simulation. Per proposer family, from the static run with the largest K: the share of
   request-steps with a draft and each class's acceptance given a draft (the per-position rate
   alpha whose expected tokens per step, (1 - alpha^(K+1)) / (1 - alpha), is the measured one).
   The simulator then serves the benchmark's class mix at each batch size with the fitted step
   time, for every static K and adaptspec; a cell's decode time is the tokens it decoded at each
   batch size over the simulated throughput there. Only the largest-K static run of each
   family fed the acceptance, so the other static Ks and adaptspec are predictions.

Then the same class mix and acceptance are simulated on the "gpu" preset (Llama-3.1-8B with an
EAGLE drafter, fitted to vLLM PR #32374's step times; adaptspec/policy.py), for the ratios a GPU
deployment could expect.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from adaptspec.policy import CostModel, Policy, load_policy
from adaptspec.tools import simulator as sim
from adaptspec.tools.bench.calibrate_hybrid import hybrid_check
from adaptspec.tools.bench.stepfit import (
    FITTED,
    GPU_LOADS,
    MIN_COVERAGE,
    TOLERANCE,
    _family,
    _mix_stream,
    _ratio_cells,
    alpha_from_length,
    fit_cost,
    observations,
    plain_step_ms,
    step_time_check,
)
from adaptspec.tools.simulator.compare import Load, oracle
from adaptspec.tools.simulator.stream import ORACLE_CANDIDATES

# ------------------------------------------------------------------------------ simulation


def class_acceptance(result: dict[str, Any], family: str
                     ) -> tuple[dict[str, float], str, float] | None:
    """Per-class alpha of a proposer family, from its static run with the largest K (tokens per
    step per class, pooled over concurrencies by request count), and the share of request-steps
    that had a draft at all (vLLM's n-gram drafts nothing where it finds no match). alpha is
    the acceptance given a draft: tokens per step = 1 + rate * (E_K(alpha) - 1)."""
    statics = [c for c in result["configs"]
               if _family(c) == family and not c["adaptive"] and c["spec"] is not None]
    if not statics:
        return None
    cfg = max(statics, key=lambda c: c["spec"]["num_speculative_tokens"])
    k = cfg["spec"]["num_speculative_tokens"]
    num: dict[str, float] = {}
    den: dict[str, float] = {}
    drafts = steps = 0.0
    for s in result["summary"][cfg["name"]].values():
        drafts += s.get("vllm_drafts", 0.0)
        steps += s.get("request_steps", 0.0)
        for cls, row in s["classes"].items():
            if math.isfinite(row.get("acceptance_length", float("nan"))):
                num[cls] = num.get(cls, 0.0) + row["acceptance_length"] * row["requests"]
                den[cls] = den.get(cls, 0.0) + row["requests"]
    # (a summary without draft counts: every step drafted, as a draft model does)
    rate = min(drafts / steps, 1.0) if drafts > 0 and steps > 0 else 1.0
    return ({cls: alpha_from_length(1.0 + (num[cls] / den[cls] - 1.0) / rate, k)
             for cls in num}, cfg["name"], rate)


def _drafter_cost(cost: CostModel, family: str, k: int) -> CostModel:
    """The cost of a configuration whose proposer may draft up to k tokens. A draft model's
    fixed cost is paid every step, whatever is drafted: folded into the base; its passes cost
    per position of the longest draft, at least one (simulate's min_passes), and per token they
    run: per_request_pass per request and pass, and as much again per verified draft token
    (see _spec_features). An n-gram proposer costs nothing per position."""
    if family != "draft_model" or k == 0:
        return cost.model_copy(update={"per_draft_position_ms": 0.0, "per_request_pass_ms": 0.0})
    return cost.model_copy(update={
        "base_ms": cost.base_ms + cost.spec_overhead_ms, "spec_overhead_ms": 0.0,
        "per_draft_token_ms": cost.per_draft_token_ms + cost.per_request_pass_ms})


def simulate_family(result: dict[str, Any], alphas: dict[str, float],
                    cost: CostModel | Callable[[int], CostModel], policy: Policy,
                    loads: list[int], ks: list[int], seed: int = 0, family: str = "ngram",
                    draft_rate: float = 1.0, concurrency: str | None = None,
                    oracle_k: dict[int, dict[str, int]] | None = None,
                    ) -> dict[str, dict[int, float]]:
    """Decode tokens/s of none, static K (every class, latency-critical too, as vLLM does) and
    the adaptspec controller (K up to max(ks)) on the benchmark's class mix (or that of one
    concurrency's stream), per load (a batch of that many requests). cost: the step time, or a
    function giving it per load. With `oracle_k` (filled per load), also "oracle": the best
    per-class static K in hindsight under the policy's latency rule (the simulator's oracle,
    K 0..max(ks) per class). K = 0 for every class is plain decoding, a server without the
    draft model; any other assignment pays a draft model's pass every step, as the others do."""
    out: dict[str, dict[int, float]] = {}
    width = max([*ks, policy.k_max, 1])
    for conc in loads:
        cost_here = cost(conc) if callable(cost) else cost
        parts = _mix_stream(result, policy, conc, seed, concurrency)
        names, cls, length, lc, rng = (parts[k] for k in ("names", "cls", "length", "lc", "rng"))
        n = len(cls)
        alpha = np.array([alphas.get(names[c], 0.0) for c in cls])[:, None] * np.ones(width)
        coins = rng.random((n, int(length.max()) + width), dtype=np.float32)
        avail = None
        if draft_rate < 1.0:
            avail = rng.random(coins.shape) < draft_rate
        stream = sim.Stream(names, cls, length, alpha, coins, avail=avail)
        noise = rng.lognormal(-sim.STEP_NOISE ** 2 / 2, sim.STEP_NOISE, 4096)
        n_done = n - conc
        # vLLM's static K drafts for every request, latency-critical ones too.
        no_lc = np.zeros(len(names), dtype=bool)
        runs: dict[str, tuple[sim.Chooser, CostModel]] = {
            "none": (sim.FixedK(stream, np.zeros(len(names)), no_lc, cost_here, conc),
                     _drafter_cost(cost_here, family, 0))}
        for k in ks:
            c_k = _drafter_cost(cost_here, family, k)
            runs[f"static_{k}"] = (sim.FixedK(stream, np.full(len(names), k), no_lc, c_k, conc),
                                   c_k)
        runs["adaptive"] = (sim.Adaptive(policy, stream, conc, seed),
                            _drafter_cost(cost_here, family, max(ks)))
        passes = 1 if family == "draft_model" else 0
        stats: dict[str, sim.RunStats] = {}
        for name, (chooser, c_run) in runs.items():
            stats[name] = sim.simulate(stream, conc, n_done, c_run, noise, chooser,
                                       min_passes=passes if name != "none" else 0)
        if oracle_k is not None:
            load = Load(stream, conc, n_done, _drafter_cost(cost_here, family, max(ks)), noise,
                         np.array([c in lc for c in names]), passes)
            statics = {0: stats["none"], **{k: stats[f"static_{k}"] for k in ks}}
            # K up to the family's largest, as the controller here is allowed
            stats["oracle"], oracle_k[conc] = oracle(load, policy, statics,
                                                     ORACLE_CANDIDATES[0],
                                                     list(range(max(ks) + 1)))
        for name, st in stats.items():
            out.setdefault(name, {})[conc] = st.tokens_per_s
    return out


def _static_name(result: dict[str, Any], family: str, k: int) -> str | None:
    for c in result["configs"]:
        if (_family(c) == family and not c["adaptive"] and c["spec"] is not None
                and c["spec"]["num_speculative_tokens"] == k):
            return c["name"]
    return None


def _adaptive_name(result: dict[str, Any], family: str) -> str | None:
    return next((c["name"] for c in result["configs"]
                 if c["adaptive"] and _family(c) == family), None)


def cost_at(fitted: dict[str, Any]) -> Callable[[int], CostModel]:
    """The fitted step time as the simulator's CostModel at each batch size: its base is
    plain decoding's step time there, less what the formula's hinge adds for the batch itself
    (so that the hinge costs the draft tokens only, as fitted)."""
    def at(batch: int) -> CostModel:
        coef = {k: fitted[k] for k in FITTED}
        hinge = coef["over_knee_ms"] * max(0.0, batch - fitted["knee_tokens"])
        return CostModel(preset="cpu", per_request_ms=0.0, knee_tokens=fitted["knee_tokens"],
                         base_ms=max(plain_step_ms(fitted, batch) - hinge, 0.0), **coef)
    return at


def calibrate(result: dict[str, Any], policy: Policy | None = None, seed: int = 0
              ) -> dict[str, Any]:
    """Both checks and the gpu-preset report for one bench.json (see the module docstring)."""
    # (keys of the summary are concurrencies: ints in memory, strings once read from JSON)
    result = {**result, "summary": {name: {str(c): s for c, s in by_c.items()}
                                    for name, by_c in result["summary"].items()}}
    if policy is None:
        policy = load_policy(result.get("policy") or None)
    rows, cells = observations(result)
    fitted = fit_cost(rows)
    step_cells = step_time_check(rows, cells, fitted)
    sim_cells, families = [], {}
    gpu: dict[str, Any] = {}
    gpu_cost = CostModel(preset="gpu")
    for family in ("draft_model", "ngram"):
        fit = class_acceptance(result, family)
        if fit is None:
            continue
        alphas, source, rate = fit
        ks = sorted(c["spec"]["num_speculative_tokens"] for c in result["configs"]
                    if _family(c) == family and not c["adaptive"] and c["spec"] is not None)
        fam_policy = policy.model_copy(update={"k_max": min(policy.k_max, max(ks))})
        names = {f"static_{k}": _static_name(result, family, k) for k in ks}
        names.update(none="none", adaptive=_adaptive_name(result, family))
        real_to_sim = {real: sim_name for sim_name, real in names.items() if real}
        fam_rows = [r for r in rows if r["config"] in real_to_sim]
        # Every batch size a cell decoded at is simulated as a batch of that many requests,
        # drawn from the class mix of the cell's own stream; a cell's decode time is the tokens
        # it decoded at each batch size over the throughput there.
        decode_s: dict[tuple[str, int], float] = {}
        for conc in sorted({r["concurrency"] for r in fam_rows}):
            here = [r for r in fam_rows if r["concurrency"] == conc]
            sim_tps = simulate_family(result, alphas, cost_at(fitted), fam_policy,
                                      sorted({r["batch"] for r in here}), ks, seed, family, rate,
                                      concurrency=str(conc))
            for r in here:
                key = (r["config"], conc)
                decode_s[key] = decode_s.get(key, 0.0) + r["tokens"] / sim_tps[
                    real_to_sim[r["config"]]][r["batch"]]
        fam_cells = {key: c for key, c in cells.items() if key[0] in real_to_sim}
        sim_cells += _ratio_cells(fam_cells, decode_s, lambda name, src=source: name == src)
        families[family] = {"alpha": {c: round(a, 4) for c, a in alphas.items()},
                            "alpha_from": source, "draft_rate": round(rate, 4)}
        # A GPU deployment sets its cost prior to its hardware (cost_model.preset: gpu).
        oracle_k: dict[int, dict[str, int]] = {}
        g = simulate_family(result, alphas, gpu_cost,
                            sim.controller_policy(fam_policy, "gpu", "engine"),
                            list(GPU_LOADS), ks, seed, family, rate, oracle_k=oracle_k)
        gpu[family] = {
            "tokens_per_s": {name: {str(n): round(v, 2) for n, v in by.items()}
                             for name, by in g.items()},
            "adaptive_over_none": {str(n): round(g["adaptive"][n] / g["none"][n], 4)
                                   for n in GPU_LOADS},
            "adaptive_over_best_static": {
                str(n): round(g["adaptive"][n] / max(g[f"static_{k}"][n] for k in ks), 4)
                for n in GPU_LOADS},
            "adaptive_over_oracle": {str(n): round(g["adaptive"][n] / g["oracle"][n], 4)
                                     for n in GPU_LOADS},
            "oracle_over_best_static": {
                str(n): round(g["oracle"][n] / max(g[f"static_{k}"][n] for k in ks), 4)
                for n in GPU_LOADS},
            "oracle_k": {str(n): ks_n for n, ks_n in oracle_k.items()},
        }

    hybrid = hybrid_check(result, rows, cells, cost_at(fitted), policy, seed)

    def worst(cells: list[dict[str, Any]], out_of_fit: bool) -> float | None:
        errs = [abs(c["error"]) for c in cells if not (out_of_fit and c["in_fit"])]
        return round(max(errs), 4) if errs else None

    return {
        "cost_model_cpu": {k: (round(v, 4) if isinstance(v, float) else
                               {b: round(x, 2) for b, x in v.items()})
                           for k, v in fitted.items()},
        "step_time_check": step_cells,
        "step_time_worst_error": worst(step_cells, False),
        "acceptance": families,
        "simulator_check": sim_cells,
        "simulator_worst_error": worst(sim_cells, False),
        "tolerance": TOLERANCE,
        # Cells whose steps the chunk times did not resolve (share of decode tokens in clean
        # decode steps below MIN_COVERAGE): where there are any, the checks mean little.
        "unresolved_cells": {f"{c['config']} c={c['concurrency']}": round(c["coverage"], 3)
                             for c in cells.values() if c["coverage"] < MIN_COVERAGE},
        "within_tolerance": {
            "step_time": (worst(step_cells, False) or 0.0) <= TOLERANCE,
            "simulator": (worst(sim_cells, False) or 0.0) <= TOLERANCE,
        },
        "gpu_preset": gpu,
        "hybrid_check": hybrid,
    }


def format_report(cal: dict[str, Any]) -> str:
    cpu = cal["cost_model_cpu"]
    lines = ["calibrated cpu step time (ms): plain decoding by batch size " + ", ".join(
        f"{b}: {v:.0f}" for b, v in cpu["plain_step_ms"].items()) + "; " + ", ".join(
        f"{k} {v:.2f}" for k, v in cpu.items() if k != "plain_step_ms")]
    for title, key in (("step-time model (measured acceptance)", "step_time_check"),
                       ("simulator (fitted acceptance)", "simulator_check")):
        lines.append(f"{title}: ratio to no speculation, predicted vs measured")
        lines.append(f"  {'config':<18}{'c':>4}{'measured':>10}{'predicted':>11}{'error':>8}")
        for c in cal[key]:
            mark = "" if not c["in_fit"] else "  (fitted)"
            lines.append(f"  {c['config']:<18}{c['concurrency']:>4}"
                         f"{c['measured_over_none']:>10.2f}{c['predicted_over_none']:>11.2f}"
                         f"{c['error']:>+8.1%}{mark}")
    if cal.get("unresolved_cells"):
        lines.append(f"NOT MEANINGFUL: {len(cal['unresolved_cells'])} cells were not resolved "
                     "into engine steps (share of decode tokens in clean decode steps: "
                     + ", ".join(f"{k} {v:.0%}" for k, v in cal["unresolved_cells"].items())
                     + "); the steps are as short as the clients' timing jitter")
    lines.append(f"worst error: step time {cal['step_time_worst_error']}, simulator "
                 f"{cal['simulator_worst_error']} (tolerance {cal['tolerance']:.0%})")
    hyb = cal.get("hybrid_check") or {}
    if hyb.get("cells"):
        lines.append("simulated hybrid: ratio to no speculation, predicted vs measured")
        for c in hyb["cells"]:
            lines.append(f"  {c['config']:<18}{c['concurrency']:>4}"
                         f"{c['measured_over_none']:>10.2f}{c['predicted_over_none']:>11.2f}"
                         f"{c['error']:>+8.1%}  (acceptance from {c['acceptance_from']})")
        lines.append(f"hybrid worst error: in sample {hyb['worst_error_in_sample']}, out of "
                     f"sample {hyb['worst_error_out_of_sample']}")
    for name, why in (hyb.get("skipped") or {}).items():
        lines.append(f"hybrid {name} not simulated: {why}")
    for fam, g in cal["gpu_preset"].items():
        lines.append(f"gpu preset, {fam} acceptance: adaptive / none "
                     + ", ".join(f"c={n} {v:.2f}" for n, v in g["adaptive_over_none"].items()))
        for key in ("adaptive_over_best_static", "adaptive_over_oracle",
                    "oracle_over_best_static"):
            if key in g:
                lines.append(f"gpu preset, {fam} acceptance: {key.replace('_over_', ' / ')} "
                             .replace("_", " ")
                             + ", ".join(f"c={n} {v:.2f}" for n, v in g[key].items()))
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    path = Path(args.json)
    result = json.loads(path.read_text())
    policy = load_policy(args.policy) if args.policy else None
    cal = calibrate(result, policy, seed=args.seed)
    print(format_report(cal))
    out = Path(args.out) if args.out else path.with_name("calibration.json")
    out.write_text(json.dumps(cal, indent=1))
    print(f"wrote {out}")
    return 0


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--json", default="out/bench/bench.json", help="a bench.json")
    ap.add_argument("--policy", default=None,
                    help="policy of the simulated controller (default: the bench's)")
    ap.add_argument("--out", default=None, help="default: calibration.json beside --json")
    ap.add_argument("--seed", type=int, default=0)
