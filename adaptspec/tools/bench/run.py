"""`adaptspec bench`: no speculation vs vLLM's static K vs adaptspec, on real vLLM servers.

One invocation starts one vLLM OpenAI server per configuration, one after another on this
machine, and sends every server the same request stream (adaptspec.tools.bench.workload) at each
concurrency: C closed-loop streaming clients, each sending its next request when the last one
finished. Per configuration and concurrency it records output tokens/s, per class the time to
first token, inter-token latency and acceptance length, and (adaptspec) the K chosen per class.

- Inter-token latency: a chunk's gap to the previous chunk, shared by the tokens it carries (a
  step that accepted 3 drafts delivered 4 tokens in one gap); TTFT is the first chunk's time.
- Acceptance length: tokens per decode step (chunks after the first), 1 without speculation.
- Correctness gate: every greedy request's tokens must equal the no-speculation run's, at every
  concurrency (float32), or the benchmark fails loudly (exit status 3, JSON still written).

This module never imports vLLM; the servers run in child processes. Full run: the Qwen2.5-Coder
1.5B target with the 0.5B draft (adaptspec.tools.models); --quick: the tiny pair, small sizes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from adaptspec.policy import load_policy
from adaptspec.serve import free_port
from adaptspec.tools.bench import workload
from adaptspec.tools.bench.cells import Sampler, run_cell
from adaptspec.tools.bench.report import (
    account_table,
    check_greedy,
    decode_table,
    format_table,
    per_class_table,
    plot,
    proposer_table,
    ratios,
    summarize_cell,
)
from adaptspec.tools.bench.servers import (
    BENCH_POLICY,
    FULL,
    GPU,
    OPT_IN,
    QUICK,
    Config,
    Server,
    gpu_configs,
    make_configs,
    policy_for,
)

# ------------------------------------------------------------------------------ main


def _models(quick: bool, target: str | None, draft: str | None) -> tuple[str, str, str]:
    from adaptspec.tools import models

    if target and draft:
        return target, draft, Path(target).name
    if quick:
        info = models.build_tiny()
        return str(info["target"]), str(info["draft"]), "tiny pair"
    info = models.build_qwen()
    return str(info["target"]), str(info["draft"]), "Qwen2.5-Coder 1.5B + 0.5B draft"


def run(args: argparse.Namespace) -> int:
    if args.gpu and not args.eagle3:
        print("adaptspec bench --gpu needs --eagle3 HEAD (and --target)", file=sys.stderr)
        return 2
    sizes = GPU if args.gpu else QUICK if args.quick else FULL
    if args.concurrency:
        sizes.concurrency = tuple(args.concurrency)
    if args.requests:
        sizes.requests = {c: args.requests * c if c > 1 else args.requests
                          for c in sizes.concurrency}
    if args.gpu:
        if not args.target:
            print("adaptspec bench --gpu needs --target MODEL", file=sys.stderr)
            return 2
        target, draft, label = args.target, args.eagle3, Path(args.target).name + " + EAGLE-3"
    else:
        target, draft, label = _models(args.quick, args.target, args.draft)
    configs = (gpu_configs(args.eagle3) if args.gpu
               else make_configs(draft, sizes, args.self_draft, args.eagle))
    if args.configs and "none_sync" in args.configs:
        # Plain decoding under the synchronous scheduling adaptspec runs with: what async
        # scheduling alone is worth on this machine.
        configs.insert(1, Config("none_sync", None, sync=True))
    if args.configs:
        keep = set(args.configs) | {"none"}
        configs = [c for c in configs if c.name in keep]
    else:
        configs = [c for c in configs if c.name not in OPT_IN]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = None
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(target)
    except Exception as e:  # the tiny pair has a tokenizer.json but maybe no chat template
        print(f"no tokenizer chat template ({e}); plain prompts", file=sys.stderr)
    prompts_by_class = workload.class_prompts(workload.load_sources(), sizes.excerpt_chars)
    streams = {c: workload.make_stream(prompts_by_class, sizes.requests[c], seed=args.seed + c,
                                       max_tokens=sizes.max_tokens,
                                       interactive_tokens=sizes.interactive_tokens)
               for c in sizes.concurrency}
    rendered = {r.id: workload.render(tok, r.prompt) for s in streams.values() for r in s}
    warmup = workload.make_stream(prompts_by_class, 2, seed=10_000, max_tokens=8,
                                  interactive_tokens=8)
    rendered.update({r.id: workload.render(tok, r.prompt) for r in warmup})
    # Prompt lengths, reported per cell and class: the prefill work a cell carries.
    prompt_tokens = {rid: (len(tok(text, add_special_tokens=False)["input_ids"]) if tok
                           else len(text.split())) for rid, text in rendered.items()}

    print(f"adaptspec bench: {label}; {len(configs)} configurations x concurrency "
          f"{list(sizes.concurrency)}; requests {sizes.requests}; {sizes.max_tokens} tokens "
          f"({sizes.interactive_tokens} for {workload.LATENCY_CRITICAL}); dtype {args.dtype}",
          file=sys.stderr, flush=True)
    cells: dict[str, dict[int, dict]] = {}
    timeline: dict[str, list] = {}
    starts: dict[str, float] = {}
    t_all = time.monotonic()
    logs = out_dir / "logs"
    logs.mkdir(exist_ok=True)
    for cfg in configs:
        print(f"[{cfg.name}] starting server", file=sys.stderr, flush=True)
        server = Server(cfg, target, free_port(), sizes,
                        policy_for(cfg, Path(args.policy).resolve(), logs),
                        logs / f"{cfg.name}.log", args.dtype, eager=not args.gpu)
        try:
            starts[cfg.name] = server.wait_ready()
            run_cell(server, warmup, rendered, 2, f"{cfg.name} warm-up")
            # Every server is scraped alike (the scrape costs the API server some CPU); only
            # the adaptspec ones have adaptspec_* series to plot.
            sampler = Sampler(server)
            cells[cfg.name] = {}
            for c in sizes.concurrency:
                cells[cfg.name][c] = run_cell(server, streams[c], rendered, c,
                                              f"{cfg.name} c={c}")
                for r in cells[cfg.name][c]["requests"]:
                    r["prompt_tokens"] = prompt_tokens[r["id"]]
            samples = sampler.stop()
            if cfg.adaptive:
                timeline[cfg.name] = samples
        finally:
            server.stop()
    summary = {
        cfg.name: {c: summarize_cell(cells[cfg.name][c],
                                     None if cfg.adaptive or cfg.spec is None
                                     else cfg.spec["num_speculative_tokens"])
                   for c in sizes.concurrency}
        for cfg in configs
    }
    mismatches = check_greedy(cells)
    rat = ratios(summary, configs)
    result = {
        "model_label": label, "target": target, "draft": draft, "dtype": args.dtype,
        "quick": args.quick, "seed": args.seed, "policy": str(args.policy),
        "sizes": {"concurrency": list(sizes.concurrency), "requests": sizes.requests,
                  "max_tokens": sizes.max_tokens,
                  "interactive_tokens": sizes.interactive_tokens},
        "configs": [{"name": c.name, "spec": c.spec, "adaptive": c.adaptive} for c in configs],
        "server_start_s": starts, "total_s": time.monotonic() - t_all,
        "summary": summary, "ratios": rat,
        "correctness": {"greedy_requests_checked": sum(
            1 for n in cells if n != "none" for c in cells[n] for r in cells[n][c]["requests"]
            if r["temperature"] == 0.0), "mismatches": mismatches},
        "errors": {n: [e for c in cells[n] for e in cells[n][c]["errors"]] for n in cells},
        "timeline": timeline,
    }
    if args.raw:
        result["raw"] = cells
    print(format_table(summary, rat))
    print()
    print(per_class_table(summary, max(sizes.concurrency)))
    if table := proposer_table(summary):
        print("\n" + table)
    if table := account_table(summary):
        print("\n" + table)
    if table := decode_table({f"{name} c={c}": cell["engine_decode"]
                              for name, by_c in summary.items()
                              for c, cell in sorted(by_c.items()) if "engine_decode" in cell}):
        print("\n" + table)
    try:  # the simulator, fitted to what was just measured (adaptspec.tools.bench.calibrate)
        from adaptspec.tools.bench.calibrate import calibrate, format_report

        result["calibration"] = calibrate(result, load_policy(args.policy), seed=args.seed)
        print()
        print(format_report(result["calibration"]))
    except Exception as e:  # a benchmark's measurements outlive a failed fit
        print(f"calibration failed: {e!r}", file=sys.stderr)
        result["calibration"] = {"error": repr(e)}
    result["plots"] = plot(result, out_dir)
    path = out_dir / "bench.json"
    path.write_text(json.dumps(result, indent=1, default=float))
    print(f"\nwrote {path} and {len(result['plots'])} plots; total "
          f"{result['total_s'] / 60:.1f} min")
    errors = sum(len(v) for v in result["errors"].values())
    if mismatches or errors:
        print(f"\nBENCHMARK FAILED: {len(mismatches)} greedy outputs differ from no speculation"
              f", {errors} request errors; first: {(mismatches or result['errors'])!s:.800}",
              file=sys.stderr)
        return 3
    return 0


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true",
                    help="the tiny model pair and small sizes (same comparison, < 10 min)")
    ap.add_argument("--target", default=None, help="target model folder (default: Qwen 1.5B)")
    ap.add_argument("--draft", default=None, help="draft model folder (default: Qwen 0.5B)")
    ap.add_argument("--self-draft", default=None, metavar="DIR",
                    help="a self-draft of the target (`adaptspec models self-draft`): adds "
                         "vllm_selfdraft_k* and adaptspec_hybrid_selfdraft beside the sibling")
    ap.add_argument("--eagle", default=None, metavar="HEAD",
                    help="an EAGLE head of the target (`adaptspec models eagle`): adds "
                         "vllm_eagle_k* and adaptspec_eagle")
    ap.add_argument("--gpu", action="store_true",
                    help="one GPU with vLLM 0.33 (docs/gpu-runbook.md): --target and its "
                         "--eagle3 head; plain vs EAGLE-3 static, Dynamic SD, adaptive "
                         "verification vs adaptspec over EAGLE-3; compiled, CUDA graphs")
    ap.add_argument("--eagle3", default=None, metavar="HEAD", help="the target's EAGLE-3 head")
    ap.add_argument("--policy", default=str(BENCH_POLICY), help="adaptspec policy")
    ap.add_argument("--concurrency", type=int, nargs="+", default=None)
    ap.add_argument("--requests", type=int, default=None,
                    help="requests per concurrency level, times the concurrency")
    ap.add_argument("--configs", nargs="+", default=None,
                    help="only these configurations (none is always run)")
    ap.add_argument("--dtype", default="float32",
                    help="float32 so that greedy outputs can be compared exactly")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/bench", help="folder for bench.json, plots, logs")
    ap.add_argument("--raw", action="store_true", help="keep every request's tokens in the JSON")
