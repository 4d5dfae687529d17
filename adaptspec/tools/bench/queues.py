"""`adaptspec bench queues`: separate queues against shared engines, data parallelism 2.

The cell of issue 33. One mixed stream (the trace set's code and role-play prompts, C
closed-loop users, and a latency-critical stream throughout, one request every `--lc-period` s)
goes to three servers of two data-parallel engines each, one after another, the order rotating
per repeat:

* `none`: plain vLLM, DP=2;
* `adaptspec_shared`: adaptspec over its n-gram proposer, every engine taking every class (the
  latency-critical slack rules each batch that carries a latency-critical request);
* `adaptspec_separate`: the same with `latency_critical_engines: [0]`: latency-critical
  requests on engine 0, which never drafts, the others on engine 1.

Reported side by side: the other classes' output tokens/s over plain's, the latency-critical
requests' inter-token gap p50 and p99 over plain's, drafts and accepted tokens; medians and the
spread over repeats, and the greedy gate (every request's tokens against plain's).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from adaptspec.tools.bench import workload
from adaptspec.tools.bench.nopay import report
from adaptspec.tools.bench.prompts import load_trace
from adaptspec.tools.bench.servers import BENCH_POLICY, OURS_NGRAM, Config
from adaptspec.tools.bench.trace import (
    PLAIN,
    Phase,
    check_greedy,
    lc_stream,
    make_trace,
    request_errors,
    run_config,
    run_repeats,
    summarize,
)
from adaptspec.tools.bench.trace import judge as trace_judge

DP = ("--data-parallel-size", "2")
OURS = {"method": "custom_class", "model": OURS_NGRAM, "num_speculative_tokens": 8}
CONFIGS = (
    Config(PLAIN, None, args=DP),
    Config("adaptspec_shared", OURS, adaptive=True, family="ours", args=DP),
    Config("adaptspec_separate", OURS, adaptive=True, family="ours", args=DP,
           policy={"latency_critical_engines": [0]}),
)


def judge(repeats: list[dict[str, dict[str, Any]]], phase: Phase) -> dict[str, Any]:
    """Per configuration, over plain in the same repeat (trace.judge on the one phase): the
    other classes' tokens/s and the latency-critical gaps; medians and spreads."""
    verdict = trace_judge(repeats, (phase,))
    return {name: {"others_tok_s": v["trace"],
                   **{k: v[k] for k in ("lc_gap_p50_ms", "lc_gap_p99_ms") if k in v}}
            for name, v in verdict.items() if name != "goals"}


def format_table(verdict: dict[str, Any], repeats: list[dict[str, dict[str, Any]]]) -> str:
    lines = [f"{'config':<22}{'others tok/s x plain':>22}{'spread':>8}{'LC p50 x':>10}"
             f"{'LC p99 x':>10}{'drafts/acc':>14}"]
    for name, v in verdict.items():
        s = summarize(repeats[0][name])
        p50 = v.get("lc_gap_p50_ms", {}).get("median")
        p99 = v.get("lc_gap_p99_ms", {}).get("median")
        lines.append(f"{name:<22}{v['others_tok_s']['median']:>22.3f}"
                     f"{v['others_tok_s']['spread']:>8.3f}"
                     f"{p50 if p50 is None else format(p50, '.3f'):>10}"
                     f"{p99 if p99 is None else format(p99, '.3f'):>10}"
                     f"{int(s['drafted']):>8}/{int(s['accepted'])}")
    plain = summarize(repeats[0][PLAIN])
    lines.append(f"plain DP=2: {plain['tok_per_s']:.2f} tok/s for the other classes; LC gap p50 "
                 f"{plain['lc_gap_p50_ms']:.0f} ms, p99 {plain['lc_gap_p99_ms']:.0f} ms; a "
                 f"latency-critical request in flight {100 * plain['lc_busy_share']:.0f}% of "
                 "the time")
    sep, shared = verdict.get("adaptspec_separate"), verdict.get("adaptspec_shared")
    if sep and shared:
        lines.append(
            f"separate over shared, other classes: "
            f"{sep['others_tok_s']['median'] / shared['others_tok_s']['median']:.3f} "
            f"(goal > 1); separate LC gap p50 x plain "
            f"{sep.get('lc_gap_p50_ms', {}).get('median', float('nan')):.3f} (goal <= 1.05)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from adaptspec.tools import models

    info = models.build_tiny() if args.quick else models.build_qwen()
    # the small model of the pair by default: DP=2 on two cores gives each engine one
    model = str(info["target"] if args.quick or args.model == "target" else info["draft"])
    phase = Phase(f"code and role-play, {args.concurrency} users", args.concurrency,
                  ("code", "roleplay"), args.requests)
    data = load_trace()
    trace = make_trace(data, (phase,), args.max_tokens)
    lc = lc_stream(data, 400, args.lc_tokens)
    warmup = [workload.Request(id=f"w-{i}", cls="writing", prompt=r.prompt, max_tokens=8,
                               temperature=0.0, seed=0) for i, r in enumerate(trace[0][:2])]
    tok = AutoTokenizer.from_pretrained(model)
    rendered = {r.id: workload.render(tok, r.prompt) for r in [*trace[0], *lc, *warmup]}
    policy = Path(args.policy or BENCH_POLICY).resolve()
    out_dir = Path(args.out)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    t_all = time.monotonic()
    repeats = run_repeats(CONFIGS, args.repeats, lambda cfg, i: run_config(
        cfg, model, rendered, trace, lc, warmup, policy, out_dir / "logs" / f"{cfg.name}-{i}.log",
        (phase,), eager=True, lc_period=args.lc_period))
    verdict = judge(repeats, phase)
    mismatches = check_greedy(repeats)
    errors = request_errors(repeats)
    cmd = " ".join(["adaptspec bench queues", *sys.argv[3:]]) if len(sys.argv) > 2 else ""
    table = format_table(verdict, repeats) + (
        f"\n{cmd}: {model}, {len(repeats)} repeats, {(time.monotonic() - t_all) / 60:.1f} min; "
        f"greedy mismatches {len(mismatches)}, errors {len(errors)}")
    result = {"model": model, "policy": str(policy), "phase": vars(phase),
              "lc_period_s": args.lc_period, "max_tokens": args.max_tokens,
              "lc_tokens": args.lc_tokens, "total_s": time.monotonic() - t_all,
              "verdict": verdict,
              "summaries": [{n: summarize(r) for n, r in rep.items()} for rep in repeats],
              "mismatches": mismatches, "errors": errors, "repeats": repeats}
    (out_dir / "queues_table.txt").write_text(table + "\n")
    return report(result, table, out_dir / "queues.json")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--policy", default=None, help="adaptspec policy (default: the bench's)")
    ap.add_argument("--model", choices=["draft", "target"], default="draft",
                    help="which model of the Qwen pair serves (default: the 0.5B)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=4, help="users of the other classes")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--lc-tokens", type=int, default=16)
    ap.add_argument("--lc-period", type=float, default=4.0,
                    help="seconds from one latency-critical request's start to the next's")
    ap.add_argument("--quick", action="store_true", help="the tiny pair (a smoke run)")
    ap.add_argument("--out", default="out/queues")
