"""Fit the simulator's step-time preset to `adaptspec bench` measurements, and check it.

The benchmark measured, per configuration and concurrency, the median time between two outputs
of a request (one engine step), how many requests were decoding while any was, how many draft
tokens vLLM verified, how many request-steps had a draft at all, and how many tokens each
request-step delivered. Two checks follow; both add to the decode steps the time a cell spent
outside them (prefills nothing overlapped), measured on the family's reference cell (none, or
its static run with the largest K), so that they predict the measured output tokens/s:

1. Step time. The cost formula of :class:`adaptspec.policy.CostModel` (base + per request + per
   draft token + a proposer's fixed cost; + per pass of a draft model, at least one a step; + a
   hinge above a knee of verified tokens where it fits markedly better) is fitted by
   non-negative least squares in relative error to the cells WITHOUT adaptspec (none and static
   K). With each cell's measured tokens per request-step, it predicts every cell's throughput;
   the adaptspec cells are predictions out of sample. Reported: predicted over measured ratio to
   no speculation, per cell.
2. Simulation. Per proposer family, from the static run with the largest K: the share of
   request-steps with a draft and each class's acceptance given a draft (the per-position rate
   alpha whose expected tokens per step, (1 - alpha^(K+1)) / (1 - alpha), is the measured one).
   The simulator then serves the benchmark's class mix with the fitted step time, at the batch
   the engine decoded at, and predicts every static K and adaptspec's ratio to no speculation at
   each concurrency; it is compared with the measurement. Only the largest-K static run of each
   family fed these fits, so the other static Ks and adaptspec are predictions.

Then the same class mix and acceptance are simulated on the "gpu" preset (an 8B model on one
H100, adaptspec/policy.py), for the ratios a GPU deployment could expect.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from adaptspec import simulator as sim
from adaptspec.policy import CostModel, Policy, load_policy

# How far a prediction may be from the measurement (issue: within 15%).
TOLERANCE = 0.15
# Requests per simulated concurrency (times the concurrency, at least MIN_SIM_REQUESTS).
SIM_REQUESTS_PER_SLOT, MIN_SIM_REQUESTS = 12, 96
GPU_LOADS = (1, 4, 16, 64, 256)
# Coefficients the fit sets, in the order of _features' columns (and knee_tokens); the rest of
# the cpu preset is kept.
FITTED = ("base_ms", "per_request_ms", "per_draft_token_ms", "spec_overhead_ms",
          "per_draft_position_ms", "over_knee_ms", "per_request_pass_ms")
# Knees tried (tokens verified per step where extra tokens start to cost more): below it a CPU
# decode step streams the weights once whatever the tokens (memory-bound), above it computes.
KNEES = (2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0)


def _family(cfg: dict[str, Any]) -> str:
    spec = cfg.get("spec")
    if spec is None:
        return "none"
    return {"draft_model": "draft_model", "ngram": "ngram"}.get(spec["method"], "ours")


def _expected_max(dist: dict[str, float], batch: float) -> float:
    """E[max K] over `batch` requests drawing K from a chosen-K histogram {k: count}:
    the sum over k >= 1 of P(max >= k) = 1 - P(K <= k - 1) ** batch."""
    counts: dict[int, float] = {}
    for k, c in dist.items():
        counts[int(k.lstrip(">"))] = counts.get(int(k.lstrip(">")), 0.0) + c
    total = sum(counts.values())
    if total <= 0:
        return 0.0
    out, below = 0.0, 0.0
    for k in range(1, max(counts) + 1):
        below += counts.get(k - 1, 0.0) / total
        out += 1.0 - min(below, 1.0) ** max(batch, 1.0)
    return out


def _num(s: dict[str, Any], key: str, default: float) -> float:
    v = s.get(key)
    return float(v) if v is not None and math.isfinite(float(v)) else default


def observations(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (configuration, concurrency) of a bench.json: what the fit needs.

    step_ms is the median gap between two outputs of a request (a gap that spans another
    request's prefill is an outlier, not a decode step); batch is the number of requests
    decoding while any was; engine_steps the decode steps the cell took; other_s the rest of its
    wall time (prompts prefilled while nothing decoded, start and end of the stream)."""
    rows = []
    for cfg in result["configs"]:
        fam = _family(cfg)
        static_k = None if cfg["adaptive"] or cfg["spec"] is None else (
            cfg["spec"]["num_speculative_tokens"])
        for c, s in result["summary"][cfg["name"]].items():
            if not s.get("request_steps"):
                continue
            batch = max(_num(s, "decode_batch", float(s["mean_batch"])), 1.0)
            steps = s["request_steps"] / batch  # engine steps
            spec = s["vllm_draft_tokens"] / steps if steps else 0.0
            if static_k is not None:
                max_k = float(static_k)
            elif cfg["adaptive"]:
                # The controller's K, as vLLM drafts it: at most the configured K (the
                # scheduler's draft budget), and a draft model passes at least once a step.
                cap = (cfg["spec"] or {}).get("num_speculative_tokens", 1 << 30)
                floor = 1 if fam == "draft_model" else 0
                dist: dict[str, float] = {}
                for row in s["classes"].values():
                    for k, n in row.get("k_distribution", {}).items():
                        k = str(min(max(int(k.lstrip(">")), floor), cap))
                        dist[k] = dist.get(k, 0.0) + n
                max_k = _expected_max(dist, batch)
            else:
                max_k = 0.0
            step_ms = _num(s, "step_ms_median", float(s["step_ms_mean"]))
            wall = _num(s, "wall_s", 0.0)
            rows.append({
                "config": cfg["name"], "family": fam, "adaptive": bool(cfg["adaptive"]),
                "static_k": static_k, "concurrency": int(c), "batch": batch,
                "step_ms": step_ms, "spec_tokens": spec, "max_k": max_k,
                "tokens_per_request_step": s["decode_tokens"] / s["request_steps"],
                "tok_per_s": float(s["tok_per_s"]), "engine_steps": steps,
                "other_s": max(wall - steps * step_ms / 1e3, 0.0) if wall else 0.0,
                "draft_rate": min(s.get("vllm_drafts", 0.0) / s["request_steps"], 1.0),
            })
    return rows


def _features(rows: list[dict[str, Any]], knee: float = 1.0) -> np.ndarray:
    """[n, 7]: 1, B, S, proposer on, draft passes, max(0, B + S - knee), draft-model tokens, in
    FITTED order.

    A draft model passes once per position of the longest draft, and at least once a step even
    when nothing is drafted (its first pass keeps the draft's KV cache in step with the target;
    adaptspec sets vLLM's per-step draft count to the longest K, so a batch at K = 0 still pays
    one pass). Each pass also costs per token it runs: the first pass runs every request's
    verified tokens (B + S), the others one token per request, S + B * passes in all; on two
    CPU cores a 0.5B draft over a batch of 6 costs several times its pass at batch 1. An n-gram
    proposer has no passes; its fixed cost comes with a draft."""
    return np.array([_row_features(r, knee) for r in rows])


def _row_features(r: dict[str, Any], knee: float) -> list[float]:
    b, s = r["batch"], r["spec_tokens"]
    passes = max(r["max_k"], 1.0) if r["family"] == "draft_model" else 0.0
    return [1.0, b, s, float(s > 0 or passes > 0), passes, max(0.0, b + s - knee),
            s + b * passes if passes else 0.0]


def fit_cost(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Non-negative least squares in relative error on the cells without adaptspec; then with a
    hinge at each knee of KNEES, kept where it cuts the squared error by a tenth or more (a
    hinge below every measured batch is a copy of the other features)."""
    from sklearn.linear_model import LinearRegression

    train = [r for r in rows if not r["adaptive"]]
    if len(train) < 2:
        raise ValueError("calibration needs at least two measured cells without adaptspec")
    y = np.array([r["step_ms"] for r in train])
    w = 1.0 / y  # relative error: divide each row by its own time

    def fit(knee: float) -> tuple[float, dict[str, float]]:
        x = _features(train, knee)
        if not math.isfinite(knee):
            x[:, -1] = 0.0
        reg = LinearRegression(fit_intercept=False, positive=True).fit(x * w[:, None], y * w)
        coef = {k: float(v) for k, v in zip(FITTED, reg.coef_, strict=True)}
        return float(np.sum(((x @ reg.coef_) * w - 1.0) ** 2)), {**coef, "knee_tokens": knee}

    err, best = fit(math.inf)
    best = {**best, "knee_tokens": KNEES[-1], "over_knee_ms": 0.0}
    bar = 0.9 * err
    for knee in KNEES:
        e, coef = fit(knee)
        if e < bar:
            bar, best = e, coef
    return best


def predict_step_ms(cost: dict[str, float], rows: list[dict[str, Any]]) -> np.ndarray:
    return _features(rows, cost.get("knee_tokens", 1.0)) @ np.array(
        [cost.get(k, 0.0) for k in FITTED])


def _reference_rows(rows: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    """Per (family, concurrency) the cell the family's fits come from: none's own, and for a
    proposer family its static run with the largest K."""
    ref: dict[tuple[str, int], dict[str, Any]] = {}
    for r in rows:
        if r["adaptive"]:
            continue
        key = (r["family"], r["concurrency"])
        if key not in ref or (r["static_k"] or 0) > (ref[key]["static_k"] or 0):
            ref[key] = r
    return ref


def _other_s(ref: dict[tuple[str, int], dict[str, Any]], family: str, concurrency: int
             ) -> float:
    """Time of a cell outside decode steps, as measured on its family's reference cell:
    prefill does not depend on K, but a draft model prefills the prompt too."""
    cell = ref.get((family, concurrency)) or ref.get(("none", concurrency))
    return cell["other_s"] if cell else 0.0


def step_time_check(rows: list[dict[str, Any]], cost: dict[str, float]) -> list[dict[str, Any]]:
    """Per cell: predicted and measured throughput ratio to no speculation. A cell's predicted
    wall time is its engine steps times the predicted step time, plus the time outside decode
    steps of its family's reference cell."""
    pred_ms = predict_step_ms(cost, rows)
    ref = _reference_rows(rows)
    pred_tps = {}
    for r, t in zip(rows, pred_ms, strict=True):
        decode_tps = r["batch"] * r["tokens_per_request_step"] / t * 1e3
        tokens = r["engine_steps"] * r["batch"] * r["tokens_per_request_step"]
        pred_tps[(r["config"], r["concurrency"])] = tokens / (
            tokens / decode_tps + _other_s(ref, r["family"], r["concurrency"]))
    out = []
    for r, t in zip(rows, pred_ms, strict=True):
        key0 = ("none", r["concurrency"])
        none = next((x for x in rows if (x["config"], x["concurrency"]) == key0), None)
        if none is None or r["config"] == "none":
            continue
        measured = r["tok_per_s"] / none["tok_per_s"]
        predicted = pred_tps[(r["config"], r["concurrency"])] / pred_tps[key0]
        out.append({"config": r["config"], "concurrency": r["concurrency"],
                    "in_fit": not r["adaptive"], "step_ms": round(r["step_ms"], 3),
                    "predicted_step_ms": round(float(t), 3),
                    "measured_over_none": round(measured, 4),
                    "predicted_over_none": round(float(predicted), 4),
                    "error": round(float(predicted / measured - 1.0), 4)})
    return out


# ------------------------------------------------------------------------------ simulation


def alpha_from_length(length: float, k: int) -> float:
    """alpha with (1 - alpha^(k+1)) / (1 - alpha) = length (tokens per step with k drafts)."""
    if k <= 0 or not math.isfinite(length):
        return 0.0
    length = min(max(length, 1.0), k + 1.0 - 1e-6)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** i for i in range(k + 1)) < length:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


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


def _class_mix(result: dict[str, Any]) -> dict[str, float]:
    counts: dict[str, float] = {}
    for s in result["summary"]["none"].values():
        for cls, row in s["classes"].items():
            counts[cls] = counts.get(cls, 0.0) + row["requests"]
    total = sum(counts.values())
    return {cls: n / total for cls, n in sorted(counts.items())}


def _interpolate(by_batch: dict[int, float], batch: float) -> float:
    """A value given at whole batches, at a fractional one (linear between its neighbours)."""
    lo, hi = by_batch[math.floor(batch)], by_batch[math.ceil(batch)]
    return lo + (hi - lo) * (batch - math.floor(batch))


def _drafter_cost(cost: CostModel, family: str, k: int) -> CostModel:
    """The cost of a configuration whose proposer may draft up to k tokens. A draft model's
    fixed cost is paid every step, whatever is drafted: folded into the base; its passes cost
    per position of the longest draft, at least one (simulate's min_passes), and per token they
    run: per_request_pass per request and pass, and as much again per verified draft token
    (see _features). An n-gram proposer costs nothing per position."""
    if family != "draft_model" or k == 0:
        return cost.model_copy(update={"per_draft_position_ms": 0.0, "per_request_pass_ms": 0.0})
    return cost.model_copy(update={
        "base_ms": cost.base_ms + cost.spec_overhead_ms, "spec_overhead_ms": 0.0,
        "per_draft_token_ms": cost.per_draft_token_ms + cost.per_request_pass_ms})


def simulate_family(result: dict[str, Any], alphas: dict[str, float],
                    cost: CostModel, policy: Policy, loads: list[int], ks: list[int],
                    seed: int = 0, family: str = "ngram", draft_rate: float = 1.0,
                    ) -> dict[str, dict[int, float]]:
    """Decode tokens/s of none, static K (every class, latency-critical too, as vLLM does) and
    the adaptspec controller (K up to max(ks)) on the benchmark's class mix, per load."""
    mix = _class_mix(result)
    names = list(mix)
    sizes = result["sizes"]
    lc = [n for n in names if n in policy.classes and policy.classes[n].latency_critical]
    out: dict[str, dict[int, float]] = {}
    width = max([*ks, policy.k_max, 1])
    for conc in loads:
        rng = np.random.default_rng([seed, conc])
        n = max(MIN_SIM_REQUESTS, SIM_REQUESTS_PER_SLOT * conc)
        share = np.array([mix[c] for c in names])
        cls = rng.permutation(np.minimum(
            np.searchsorted(np.cumsum(share), (np.arange(n) + rng.random()) / n, side="right"),
            len(names) - 1))
        length = np.array([sizes["interactive_tokens"] if names[c] in lc else sizes["max_tokens"]
                           for c in cls], dtype=np.int64)
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
            "none": (sim.FixedK(stream, np.zeros(len(names)), no_lc, cost, conc),
                     _drafter_cost(cost, family, 0))}
        for k in ks:
            c_k = _drafter_cost(cost, family, k)
            runs[f"static_{k}"] = (sim.FixedK(stream, np.full(len(names), k), no_lc, c_k, conc),
                                   c_k)
        runs["adaptive"] = (sim.Adaptive(policy, stream, conc, seed),
                            _drafter_cost(cost, family, max(ks)))
        passes = 1 if family == "draft_model" else 0
        for name, (chooser, c_run) in runs.items():
            run = sim.simulate(stream, conc, n_done, c_run, noise, chooser,
                               min_passes=passes if name != "none" else 0)
            out.setdefault(name, {})[conc] = run.tokens_per_s
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


def calibrate(result: dict[str, Any], policy: Policy | None = None, seed: int = 0
              ) -> dict[str, Any]:
    """Both checks and the gpu-preset report for one bench.json (see the module docstring)."""
    # (keys of the summary are concurrencies: ints in memory, strings once read from JSON)
    result = {**result, "summary": {name: {str(c): s for c, s in by_c.items()}
                                    for name, by_c in result["summary"].items()}}
    if policy is None:
        policy = load_policy(result.get("policy") or None)
    rows = observations(result)
    fitted = fit_cost(rows)
    cpu = CostModel(preset="cpu", **fitted)
    step_cells = step_time_check(rows, fitted)
    loads = sorted({r["concurrency"] for r in rows})
    ref = _reference_rows(rows)
    by_cell = {(r["config"], r["concurrency"]): r for r in rows}
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
        # Each cell is simulated at the batch the engine decoded it at: prompts are admitted a
        # few at a time, so 16 clients decode ~6 requests at once, and how many depends on the
        # configuration (none decoded 7.8 at once in a run where draft_model K=2 decoded 5.9,
        # which alone is worth 15% of throughput). Between whole batches: interpolated.
        names = {f"static_{k}": _static_name(result, family, k) for k in ks}
        names.update(none="none", adaptive=_adaptive_name(result, family))
        batch_of = {(sim_name, c): by_cell[(real, c)]["batch"]
                    for sim_name, real in names.items() for c in loads if (real, c) in by_cell}
        sim_tps = simulate_family(result, alphas, cpu, fam_policy, sorted(
            {f(b) for b in batch_of.values() for f in (math.floor, math.ceil)}), ks, seed,
            family, rate)
        tps = {cell: _interpolate(sim_tps[cell[0]], b) for cell, b in batch_of.items()}
        families[family] = {"alpha": {c: round(a, 4) for c, a in alphas.items()},
                            "alpha_from": source, "draft_rate": round(rate, 4)}
        for conc in loads:
            none = by_cell.get(("none", conc))
            if none is None:
                continue
            # The simulator gives decode throughput; the measured ratio also counts the time
            # outside decode steps (prefill), taken from none's and the family's reference cell.
            decode_none = none["engine_steps"] * none["step_ms"] / 1e3
            fam_other = _other_s(ref, family, conc)
            for sim_name, real in names.items():
                if sim_name == "none" or real is None or (real, conc) not in by_cell:
                    continue
                measured = by_cell[(real, conc)]["tok_per_s"] / none["tok_per_s"]
                wall = fam_other + decode_none * tps[("none", conc)] / tps[(sim_name, conc)]
                predicted = (none["other_s"] + decode_none) / wall
                sim_cells.append({"config": real, "concurrency": conc,
                                  "in_fit": real == source,
                                  "measured_over_none": round(measured, 4),
                                  "predicted_over_none": round(predicted, 4),
                                  "error": round(predicted / measured - 1.0, 4)})
        # A GPU deployment sets its cost prior to its hardware (cost_model.preset: gpu).
        g = simulate_family(result, alphas, gpu_cost,
                            sim.controller_policy(fam_policy, "gpu", "engine"),
                            list(GPU_LOADS), ks, seed, family, rate)
        gpu[family] = {
            "tokens_per_s": {name: {str(n): round(v, 2) for n, v in by.items()}
                             for name, by in g.items()},
            "adaptive_over_none": {str(n): round(g["adaptive"][n] / g["none"][n], 4)
                                   for n in GPU_LOADS},
            "adaptive_over_best_static": {
                str(n): round(g["adaptive"][n] / max(g[f"static_{k}"][n] for k in ks), 4)
                for n in GPU_LOADS},
        }

    def worst(cells: list[dict[str, Any]], out_of_fit: bool) -> float | None:
        errs = [abs(c["error"]) for c in cells if not (out_of_fit and c["in_fit"])]
        return round(max(errs), 4) if errs else None

    return {
        "cost_model_cpu": {k: round(v, 4) for k, v in fitted.items()},
        "step_time_check": step_cells,
        "step_time_worst_error": worst(step_cells, False),
        "acceptance": families,
        "simulator_check": sim_cells,
        "simulator_worst_error": worst(sim_cells, False),
        "tolerance": TOLERANCE,
        "within_tolerance": {
            "step_time": (worst(step_cells, False) or 0.0) <= TOLERANCE,
            "simulator": (worst(sim_cells, False) or 0.0) <= TOLERANCE,
        },
        "gpu_preset": gpu,
    }


def format_report(cal: dict[str, Any]) -> str:
    lines = ["calibrated cpu step time (ms): " + ", ".join(
        f"{k} {v:.2f}" for k, v in cal["cost_model_cpu"].items())]
    for title, key in (("step-time model (measured acceptance)", "step_time_check"),
                       ("simulator (fitted acceptance)", "simulator_check")):
        lines.append(f"{title}: ratio to no speculation, predicted vs measured")
        lines.append(f"  {'config':<18}{'c':>4}{'measured':>10}{'predicted':>11}{'error':>8}")
        for c in cal[key]:
            mark = "" if not c["in_fit"] else "  (fitted)"
            lines.append(f"  {c['config']:<18}{c['concurrency']:>4}"
                         f"{c['measured_over_none']:>10.2f}{c['predicted_over_none']:>11.2f}"
                         f"{c['error']:>+8.1%}{mark}")
    lines.append(f"worst error: step time {cal['step_time_worst_error']}, simulator "
                 f"{cal['simulator_worst_error']} (tolerance {cal['tolerance']:.0%})")
    for fam, g in cal["gpu_preset"].items():
        lines.append(f"gpu preset, {fam} acceptance: adaptive / none "
                     + ", ".join(f"c={n} {v:.2f}" for n, v in g["adaptive_over_none"].items()))
        lines.append(f"gpu preset, {fam} acceptance: adaptive / best static "
                     + ", ".join(f"c={n} {v:.2f}"
                                 for n, v in g["adaptive_over_best_static"].items()))
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
