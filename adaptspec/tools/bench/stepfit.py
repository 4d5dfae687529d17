"""Step time from a benchmark run: engine steps per cell, the cpu cost model fitted to them
(plain decoding per batch size, plus the costs of verifying, drafting and passes), and how well
the fit predicts each cell."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from adaptspec.tools.bench.steps import engine_steps, summarize

if TYPE_CHECKING:
    from adaptspec.policy import Policy

TOLERANCE = 0.15
# A cell whose clean decode steps hold less than this share of its decode tokens was not
# resolved into steps: on the tiny pair a step takes ~5 ms, as much as the clients' jitter.
MIN_COVERAGE = 0.5
# Requests per simulated batch size (times the batch, at least MIN_SIM_REQUESTS).
SIM_REQUESTS_PER_SLOT, MIN_SIM_REQUESTS = 12, 96
GPU_LOADS = (1, 4, 16, 64, 256)
# Speculation coefficients the fit sets, in the order of _spec_features' columns (and
# knee_tokens); plain decoding's step time is the table plain_step_ms.
FITTED = ("per_draft_token_ms", "spec_overhead_ms", "per_draft_position_ms", "over_knee_ms",
          "per_request_pass_ms")
# Knees tried (tokens verified per step where extra tokens start to cost more).
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


def cell_steps(result: dict[str, Any], name: str, conc: str) -> dict[str, Any]:
    """A cell's engine steps (steps.summarize): from its summary, or rebuilt from the
    requests' chunk times of a bench.json written with --raw before summaries carried them."""
    s = result["summary"][name][conc]
    if "engine_steps" in s:
        return s["engine_steps"]
    raw = (result.get("raw") or {}).get(name, {})
    cell = raw.get(conc) or raw.get(int(conc)) if raw else None
    if cell is None:
        raise ValueError(
            f"{name} at concurrency {conc}: no engine steps in this bench.json (written before "
            "adaptspec recorded them, without --raw); run `adaptspec bench` again")
    return summarize(engine_steps(cell["requests"]))


def observations(result: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[tuple[str, int],
                                                                            dict[str, Any]]]:
    """What the fit needs of a bench.json: one row per (configuration, concurrency, batch size)
    of pure decode steps, and one entry per cell.

    A row: steps, their mean step_ms, the decode tokens they gave, and the drafts they verified
    (spec_tokens: the cell's draft tokens per request-step, from vLLM's counters, times the
    batch) and the longest draft max_k (static K; adaptspec's in expectation over the batch,
    from its chosen-K histogram). A cell: its output tokens/s, output tokens, other_s (the
    time of its steps that were not pure decode steps) and coverage (the share of its decode
    tokens that came in pure decode steps)."""
    rows: list[dict[str, Any]] = []
    cells: dict[tuple[str, int], dict[str, Any]] = {}
    for cfg in result["configs"]:
        fam = _family(cfg)
        static_k = None if cfg["adaptive"] or cfg["spec"] is None else (
            cfg["spec"]["num_speculative_tokens"])
        for c, s in result["summary"][cfg["name"]].items():
            if not s.get("request_steps"):
                continue
            st = cell_steps(result, cfg["name"], c)
            rate = s["vllm_draft_tokens"] / s["request_steps"]
            dist: dict[str, float] = {}
            if cfg["adaptive"]:
                # The controller's K, as vLLM drafts it: at most the configured K (the
                # scheduler's draft budget), and a draft model passes at least once a step.
                cap = (cfg["spec"] or {}).get("num_speculative_tokens", 1 << 30)
                floor = 1 if fam == "draft_model" else 0
                for row in s["classes"].values():
                    for k, n in row.get("k_distribution", {}).items():
                        k = str(min(max(int(k.lstrip(">")), floor), cap))
                        dist[k] = dist.get(k, 0.0) + n
            key = (cfg["name"], int(c))
            cells[key] = {"config": cfg["name"], "family": fam, "adaptive": bool(cfg["adaptive"]),
                          "concurrency": int(c), "tok_per_s": float(s["tok_per_s"]),
                          "output_tokens": float(s["output_tokens"]),
                          "other_s": float(st["other_s"]), "static_k": static_k,
                          "coverage": sum(t for _, _, t in st["decode"].values())
                          / max(s["decode_tokens"], 1)}
            for b, (n, ms, tokens) in st["decode"].items():
                batch = int(b)
                max_k = (float(static_k) if static_k is not None
                         else _expected_max(dist, batch) if cfg["adaptive"] else 0.0)
                rows.append({"config": cfg["name"], "family": fam, "adaptive": cfg["adaptive"],
                             "concurrency": int(c), "batch": batch, "steps": float(n),
                             "step_ms": float(ms), "tokens": float(tokens),
                             "spec_tokens": rate * batch, "max_k": max_k})
    return rows, cells


def _spec_features(r: dict[str, Any], knee: float) -> list[float]:
    """What speculation adds to plain decoding's step at the same batch size, in FITTED order:
    S, proposer on, draft passes, the draft tokens' share of the hinge (verified tokens
    B + S above the knee, less the batch's own B - B above it), draft-model tokens.

    A draft model passes once per position of the longest draft, and at least once a step even
    when nothing is drafted (its first pass keeps the draft's KV cache in step with the target;
    adaptspec sets vLLM's per-step draft count to the longest K, so a batch at K = 0 still pays
    one pass). Each pass also costs per token it runs: the first pass runs every request's
    verified tokens (B + S), the others one token per request, S + B * passes in all. An n-gram
    proposer has no passes; its fixed cost comes with a draft."""
    b, s = r["batch"], r["spec_tokens"]
    passes = max(r["max_k"], 1.0) if r["family"] == "draft_model" else 0.0
    return [s, float(s > 0 or passes > 0), passes, max(0.0, b + s - knee) - max(0.0, b - knee),
            s + b * passes if passes else 0.0]


def _hats(batch: float, knots: list[float]) -> list[float]:
    """Weights of `batch` on piecewise-linear basis functions at `knots` (linear beyond the
    first and last, constant with one knot)."""
    out = [0.0] * len(knots)
    if len(knots) == 1:
        out[0] = 1.0
        return out
    j = min(max(int(np.searchsorted(knots, batch)) - 1, 0), len(knots) - 2)
    w = (batch - knots[j]) / (knots[j + 1] - knots[j])
    out[j], out[j + 1] = 1.0 - w, w
    return out


def _features(rows: list[dict[str, Any]], knots: list[float], knee: float) -> np.ndarray:
    return np.array([_hats(r["batch"], knots) + _spec_features(r, knee) for r in rows])


def plain_step_ms(cost: dict[str, Any], batch: float) -> float:
    """The fitted plain decoding step time at a batch size (linear between the sizes no
    speculation decoded at, and beyond them)."""
    table = cost["plain_step_ms"]
    knots = sorted(float(b) for b in table)
    return float(np.dot(_hats(batch, knots), [table[str(int(b))] for b in knots]))


def fit_cost(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Non-negative least squares in relative error, each row weighing as many steps as it
    holds, on the cells without adaptspec; then with a hinge at each knee of KNEES, kept where
    it cuts the squared error by a tenth or more. Plain decoding's step time is free at each
    batch size none decoded at (between them linear)."""
    from sklearn.linear_model import LinearRegression

    train = [r for r in rows if not r["adaptive"]]
    knots = sorted({float(r["batch"]) for r in train if r["family"] == "none"})
    if not knots or len({r["config"] for r in train}) < 2:
        raise ValueError("calibration needs decode steps of no speculation and of at least one "
                         "static configuration")
    y = np.array([r["step_ms"] for r in train])
    root_n = np.sqrt([r["steps"] for r in train])
    w = root_n / y  # relative error, per step
    hinge = len(knots) + FITTED.index("over_knee_ms")

    def fit(knee: float) -> tuple[float, dict[str, Any]]:
        x = _features(train, knots, knee)
        if not math.isfinite(knee):
            x[:, hinge] = 0.0
        reg = LinearRegression(fit_intercept=False, positive=True).fit(x * w[:, None], y * w)
        coef = reg.coef_
        out: dict[str, Any] = {k: float(v) for k, v in zip(FITTED, coef[len(knots):],
                                                            strict=True)}
        out["plain_step_ms"] = {str(int(b)): float(v)
                                for b, v in zip(knots, coef[:len(knots)], strict=True)}
        return float(np.sum(((x @ coef) * w - root_n) ** 2)), {**out, "knee_tokens": knee}

    err, best = fit(math.inf)
    best = {**best, "knee_tokens": KNEES[-1], "over_knee_ms": 0.0}
    bar = 0.9 * err
    for knee in KNEES:
        e, coef = fit(knee)
        if e < bar:
            bar, best = e, coef
    return best


def predict_step_ms(cost: dict[str, Any], rows: list[dict[str, Any]]) -> np.ndarray:
    spec = np.array([_spec_features(r, cost["knee_tokens"]) for r in rows]).reshape(len(rows), -1)
    return np.array([plain_step_ms(cost, r["batch"]) for r in rows]) + spec @ np.array(
        [cost[k] for k in FITTED])


def _reference_cells(cells: dict[tuple[str, int], dict[str, Any]]
                     ) -> dict[tuple[str, int], dict[str, Any]]:
    """Per (family, concurrency) the cell the family's fits come from: none's own, and for a
    proposer family its static run with the largest K."""
    ref: dict[tuple[str, int], dict[str, Any]] = {}
    for c in cells.values():
        if c["adaptive"]:
            continue
        key = (c["family"], c["concurrency"])
        if key not in ref or (c["static_k"] or 0) > (ref[key]["static_k"] or 0):
            ref[key] = c
    return ref


def _other_s(ref: dict[tuple[str, int], dict[str, Any]], family: str, concurrency: int
             ) -> float:
    """Time of a cell outside pure decode steps, as measured on its family's reference cell:
    prefill does not depend on K, but a draft model prefills the prompt too."""
    cell = ref.get((family, concurrency)) or ref.get(("none", concurrency))
    return cell["other_s"] if cell else 0.0


def _ratio_cells(cells: dict[tuple[str, int], dict[str, Any]],
                 decode_s: dict[tuple[str, int], float], in_fit: Callable[[str], bool]
                 ) -> list[dict[str, Any]]:
    """Predicted and measured ratio of output tokens/s to no speculation, per cell, from each
    cell's predicted decode time and its family's reference time outside decode steps."""
    ref = _reference_cells(cells)
    pred_tps = {key: cells[key]["output_tokens"] / (
        t + _other_s(ref, cells[key]["family"], key[1])) for key, t in decode_s.items()}
    out = []
    for (name, conc), cell in cells.items():
        if name == "none" or (name, conc) not in pred_tps or ("none", conc) not in pred_tps:
            continue
        measured = cell["tok_per_s"] / cells[("none", conc)]["tok_per_s"]
        predicted = pred_tps[(name, conc)] / pred_tps[("none", conc)]
        out.append({"config": name, "concurrency": conc, "in_fit": in_fit(name),
                    "measured_over_none": round(measured, 4),
                    "predicted_over_none": round(float(predicted), 4),
                    "error": round(float(predicted / measured - 1.0), 4)})
    return out


def step_time_check(rows: list[dict[str, Any]], cells: dict[tuple[str, int], dict[str, Any]],
                    cost: dict[str, Any]) -> list[dict[str, Any]]:
    """Per cell: predicted and measured throughput ratio to no speculation. A cell's predicted
    decode time is its decode steps at each batch size times the predicted step time there."""
    decode_s: dict[tuple[str, int], float] = {}
    for r, t in zip(rows, predict_step_ms(cost, rows), strict=True):
        key = (r["config"], r["concurrency"])
        decode_s[key] = decode_s.get(key, 0.0) + r["steps"] * float(t) / 1e3
    adaptive = {c["config"] for c in cells.values() if c["adaptive"]}
    return _ratio_cells(cells, decode_s, lambda name: name not in adaptive)


# ---------------------------------------------------- the benchmark as the simulator sees it


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


def _class_mix(result: dict[str, Any], concurrency: str | None = None) -> dict[str, float]:
    """Share of requests per class: of the whole benchmark, or of one concurrency's stream (4
    requests at c=1: its mix is not the benchmark's)."""
    counts: dict[str, float] = {}
    for c, s in result["summary"]["none"].items():
        if concurrency is not None and c != concurrency:
            continue
        for cls, row in s["classes"].items():
            counts[cls] = counts.get(cls, 0.0) + row["requests"]
    total = sum(counts.values())
    return {cls: n / total for cls, n in sorted(counts.items())}


def _mix_stream(result: dict[str, Any], policy: Policy, conc: int, seed: int,
                concurrency: str | None) -> dict[str, Any]:
    """The requests simulated at a batch of `conc`: classes drawn from the benchmark's mix (or
    that of one concurrency's stream), lengths as the benchmark asked; with the generator that
    drew them (names, cls, length, lc: latency-critical class names, rng)."""
    mix = _class_mix(result, concurrency)
    names = list(mix)
    sizes = result["sizes"]
    lc = [n for n in names if n in policy.classes and policy.classes[n].latency_critical]
    rng = np.random.default_rng([seed, conc])
    n = max(MIN_SIM_REQUESTS, SIM_REQUESTS_PER_SLOT * conc)
    share = np.array([mix[c] for c in names])
    cls = rng.permutation(np.minimum(
        np.searchsorted(np.cumsum(share), (np.arange(n) + rng.random()) / n, side="right"),
        len(names) - 1))
    length = np.array([sizes["interactive_tokens"] if names[c] in lc else sizes["max_tokens"]
                       for c in cls], dtype=np.int64)
    return {"names": names, "cls": cls, "length": length, "lc": lc, "rng": rng}
