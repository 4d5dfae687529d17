"""`adaptspec bench vllm-client`: the unseen long prompts through vLLM's own benchmark client.

The last line of issue 34's cell, measured with a client the project did not write:
`vllm.benchmarks.serve` (what `vllm bench serve` runs), openai-chat backend, the repo's 16 long
unseen chat prompts (adaptspec/tools/bench/prompts, ~700 tokens each, used to tune nothing) as a
custom dataset in order, greedy, `--ignore-eos`, C at a time. Every configuration gets a fresh
server per repeat (prefix cache cold, every shape a first use), started in groups of at most
MAX_SERVERS with a plain one in each group, and the client run against each server of a group
in turn (the order rotating with the repeat). Configurations: those of `bench unseen` (plain,
vLLM's static n-gram at K = 2, 4 and 8, adaptspec over vLLM's n-gram and over its own).

Reported per configuration: the client's output tokens/s over its group's plain server (median
over repeats, and the spread), for adaptspec over the best static K too and over the static K
of its own group repeat by repeat (`paired`), and the greedy gate:
every request's generated text must equal plain's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from adaptspec.tools.bench.nopay import DEFAULT_POLICY, _start, report
from adaptspec.tools.bench.prompts import load_unseen_chat
from adaptspec.tools.bench.unseen import (
    ADAPTIVE,
    PAIRS,
    PLAIN,
    STATIC,
    chosen,
    group_runs,
    paired,
)

# The client in a process of its own: it imports vLLM, which this package never does.
CLIENT = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
          "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
          "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


def write_dataset(path: Path) -> int:
    """The long unseen prompts as vLLM's custom dataset (JSONL, one {"prompt"} per line)."""
    long = load_unseen_chat()["long"]
    path.write_text("".join(json.dumps({"prompt": p["prompt"]}) + "\n" for p in long))
    return len(long)


def client_args(port: int, model: str, dataset: Path, n: int, concurrency: int,
                max_tokens: int, out: Path) -> list[str]:
    """`vllm bench serve`'s arguments for one run against the server on `port`."""
    return ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
            "--base-url", f"http://127.0.0.1:{port}", "--model", "bench", "--tokenizer", model,
            "--dataset-name", "custom", "--dataset-path", str(dataset),
            # the server applies the chat template; the dataset must not apply it too
            "--skip-chat-template", "--disable-shuffle", "--num-prompts", str(n),
            "--custom-output-len", str(max_tokens), "--ignore-eos", "--temperature", "0",
            "--max-concurrency", str(concurrency), "--num-warmups", "0",
            "--save-result", "--save-detailed", "--result-dir", str(out.parent),
            "--result-filename", out.name, "--disable-tqdm"]


def run_client(args: list[str], log: Path) -> dict[str, Any]:
    """One run of vLLM's client; its saved result (output_throughput, generated_texts, ...)."""
    out = Path(args[args.index("--result-dir") + 1]) / args[args.index("--result-filename") + 1]
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-c", CLIENT, *args], stdout=f,
                              stderr=subprocess.STDOUT, timeout=3600)
    if proc.returncode != 0 or not out.exists():
        return {"error": f"vllm bench serve exited {proc.returncode} (log {log})"}
    return json.loads(out.read_text())


def judge(repeats: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per configuration: output tokens/s over its group's plain server, median and spread
    over repeats; adaptspec's over the best static K's median."""
    per: dict[str, list[float]] = {}
    for rep in repeats:
        for name, r in rep.items():
            if name != PLAIN and r.get("output_throughput") and r.get("plain_tok_s"):
                per.setdefault(name, []).append(r["output_throughput"] / r["plain_tok_s"])
    out: dict[str, Any] = {n: {"per_repeat": v, "median": statistics.median(v),
                               "spread": max(v) - min(v)} for n, v in per.items()}
    best = max((out[s]["median"] for s in STATIC if s in out), default=None)
    out["goals"] = {n: {"over_best_static": out[n]["median"] / best if best else None,
                        # (both ran on the same repeat's servers, back to back: the
                        # machine's drift between groups and repeats divides out)
                        "paired": paired(out, n, lambda v: v.get("per_repeat"), PAIRS.get(n))}
                    for n in ADAPTIVE if n in out}
    return out


def check_greedy(repeats: list[dict[str, dict[str, Any]]]) -> list[str]:
    """Requests whose generated text differs from the plain server's of the same repeat."""
    bad = []
    for i, rep in enumerate(repeats):
        want = rep[PLAIN].get("generated_texts") or []
        for name, r in rep.items():
            got = r.get("generated_texts") or []
            if name == PLAIN or not want or not got:
                continue
            bad += [f"repeat {i} {name} request {j}" for j, (a, b)
                    in enumerate(zip(want, got, strict=False)) if a != b]
    return bad


def format_table(repeats: list[dict[str, dict[str, Any]]], verdict: dict[str, Any]) -> str:
    lines = [f"{'config':<22}{'tok/s':>8}{'x plain':>9}{'spread':>8}{'drafts/acc':>12}"]
    for name in repeats[0]:
        tok = statistics.median(r[name].get("output_throughput", float("nan"))
                                for r in repeats)
        v = verdict.get(name, {})
        ratio = f"{v['median']:>9.3f}{v['spread']:>8.3f}" if v else f"{'-':>9}{'-':>8}"
        drafts = [r[name].get("spec_decode_draft_tokens") for r in repeats]
        acc = [r[name].get("spec_decode_accepted_tokens") for r in repeats]
        da = (f"{statistics.median(drafts):.0f}/{statistics.median(acc):.0f}"
              if all(x is not None for x in drafts + acc) else "-")
        lines.append(f"{name:<22}{tok:>8.2f}{ratio}{da:>12}")
    for name, g in verdict.get("goals", {}).items():
        best, pair = g["over_best_static"], g.get("paired")
        paired = (f"; paired with {pair['over']} (same group): {pair['median']:.3f}x, repeats "
                  f"{' '.join(f'{x:.3f}' for x in pair['per_repeat'])}" if pair else "")
        lines.append(f"{name}: {'-' if best is None else f'{best:.3f}'}x the best static K "
                     f"(goal >= 1.00){paired}")
    return "\n".join(lines)


# What vLLM's client imports only when it reads a custom dataset (the `bench` extra): checked
# before any server starts, not found after the first server's minutes.
CLIENT_NEEDS = ("pandas",)


def missing_client_modules() -> list[str]:
    """The modules vLLM's client needs here that this Python cannot import."""
    return [m for m in CLIENT_NEEDS if importlib.util.find_spec(m) is None]


def run(args: argparse.Namespace) -> int:
    missing = missing_client_modules()
    if missing:
        print(f"adaptspec bench vllm-client: vLLM's benchmark client needs {', '.join(missing)}"
              " to read its dataset: pip install 'adaptspec[bench]'", file=sys.stderr)
        return 2
    if args.model is None:
        from adaptspec.tools.models import build_qwen

        args.model = str(build_qwen(roles=("draft",))["draft"])
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    dataset = out_dir / "unseen_long.jsonl"
    n = min(write_dataset(dataset), args.prompts)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    policy = Path(args.policy or DEFAULT_POLICY).resolve()
    t_all = time.monotonic()
    repeats: list[dict[str, dict[str, Any]]] = [{} for _ in range(args.repeats)]
    for i, g, group in group_runs(chosen(args.configs), args.repeats):
        logs = out_dir / "logs" / f"r{i}g{g}"
        logs.mkdir(parents=True, exist_ok=True)
        servers = {c.name: _start(c, args.model, policy, logs / f"{c.name}.log",
                                  args.concurrency, eager=not args.compiled) for c in group}
        res: dict[str, dict[str, Any]] = {}
        try:
            for s in servers.values():
                s.wait_ready()
            order = list(servers)
            shift = i % len(order)
            for name in order[shift:] + order[:shift]:
                print(f"  {name}", file=sys.stderr, flush=True)
                res[name] = run_client(
                    client_args(servers[name].port, args.model, dataset, n, args.concurrency,
                                args.max_tokens, logs / f"{name}.json"),
                    logs / f"{name}-client.log")
        finally:
            for s in servers.values():
                s.stop()
        plain = res[PLAIN].get("output_throughput")
        for r in res.values():
            r["plain_tok_s"] = plain
        repeats[i].setdefault(PLAIN, res[PLAIN])
        repeats[i].update({k: v for k, v in res.items() if k != PLAIN})
    verdict = judge(repeats)
    errors = [f"{name}: {r['error']}" for rep in repeats for name, r in rep.items()
              if "error" in r]
    result = {"model": args.model, "policy": str(policy), "prompts": load_unseen_chat()["source"],
              "requests": n, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
              "total_s": time.monotonic() - t_all, "verdict": verdict,
              "mismatches": check_greedy(repeats), "errors": errors,
              "repeats": [{name: {k: v for k, v in r.items() if k != "generated_texts"}
                           for name, r in rep.items()} for rep in repeats]}
    return report(result, format_table(repeats, verdict), out_dir / "vllm_client.json")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None, help="model folder (default: Qwen2.5-Coder 0.5B)")
    ap.add_argument("--policy", default=None, help="adaptspec policy (default: the shipped one)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16,
                    help="the first N of the 16 long prompts (prefill is most of the time)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--configs", nargs="+", default=None,
                    help="configurations (default: all); plain always runs")
    ap.add_argument("--compiled", action="store_true",
                    help="servers compile the model (vLLM's default) instead of running eager")
    ap.add_argument("--out", default="out/vllm_client")
